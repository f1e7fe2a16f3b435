"""Trainer set-ups the worker scripts share: the parallel layouts they run, a fixed batch, a trainer at a layout."""

from __future__ import annotations

import torch

LAYOUTS = {
    "single": dict(),
    "tp2": dict(tp=2),
    "tp2_sp": dict(tp=2, sequence_parallel=True),
    "tp2_sp_etp1": dict(tp=2, etp=1, sequence_parallel=True),
    "tp2_full_logits": dict(tp=2, logprob_chunk=0),
    "single_aux_loss": dict(moe_aux_loss_coeff=0.1),
    "single_z_loss": dict(moe_z_loss_coeff=0.1),
    "pp2": dict(pp=2),
    "pp2_vpp2": dict(pp=2, vpp=2),
    # one microbatch of 8 rows; interleaving pads a second, all-padding one (PP=2 microbatches)
    "single_mbs8": dict(micro_batch_size=8),
    "pp2_vpp2_mbs8": dict(pp=2, vpp=2, micro_batch_size=8),
    "dp2": dict(),
    # a batch of one row on two data-parallel ranks (a dynamic-sampling step with few useful samples, or a
    # mini-batch smaller than DP): the rank without a row gets a padding row instead of failing in the schedule
    "single_one_row": dict(rows=1),
    "dp2_one_row": dict(rows=1),
    "ep2_alltoall": dict(ep=2, moe_dispatcher="alltoall"),
    "ep2_allgather": dict(ep=2, moe_dispatcher="allgather"),
    # four processes (torchrun --nproc-per-node 4): combined layouts (PP × DP)
    "ep2_pp2": dict(ep=2, pp=2),
    "ep2_pp2_mbs8": dict(ep=2, pp=2, micro_batch_size=8),
    "ep2_tp2": dict(ep=2, tp=2, sequence_parallel=True),
    "ep2_tp2_etp1": dict(ep=2, tp=2, etp=1, sequence_parallel=True),
    # expert TP 2 asking for alltoall: on gloo megarl runs the allgather dispatcher (trainer/parallel.py)
    "ep2_tp2_etp2": dict(ep=2, tp=2, etp=2, sequence_parallel=True, moe_dispatcher="alltoall"),
    # bf16 mixed precision (trainer.precision): fp32 main params, gradients and Adam state beside bf16 weights
    "bf16_single": dict(precision="bf16"),
    "bf16_tp2_sp": dict(precision="bf16", tp=2, sequence_parallel=True),
    "bf16_pp2": dict(precision="bf16", pp=2),
    # at 2 processes EP 2 leaves the dense part DP 2: the distributed optimizer shards its fp32 main params
    "bf16_ep2_distopt": dict(precision="bf16", ep=2, distributed_optimizer=True),
    "bf16_dp2_distopt": dict(precision="bf16", distributed_optimizer=True),
    # context parallelism (parallel.cp, packed rows): 2 processes share each row; at 4, with TP 2 + SP or DP 2
    "cp2": dict(cp=2),
    "ep2_cp2": dict(ep=2, cp=2),
    "tp2_sp_cp2": dict(tp=2, cp=2, sequence_parallel=True),
    "dp2_cp2": dict(cp=2),
    "pp2_cp2": dict(pp=2, cp=2),
}


def fixed_batch(vocab: int, n: int = 8, prompt: int = 5, seq: int = 20):
    from megarl.algo.batch import build_batch

    g = torch.Generator().manual_seed(1234)
    prompts, responses, logps = [], [], []
    for i in range(n):
        length = 4 + (i * 5) % (seq - prompt - 3)
        prompts.append(torch.randint(2, vocab, (prompt,), generator=g).tolist())
        responses.append(torch.randint(2, vocab, (length,), generator=g).tolist())
        logps.append((-torch.rand(length, generator=g) - 2.5).tolist())
    adv = (torch.rand(n, generator=g) * 2 - 1).tolist()
    return build_batch(prompts, responses, logps, adv, loss_agg="token_mean", seq_len=seq)


