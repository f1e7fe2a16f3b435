"""Which layout ``megarl plan`` proposes: on GPUs the fastest that fits by the step-time model, with the next ones
beside it; on CPUs (``--cpu``, no step-time model) the first that fits in the order of preference
(``layout.colocated_layouts``). When none fits, the one closest to fitting.

The candidates: the trainer's TP × PP × EP × expert TP on its nodes, and for the engines colocated with each
sleep level (with and without the trainer's offload), the job's last nodes as engine-only nodes, or the last
GPUs of every node as engine-only GPUs (the trainer on the rest), each at every engine TP; each of them without
activation recompute, then with selective and full recompute (``trainer.recompute``, unless the config fixes it),
which a layout takes where it fits only so or runs faster than every layout that fits without. Where responses are
long (``rollout.max_new_tokens`` ≥ ``LONG_RESPONSE_TOKENS``) and nothing fits, every candidate again at context
parallelism 2, 4 and 8 (``parallel.cp``: 1/CP of a micro-batch's activations and logits per GPU, for its key/value
traffic; the config's CP alone when it sets ``parallel.cp``). A candidate the config checks refuse
(``check_layout``, ``check_kv_cache``) is skipped.
"""

from __future__ import annotations

from dataclasses import replace

from megarl.config import ConfigError
from megarl.config.schema import RunConfig
from megarl.launch.gpus import Gpu
from megarl.launch.layout import (
    Layout,
    apply_layout,
    check_layout,
    colocated_layouts,
    disaggregated_layouts,
    engine_gpu_layouts,
)
from megarl.launch.memory import check_kv_cache, memory_gib
from megarl.launch.model_size import Counts
from megarl.launch.step_time import Work, step_time

RECOMPUTE_MODES = ("none", "selective", "full")
"""``trainer.recompute`` in the order a plan tries them (``--cpu`` proposes the first that fits)."""
LONG_RESPONSE_TOKENS = 8192
"""Responses this long (``rollout.max_new_tokens``) have a plan weigh context parallelism where nothing fits without."""
WIDER_CP = (2, 4, 8)
"""The ``parallel.cp`` a plan weighs then."""


def candidates(hf: dict, nodes: int, gpus_per_node: int, cpu: bool, trainer_gpus: int = 0,
               recompute: tuple[str, ...] = RECOMPUTE_MODES, recompute_layers: int = 1, cps: tuple[int, ...] = (1,)):
    """The layouts a plan of a ``nodes``-node job weighs (all of its nodes: engine-only ones are carved out), under
    each of ``recompute`` in turn (units of ``recompute_layers`` under full). ``trainer_gpus`` below
    ``gpus_per_node`` (the trainer launched on that many processes a node): only the splits that give each node's
    other GPUs to replicas. ``cps``: the context parallelism each is weighed at (a CP size that does not divide its
    world / (TP × PP) is refused by the checks)."""
    for mode in recompute:
        for cp in cps:
            for lay in _placements(hf, nodes, gpus_per_node, cpu, trainer_gpus):
                yield replace(lay, recompute=mode, recompute_layers=recompute_layers, cp=cp)


def _placements(hf: dict, nodes: int, gpus_per_node: int, cpu: bool, trainer_gpus: int = 0):
    if cpu:  # vLLM has no sleep mode on CPU, and no step-time model orders the rest
        yield from colocated_layouts(hf, nodes, gpus_per_node)
        return
    if 0 < trainer_gpus < gpus_per_node:
        yield from engine_gpu_layouts(hf, nodes, gpus_per_node, (gpus_per_node - trainer_gpus,))
        return
    yield from colocated_layouts(hf, nodes, gpus_per_node, (0, 1, 2), (False, True))
    yield from disaggregated_layouts(hf, nodes, gpus_per_node)
    yield from engine_gpu_layouts(hf, nodes, gpus_per_node)


