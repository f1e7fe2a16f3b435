"""Build everything a run needs, in the one order that works with megatron-core and vLLM in one process.

Order: process group + Megatron parallel groups → (rank 0) tiny model if asked →
vLLM engine (it patches torch.cuda on CPU) → the CPU adapter for megatron-core
(applied after vLLM so its patches win) → Megatron's RNG seed → trainer.
"""

from __future__ import annotations

import json
import logging
import random
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.algo.curriculum import CurriculumSource, PassRateTracker
from megarl.algo.filters import is_informative
from megarl.checkpoint.run import start_run_dir
from megarl.checkpoint.saver import RunSaver
from megarl.checkpoint.session_state import IndexedSource
from megarl.compat.megatron import activate_cpu
from megarl.config import RunConfig, to_dict, validate
from megarl.config.schema import captures_routes, resolved_engine_dtype, resolved_routing_replay
from megarl.config.validate.algo import needed_learners, reference_kept
from megarl.config.validate.lora import hf_modules
from megarl.config.validate.settings import resolved_transformer_engine
from megarl.convert.lora_base import engine_model_dir, engines_start_empty, ensure_lora_base
from megarl.data.addition import AdditionTask
from megarl.data.source import Prompt, build_prompts
from megarl.distributed.bootstrap import detect, gpu_identity, refuse_shared_gpus
from megarl.distributed.collectives import gather
from megarl.distributed.parallel import ParallelState, build_parallel_state
from megarl.distributed.placement import RankPlacement, available_cores, rank_placement
from megarl.distributed.placement import apply as use_cpus
from megarl.engines.colocated import ColocatedEngines
from megarl.engines.memory import Handover, on_gpu, sleep_supported
from megarl.engines.protocol import Engines
from megarl.engines.remote.host import rendezvous_path
from megarl.engines.remote.replicas import EngineReplicas
from megarl.engines.vllm_engine import VLLMEngine, set_cpu_engine_env
from megarl.envs.tools import prompt_tools
from megarl.logging.console import configure as configure_console
from megarl.logging.console import main_only
from megarl.logging.metrics import MetricsLogger
from megarl.logging.timeline import Timeline, write_trace
from megarl.models.hf_config import model_files_dir, num_experts, read_hf_config
from megarl.models.tiny import TinyShape, make_tiny_model
from megarl.rewards.pool import RewardPool, build_rewards
from megarl.rollout.controller import ControllerConfig, RolloutController
from megarl.rollout.leader import LeaderController
from megarl.rollout.phases import PhaseRunner
from megarl.rollout.pipeline import Pipeline
from megarl.rollout.scoring import PromptFeed, group_scorer, pool_prompt_source, shared_rewards, tracking_scorer
from megarl.rollout.turns import Episodes, build_episodes
from megarl.testing.faults import install as install_test_faults
from megarl.trainer.policy import PolicyTrainer
from megarl.trainer.rl_update import AdaptersOff, HostReference, Learners
from megarl.weight_sync.protocol import WeightSync

log = logging.getLogger(__name__)


@dataclass
class Session:
    """Every room of a run, built and wired once (``build_session``): the loop and the keeper only call them."""

    cfg: RunConfig
    ps: ParallelState
    hf_cfg: dict
    tokenizer: object
    engines: Engines
    trainer: PolicyTrainer
    learners: Learners
    task: AdditionTask | None  # the built-in task (None when data.path names a dataset)
    rewards: RewardPool
    controller: RolloutController
    logger: MetricsLogger
    run_dir: Path
    weight_sync: WeightSync  # the trainer's weights into the engines, all or nothing
    handover: Handover  # engines asleep while the trainer trains (engine.sleep_level), trainer offload
    saver: RunSaver  # run checkpoints: every learner and the run's state
    phases: PhaseRunner  # one phase for one batch, put back whole when it fails
    pipeline: Pipeline  # who waits for whom: rollout.overlap (rank 0's generating thread)
    timeline: Timeline  # spans of this process: the pipeline's figures and train.trace
    prompts: object  # the prompt source (megarl.data.source): state_dict() is the data cursor
    eval_prompts: list[Prompt]
    stateful: dict = field(default_factory=dict)  # more objects whose state a run checkpoint keeps (by name)
    policy_version: int = 0  # weight updates made (a step with no useful group makes none): phase and engine version
    cpus: RankPlacement | None = None  # this rank's cores (distributed.placement), the whole node while it is alone
    eval_episodes: Episodes | None = None  # env.fn: the evaluation's own environments (rollout/episode_eval.py)

    @property
    def trainer_track(self) -> str:
        return f"trainer rank {self.ps.rank}"

    @property
    def is_main(self) -> bool:
        return self.ps.rank == 0

    def close(self) -> None:
        """The generating thread ends, the trace is written (every rank's spans: collective), the logger closes."""
        self.pipeline.close()
        self.controller.close()
        if self.eval_episodes is not None:
            self.eval_episodes.close()
        if self.cfg.train.trace:
            events = gather(self.timeline.events())
            if self.is_main:
                log.info(f"trace: {write_trace(self.run_dir / 'trace.json', events)} (Perfetto, chrome://tracing)")
        self.logger.close()


