"""Routing replay's bookkeeping without an engine: a sample's routes across resumes, the batch's routes tensor and
its padding, the settings refused before launch."""

import numpy as np
import pytest
import torch

from megarl.algo.batch import batch_routes, build_batch
from megarl.config import ConfigError, load_config, validate
from megarl.models.tiny import TinyShape, hf_config
from megarl.types import ROUTE_PARTS, Sample, no_route

MOE = hf_config(TinyShape(family="qwen3_moe"), eos_id=1, pad_id=0)
DENSE = hf_config(TinyShape(family="qwen2"), eos_id=1, pad_id=0)


def rows(first: int, n: int, value=None) -> np.ndarray:
    """n routes [n, 2 layers, k 2] whose first expert id is the position (or ``value``)."""
    out = np.zeros((n, 2, 2), dtype=np.uint8)
    out[:, :, 0] = np.arange(first, first + n)[:, None] if value is None else value
    out[:, :, 1] = 1
    return out


def test_a_resumed_sample_keeps_its_earlier_routes_and_a_gap_is_refused():
    s = Sample(prompt_ids=[5, 6, 7])
    s.add_routes(0, rows(0, 3))  # prefill: positions 0..2
    s.add_routes(3, rows(3, 1))  # a decode step
    s.add_routes(0, rows(0, 5, value=9))  # resumed: re-prefilled 0..4 under new weights; only 4 is new
    got = s.route_array()
    assert got.shape == (5, 2, 2) and got[:4, 0, 0].tolist() == [0, 1, 2, 3] and got[4, 0, 0] == 9
    with pytest.raises(RuntimeError, match="start at position 7 but only 5 are known"):
        s.add_routes(7, rows(7, 1))
    assert Sample(prompt_ids=[1]).route_array() is None


def test_a_long_decode_keeps_every_route_in_few_arrays():
    """One row per decode step: the arrays are merged as they come and their positions counted (a step's cost does
    not grow with the length), and every position keeps its own route, a resume's re-prefill included."""
    s = Sample(prompt_ids=[5, 6, 7])
    s.add_routes(0, rows(0, 3))
    for pos in range(3, 200):
        s.add_routes(pos, rows(pos, 1))
        assert len(s.routes) <= ROUTE_PARTS + 1
    s.add_routes(0, rows(0, 201, value=7))  # resumed: only position 200 is new
    got = s.route_array()
    assert got.shape == (201, 2, 2) and got[:200, 0, 0].tolist() == list(range(200))
    assert got[200, 0, 0] == 7 and s.routed == 201
    s.routed = 0  # (a sample from a checkpoint written before the count): counted from its arrays once
    s.add_routes(201, rows(201, 1))
    assert s.route_array().shape[0] == 202 and s.routed == 202


def test_the_batch_routes_pad_with_no_expert_and_survive_the_trainers_padding():
    batch = build_batch([[3, 4], [3, 4, 5]], [[6, 7, 8], [6]], [[-1.0] * 3, [-1.0]])
    batch.routes = batch_routes([rows(0, 4), None], batch.seq_len)
    assert batch.routes.shape == (2, 4, 2, 2) and batch.routes.dtype == torch.uint8
    assert batch.routes[0, :, 0, 0].tolist() == [0, 1, 2, 3]
    assert (batch.routes[1] == no_route(torch.uint8)).all()  # a sample without routes: the trainer routes it
    padded = batch.pad_rows(1).pad_columns(2)
    assert padded.routes.shape == (3, 6, 2, 2)
    assert (padded.routes[2] == 255).all() and (padded.routes[:, 4:] == 255).all()
    assert no_route(np.int16) == -1 and batch_routes([None, None], 4) is None


