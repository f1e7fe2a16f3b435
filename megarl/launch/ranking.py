"""Which layout ``megarl plan`` proposes: on GPUs the fastest that fits by the step-time model, with the next ones
beside it; on CPUs (``--cpu``, no step-time model) the first that fits in the order of preference
(``layout.colocated_layouts``). When none fits, the one closest to fitting.

The candidates: the trainer's TP × PP × EP × expert TP on its nodes, and for the engines colocated with each
sleep level (with and without the trainer's offload), the job's last nodes as engine-only nodes, or the last
GPUs of every node as engine-only GPUs (the trainer on the rest), each at every engine TP. A candidate the
config checks refuse (``check_layout``, ``check_kv_cache``) is skipped.
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


def candidates(hf: dict, nodes: int, gpus_per_node: int, cpu: bool, trainer_gpus: int = 0):
    """The layouts a plan of a ``nodes``-node job weighs (all of its nodes: engine-only ones are carved out).
    ``trainer_gpus`` below ``gpus_per_node`` (the trainer launched on that many processes a node): only the splits
    that give each node's other GPUs to replicas."""
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
           first_fit: bool = False, trainer_gpus: int = 0) -> dict:
    """{'fitting': [(layout, memory, step time or None)] fastest first (``keep`` of them; on CPU or with
    ``first_fit`` the first that fits), 'closest': (layout, memory) nearest to fitting when none fits, 'valid':
    whether any candidate was}. Memory is arithmetic and the checks are not: a candidate is checked only once
    it fits, or would be the closest so far. ``trainer_gpus``: the trainer's processes per node (``candidates``)."""
    checked, fitting, closest = Checked(hf, cfg, precision), [], None
    for lay in candidates(hf, nodes, gpus_per_node, cpu, trainer_gpus):
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