def ensure_model(cfg: RunConfig) -> None:
    """Create the tiny checkpoint at ``model.path`` if ``model.make_tiny`` asks for one and none is there."""
    path = Path(cfg.model.path)
    if (path / "config.json").is_file() or not cfg.model.make_tiny:
        return
    make_tiny_model(path, TinyShape(family=cfg.model.make_tiny), seed=cfg.model.seed)
    log.info(f"model.make_tiny: made a tiny random {cfg.model.make_tiny} model at {path}")


def build_session(cfg: RunConfig) -> Session:
    configure_console()  # (a script that builds a session without the CLI logs alike)
    # megatron-core warns at import that TE/Apex are absent (expected on CPU; the fallbacks are used).
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) (are|is) not installed.*")
    warnings.filterwarnings("ignore", message=".*cuda_graph_scope.*")
    set_cpu_engine_env(cfg.engine.kv_cache_gib)
    import vllm  # noqa: F401  (import before the CPU adapter patches torch.cuda)

    random.seed(cfg.train.seed)
    torch.manual_seed(cfg.train.seed)
    p = cfg.parallel
    ps = build_parallel_state(p.tp, p.pp, p.ep, p.etp or p.tp, p.sequence_parallel, p.vpp, p.cp)
    cpus = place_trainer(cfg, ps)  # this rank's cores and threads (before vLLM starts here: it fixes them)
    if ps.rank == 0:
        ensure_model(cfg)
    dist.barrier()
    hf_cfg = read_hf_config(cfg.model.path)
    validate(cfg, ps.world_size, hf_cfg)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_files_dir(cfg.model.path))
    d = cfg.data
    task = None if d.path else AdditionTask(d.max_digits, d.tail_alpha, d.seed, d.eval_size)
    prompts = build_prompts(d, tokenizer, task, cfg.engine.max_model_len - cfg.rollout.max_new_tokens,
                            prompt_tools(cfg.env))  # (env.fn=tools: the prompts describe env.tools)
    rewards = build_rewards(cfg.reward, d)
    ensure_lora_base(cfg, ps.rank)  # LoRA from a dist checkpoint: its HF weights for the engines, converted once
    engines = build_engines(cfg, hf_cfg, cpus.node.replicas, main_only(log.info, ps.rank))
    activate_cpu()
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(cfg.train.seed)
    learners = build_learners(cfg, hf_cfg, ps)
    trainer = learners.policy
    run_dir = Path(cfg.train.run_dir)
    if ps.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        start_run_dir(cfg.train.resume, run_dir)  # resume=never: the earlier run's files set aside first
        (run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2) + "\n")
    logger = MetricsLogger(run_dir, cfg.train.steps, enabled=ps.rank == 0, time_limit_s=cfg.train.time_limit_s)
    # colocated: every rank's controller scores in lockstep, so one rank scores for all; disaggregated: only
    # rank 0 runs the controller (LeaderController) and shares the scored phase
    lockstep = cfg.engine.placement == "colocated"
    score = group_scorer(tokenizer, shared_rewards(rewards) if lockstep else rewards)
    stateful, source = {}, PromptFeed(prompts)  # the feed hands each row's extra columns to the reward
    if d.pool_size:
        pool = task.next_problems(d.pool_size)
        tracker = PassRateTracker()
        draw = (CurriculumSource(pool, lambda p: p.prompt, tracker, cfg.algo.curriculum_eps, seed=d.seed)
                if cfg.algo.curriculum else None)
        source = pool_prompt_source(pool, tokenizer, d.seed, draw)
        score = tracking_scorer(score, tracker)
        stateful = {"tracker": tracker, **({"curriculum": draw} if draw is not None else {})}
    timeline = Timeline(ps.rank, keep_all=cfg.train.trace, append_to=run_dir / "trace" if cfg.train.trace else None)
    # rank 0's generating thread runs the phases (``phases``, built below from the controller this pipeline gates)
    pipeline = Pipeline(cfg.rollout.overlap, lambda version, batch: phases(version, batch, alone=True),
                        cfg.rollout.staleness_limit, leader=ps.rank == 0, batches=cfg.train.steps,
                        on_thread=cpus.generating_thread, handed=lambda: controller.hand_over())
    controller = build_controller(
        cfg, engines.slot_engines(), IndexedSource(source), traced_scorer(score, timeline),
        engine_turn=pipeline.gate.step, lock=pipeline.lock,  # (one state lock: a checkpoint takes both at once)
        on_engine_step=lambda k, start, end: timeline.add(f"replica {k}", "generate", start, end, merge=True),
        # phases run ahead of the weights under overlap: partial admission minds the lag
        engine_version=pipeline.engine_version if cfg.rollout.overlap != "none" else None,
        # multi-turn: the samples' environments (env.fn), each call a span on the timeline's environments track
        episodes=build_episodes(cfg, tokenizer, lambda a, b: timeline.add("environments", "env step", a, b)))
    if controller.episodes is not None:
        stateful["envs"] = controller.episodes.pool  # (its env/* counts)
    phases = PhaseRunner(controller, rewards, prompts, cfg.train.seed, timeline.span)
    weight_sync = WeightSync(trainer, engines.dtype, cfg.sync.bucket_mib, cfg.sync.check_every,
                             main_only(log.warning, ps.rank))
    handover = Handover(engines, [t for _, t in learners.named()], cfg.trainer.offload_during_rollout,
                        main_only(log.info, ps.rank))
    saver = RunSaver(cfg.train.run_dir, cfg.train.keep_checkpoints, learners.named())
    s = Session(cfg, ps, hf_cfg, tokenizer, engines, trainer, learners, task, rewards, controller, logger, run_dir,
                weight_sync, handover, saver, phases, pipeline, timeline, prompts, prompts.eval_prompts(), stateful,
                cpus=cpus)
    if s.eval_prompts:  # (a multi-turn run evaluates episodes, on workers apart from the controller's)
        s.eval_episodes = build_episodes(cfg, tokenizer)
    if engines_start_empty(cfg) and not weight_sync.run(engines, version=0).loaded:  # (random weights)
        raise RuntimeError(f"model.path={cfg.model.path}: the trainer's weights could not be loaded into the engines, "
                           "which started without any (see the log above)")
    install_test_faults(s)  # the fault hooks a test asks for, wrapped around the rooms (testing/); else nothing
    return s


