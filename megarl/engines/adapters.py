"""LoRA adapters served by an in-process vLLM engine (``lora.rank`` > 0): the adapter-only weight sync's engine side.

The engine starts with vLLM's LoRA support on (``lora_args``) and the base model's weights, which never change. Each
sync hands it the trainer's adapters as PEFT-named tensors in memory (``trainer.lora_peft``); ``EngineAdapters.load``
makes them a new vLLM adapter — a new adapter id per version — and the requests from then on ask for it::

    build   vLLM's LoRAModel from the tensors (no file), registered beside the one served   (fails: nothing changed)
    agree   every rank of the trainer built it (one exchange)         (any failed: the new one removed on every
                                                                       rank, the old one still served: WeightLoadError)
    switch  the old adapter removed, the new one served, the prefix cache dropped (KV computed under the old one)

All or nothing as the full-weight load is, without a backup copy (the old adapter stays registered until every rank
has the new one). Before the first sync the engine serves the base model, which is the adapted model at the start
(B = 0). vLLM keeps two adapters on the host (``max_cpu_loras``: the served one and the incoming one) and runs one at
a time (``max_loras``).
"""

from __future__ import annotations

import torch.distributed as dist

from megarl.config.validate.lora import VLLM_RANKS
from megarl.weight_sync.adapter_load import register
from megarl.weight_sync.load import WeightLoadError


def lora_args(rank: int, modules: tuple[str, ...] = ()) -> dict:
    """``LLM``'s LoRA arguments for adapters of ``rank`` (0: none): the smallest rank vLLM accepts that holds them;
    ``modules``: the HF modules they adapt (``config.validate.lora.hf_modules``), the only ones vLLM then wraps for
    LoRA (none: every one it supports; an MoE layer wrapped runs vLLM's Triton kernel, which has no CPU build)."""
    if rank <= 0:
        return {}
    fits = [r for r in VLLM_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"lora.rank={rank}: vLLM serves adapters up to rank {VLLM_RANKS[-1]}")
    return {"enable_lora": True, "max_lora_rank": fits[0], "max_loras": 1, "max_cpu_loras": 2,
            **({"lora_target_modules": list(modules)} if modules else {})}


class EngineAdapters:
    """The adapter an in-process ``VLLMEngine`` serves: ``request`` (the ``LoRARequest`` its generations carry; None:
    the base model) and ``load`` of a new version."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.request = None
        self._next_id = 1  # vLLM's adapter ids are > 0; each load takes a new one

    def _manager(self):
        return self.engine.worker.model_runner.lora_manager

    def load(self, tensors: dict, config: dict, version: int) -> None:
        """``tensors`` (PEFT-named) served as ``version`` on every rank, or on none (``WeightLoadError``)."""
        manager = self._manager()
        new_id = self._next_id
        self._next_id += 1
        problems = every_rank(register(manager, tensors, config, new_id,
                                       self.engine.llm.llm_engine.model_config.hf_config.to_dict()))
        if any(problems):
            manager.remove_adapter(new_id)
            why = "; ".join(f"rank {r}: {p}" for r, p in enumerate(problems) if p)
            raise WeightLoadError(f"LoRA adapter for version {version} not loaded ({why}); the engine still serves "
                                  "the previous one")
        old, self.request = self.request, served_request(version, new_id)
        if old is not None:
            manager.remove_adapter(old.lora_int_id)

    def forget(self) -> None:
        """A fresh engine serves the base model until the next load."""
        self.request = None


def every_rank(problem: str) -> list[str]:
    """Each trainer rank's ``problem`` ('' for none), on every rank (one exchange; just this one alone)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [problem]
    every = [""] * dist.get_world_size()
    dist.all_gather_object(every, problem)
    return every


def served_request(version: int, adapter_id: int):
    """The ``LoRARequest`` that asks for adapter ``adapter_id``, the trainer's ``version`` (registered in memory: its
    path names nothing on disk)."""
    from vllm.lora.request import LoRARequest  # deferred: vLLM, in engine processes only

    return LoRARequest(f"megarl-v{version}", adapter_id, f"megarl://adapter/{adapter_id}")