def test_routing_replay_on_a_dense_model_is_refused_before_launch():
    with pytest.raises(ConfigError, match="algo.routing_replay=rollout: .* is a dense model"):
        validate(load_config(None, ["algo.routing_replay=rollout"]), 1, DENSE)
    validate(load_config(None, ["algo.routing_replay=trainer"]), 1, MOE)
    with pytest.raises(ConfigError, match="engine.tensor_parallel_size=2 on CPU: a replica's routes"):
        validate(load_config(None, ["algo.routing_replay=rollout", "engine.placement=disaggregated",
                                    "engine.tensor_parallel_size=2"]), 2, MOE)
    with pytest.raises(ConfigError, match="algo.routing_replay must be one of"):
        load_config(None, ["algo.routing_replay=r3"])


def test_auto_replays_the_engines_routes_wherever_they_are_captured():
    from megarl.config.schema import resolved_routing_replay

    assert resolved_routing_replay(load_config(None), 4) == "rollout"
    assert resolved_routing_replay(load_config(None), 0) == "none"  # dense: nothing to replay, nothing refused
    validate(load_config(None), 1, DENSE)
    remote_tp2 = load_config(None, ["engine.placement=disaggregated", "engine.tensor_parallel_size=2"])
    assert resolved_routing_replay(remote_tp2, 4) == "none"  # no capture in a TP-2 replica
    assert resolved_routing_replay(load_config(None, ["algo.routing_replay=none"]), 4) == "none"


def test_prefix_caching_is_off_only_while_the_hook_captures_routes():
    from megarl.config.schema import captures_routes
    from megarl.engines.routes import capture_args

    assert not captures_routes(load_config(None, ["algo.routing_replay=none"]), 4)  # no routes asked for: none taken
    assert captures_routes(load_config(None), 4)
    assert captures_routes(load_config(None, ["algo.routing_replay=trainer"]), 4)
    assert capture_args(0, gpu=False) == {"enable_prefix_caching": True}
    assert capture_args(4, gpu=False) == {"enable_prefix_caching": False}  # the CPU hook never sees cached rows
    # vLLM's own route output keeps each cached block's routes, and requires prefix caching
    assert capture_args(4, gpu=True) == {"enable_prefix_caching": True, "enable_return_routed_experts": True}


def test_on_gpus_every_placement_captures_routes_and_on_cpu_a_tp2_replica_does_not(monkeypatch):
    from megarl.config.schema import captures_routes, resolved_routing_replay
    from megarl.config.validate.limits import vllm_route_output_problem

    colocated_tp2 = load_config(None, ["engine.tensor_parallel_size=2"])
    assert captures_routes(colocated_tp2, 4, gpu=False)  # the CPU hook: every rank routes every token
    assert captures_routes(colocated_tp2, 4, gpu=True)  # vLLM's output, on the engine's first TP rank
    assert resolved_routing_replay(colocated_tp2, 4, gpu=True) == "rollout"
    remote_tp2 = load_config(None, ["engine.placement=disaggregated", "engine.tensor_parallel_size=2"])
    assert captures_routes(remote_tp2, 4, gpu=True) and not captures_routes(remote_tp2, 4, gpu=False)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in vllm_route_output_problem()
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert vllm_route_output_problem() == ""  # (triton is installed here)