def traced_scorer(score, timeline: Timeline):
    """``score`` with a span on the timeline's ``reward`` track per released group."""

    def scored(group) -> None:
        with timeline.span("reward", "reward"):
            score(group)

    return scored


def build_learners(cfg: RunConfig, hf_cfg: dict, ps: ParallelState) -> Learners:
    """The policy (with LoRA adapters at ``lora.rank`` > 0); a critic (same backbone, value head, all its weights
    trained) for GAE; a frozen reference for the KL penalty (with LoRA: the policy's base, its adapters off;
    ``trainer.reference_on_host``: its weights on the host, run in the policy's model)."""
    a = cfg.algo
    common = dict(temperature=cfg.rollout.temperature, moe_dispatcher=cfg.parallel.moe_dispatcher, fp8=cfg.model.fp8,
                  transformer_engine=resolved_transformer_engine(cfg), precision=cfg.trainer.precision,
                  packing=cfg.trainer.packing, max_tokens_per_microbatch=cfg.trainer.max_tokens_per_microbatch,
                  recompute=cfg.trainer.recompute, recompute_layers=cfg.trainer.recompute_layers,
                  cp_comm_type=cfg.parallel.cp_comm_type)
    policy = PolicyTrainer(hf_cfg, cfg.model.path, ps, cfg.optim, entropy=a.entropy_coef > 0,
                           routing_replay=resolved_routing_replay(cfg, num_experts(hf_cfg), on_gpu()), lora=cfg.lora,
                           seed=cfg.train.seed, **common)
    critic = reference = None
    if a.kl_coef > 0 and cfg.lora.rank > 0:
        reference = AdaptersOff(policy)
    needed = needed_learners(a, cfg.lora.rank)  # the same rule the pre-launch resume check applies
    if "critic" in needed:
        critic = PolicyTrainer(hf_cfg, cfg.model.path, ps, replace(cfg.optim, lr=a.critic_lr), head="value", **common)
    if kept := reference_kept(cfg):  # (needed_learners' reference, its weights on the device or the host)
        reference = PolicyTrainer(hf_cfg, cfg.model.path, ps, cfg.optim, trainable=False, on_host=kept == "host",
                                  **common)
        reference = HostReference(policy, reference) if kept == "host" else reference
    return Learners(policy, critic, reference)


