"""The policy trainer (and, with a value head, the critic): a megatron-core GPTModel under DDP.

``train_step`` runs one optimizer step through ``get_forward_backward_func`` (so
pipeline schedules and microbatching are Megatron's own). The loss is given as a
per-token function plus per-token weights: the objective is
``Σ_t weight_t · loss_t`` over the whole step batch, which expresses every
aggregation mode (token mean, sequence mean of token means, constant
normaliser) without the trainer knowing which one is in use.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist

from megarl.algo.packing import (
    PackedLayout,
    pack,
    pack_rows,
    plan_microbatches,
    split_for_context_parallel,
    unpack,
)
from megarl.checkpoint.dist import load_model_weights
from megarl.compat.megatron import count_expert_grads_once
from megarl.config.schema import PRECISION_DTYPES, LoraConfig, OptimConfig
from megarl.config.validate.lora import lora_on_experts
from megarl.distributed.collectives import gather
from megarl.distributed.parallel import ParallelState
from megarl.distributed.watchdog import guard, rl_step
from megarl.models.hf_config import is_dist_checkpoint, num_experts
from megarl.trainer.logprobs import HiddenOutput, chunked_token_logprobs, token_entropy, token_logprobs
from megarl.trainer.lora import apply_lora
from megarl.trainer.model import ValueHead, build_gpt_model, load_hf_weights, moe_dispatcher_for
from megarl.trainer.packed import pack_order, packed_seq_params, rows_to_batch, step_metrics
from megarl.trainer.route_recording import RouteRecording
from megarl.trainer.route_store import RouteStore
from megarl.trainer.routing import (
    RouteStats,
    attach_taps,
    check_replay_holds,
    clear_targets,
    moe_columns,
    padding_mask,
    router_losses_off,
    set_targets,
)
from megarl.types import TrainBatch, no_route

# (logprobs [mb, T] — values for a critic —, microbatch fields) -> (per-token loss [mb, T], {metric: scalar})
LossFn = Callable[[torch.Tensor, dict], tuple[torch.Tensor, dict]]


def nonfinite(loss_sums: list, grad_buffers: list[torch.Tensor], device=None) -> str:
    """'' when the loss and every gradient are finite on every rank, else 'loss', 'gradient' or both.

    Each rank holds a part of the model (TP/PP/EP) and the loss lives on the last stage: the
    verdict is all-reduced so that every rank skips the same step.
    """
    loss_bad = any(not torch.isfinite(torch.as_tensor(x)).all() for x in loss_sums)
    grad_bad = any(not torch.isfinite(g).all() for g in grad_buffers)
    flags = torch.tensor([float(loss_bad), float(grad_bad)], device=device)  # (NCCL reduces device tensors only)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return " and ".join(name for name, bad in zip(("loss", "gradient"), flags.tolist()) if bad)


class PolicyTrainer(RouteRecording):
    """``head='lm'``: the policy (logprobs); ``head='value'``: a critic on the same backbone (values).
    ``trainable=False`` builds no optimizer (the frozen reference policy of the KL penalty); ``on_host`` (frozen
    only) keeps its weights in host memory on a GPU machine (``rl_update.HostReference`` runs its forward).

    ``precision='bf16'`` is megatron's mixed precision: the model's weights and activations in bf16, gradients
    accumulated and reduced in fp32 (DDP's buffers), fp32 main parameters and Adam state in the optimizer (the
    distributed optimizer shards them), each step's result cast back into the bf16 weights. Logits are bf16 (as an
    engine's are), their log-softmax, the loss and the advantages fp32.

    ``packing``: each micro-batch is its rows laid end to end (``algo/packing.py``, megatron's ``thd`` path),
    ``micro_batch_size`` rows each or, with ``max_tokens_per_microbatch``, by tokens (``trainer.*`` keys; the class
    default is unpacked, the config's packed). Under context parallelism (``ps.cp`` > 1, packed only) each rank
    computes its chunks of every row (``algo.packing.split_for_context_parallel``); the logprobs are gathered over
    the CP group before the loss, which reads whole rows (``docs/parallelism.md``); ``cp_comm_type``: Transformer
    Engine's key/value exchange on GPUs (``parallel.cp_comm_type``).

    ``recompute`` ('none', 'selective', 'full'; ``trainer.recompute``) and ``recompute_layers``: megatron's activation
    recompute in training passes (``model.transformer_config``); the route taps replay a recomputed router's
    first choice (``routing.RouteTap``).

    ``lora`` with a rank > 0: LoRA adapters on the targeted layers, A drawn from ``seed``, the rest frozen; only
    the adapters have gradients and optimizer state (``trainer/lora.py``)."""

    def __init__(self, hf_cfg: dict, model_dir: str, ps: ParallelState, optim: OptimConfig,
                 temperature: float = 1.0, moe_dispatcher: str = "alltoall", head: str = "lm",
                 trainable: bool = True, entropy: bool = False, fp8: str = "",
                 transformer_engine: bool = False, precision: str = "fp32", routing_replay: str = "none",
                 packing: bool = False, max_tokens_per_microbatch: int = 0, recompute: str = "none",
                 recompute_layers: int = 1, cp_comm_type: str = "p2p", lora: LoraConfig | None = None,
                 seed: int = 0, on_host: bool = False) -> None:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        if head not in ("lm", "value"):
            raise ValueError(f"head must be 'lm' or 'value', got {head!r}")
        if precision not in PRECISION_DTYPES:
            raise ValueError(f"precision must be one of {sorted(PRECISION_DTYPES)}, got {precision!r}")
        self.precision, self.dtype = precision, getattr(torch, PRECISION_DTYPES[precision])
        self.hf_cfg, self.ps, self.optim_cfg, self.temperature = hf_cfg, ps, optim, temperature
        self.head, self.entropy = head, entropy
        # trainer.packing: micro-batches of rows laid end to end (algo/packing.py), by tokens when max_tokens is set
        self.packing, self.max_tokens = packing, max_tokens_per_microbatch
        if ps.cp > 1 and not packing:  # (the CP split is that of packed rows; config.validate refuses it first)
            raise ValueError(f"parallel.cp={ps.cp} needs packed micro-batches: set trainer.packing=true")
        moe_dispatcher = moe_dispatcher_for(moe_dispatcher, ps)  # alltoall at EP × expert TP on gloo: allgather
        # One model chunk per virtual pipeline stage (one without): chunk i holds piece i·pp + pp_rank.
        self.modules = [build_gpt_model(hf_cfg, ps, vp, moe_aux_loss_coeff=optim.moe_aux_loss_coeff,
                                        moe_z_loss_coeff=optim.moe_z_loss_coeff, moe_dispatcher=moe_dispatcher, fp8=fp8,
                                        transformer_engine=transformer_engine, dtype=self.dtype,
                                        sequential_experts=lora_on_experts(lora),
                                        recompute=recompute, recompute_layers=recompute_layers,
                                        cp_comm_type=cp_comm_type)
                        for vp in range(ps.vpp)]
        last = self.modules[-1]  # the loss is computed after this chunk (on the last pipeline stage)
        if head == "value" and ps.is_last_stage:
            last.output_layer = ValueHead(hf_cfg["hidden_size"], ps.sequence_parallel, self.dtype)
        skip = ("output_layer.",) if head == "value" else ()  # (the value head starts at zero)
        if is_dist_checkpoint(model_dir):  # hf-to-mcore's output: megatron's own loading, resharded
            load_model_weights(self.modules, model_dir, skip)
        else:
            load_hf_weights(self.modules, model_dir, hf_cfg, ps, skip=skip)
        # lora.rank > 0: adapters beside the loaded weights, which are frozen (DDP and the optimizer skip them)
        self.adapters = apply_lora(self.modules, lora, seed) if lora is not None and lora.rank > 0 else []
        self.lora, self.model_dir = (lora if self.adapters else None), str(model_dir)
        # built on the host (use_cpu_initialization); on a GPU the model, its DDP buffers and each microbatch live on
        # this rank's device, and what leaves the trainer (logprobs, values) comes back to the host
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        if self.device is not None and not on_host:
            for m in self.modules:
                m.cuda(self.device)
        elif self.device is not None:  # a frozen model kept on the host (trainer.reference_on_host): pinned copies
            for p in (p for m in self.modules for p in m.parameters()):
                p.data = p.data.pin_memory()
        # Logprobs straight from hidden states in sequence chunks (no [tokens × vocab] logits) when
        # entropy (which needs full logits) is not asked for; vocab-parallel under TP either way.
        self.chunk = optim.logprob_chunk if head == "lm" and not entropy else 0
        if self.chunk and ps.is_last_stage:
            last.output_layer = HiddenOutput(last.output_layer, ps.sequence_parallel)
        self.tcfg = last.config
        distributed = optim.distributed_optimizer and ps.dp > 1
        if not trainable:  # frozen before DDP wraps it: DDP then keeps no gradient buffer (fp32, 4 B a parameter)
            for m in self.modules:
                m.requires_grad_(False)
        self.chunks = [
            DistributedDataParallel(
                config=m.config,
                ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                         use_distributed_optimizer=distributed),
                module=m,
                disable_bucketing=vp > 0,  # megatron's choice for the interleaved schedule's later chunks
            )
            for vp, m in enumerate(self.modules)
        ]
        # MoE: every router's top-k through a tap (trainer/routing.py), which replays a batch's ``routes`` when
        # algo.routing_replay asks and always measures how often the trainer's own routes agree with them
        self.routing_replay = routing_replay
        columns = moe_columns(hf_cfg, hf_cfg["num_hidden_layers"]) if num_experts(hf_cfg) and head == "lm" else {}
        self.taps = {id(c): attach_taps(m, columns) for c, m in zip(self.chunks, self.modules)} if columns else {}
        self.route_columns = columns
        self.held_columns = sorted(t.column for taps in self.taps.values() for t in taps)  # this stage's MoE layers
        self.moe = num_experts(hf_cfg) > 0
        self.route_stats: dict[str, float] = {}  # of the last pass that had routes (moe/route_agreement, ...)
        for m in self.modules:
            m.config.no_sync_func = [c.no_sync for c in self.chunks] if ps.vpp > 1 else self.chunks[0].no_sync
            m.config.finalize_model_grads_func = finalize_model_grads
        self.optimizer = None
        self.last_nonfinite = ""  # what was non-finite in a skipped step ('loss', 'gradient'); cleared by the loop
        self.updates = 0  # optimizer steps applied (skipped ones not): the loop's policy version moves with them
        if not trainable:
            return
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=optim.lr,
                weight_decay=optim.weight_decay,
                adam_beta1=optim.adam_beta1,
                adam_beta2=optim.adam_beta2,
                clip_grad=optim.grad_clip,
                use_distributed_optimizer=distributed,
                bf16=precision == "bf16",  # fp32 main params and Adam state beside the bf16 weights
                params_dtype=self.dtype,
            ),
            self.chunks,
        )
        count_expert_grads_once(self.optimizer, ps.etp_group)
        if self.taps and routing_replay != "none":  # a forced route must be the one dispatched (or refuse to run)
            check_replay_holds(self)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def _local(self, batch: TrainBatch) -> TrainBatch:
        """This data-parallel rank's rows, padded for the schedule.

        Rows are split in contiguous chunks over DP ranks; the loss weights stay those of
        the whole batch, so the DP-averaged gradient equals the single-process one (a batch of
        fewer rows than DP ranks is padded to one row each). Under
        pipeline parallelism every microbatch must have the same shape: rows are padded
        to a multiple of the microbatch size (zero weight, zero mask); the interleaved schedule
        also needs a multiple of PP microbatches. Under sequence parallelism the sequence is
        padded to a multiple of TP.
        """
        if self.ps.dp > 1:
            if batch.size < self.ps.dp:  # a rank without a row would build no microbatch (the schedule raises)
                batch = batch.pad_rows(self.ps.dp - batch.size)
            batch = batch.select(torch.tensor_split(torch.arange(batch.size), self.ps.dp)[self.ps.dp_rank])
        rows = self.optim_cfg.micro_batch_size * (self.ps.pp if self.ps.vpp > 1 else 1)
        if self.ps.pp > 1 and batch.size % rows:
            batch = batch.pad_rows(rows - batch.size % rows)
        multiple = self.token_multiple
        if batch.seq_len % multiple:
            batch = batch.pad_columns(multiple - batch.seq_len % multiple)
        return batch

    @functools.cached_property
    def token_multiple(self) -> int:
        """What a micro-batch's positions are padded to a multiple of: TP under sequence parallelism (each rank its
        shard), times megatron's FP8 alignment under FP8 (Transformer Engine's FP8 GEMMs take token counts of a
        multiple of 16 only, 32 under MXFP8, on each rank's shard)."""
        fp8 = 1
        if self.tcfg.fp8:
            from megatron.core.fp8_utils import get_fp8_align_size

            fp8 = get_fp8_align_size(self.tcfg.fp8_recipe)
        return (self.ps.tp if self.ps.sequence_parallel else 1) * fp8

    def _plan(self, batch: TrainBatch) -> list[list[PackedLayout]]:
        """Every DP rank's packed micro-batches (``algo/packing.py``) shaped for the layout: a multiple of TP
        positions under sequence parallelism (and of 16 or 32 under FP8); one length under PP (equal p2p shapes)
        and under megatron's all-gather dispatcher at EP > 1 (equal all-gathers); a multiple of PP micro-batches
        under virtual stages. Rows of similar length together (``by_length``) where nothing reads a
        micro-batch's make-up: not under one length (the longest micro-batch would set every one's) nor with the
        MoE router losses on (a micro-batch's load statistic)."""
        ps, cfg = self.ps, self.tcfg
        same = ps.pp > 1 or (ps.ep > 1 and cfg.moe_token_dispatcher_type == "allgather")
        router_losses = bool(self.moe and (cfg.moe_aux_loss_coeff or cfg.moe_z_loss_coeff))
        rows = 2 * ps.cp if ps.cp > 1 else 1  # context parallelism: each row in 2·CP chunks, each rank's a multiple
        return plan_microbatches(batch.row_lengths(), ps.dp, self.optim_cfg.micro_batch_size, self.max_tokens,
                                 multiple=rows * self.token_multiple, equal_length=same,
                                 count_multiple=ps.pp if ps.vpp > 1 else 1, by_length=not same and not router_losses,
                                 row_multiple=rows)

    def _microbatches(self, batch: TrainBatch) -> list[dict]:
        mbs = self.optim_cfg.micro_batch_size
        return [batch.slice(i, i + mbs).as_dict() for i in range(0, batch.size, mbs)]

    def _run(self, batch: TrainBatch, loss_fn: LossFn | None, forward_only: bool) -> list:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        store = batch.routes if isinstance(batch.routes, RouteStore) else None
        if store is not None and not self.taps:  # (a critic: no router to replay them)
            batch, store = replace(batch, routes=None), None
        if self.packing:  # this rank's rows laid end to end, one sequence per micro-batch
            mine = self._plan(batch)[self.ps.dp_rank]
            fields = batch.as_dict()
            mbs = [pack(fields, layout) for layout in mine]
            seq_length, rows_per_mb = max(layout.padded for layout in mine), 1
            if store is not None:  # the routes of this rank's rows, from the DP ranks holding them
                rows = [r for layout in mine for r in layout.rows]
                fetched = store[torch.tensor(rows, dtype=torch.long)].fetch(self.device)
                by_row = dict(zip(rows, fetched))
                for mb, layout in zip(mbs, mine):
                    mb["routes"] = pack_rows(by_row if layout.rows else fetched, layout, no_route(store.dtype))
            if self.ps.cp > 1:  # this CP rank's chunks of every row (``seq_length`` stays the pack's: megatron divides)
                mbs = [split_for_context_parallel(mb, self.ps.cp, self.ps.cp_rank) for mb in mbs]
        else:
            batch = self._local(batch)
            if store is not None:  # (a new batch: ``_local`` may hand back the caller's)
                batch = replace(batch, routes=batch.routes.fetch(self.device))
            mbs = self._microbatches(batch)
            seq_length, rows_per_mb = batch.seq_len, min(self.optim_cfg.micro_batch_size, batch.size)
        scale = len(mbs) * self.ps.dp  # undo the schedule's 1/M and DDP's 1/dp averaging
        temperature, head, with_entropy = self.temperature, self.head, self.entropy and not forward_only
        chunk, tp_group = self.chunk, self.ps.tp_group if self.ps.tp > 1 else None  # (None: the whole vocabulary)
        cp_group = self.ps.cp_group if self.ps.cp > 1 else None
        last = self.modules[-1]
        output_weight = None
        if chunk and self.ps.is_last_stage:  # tied: the embedding (PP = 1) or its last-stage copy
            output_weight = (last.shared_embedding_or_output_weight() if last.share_embeddings_and_output_weights
                             else last.output_layer.weight)

        stats, passes = RouteStats(), {}
        sp = self.ps.tp if self.ps.sequence_parallel and self.ps.tp > 1 else 1  # TP ranks sharing a sequence
        columns = store.columns if store is not None else None
        held_chunk = store is not None and store.span is not None  # routes of this TP rank's sequence chunk only

        def forward_step(data_iter, model):
            mb = {k: v.to(self.device) if self.device is not None and torch.is_tensor(v) else v
                  for k, v in next(data_iter).items()}
            routes = mb.pop("routes", None)
            if self.taps and routes is not None:  # every chunk, MoE layers or not (RouteStats.expect)
                passes[id(model)] = passes.get(id(model), -1) + 1
                stats.expect(passes[id(model)], routes.shape[0] * routes.shape[1] // (1 if held_chunk else sp))
            if taps := self.taps.get(id(model)):  # this chunk's routers: the microbatch's routes (or none)
                set_targets(taps, routes, self.routing_replay != "none", stats, self.ps.tp_rank,
                            1 if held_chunk else self.ps.tp, self.ps.sequence_parallel, columns)
            packed = packed_seq_params(mb, cp_group) if "cu_seqlens" in mb else None
            pad = padding_mask(mb) if self.moe else None  # padding left out of the MoE router losses
            with router_losses_off(model.config, pad is not None and bool(pad.all())):
                if pad is not None and not getattr(model, "module", model).pre_process and sp > 1:
                    pad = pad.chunk(sp, dim=1)[self.ps.tp_rank]  # (a first stage scatters it itself)
                output = model(mb["input_ids"], mb["position_ids"], None, packed_seq_params=packed,
                               **({"padding_mask": pad} if pad is not None else {}))

            def loss_func(logits):
                if head == "value":
                    out = logits[..., 0].float()  # values, one per position
                elif chunk:  # ``logits`` are the final hidden states here
                    out = chunked_token_logprobs(logits, output_weight, mb["labels"], temperature, chunk, tp_group)
                else:
                    out = token_logprobs(logits, mb["labels"], temperature, tp_group)
                    if with_entropy:
                        mb["entropy"] = token_entropy(logits, temperature, tp_group)
                if "cp_inverse" in mb:  # every CP rank's positions, in pack order (the gradient goes back to each)
                    out = pack_order(out, mb, cp_group)
                    if "entropy" in mb:
                        mb["entropy"] = pack_order(mb["entropy"], mb, cp_group)
                if packed is not None:  # each row's span of the pack: the loss reads rows, as unpacked
                    out = unpack(out, mb)
                    if "entropy" in mb:
                        mb["entropy"] = unpack(mb["entropy"], mb)
                if loss_fn is None:  # forward only: hand the logprobs (or values) back, with their batch rows
                    back = {"logprobs": out.detach().cpu()}
                    if packed is not None:
                        back["rows"] = mb["rows"].cpu()
                    # (on the output's device: megatron keeps MoE's aux-loss scale, made on this loss's device by the
                    # first micro-batch of the process, for every later backward)
                    return torch.zeros((), device=out.device), back
                per_token, metrics = loss_fn(out, mb)
                weighted = per_token * mb["weights"]
                # under CP every rank has the whole rows' loss: each back-propagates the positions it computed, and
                # megatron multiplies by CP what DDP then averages over DP × CP
                loss = (weighted * mb["cp_own"] if "cp_own" in mb else weighted).sum() * scale
                report = {k: v.detach().float() for k, v in metrics.items()}
                report["loss_sum"] = weighted.detach().sum()
                report["tokens"] = mb["loss_mask"].sum()  # metrics are token means: padding counts for nothing
                return loss, report

            return output, loss_func

        try:
            out = get_forward_backward_func()(
                forward_step_func=forward_step,
                # The interleaved schedule reads one iterator per chunk, each over every microbatch.
                data_iterator=[iter(mbs) for _ in self.chunks] if self.ps.vpp > 1 else iter(mbs),
                model=self.chunks,
                num_microbatches=len(mbs),
                seq_length=seq_length,
                micro_batch_size=rows_per_mb,
                forward_only=forward_only,
            )
        finally:
            for taps in self.taps.values():
                clear_targets(taps)
        if batch.routes is not None and self.taps:  # every rank (a collective)
            self.route_stats = stats.metrics(self.ps.pp_group)
        return out

    @torch.no_grad()
    def _from_last_stage(self, value):
        """``value`` as the last pipeline stage has it, on every stage (the loss and logprobs live there)."""
        if self.ps.pp == 1:
            return value
        box = [value]
        torch.distributed.broadcast_object_list(box, src=self.ps.last_stage_rank, group=self.ps.pp_group)
        return box[0]

    def _watched(self, what: str):
        """The hang watchdog over one of this trainer's calls (``distributed/watchdog.py``): its collectives (the
        pipeline's sends, the gradient and metric reductions, the gathers) never returning end the process with
        exit 75 after ``engine.hang_timeout_s``, as a hung engine step does."""
        role = "critic" if self.head == "value" else "policy" if self.optimizer is not None else "reference"
        return guard(f"the {role} trainer's {what} (RL step {rl_step()})")

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Per-label-position logprobs [N, T] of ``batch`` — values for a critic — on every rank (packed: 0 past
        each row's length; unpacked: whatever the padding scored; masked out by every caller)."""
        with self._watched("forward pass"):
            return self._logprobs(batch)

    def _logprobs(self, batch: TrainBatch) -> torch.Tensor:
        for c in self.chunks:
            c.eval()
        out = self._run(batch, None, forward_only=True)
        for c in self.chunks:
            c.train()
        local = None
        if self.ps.is_last_stage and self.packing:  # each micro-batch's rows, from every DP rank
            mine = [(o["rows"], o["logprobs"]) for o in out]
            pieces = [p for part in gather(mine, self.ps.dp_group) for p in part]
            local = rows_to_batch(pieces, batch.size, batch.seq_len)
        elif self.ps.is_last_stage:
            local = torch.cat([o["logprobs"] for o in out], dim=0)
            if self.ps.dp > 1:  # every DP rank computed its own rows: put the batch back together
                # without the rows ``_local`` padded for the pipeline schedule (else the next rank's rows are lost)
                local = local[: len(torch.tensor_split(torch.arange(batch.size), self.ps.dp)[self.ps.dp_rank])]
                local = torch.cat(gather(local, self.ps.dp_group), dim=0)
        return self._from_last_stage(local)[: batch.size, : batch.seq_len]

    def grad_buffers(self) -> list[torch.Tensor]:
        """The gradients of the step being taken (DDP's flat buffers), after the backward, before the optimizer."""
        return [b.grad_data for c in self.chunks for b in c.buffers + c.expert_parallel_buffers]

    def train_step(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step on ``batch``; returns the loss and mean metrics (on every rank)."""
        if self.optimizer is None:
            raise RuntimeError("this model was built frozen (trainable=False)")
        with self._watched("optimizer step"):
            return self._train_step(batch, loss_fn)

    def _train_step(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        for c in self.chunks:
            c.zero_grad_buffer()
        self.optimizer.zero_grad()
        out = self._run(batch, loss_fn, forward_only=False)
        bad = nonfinite([o["loss_sum"] for o in out], self.grad_buffers(), self.device)
        if bad:  # skip the step: weights and optimizer state stay as they are
            self.last_nonfinite, ok, grad_norm = bad, False, float("nan")
        else:
            ok, grad_norm, _ = self.optimizer.step()
            self.updates += bool(ok)
        metrics: dict[str, float] = {"grad_norm": float(grad_norm or 0.0), "skipped": float(not ok)}
        if out:
            metrics.update(step_metrics(out, self.ps.dp_group if self.ps.dp > 1 else None, self.device))
        metrics = self._from_last_stage(metrics)
        if batch.routes is not None:  # measured on every rank, over every rank
            metrics.update(self.route_stats)
        return metrics  # every stage reports the loss (rank 0 logs)