class Checked:
    """``check_layout`` and ``check_kv_cache`` of a candidate, once per what they read (not the sleep level or
    the offload)."""

    def __init__(self, hf: dict, cfg: RunConfig, precision: str) -> None:
        self.hf, self.cfg, self.precision, self.seen = hf, cfg, precision, {}

    def ok(self, lay: Layout) -> bool:
        key = replace(lay, sleep_level=0, offload=False)
        if key not in self.seen:
            try:
                check_layout(apply_layout(self.cfg, key), self.hf, lay.nodes, lay.gpus_per_node, False, lay.node_gpus)
                check_kv_cache(self.hf, self.cfg, key, self.precision)
                self.seen[key] = True
            except ConfigError:
                self.seen[key] = False
        return self.seen[key]


def ranked(counts: Counts, hf: dict, cfg: RunConfig, nodes: int, gpus_per_node: int, gpu_mem_gib: float,
           precision: str, cpu: bool, gpu: Gpu | None, work: Work | None, keep: int = 3,
           first_fit: bool = False, trainer_gpus: int = 0, recompute: tuple[str, ...] = RECOMPUTE_MODES,
           cps: tuple[int, ...] | None = None) -> dict:
    """``_ranked`` at ``cps`` (the context parallelism the config fixes), or (None) at CP 1 and, where responses are
    long and nothing fits, at ``WIDER_CP``."""
    args = (counts, hf, cfg, nodes, gpus_per_node, gpu_mem_gib, precision, cpu, gpu, work, keep, first_fit,
            trainer_gpus, recompute)
    found = _ranked(*args, cps or (1,))
    if cps is None and not found["fitting"] and cfg.rollout.max_new_tokens >= LONG_RESPONSE_TOKENS:
        wider = _ranked(*args, WIDER_CP)
        if wider["fitting"]:
            return wider
    return found


def _ranked(counts: Counts, hf: dict, cfg: RunConfig, nodes: int, gpus_per_node: int, gpu_mem_gib: float,
            precision: str, cpu: bool, gpu: Gpu | None, work: Work | None, keep: int, first_fit: bool,
            trainer_gpus: int, recompute: tuple[str, ...], cps: tuple[int, ...]) -> dict:
    """{'fitting': [(layout, memory, step time or None)] fastest first (``keep`` of them; on CPU or with
    ``first_fit`` the first that fits), 'closest': (layout, memory) nearest to fitting when none fits, 'valid':
    whether any candidate was}. Memory is arithmetic and the checks are not: a candidate is checked only once
    it fits, or would be the closest so far. ``trainer_gpus``: the trainer's processes per node, ``recompute`` the
    modes to weigh (``candidates``), ``cps`` the context parallelism."""
    checked, fitting, closest = Checked(hf, cfg, precision), [], None
    for lay in candidates(hf, nodes, gpus_per_node, cpu, trainer_gpus, recompute, cfg.trainer.recompute_layers,
                          cps):
        if lay.sleep_level == 2 and cfg.lora.rank > 0:
            continue  # (level 2 drops the engine's base weights, which a LoRA sync never sends back)
        mem = memory_gib(counts, hf, cfg, lay, precision, cpu, gpu_mem_gib)
        if mem["total"] > gpu_mem_gib:
            if (closest is None or mem["total"] < closest[1]["total"]) and checked.ok(lay):
                closest = (lay, mem)
            continue
        if not checked.ok(lay):
            continue
        if cpu or first_fit:
            return {"fitting": [(lay, mem, None if cpu else step_time(counts, hf, cfg, lay, gpu, work, mem))],
                    "closest": None, "valid": True}
        fitting.append((lay, mem, step_time(counts, hf, cfg, lay, gpu, work, mem)))
    fitting.sort(key=lambda x: (x[2]["step_s"], x[1]["total"]))
    return {"fitting": fitting[:keep], "closest": closest, "valid": bool(fitting) or closest is not None}