def test_where_auto_resolves_to_none_for_want_of_routes_the_start_and_the_plan_say_so(tmp_path, capsys):
    from helpers.plans import QWEN3_30B_A3B, RUN
    from megarl.config.validate.prelaunch import checked_config
    from megarl.launch.plan import plan
    from megarl.launch.plan_table import routes_lines

    run = [f"train.run_dir={tmp_path}", f"model.path={tmp_path / 'model'}", "model.make_tiny=qwen3_moe"]
    off = ("algo.routing_replay=auto resolves to none (no routing replay, no moe/* agreement metrics): the engines "
           "cannot capture each token's routes with engine.placement=disaggregated at engine.tensor_parallel_size=2 "
           "on CPU")
    checked_config(None, [*run, "engine.placement=disaggregated", "engine.tensor_parallel_size=2"], 1,
                   command="plan")
    said = [line for line in capsys.readouterr().err.splitlines() if "routing_replay" in line]
    assert len(said) == 1 and said[0].startswith(f"megarl: note: {off}: a replica's routes are captured")
    assert said[0].endswith("engine.tensor_parallel_size=1 captures them, algo.routing_replay=trainer replays the "
                            "trainer's own (R2)")
    for kept in (["engine.tensor_parallel_size=2"], ["engine.placement=disaggregated", "engine.tensor_parallel_size=2",
                                                     "algo.routing_replay=none"]):
        checked_config(None, [*run, *kept], 2, command="plan")  # routes captured, or none asked for: no note
        assert "routing_replay" not in capsys.readouterr().err
    # on GPUs the layouts the plan proposes (the 30B recipe's colocated engine TP 8 among them) all replay
    gpus = plan(QWEN3_30B_A3B, load_config(None, RUN), 2, 8, 80, propose=True)
    assert gpus["routes_off"] == "" and routes_lines(gpus)[0].startswith("routes  384 B per token")
    tp8 = plan(QWEN3_30B_A3B, load_config(None, [*RUN, "engine.tensor_parallel_size=8"]), 2, 8, 80)
    assert tp8["layout"]["placement"] == "colocated" and tp8["layout"]["engine_tp"] == 8 and tp8["routes_off"] == ""
    cpu = plan(MOE, load_config(None, ["engine.placement=disaggregated", "engine.tensor_parallel_size=2",
                                       "engine.replicas=1"]), 2, 2, 64, cpu=True)
    assert routes_lines(cpu) == [f"routes  none: {cpu['routes_off']}"] and cpu["routes_off"].startswith(off)


def test_vllms_route_layout_becomes_megarls():
    """vLLM's rows [tokens, every decoder layer, k] (uint8 up to 256 experts, else uint16; a dense layer's rows
    never written) → [tokens, MoE layers, k] in megarl's dtype (255 is no_route: 255 experts and more are int16)."""
    from megarl.engines.routes import moe_layer_ids, route_dtype, vllm_routes

    hf = {**MOE, "num_hidden_layers": 4, "mlp_only_layers": [1]}
    assert moe_layer_ids(hf) == [0, 2, 3]
    rows = np.zeros((3, 4, 2), dtype=np.uint16)
    rows[:, [0, 2, 3]] = np.arange(18, dtype=np.uint16).reshape(3, 3, 2) + 250
    got = vllm_routes(rows, moe_layer_ids(hf), route_dtype(300))
    assert got.dtype == np.int16 and got.shape == (3, 3, 2) and got[2, 2].tolist() == [266, 267]
    small = vllm_routes((rows[:, :, :1] - 250).astype(np.uint8), [0, 2, 3], route_dtype(4))
    assert small.dtype == np.uint8 and small[:, :, 0].tolist() == [[0, 2, 4], [6, 8, 10], [12, 14, 16]]
    with pytest.raises(ValueError, match="decoder layers > 3"):
        vllm_routes(rows[:, :3], [0, 2, 3], np.uint8)


def test_a_request_preempted_mid_prefill_routes_again_from_position_0_in_place_of_its_held_rows():
    """vLLM's scheduler preempts the newest request when a running one needs a KV block and recomputes it from
    position 0: the rows its chunked prefill had routed (held: no output yet) are replaced, and counted."""
    from megarl.engines.routes import HeldRoutes

    held = HeldRoutes()
    held.file("a", 0, rows(0, 64))  # first prefill chunk
    held.file("a", 64, rows(64, 64))  # second chunk: appended
    assert held.pending["a"][0] == 0 and len(held.pending["a"][1]) == 128 and held.restarts == 0
    held.file("a", 0, rows(0, 64, value=7))  # preempted, recomputed from 0
    first, got = held.pending["a"]
    assert first == 0 and len(got) == 64 and (got[:, 0, 0] == 7).all() and held.restarts == 1
    held.file("a", 64, rows(64, 70))  # its prefill goes on, then decodes
    assert len(held.pending["a"][1]) == 134 and held.restarts == 1
    with pytest.raises(RuntimeError, match="routed positions 0..133, then from 140"):
        held.file("a", 140, rows(140, 1))  # a hole is never filled in silently