def seeded_layout(spec: dict, model_dir: str) -> tuple:
    """What a worker building trainers at a layout starts with: the parallel state of ``spec`` (a ``LAYOUTS`` entry
    less its trainer keys), the CPU adapter, every seed at 0, and the model's HF config: (ps, cfg)."""
    from megarl.compat.megatron import activate_cpu
    from megarl.distributed.parallel import build_parallel_state
    from megarl.models.hf_config import read_hf_config

    ps = build_parallel_state(**spec)
    activate_cpu()
    from megatron.core import tensor_parallel  # (megatron's RNG tracker: after the CPU adapter)

    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    return ps, read_hf_config(model_dir)


def relative_gap(weights: dict, reference: dict) -> float:
    """The largest gap of any tensor to the reference's, relative to that tensor's largest entry (at least 1e-2)."""
    return max(float((weights[k].float() - reference[k].float()).abs().max()
                     / reference[k].float().abs().max().clamp(min=1e-2)) for k in reference)


def build_trainer(layout: str, model_dir: str, optim, head: str = "lm", **extra):
    """Parallel state for ``layout``, the CPU adapter, seeds, and a trainer from the HF weights.

    Logprobs come from hidden states in chunks of 8 positions (several chunks per sequence),
    or from full vocab-parallel logits where the layout says ``logprob_chunk=0``. A layout's
    OptimConfig keys (router losses, chunking) go to the optimizer config; ``extra``: more of the trainer's
    arguments (``lora``).
    """
    import dataclasses

    from megarl.trainer.policy import PolicyTrainer

    spec = dict(LAYOUTS[layout])
    spec.pop("rows", None)
    precision = spec.pop("precision", "fp32")
    dispatcher = spec.pop("moe_dispatcher", "alltoall")
    optim_keys = {f.name for f in dataclasses.fields(optim)}
    optim = dataclasses.replace(optim,
                                **{"logprob_chunk": 8, **{k: spec.pop(k) for k in list(spec) if k in optim_keys}})
    ps, cfg = seeded_layout(spec, model_dir)
    return ps, cfg, PolicyTrainer(cfg, model_dir, ps, optim, moe_dispatcher=dispatcher, head=head,
                                    precision=precision, **extra)


def hf_weights(trainer):
    """The trainer's full HF-named weights on every rank (the sync's plain reference, ``weight_sync.gather``)."""
    from megarl.models.hf_config import num_experts
    from megarl.weight_sync.gather import gather_hf_weights

    return gather_hf_weights(trainer.modules, trainer.hf_cfg, trainer.ps, num_experts(trainer.hf_cfg))


def rank_gaps(engine, trainer, seed: int = 0, prompts: int = 4, tokens: int = 8) -> list[float]:
    """The audit's probe on each rank's own engine (``engine``: this rank's ``VLLMEngine``; colocated replicas hold
    different ones), every rank's probe exchanged and scored by the whole trainer: one gap per rank."""
    import torch.distributed as dist

    from megarl.algo.batch import build_batch
    from megarl.types import GenerationRequest

    vocab = int(trainer.hf_cfg["vocab_size"])
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(2, vocab, (6,), generator=g).tolist() for _ in range(prompts)]
    temp = float(getattr(trainer, "temperature", 1.0))
    outs = engine.generate([GenerationRequest(p, n=1, max_tokens=tokens, temperature=temp) for p in ids], seed=seed)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, [(o[0].token_ids, o[0].logprobs) for o in outs])
    gaps: list[float] = []
    for probe in every:
        batch = build_batch(ids, [t for t, _ in probe], [lp for _, lp in probe])
        gaps.append(float(((trainer.logprobs(batch) - batch.old_logprobs) * batch.loss_mask).abs().max()))
    return gaps


def every_stage_routes(recorded):
    """R2's recorded routes [N, T, MoE layers, k] of every rank merged (each rank receives its own pipeline stage's
    layers only; the rest hold no expert id), and the MoE columns each rank received."""
    import torch.distributed as dist

    from megarl.types import no_route

    empty = no_route(recorded.dtype)
    every = [None] * dist.get_world_size() if dist.is_initialized() else None
    if every is None:
        every = [recorded]
    else:
        dist.all_gather_object(every, recorded)
    merged = every[0].clone()
    for other in every[1:]:
        merged = torch.where(merged != empty, merged, other)
    received = [sorted(int(c) for c in torch.nonzero((r != empty).any(dim=(0, 1, 3))).flatten()) for r in every]
    return merged, received