def engine_numerics(cfg: RunConfig, hf_cfg: dict) -> dict:
    """The engines' weights at start (``load_format``), dtype (``engine.dtype``, 'auto': the trainer's precision),
    graphs and GPU memory share, the expert count of the routes they capture (MoE: routing replay and its agreement
    metrics; 0: none), and the LoRA adapters they serve (rank, HF modules; rank 0: none)."""
    e, experts = cfg.engine, num_experts(hf_cfg)
    # model.path a dist checkpoint: vLLM starts on random weights (its 'dummy' load) and serves the trainer's from the
    # first sync (build_session) on, its config and tokenizer the checkpoint's hf/; under LoRA from the checkpoint's
    # weights converted to HF (convert/lora_base.py: a LoRA sync sends the adapters alone)
    return dict(load_format="dummy" if engines_start_empty(cfg) else "auto",
                dtype=resolved_engine_dtype(cfg), enforce_eager=e.enforce_eager,
                gpu_memory_utilization=e.gpu_memory_utilization,
                route_experts=experts if captures_routes(cfg, experts, on_gpu()) else 0,
                lora_rank=cfg.lora.rank, lora_modules=hf_modules(cfg.lora) if cfg.lora.rank else ())


def place_trainer(cfg: RunConfig, ps: ParallelState) -> RankPlacement:
    """This node's cpu placement (``distributed.placement``), applied to this trainer rank and said by rank 0."""
    launch = detect()
    local = max(1, launch.local_world_size)
    node = ps.rank // local
    seen = gather((tuple(available_cores()), gpu_identity()))  # every rank's CPU set and GPU
    refuse_shared_gpus([gpu for _, gpu in seen])
    local_cores = [cores for cores, _ in seen][node * local:(node + 1) * local]  # (bound apart by a launcher?)
    placed = rank_placement(cfg, local_cores, launch.local_rank % local, node, max(1, ps.world_size // local))
    use_cpus(placed.node.trainer[placed.index])
    if ps.rank == 0:
        log.info(f"megarl: {placed.node.describe()} (trainer.cpu_threads, engine.cpu_threads: 0 = megarl's choice)")
    return placed


def build_engines(cfg: RunConfig, hf_cfg: dict, replica_cpus: list | None = None, say=print) -> Engines:
    """The run's engines: in the trainer's processes (colocated), or ``engine.replicas`` vLLM engines in processes of
    their own (disaggregated; ``replica_cpus``: the cores of each replica this node hosts, by its place here)."""
    e, model = cfg.engine, str(engine_model_dir(cfg))  # (a dist checkpoint's hf/, or under LoRA its HF weights)
    if e.placement == "disaggregated":
        return EngineReplicas(model, e.replicas, e.tensor_parallel_size, e.max_model_len, e.kv_cache_gib,
                              e.slots, seed=cfg.train.seed, transport=cfg.sync.transport, timeout_s=cfg.sync.timeout_s,
                              devices=e.replica_devices, rollback=cfg.sync.rollback, replica_nodes=e.replica_nodes,
                              hosts_file=str(rendezvous_path(cfg.train.run_dir)) if e.replica_nodes_dedicated else "",
                              cpus=replica_cpus or [], cpu_threads=e.cpu_threads, **engine_numerics(cfg, hf_cfg))
    engine = VLLMEngine(model, e.max_model_len, e.kv_cache_gib, e.tensor_parallel_size, seed=cfg.train.seed,
                        max_num_seqs=e.slots, enable_sleep_mode=e.sleep_level > 0 and sleep_supported(),
                        peer_wait_s=e.peer_wait_s, **engine_numerics(cfg, hf_cfg))
    return ColocatedEngines(engine, e.slots, e.tensor_parallel_size, cfg.sync.rollback, e.sleep_level, say)


def build_controller(cfg: RunConfig, engines: list, next_prompt, score, **hooks) -> RolloutController:
    """The SortedRL controller over ``engines`` (slot engines) as ``rollout.*`` says; ``hooks``: the controller's
    ``engine_turn``, ``on_engine_step``, ``engine_version``, ``episodes`` and ``lock``."""
    r = cfg.rollout
    ccfg = ControllerConfig(
        mode=r.mode, group_size=r.samples_per_prompt, update_groups=r.prompts_per_step,
        rollout_groups=max(r.prompts_per_step, round(r.prompts_per_step * r.oversubscription)),
        max_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, staleness_limit=r.staleness_limit,
        stale_action=r.stale_action, max_discards=r.max_discards, token_budget=r.token_budget, dispatch=r.dispatch,
        release_cap=round(cfg.algo.oversample_cap * r.prompts_per_step) if cfg.algo.dynamic_sampling else 0,
        max_update_groups=r.max_update_groups, long_rounds=r.long_rounds, buffer_samples=r.buffer_samples,
        long_round_groups=r.long_round_groups,
    )
    keep = is_informative if cfg.algo.dynamic_sampling else None
    cls = LeaderController if cfg.engine.placement == "disaggregated" else RolloutController
    return cls(ccfg, engines, next_prompt, score=score, keep_group=keep, **hooks)

