"""One parallel layout of the megatron-core trainer on a fixed batch (gloo, CPU), for comparison
with the single-process run. Launched by the tests with torchrun (2 processes) or plainly (1).

    python tests/parallel_checks.py LAYOUT MODEL_DIR OUT_DIR [lm|value]
    torchrun --nproc-per-node 2 tests/parallel_checks.py ep2_alltoall MODEL_DIR OUT_DIR

The last pipeline stage of data-parallel rank 0 writes OUT_DIR/result.json (loss, logprobs of the
whole batch, gathered from every data-parallel rank) and rank 0 OUT_DIR/weights.pt (the full model
after one optimizer step). The same script serves the critic check.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

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


def build_trainer(layout: str, model_dir: str, optim, head: str = "lm"):
    """Parallel state for ``layout``, the CPU adapter, seeds, and a trainer from the HF weights.

    Logprobs come from hidden states in chunks of 8 positions (several chunks per sequence),
    or from full vocab-parallel logits where the layout says ``logprob_chunk=0``. A layout's
    OptimConfig keys (router losses, chunking) go to the optimizer config.
    """
    import dataclasses

    from megarl.compat.megatron import activate_cpu
    from megarl.distributed.parallel import build_parallel_state
    from megarl.models.hf_config import read_hf_config
    from megarl.trainer.policy import PolicyTrainer

    spec = dict(LAYOUTS[layout])
    spec.pop("rows", None)
    dispatcher = spec.pop("moe_dispatcher", "alltoall")
    optim_keys = {f.name for f in dataclasses.fields(optim)}
    optim = dataclasses.replace(optim, **{"logprob_chunk": 8, **{k: spec.pop(k) for k in list(spec) if k in optim_keys}})
    ps = build_parallel_state(**spec)
    activate_cpu()
    from megatron.core import tensor_parallel

    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    cfg = read_hf_config(model_dir)
    return ps, cfg, PolicyTrainer(cfg, model_dir, ps, optim, moe_dispatcher=dispatcher, head=head)


def main(layout: str, model_dir: str, out_dir: str, head: str = "lm") -> None:
    from megarl.algo.losses import ppo_clip_loss, value_loss
    from megarl.config.schema import OptimConfig
    from megarl.models.hf_config import num_experts
    from megarl.trainer import model as trainer_model
    from megarl.trainer.export import gather_full_megatron

    ps, cfg, trainer = build_trainer(layout, model_dir, OptimConfig(lr=1e-5, micro_batch_size=2, grad_clip=1.0),
                                     head)
    batch = fixed_batch(cfg["vocab_size"], n=LAYOUTS[layout].get("rows", 8))
    if head == "value":  # the critic regresses onto fixed targets
        batch.old_values = torch.zeros_like(batch.loss_mask)
        batch.returns = batch.advantages.clone()
        # a head that is not zero (as after the critic's first step): the zero head of a fresh critic sends the
        # backbone no gradient, which hid a TP× backbone gradient under sequence parallelism
        for m in trainer.modules:
            if type(getattr(m, "output_layer", None)).__name__ == "ValueHead":
                g = torch.Generator().manual_seed(7)
                m.output_layer.weight.data.copy_(torch.randn(m.output_layer.weight.shape, generator=g) * 0.05)
    logp = trainer.logprobs(batch)

    def loss(lp, mb):
        if head == "value":
            return value_loss(lp, mb["old_values"], mb["returns"], mb["loss_mask"], clip=0.0)
        return ppo_clip_loss(lp, mb["old_logprobs"], mb["advantages"], mb["loss_mask"], 0.2, 0.28)

    metrics = trainer.train_step(batch, loss)
    full = gather_full_megatron(trainer.modules, ps, cfg["num_hidden_layers"], num_experts(cfg))
    norms = [metrics["grad_norm"]] * ps.world_size  # every rank's (its clipping uses it): all must agree
    if ps.world_size > 1:
        dist.all_gather_object(norms, metrics["grad_norm"])
    os.makedirs(out_dir, exist_ok=True)
    if ps.rank == 0:
        torch.save({k: v.float() for k, v in full.items()}, os.path.join(out_dir, "weights.pt"))
    if ps.is_last_stage and ps.dp_rank == 0 and ps.tp_rank == 0:
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump({"layout": layout, "head": head, "loss": metrics.get("loss"), "grad_norm": metrics["grad_norm"], "metrics": metrics,
                       "logprobs": logp.tolist(), "mask": batch.loss_mask.tolist(), "world": ps.world_size,
                       "dp": ps.dp, "tp": ps.tp, "pp": ps.pp, "ep": ps.ep, "etp": ps.etp,
                       "dispatcher": trainer.tcfg.moe_token_dispatcher_type, "said": sorted(trainer_model._SAID), "grad_norms": norms}, f)
    dist.barrier()
    # gloo's threads ended before the interpreter's teardown: once in a full suite run, a rank left to exit with
    # them alive aborted ("terminate called without an active exception", SIGABRT) after writing its results
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
    if os.environ.get("RANK", "0") == "0":
        print(json.dumps({"ok": True}), flush=True)
