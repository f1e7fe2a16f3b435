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
from megarl.models.hf_adapter import head_layout
from megarl.models.hf_config import is_moe_layer
from megarl.weight_sync.load import WeightLoadError


def lora_args(rank: int) -> dict:
    """``LLM``'s LoRA arguments for adapters of ``rank`` (0: none): the smallest rank vLLM accepts that holds them."""
    if rank <= 0:
        return {}
    fits = [r for r in VLLM_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"lora.rank={rank}: vLLM serves adapters up to rank {VLLM_RANKS[-1]}")
    return {"enable_lora": True, "max_lora_rank": fits[0], "max_loras": 1, "max_cpu_loras": 2}


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
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper
        from vllm.lora.request import LoRARequest

        manager = self._manager()
        new_id, problem = self._next_id, ""
        self._next_id += 1
        try:
            helper = PEFTHelper.from_dict(dict(config))
            helper.validate_legal(manager.lora_config)
            model = LoRAModel.from_lora_tensors(new_id, tensors, helper, device="cpu",
                                                dtype=manager.lora_config.lora_dtype,
                                                model_vocab_size=manager.vocab_size)
            check_adapter(tensors, helper.r, self.engine.llm.llm_engine.model_config.hf_config.to_dict(),
                          _served_modules(manager))
            manager._adapter_manager.add_adapter(model)
        except Exception as exc:  # noqa: BLE001  (agreed below: every rank keeps the old adapter)
            problem = f"{type(exc).__name__}: {exc}"
        problems = every_rank(problem)
        if any(problems):
            manager.remove_adapter(new_id)
            why = "; ".join(f"rank {r}: {p}" for r, p in enumerate(problems) if p)
            raise WeightLoadError(f"LoRA adapter for version {version} not loaded ({why}); the engine still serves "
                                  "the previous one")
        old, self.request = self.request, LoRARequest(f"megarl-v{version}", new_id, f"megarl://adapter/{new_id}")
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


def module_shapes(hf: dict) -> dict[str, tuple[int, int]]:
    """(out, in) of each HF module an adapter may target, from the model's config."""
    h, f = hf["hidden_size"], hf["intermediate_size"]
    heads, kv, d = head_layout(hf)
    return {"q_proj": (heads * d, h), "k_proj": (kv * d, h), "v_proj": (kv * d, h), "o_proj": (h, heads * d),
            "gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f)}


def check_adapter(tensors: dict, rank: int, hf: dict, served: set[str]) -> None:
    """Raise ValueError unless ``tensors`` are a whole adapter of the model ``hf``: every module vLLM serves LoRA on,
    ``lora_A`` [rank, in] and ``lora_B`` [out, rank] of its shape, both of each, the same modules in every layer
    that has them. vLLM itself takes a B a row short (and serves it wrong) or an adapter missing a layer (that layer
    then runs the base): a broken transfer must fail the load instead."""
    shapes, held = module_shapes(hf), {}
    for name, t in tensors.items():
        where, which, _ = name.rsplit(".", 2)
        layer, module = where.split(".layers.", 1)[1].split(".", 1)[0], where.rsplit(".", 1)[-1]
        if module not in served or module not in shapes:
            raise ValueError(f"{name}: the engine's model has no LoRA-capable module {module!r}")
        out, inp = shapes[module]
        want = (rank, inp) if which == "lora_A" else (out, rank)
        if tuple(t.shape) != want:
            raise ValueError(f"{name}: shape {tuple(t.shape)}, the model's {module} takes {want}")
        held.setdefault(module, {}).setdefault(int(layer), set()).add(which)
    for module, layers in held.items():
        dense = module in ("gate_proj", "up_proj", "down_proj")
        expected = {i for i in range(hf["num_hidden_layers"]) if not (dense and is_moe_layer(hf, i))}
        if set(layers) != expected or any(parts != {"lora_A", "lora_B"} for parts in layers.values()):
            raise ValueError(f"the adapter's {module} is not whole: layers {sorted(layers)} of {sorted(expected)}, "
                             "each needs lora_A and lora_B")


def _served_modules(manager) -> set[str]:
    """The HF module names the engine takes adapters for (packed ones, qkv_proj and gate_up_proj, by their parts)."""
    adapter_manager = manager._adapter_manager
    packed = adapter_manager.packed_modules_mapping
    return {part for m in adapter_manager.supported_lora_modules for part in packed.get(m, [m])}
