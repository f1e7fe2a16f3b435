"""Colocated memory hand-over: engines sleep while the trainer trains; the trainer offloads while engines generate.

On GPUs a 32B trainer and its colocated engines cannot both hold their memory. Around each
phase of the loop::

    generate   engine awake           trainer: optimizer state + grads on host (offload_during_rollout)
    ─ end of phase ─ engine.sleep(level) ─ trainer: state back on device ─
    train      engine asleep (level 1: weights on host, KV cache dropped; level 2: both dropped)
    ─ engine.wake_up() ─ sync (a level-2 engine gets all its weights from the sync) ─
    generate …

vLLM refuses sleep mode on its CPU platform, and a CPU trainer's state already lives in host
memory: there each call is skipped, said once in the log.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)


def on_gpu() -> bool:
    import torch

    return bool(torch.cuda.is_available()) and torch.cuda.device_count() > 0


def peak_rss_added(fn) -> int:
    """Bytes of peak RSS while ``fn`` runs, above the RSS before it (Linux: ``clear_refs`` 5 resets the peak).

    Run under a small ``MALLOC_MMAP_THRESHOLD_`` (65536; 4096 for a tiny model's small tensors) so that
    every buffer above it is its own mapping and RSS sees it come and go (glibc's heap would keep freed
    memory and hide new buffers)."""
    import re
    from pathlib import Path

    def rss(key: str) -> int:
        return int(re.search(key + r":\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024

    Path("/proc/self/clear_refs").write_text("5")
    before = rss("VmRSS")
    fn()
    return rss("VmHWM") - before


def sleep_supported() -> bool:
    """vLLM offers sleep mode on this platform (not on CPU)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return bool(getattr(current_platform, "is_sleep_mode_available", lambda: False)())


class EngineSleep:
    """``engine.sleep_level`` 0 (never), 1 or 2 around training; skipped with one log line where unsupported."""

    def __init__(self, engine, level: int, log: Callable[[str], None] = print) -> None:
        self.engine, self.level, self.log = engine, level, log
        self.supported = level > 0 and sleep_supported()
        self.asleep = False
        if level > 0 and not self.supported:
            log(f"engine.sleep_level={level}: vLLM has no sleep mode on this platform (CPU); "
                "the engine stays awake and sleep/wake calls are skipped")

    def rollback(self, requested: str) -> str:
        """``sync.rollback`` as the loads after a wake-up can apply it: at level 2 the weights were dropped, and the
        sync that follows the wake-up refills them whole, so 'copy' would back up (and on a failed load restore)
        memory that holds no weights; there a failed load leaves the engine unusable until the next sync, as
        'resync' does (said once)."""
        if requested == "copy" and self.supported and self.level == 2:
            self.log("engine.sleep_level=2 drops the engine's weights while it sleeps, so sync.rollback=copy has none "
                     "to back up after the wake-up: a failed load leaves the engine unusable until the next sync "
                     "(as sync.rollback=resync)")
            return "resync"
        return requested

    def sleep(self) -> None:
        if self.supported and not self.asleep:
            self.engine.llm.sleep(level=self.level)
            self.asleep = True

    def wake(self) -> None:
        if self.asleep:
            self.engine.llm.wake_up()
            self.asleep = False


class TrainerOffload:
    """``trainer.offload_during_rollout``: optimizer state and gradient buffers to host while engines generate.

    Moves the optimizer's own tensors (``offloadable``: not megatron's ``offload_to_cpu``, which moves an fp32
    optimizer's parameters, there the model's own) and uses the DDP wrappers' ``offload_grad_buffers`` /
    ``restore_grad_buffers`` (the buffers' storage is freed and reallocated, views stay valid, grads are zeroed —
    they are zeroed before every step anyway). A frozen model (the KL reference: no optimizer, no gradients) moves
    its weights, which only its forward in the training phase reads. With the trainer on CPU there is nothing to
    move: skipped, said once.
    """

    def __init__(self, trainer, enabled: bool, log: Callable[[str], None] = print) -> None:
        self.trainer, self.log = trainer, log
        self.active = enabled and on_gpu()
        self.offloaded = False
        self.params, self.state, self.device = [], [], None  # what the offload moved, and from where
        if enabled and not self.active:
            log("trainer.offload_during_rollout: the trainer's state is already in host memory (CPU); skipped")

    def offload(self) -> None:
        if not self.active or self.offloaded:
            return
        import torch

        self.device = torch.device("cuda", torch.cuda.current_device())
        if self.trainer.optimizer is None:  # frozen: its weights (no DDP hook on a parameter that takes no grad)
            self.params = [p for c in self.trainer.chunks for p in c.parameters() if p.device == self.device]
        else:
            self.params, self.state = offloadable(self.trainer.optimizer, self.trainer.chunks, self.device)
        for p in self.params:
            p.data = p.data.cpu()
        for entries, key in self.state:
            entries[key] = entries[key].cpu()
        for chunk in self.trainer.chunks:
            chunk.offload_grad_buffers()
        torch.cuda.empty_cache()
        self.offloaded = True

    def restore(self) -> None:
        if not self.offloaded:
            return
        for p in self.params:
            p.data = p.data.to(self.device)
        for entries, key in self.state:
            entries[key] = entries[key].to(self.device)
        for chunk in self.trainer.chunks:
            chunk.restore_grad_buffers()
        self.offloaded = False


def offloadable(optimizer, modules, device) -> tuple[list, list]:
    """What an offload moves to host: the tensors of megatron's ``optimizer`` (chained or not) on ``device`` — its
    state entries (Adam's moments and step, as (dict, key)) and the parameters it steps that are not the model's
    (fp32 main copies) — never one of ``modules``' parameters: an fp32 run without the distributed optimizer steps
    the model's own, and a parameter moved through ``.data`` across devices loses the gradient accumulator DDP
    hooked (its gradients would stay zero)."""
    import torch

    model = {id(p) for m in modules for p in m.parameters()}
    params, state = [], []
    for sub in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(sub, "optimizer", None)
        if inner is None or getattr(sub, "is_stub_optimizer", False):
            continue
        params += [p for group in inner.param_groups for p in group["params"]
                   if id(p) not in model and p.device == device]
        state += [(entries, key) for entries in inner.state.values() for key, v in entries.items()
                  if isinstance(v, torch.Tensor) and v.device == device]
    return params, state


class Handover:
    """The loop's two calls: ``to_train`` after generation, ``to_generate`` before the sync (``engines``: the run's
    ``Engines``, which sleep as ``engine.sleep_level`` says; ``trainers``: the learners an offload moves, the policy
    first, then a GAE critic and a frozen KL reference where the run has them)."""

    def __init__(self, engines, trainers: list, offload: bool, log: Callable[[str], None] = print) -> None:
        self.engines = engines
        self.offloads = [TrainerOffload(t, offload, log if i == 0 else (lambda _: None))
                         for i, t in enumerate(trainers)]

    def to_train(self) -> None:
        self.engines.sleep()
        for o in self.offloads:
            o.restore()

    def to_generate(self) -> None:
        for o in self.offloads:
            o.offload()
        self.engines.wake()

    @contextmanager
    def training(self) -> Iterator[None]:
        """Trainer work outside the RL step (the supervised warm-up, a checkpoint's load): the engines asleep and the
        trainer's state on device inside, as ``megarl plan`` sized the trainer's peak; the engines awake after (at
        sleep level 2 without weights: the caller syncs)."""
        self.to_train()
        try:
            yield
        finally:
            self.to_generate()
