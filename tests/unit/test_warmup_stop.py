"""A preemption during the supervised warm-up (``RunKeeper.warm_up``): the signal is read between two warm-up steps,
the warm-up stops after the step it arrived in, the checkpoint it saves records the steps done, and the rerun goes on
from the next step with the examples a warm-up never stopped would have drawn: the built-in task's stream (its cursor
restored as a run checkpoint restores it) and a conversation stream (derived again from its seed). The trainer records
its batches and the save its state; the real save, resume and the exactness of a whole run are
``tests/engine/test_resume.py``'s (slow)."""

from __future__ import annotations

import contextlib
import copy
import json
import signal
from types import SimpleNamespace

import pytest

from megarl.checkpoint.session_state import restore, state_of
from megarl.config.schema import RunConfig
from megarl.data.addition import AdditionTask
from megarl.distributed import signals
from megarl.distributed.signals import Preemption
from megarl.engines.memory import Handover
from megarl.keeper import RunKeeper
from megarl.models.tiny import build_tokenizer

STEPS = 6


class Flag(Preemption):
    """The run's preemption flag without its handlers in the test process: a test calls its handler itself."""

    def install(self) -> None:
        pass


class Trainer:
    """Records each warm-up batch, its NLL a function of the batch; SIGTERM reaches the flag's handler during step
    ``signal_at`` (1-based; 0: never)."""

    def __init__(self, flag: Flag, signal_at: int = 0) -> None:
        self.flag, self.signal_at, self.batches = flag, signal_at, []

    def set_lr(self, lr: float) -> None:
        self.lr = lr

    def train_step(self, batch, loss_fn) -> dict[str, float]:
        self.batches.append(batch.input_ids.tolist())
        if len(self.batches) == self.signal_at:
            self.flag._handle(signal.SIGTERM, None)  # what the preemption thread does when Slurm's signal comes
        return {"nll": float(batch.input_ids.float().mean())}


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(params=["task", "conversations"])
def cfg(request, tmp_path):
    cfg = RunConfig()
    cfg.warmup.steps, cfg.warmup.batch_size, cfg.engine.hang_timeout_s = STEPS, 3, 0
    if request.param == "conversations":  # 5 conversations, 3 a step: the resumed stream crosses an epoch
        path = tmp_path / "warmup.jsonl"
        path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                                                         {"role": "assistant", "content": str(2 * i)}]}) + "\n"
                                for i in range(5)))
        cfg.warmup.path = str(path)
    return cfg


@pytest.fixture(autouse=True)
def no_signal_left(monkeypatch):
    monkeypatch.setattr(signals, "_signalled", "")  # (the handler sets this process's flag: put back after)


def keeper(cfg, tok, signal_at: int = 0, saved: tuple | None = None) -> RunKeeper:
    """A keeper of a fresh process's session (the task, the tokenizer, a recording trainer); ``saved``: the
    checkpoint it resumed, ``(step, run state, task state)``, put back as ``RunKeeper.resume`` puts it back."""
    d, flag, calls = cfg.data, Flag(), []
    trainer = Trainer(flag, signal_at)
    engines = SimpleNamespace(sleep=lambda: calls.append("sleep"), wake=lambda: calls.append("wake"))
    s = SimpleNamespace(cfg=cfg, tokenizer=tok, trainer=trainer, cpus=SimpleNamespace(alone=contextlib.nullcontext),
                        task=AdditionTask(d.max_digits, d.tail_alpha, d.seed, d.eval_size),
                        handover=Handover(engines, [trainer], offload=False))
    k = RunKeeper(s, flag)
    k.handed = calls  # the engines' sleep and wake around the warm-up
    if saved is not None:
        k.run = copy.deepcopy(saved[1])
        restore(s.task, saved[2])
    k.saves, k.syncs = [], []
    k.save = lambda step, exact=True: k.saves.append((step, copy.deepcopy(k.run), state_of(s.task)))
    k.sync = lambda version, done_steps=0: k.syncs.append(version) or calls.append("sync") or {}
    return k


