"""The trainer's handle on a replica process (``engines/remote/client.py``) over a real pipe, a thread answering as
the replica's command loop does: what goes over the wire, in which order."""

from __future__ import annotations

import multiprocessing
import threading

from megarl.engines.remote.client import ReplicaClient
from megarl.engines.remote.messages import Abort, Step, StepDone, Submit
from megarl.types import SlotRequest, TokenEvent


def _replica(conn, seen: list) -> None:
    """Answers Step with one token for every request it was given and not told to abort."""
    live: list[str] = []
    while (msg := conn.recv()) is not None:
        seen.append(msg)
        if isinstance(msg, Submit):
            live += [r.request_id for r in msg.requests]
        elif isinstance(msg, Abort):
            live = [r for r in live if r not in msg.request_ids]
        elif isinstance(msg, Step):
            conn.send(StepDone([TokenEvent(r, [7], [-0.5]) for r in live], 0.01, 0))


def _request(rid: str) -> SlotRequest:
    return SlotRequest(rid, [1, 2, 3], 4, 1.0, 1.0)


def test_requests_submitted_between_two_commands_go_as_one_message_before_the_next():
    ours, theirs = multiprocessing.Pipe()
    seen: list = []
    replica = threading.Thread(target=_replica, args=(theirs, seen))
    replica.start()
    try:
        c = ReplicaClient(0, ours, None, slots=4)
        for rid in ("a", "b", "c"):
            c.submit(_request(rid))
        assert seen == [] and c.num_active() == 3  # nothing sent yet, but the slots count as taken
        report = c.step()
        assert [type(m).__name__ for m in seen] == ["Submit", "Step"]
        assert [r.request_id for r in seen[0].requests] == ["a", "b", "c"]
        assert sorted(ev.request_id for ev in report.events) == ["a", "b", "c"]
        c.submit(_request("d"))
        c.abort(["d", "a"])  # the submit goes first: the replica never sees an abort of a request it lacks
        report = c.step()
        assert [type(m).__name__ for m in seen[2:]] == ["Submit", "Abort", "Step"]
        assert sorted(ev.request_id for ev in report.events) == ["b", "c"] and c.num_active() == 2
        c.submit(_request("e"))
        c.reset()  # (the replica restarted: what was not sent is dropped with the rest)
        c.step()
        assert type(seen[-2]).__name__ == "Step" and c.num_active() == 0
    finally:
        ours.send(None)
        replica.join()


def test_a_steps_routes_travel_as_one_array_and_come_back_on_their_events():
    """Routing replay: the reply carries the events' routes as one array (``StepDone.packed``); through a real pipe
    each event gets its own rows back at its own start, and an event without routes stays without."""
    import numpy as np

    events = [TokenEvent("a", [5], [-0.1]), TokenEvent("b", [6, 7], [-0.2, -0.3]), TokenEvent("c", [8], [-0.4])]
    events[0].route_start, events[0].routes = 3, np.full((4, 2, 2), 1, dtype=np.uint8)  # a prefill's rows
    events[2].route_start, events[2].routes = 9, np.full((1, 2, 2), 3, dtype=np.uint8)
    ours, theirs = multiprocessing.Pipe()
    theirs.send(StepDone.packed(events, 0.5, 2))
    done = ours.recv()
    assert done.route_rows == [4, 0, 1] and done.routes.shape == (5, 2, 2)
    got = done.routes_of()
    assert [e.request_id for e in got] == ["a", "b", "c"] and [e.route_start for e in got] == [3, 0, 9]
    assert got[0].routes.shape == (4, 2, 2) and (got[0].routes == 1).all() and got[1].routes is None
    assert got[2].routes.tolist() == [[[3, 3], [3, 3]]]
    plain = StepDone.packed([TokenEvent("d", [1], [-1.0])], 0.1, 0)  # no routes captured: nothing packed
    assert plain.routes is None and plain.routes_of()[0].routes is None