def test_a_preemption_stops_the_warmup_after_its_step_and_the_rerun_goes_on_from_the_next(cfg, tok):
    ref = keeper(cfg, tok)
    ref.warm_up()
    assert len(ref.s.trainer.batches) == STEPS and ref.run["warmup_done"] == STEPS and ref.syncs == [0]
    assert not ref.saves and not ref.stopped
    assert ref.handed == ["sleep", "wake", "sync"]  # the engines asleep while it trains, synced once awake

    stopped = keeper(cfg, tok, signal_at=3)
    stopped.warm_up()
    assert stopped.s.trainer.batches == ref.s.trainer.batches[:3]  # the step the signal came in ends, no more
    assert stopped.stopped == "SIGTERM received" and stopped.syncs == []  # (train.run leaves, exit 0)
    [(step, run, _)] = stopped.saves
    assert step == 0 and run["warmup_done"] == 3 and run["warmup_nll"] == ref.run["warmup_nll"][:3]

    rerun = keeper(cfg, tok, saved=stopped.saves[0])
    rerun.warm_up()
    assert rerun.s.trainer.batches == ref.s.trainer.batches[3:]  # the stream where the stopped warm-up left it
    assert rerun.run["warmup_done"] == STEPS and rerun.run["warmup_nll"] == ref.run["warmup_nll"]
    assert rerun.syncs == [0] and not rerun.saves and not rerun.stopped
    assert state_of(rerun.s.task) == state_of(ref.s.task)  # RL draws its prompts on from the same place


def test_a_signal_in_the_last_warmup_step_saves_it_done_and_the_rerun_trains_no_warmup_step(cfg, tok):
    stopped = keeper(cfg, tok, signal_at=STEPS)
    stopped.warm_up()
    assert len(stopped.s.trainer.batches) == STEPS and stopped.stopped == "SIGTERM received"
    assert [(step, run["warmup_done"]) for step, run, _ in stopped.saves] == [(0, STEPS)]
    rerun = keeper(cfg, tok, saved=stopped.saves[0])
    rerun.warm_up()  # (the resume synced the engines: nothing to do)
    assert rerun.s.trainer.batches == [] and rerun.syncs == [] and not rerun.stopped


def test_a_signal_before_the_first_warmup_step_trains_none_and_a_rerun_at_another_batch_size_goes_on(cfg, tok):
    """A signal taken while the session was built: no warm-up step, the checkpoint says so. Resumed after 3 steps of
    3 at a batch of 2: the stream goes on after the 9 examples drawn (not 3 × 2), and the pass@1 a step-0 checkpoint
    measured before the warm-up's rest is measured again."""
    from megarl.trainer.sft import warmup_examples

    early = keeper(cfg, tok)
    early.preemption._handle(signal.SIGTERM, None)
    early.warm_up()
    assert early.s.trainer.batches == [] and [run["warmup_done"] for _, run, _ in early.saves] == [0]

    stopped = keeper(cfg, tok, signal_at=3)
    stopped.warm_up()
    (_, run, task), = stopped.saves
    assert run["warmup_examples"] == 9
    run["pass_at_1_before"] = 0.5
    cfg.warmup.batch_size = 2
    rerun = keeper(cfg, tok, saved=(0, run, task))
    rerun.warm_up()
    assert rerun.run["warmup_done"] == STEPS and rerun.run["warmup_examples"] == 9 + 3 * 2
    assert "pass_at_1_before" not in rerun.run
    if cfg.warmup.path:  # the conversations' stream: the rerun's first batch is examples 10 and 11 of one stream
        whole = warmup_examples(cfg, tok, None)
        whole(9)
        assert warmup_examples(cfg, tok, None, drawn=9)(2) == whole(2)
