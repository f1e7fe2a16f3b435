"""Every setting of a megarl run, as typed dataclasses; each field's docstring is its doc.

YAML files map onto ``RunConfig`` strictly (see ``loader.py``): a key that is not
a field here, or a value of the wrong type, is an error naming the key and file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# A choice-valued setting is typed ``Literal[...]``: the loader refuses any other value, naming the key, the file
# and the valid ones (``loader.check_choices``); no per-key check is written for it.


@dataclass
class ModelConfig:
    path: str = "runs/tiny_moe/model"
    """HF checkpoint directory (config.json, *.safetensors, tokenizer) of the policy."""
    make_tiny: Literal["", "qwen3_moe", "qwen2", "mixtral", "qwen2_moe"] = ""
    """If set ('qwen3_moe', 'qwen2', 'mixtral', 'qwen2_moe') and ``path`` holds no checkpoint, create a tiny one
    there."""
    seed: int = 0
    """Seed of the tiny model's random weights (``make_tiny`` only)."""
    fp8: Literal["", "delayed", "tensorwise", "blockwise", "mxfp8"] = ""
    """FP8 training through Transformer Engine: '' (off), 'delayed', 'tensorwise', 'blockwise', 'mxfp8'."""
    transformer_engine: Literal["auto", True, False] = "auto"
    """Build layers from Transformer Engine's spec (fused norm+linear, grouped expert GEMMs), FP8 or not: 'auto' (on
    where CUDA and Transformer Engine are importable, off on CPU and under LoRA), true (needs TE on a GPU) or false;
    FP8 always uses it."""


@dataclass
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel size of the trainer (must divide attention heads and KV heads)."""
    pp: int = 1
    """Pipeline-parallel size (must divide the number of layers)."""
    vpp: int = 1
    """Virtual pipeline stages per pipeline rank (interleaved 1F1B; needs pp > 1; pp × vpp must divide the layers)."""
    ep: int = 1
    """Expert-parallel size (must divide the number of experts; MoE only)."""
    etp: int = 0
    """Expert tensor-parallel size (0: the same as tp, megatron's default)."""
    sequence_parallel: bool = False
    """Shard activations along the sequence in TP regions (needs tp > 1)."""
    cp: int = 1
    """Context-parallel size: each packed row cut in 2·cp chunks over cp ranks (long responses; needs
    ``trainer.packing``); world = tp × pp × cp × dp."""
    cp_comm_type: Literal["p2p", "all_gather", "a2a"] = "p2p"
    """How Transformer Engine's attention exchanges keys and values under cp > 1 on GPUs (the CPU path all-gathers)."""
    moe_dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    """MoE token dispatcher: 'alltoall' or 'allgather' (gloo at ep > 1 × etp > 1 runs 'allgather'; so does ep 1 × expert
    TP 1, where neither communicates: the same bits, fewer copies)."""


@dataclass
class DataConfig:
    task: Literal["addition"] = "addition"
    """Built-in prompt source used when ``path`` is empty: 'addition' (multi-digit addition with a scratchpad)."""
    path: str = ""
    """Prompt dataset: a .jsonl or .parquet file, a directory or glob of them, or a ``datasets`` save_to_disk dir."""
    eval_path: str = ""
    """Held-out dataset for pass@1 (same formats; '' with ``path`` set: no evaluation)."""
    prompt_key: str = "prompt"
    """Column holding the prompt: a string or a list of chat messages ``[{role, content}]``."""
    answer_key: str = "answer"
    """Column holding the reference answer; every other column reaches the reward as a keyword argument."""
    eval_prompt_key: str = ""
    """Column of ``eval_path`` holding the prompt when its layout differs ('': ``prompt_key``)."""
    eval_answer_key: str = ""
    """Column of ``eval_path`` holding the answer when its layout differs ('': ``answer_key``)."""
    system_prompt: str = ""
    """System message put first in every prompt that has none ('' : none)."""
    chat_template: str = "auto"
    """'auto' (the tokenizer's chat template, plain text if it has none), 'none' (plain text), or a Jinja file path."""
    enable_thinking: Literal["auto", True, False] = "auto"
    """Passed to the chat template as ``enable_thinking`` for prompts and environment messages: true or false (Qwen3's
    reasoning switch: false ends each generation prompt with an empty ``<think>`` block; a template that does not
    read it renders the same), 'auto' (not passed: the template's default, Qwen3's thinking on)."""
    max_prompt_tokens: int = 0
    """Drop prompts longer than this many tokens, counted as data/prompts_too_long
    (0: max_model_len − max_new_tokens)."""
    shuffle: bool = True
    """Shuffle the dataset each epoch (seeded by ``seed`` and the epoch)."""
    on_bad_row: Literal["skip", "error"] = "skip"
    """A row without a usable prompt or answer: 'skip' (counted as data/bad_rows) or 'error' (stop before training)."""
    max_digits: int = 6
    """Largest operand size in digits."""
    tail_alpha: float = 1.0
    """Power-law exponent of the operand size distribution (larger: more short problems)."""
    eval_size: int = 200
    """Held-out prompts for greedy pass@1 (with ``eval_path``: its first N usable rows; 0: all)."""
    pool_size: int = 0
    """Train on a finite pool of this many prompts (0: an endless stream); the curriculum needs one."""
    seed: int = 0
    """Seed of the prompt stream and of the held-out set."""


@dataclass
class RolloutConfig:
    prompts_per_step: int = 32
    """Prompts per RL step."""
    samples_per_prompt: int = 8
    """G: samples per prompt (one group)."""
    max_new_tokens: int = 96
    """Length cap of a response in tokens."""
    temperature: float = 1.0
    """Sampling temperature; the trainer's logprobs use the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    mode: Literal["sync", "on_policy", "partial"] = "sync"
    """Rollout scheduling: 'sync' (wait for the longest), 'on_policy' or 'partial' (SortedRL)."""
    oversubscription: float = 2.0
    """SortedRL: groups kept live per update group (the rollout batch is this × prompts_per_step)."""
    staleness_limit: int = 1
    """k: partial mode does not resume a sample whose oldest token is more than k versions old; rollout.overlap=async
    starts no phase whose batch would train more than k versions after the engine's weights."""
    stale_action: Literal["regenerate", "drop"] = "regenerate"
    """Partial mode: 'regenerate' a stale sample from scratch, or 'drop' its group and re-queue the prompt."""
    max_discards: int = 2
    """On-policy mode: a prompt discarded this often is protected from early termination."""
    token_budget: int = 0
    """End a phase once this many tokens were generated in it (0: off; needs one useful group)."""
    dispatch: Literal["pull", "lpt"] = "pull"
    """'pull' (FIFO) or 'lpt' (longest first once lengths from earlier epochs are known)."""
    max_update_groups: int = 0
    """Most groups one step trains (0: prompts_per_step); a phase still ends at prompts_per_step useful groups."""
    long_rounds: bool = True
    """On-policy starvation guard: tail batching (prompts discarded max_discards times run in a long round of
    their own); false: drain them in a pinned phase."""
    buffer_samples: int = 0
    """SortedRL admission budget: unfinished samples live at most while admitting for free slots
    (0: one per free slot)."""
    long_round_groups: int = 0
    """On-policy long rounds: long-queue prompts per round, topped up with new ones (0: prompts_per_step;
    fewer: shorter rounds, more bubble)."""
    overlap: Literal["none", "one_step", "async"] = "none"
    """Generation beside training (disaggregated engines): 'none' (they take turns), 'one_step' (the next phase is
    generated with the previous weights while this batch trains; staleness 1), 'async' (engines never wait: batches
    queue, weights load between engine steps, at most staleness_limit versions ahead)."""


@dataclass
class EngineConfig:
    max_model_len: int = 256
    """Longest prompt + response the engine accepts."""
    kv_cache_gib: float = 1.0
    """KV cache per engine worker (each tensor-parallel rank of an engine) in GiB; vLLM reserves exactly this
    (vLLM's CPU default would take ~10 GiB; on a GPU, instead of its default 90% of the memory)."""
    tensor_parallel_size: int = 1
    """vLLM tensor-parallel size; divides the world: TP = world is one engine, TP < world gives world/TP
    colocated replicas."""
    slots: int = 256
    """Concurrent sequences per engine (vLLM max_num_seqs); the controller never exceeds it."""
    placement: Literal["colocated", "disaggregated"] = "colocated"
    """'colocated' (engines inside the trainer's processes) or 'disaggregated' (replicas in processes of their own)."""
    replicas: int = 1
    """Disaggregated engine replicas, each with its own tensor parallelism, fed by one shared pull queue."""
    replica_devices: str = ""
    """Disaggregated on GPUs: CUDA device ids on each hosting node for its replicas
    ('4,5,6,7': replicas/node × TP of them)."""
    replica_nodes: int = 0
    """Disaggregated: the job's last N nodes host the replicas, engine.replicas / N each (0: all on rank 0's node)."""
    replica_nodes_dedicated: bool = False
    """With engine.replica_nodes=N: those last N nodes run only replicas
    (a replica host each, no trainer rank; slurm/train.sbatch)."""
    sleep_level: Literal[0, 1, 2] = 0
    """Colocated engines sleep while the trainer trains: 0 never, 1 weights to host + KV dropped, 2 both dropped."""
    max_restarts: int = 3
    """Engine restarts in a row after errors mid-phase (phase re-queued, engine rebuilt); one more failure stops the run
    with a checkpoint."""
    hang_timeout_s: float = 1800.0
    """Watchdog: an engine step, a trainer's optimizer step or forward pass, weight sync, evaluation or checkpoint
    save blocked this long ends the process with exit 75 (requeue); 0 off."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """The engines' weights and activations: 'auto' (the trainer's precision: bf16 → 'bfloat16', fp32 →
    'float32'), or one named; the weight sync casts to it on the way."""
    enforce_eager: Literal["auto", True, False] = "auto"
    """vLLM without CUDA graphs: 'auto' (eager on CPU, where vLLM requires it; CUDA graphs on GPUs), true or false."""
    gpu_memory_utilization: float = 0.0
    """GPU engines: the share of each GPU vLLM may take (weights + KV cache) instead of ``kv_cache_gib``
    (0: ``kv_cache_gib`` sizes the KV cache exactly). Not used on CPU."""
    peer_wait_s: float = 60.0
    """Colocated engine TP > 1: a rank whose engine step failed waits this long for the engine's other ranks, then
    exits 75 (they are stuck in vLLM's collectives)."""
    cpu_threads: int = 0
    """Compute threads of each disaggregated replica worker (0: megarl chooses: the replicas' share of the node's
    cores, pinned, while generation runs beside training; see docs/cluster.md)."""


@dataclass
class AlgoConfig:
    preset: Literal["", "grpo", "dr_grpo", "rloo", "dapo", "gspo", "cispo", "ppo", "vapo"] = ""
    """Named defaults for the keys below: grpo, dr_grpo, rloo, dapo, gspo, cispo, ppo, vapo; replaces algo keys of
    earlier layers (file before override), keys in its own or a later layer win."""
    advantage: Literal["grpo", "dr_grpo", "rloo", "gae"] = "grpo"
    """'grpo' (group mean/std), 'dr_grpo' (group mean only), 'rloo' (leave-one-out), 'gae' (critic)."""
    policy_loss: Literal["ppo", "gspo", "cispo"] = "ppo"
    """'ppo' (token ratio, clipped), 'gspo' (sequence ratio, length-normalised) or 'cispo' (the clipped ratio as a
    detached weight on −Â·log π: no token loses its gradient)."""
    clip_low: float = 0.2
    """PPO clip bound below: ratio ≥ 1 − clip_low (GSPO: its own, much smaller range; CISPO: the weight's, 1 = none)."""
    clip_high: float = 0.2
    """PPO clip bound above: ratio ≤ 1 + clip_high (clip-higher when > clip_low; CISPO: the weight's bound)."""
    dual_clip: float = 0.0
    """Dual-clip constant c > 1 bounding the loss of negative advantages (0: off)."""
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = "token_mean"
    """'token_mean' (DAPO), 'seq_mean_token_mean' (GRPO), 'seq_mean_token_sum_norm' (Dr. GRPO)."""
    loss_norm_tokens: int = 0
    """Dr. GRPO's constant normaliser in tokens (0: rollout.max_new_tokens)."""
    kl_coef: float = 0.0
    """KL(π_θ ‖ π_ref) penalty coefficient; > 0 keeps a frozen reference model."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator: 'k1', 'k2' or 'k3'."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (loss −= coef · entropy)."""
    tis: Literal["none", "token", "sequence", "mask_token", "mask_sequence"] = "none"
    """Correction of the trainer/engine mismatch and of stale samples by ρ = π_prox/π_behaviour (the loss then clips
    against π_prox): 'token' or 'sequence' weight the loss by ρ truncated at tis_cap (TIS); 'mask_token' (IcePop)
    keeps ρ_t as the weight where it is within [mask_low, mask_high] and drops the token elsewhere; 'mask_sequence'
    drops a sequence whose geometric-mean ρ is outside that band; 'none'."""
    tis_cap: float = 2.0
    """TIS cap C on the importance weight."""
    mask_low: float = 0.5
    """algo.tis=mask_token|mask_sequence: the band's lower bound, inclusive (< 1; 0: none)."""
    mask_high: float = 2.0
    """algo.tis=mask_token|mask_sequence: the band's upper bound, inclusive (> 1; IcePop used 5). A sequence's
    geometric mean moves far less than one token's ρ: mask_sequence wants a band near 1 (verl: 1.0001 to 1.001)."""
    decoupled_ppo: Literal["auto", True, False] = "auto"
    """AReaL's decoupled PPO for stale samples: clip against the proximal policy (the trainer's logprobs before the
    update, one more forward over the batch), weight by min(π_prox/π_behaviour, tis_cap) per token (algo.tis=token's
    computation, named). 'auto': on where the run trains stale tokens (rollout.overlap one_step, or async or partial
    rollouts at staleness_limit ≥ 1) and neither algo.tis nor policy_loss=cispo corrects them; else off."""
    gamma: float = 1.0
    """GAE discount."""
    lam: float = 0.95
    """GAE λ of the policy's advantages (with ``advantage: gae``); the value targets use lam_critic."""
    lam_critic: float = 1.0
    """GAE λ of the critic's value targets, in every GAE run (PPO: = lam; VAPO decouples: 1.0)."""
    length_adaptive_alpha: float = 0.0
    """VAPO length-adaptive λ_policy = 1 − 1/(α·l) (0: off, use lam)."""
    whiten_advantages: bool = False
    """Normalise GAE advantages to zero mean, unit std over the batch's tokens."""
    value_clip: float = 0.2
    """Clip range of the value loss around the old values (0: off)."""
    critic_lr: float = 1.0e-3
    """Learning rate of the critic."""
    critic_warmup_steps: int = 0
    """Value pre-training: RL steps that train only the critic before the policy moves (GAE only; < train.steps)."""
    positive_nll_coef: float = 0.0
    """VAPO: weight of the LM loss on samples with reward 1 (positive examples)."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards all match; a phase ends at prompts_per_step useful groups."""
    oversample_cap: float = 3.0
    """Dynamic sampling: stop a phase once this × prompts_per_step groups were released, useful or not (>= 1)."""
    overlong_filter: bool = False
    """Mask the loss of samples truncated by the length cap."""
    overlong_cache: int = 0
    """DAPO soft over-long punishment: length of the penalty ramp before the cap, in tokens (0: overlong_cache_frac
    decides)."""
    overlong_cache_frac: float = 0.0
    """The penalty ramp as a share of rollout.max_new_tokens when overlong_cache is 0, in [0, 1) (DAPO: 0.2, its
    4,096 of 20,480 tokens; 0: off)."""
    overlong_penalty: float = 1.0
    """Penalty λ reached at the cap."""
    ppo_epochs: int = 1
    """Inner epochs over each rollout batch (replay)."""
    minibatches: int = 1
    """Optimizer steps per epoch (mini-batches of the rollout batch)."""
    prioritized_replay: bool = False
    """Draw mini-batch rows ∝ |advantage| instead of uniformly."""
    curriculum: bool = False
    """Draw prompts from a finite pool ∝ p(1−p) + ε of their pass rates (needs data.pool_size)."""
    curriculum_eps: float = 0.05
    """ε of the curriculum weights."""
    routing_replay: Literal["auto", "none", "rollout", "trainer"] = "auto"
    """MoE routing replay: 'rollout' (R3: the trainer routes each token to the experts the engine used), 'trainer'
    (R2: the trainer's own routes of the step's first forward, replayed in its updates), 'none'; 'auto': 'rollout'
    for an MoE model whose engines capture routes, else 'none'. 'rollout' and 'trainer' need an MoE model."""


@dataclass
class OptimConfig:
    lr: float = 1e-4
    """Adam learning rate."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam β1."""
    adam_beta2: float = 0.999
    """Adam β2."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0: off)."""
    lr_warmup_steps: int = 0
    """Linear learning-rate warm-up over this many RL steps."""
    lr_decay: Literal["constant", "cosine"] = "constant"
    """After warm-up: 'constant' or 'cosine' (down to min_lr at train.steps)."""
    min_lr: float = 0.0
    """Floor of the cosine decay."""
    micro_batch_size: int = 64
    """Sequences per forward/backward microbatch."""
    moe_aux_loss_coeff: float = 0.0
    """Load-balancing loss coefficient for MoE routers (0: off)."""
    moe_z_loss_coeff: float = 0.0
    """Router z-loss coefficient (ST-MoE: penalises large router logits; 0: off)."""
    logprob_chunk: int = 1024
    """Compute logprobs from hidden states this many positions of a micro-batch at a time, its rows together (0: from
    full logits)."""
    distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks (megatron's distributed optimizer) when DP > 1."""


@dataclass
class WarmupConfig:
    steps: int = 0
    """Supervised steps before RL (0: none), on ``path``'s conversations, else the built-in task's references."""
    batch_size: int = 64
    """Examples per supervised step."""
    lr: float = 1e-3
    """Learning rate of the supervised phase."""
    path: str = ""
    """Warm-up conversations: rows ``{"messages": [...]}`` (.jsonl, .parquet, a directory or glob, a datasets dir),
    trained on their assistant turns, a multi-turn episode's environment messages masked, rendered as the rollouts
    render them ('': the built-in task's reference responses; docs/environments.md)."""


@dataclass
class TrainConfig:
    steps: int = 20
    """RL steps (each: generate, reward, advantage, update, sync)."""
    time_limit_s: float = 0.0
    """Stop RL after this many seconds (0: no limit); the final evaluation still runs."""
    seed: int = 0
    """Seed of sampling and training."""
    run_dir: str = "runs/default"
    """Where TensorBoard events, the resolved config and results go."""
    eval_every: int = 0
    """Greedy pass@1 on the held-out set every N steps (0: only at start and end)."""
    save_every: int = 50
    """Save a run checkpoint (run_dir/checkpoints/step_N) every N steps, and always at the end (0: only at the end)."""
    keep_checkpoints: int = 2
    """Keep the newest this many run checkpoints; older ones are deleted after a save."""
    resume: str = "auto"
    """'auto': continue from run_dir/checkpoints/latest if there is one; 'never': start fresh; or a step_N directory."""
    deterministic: bool = False
    """Exact resume: a killed and resumed run logs the same metrics as one never stopped (forbids time_limit_s)."""
    max_bad_steps: int = 3
    """Steps in a row with a non-finite loss or gradient (each skipped, weights untouched) that stop the run."""
    export_hf_every: int = 0
    """Export the policy as an HF checkpoint to run_dir/hf/step_N every N steps (0: only at the end)."""
    export_shard_gib: float = 5.0
    """Largest safetensors file of the HF export (the hub's and transformers' usual 5 GB; an index names them all)."""
    trace: bool = False
    """Write run_dir/trace.json, a Chrome trace (Perfetto, chrome://tracing): generate, reward, train and sync spans,
    one track per engine replica and trainer rank."""


@dataclass
class SyncConfig:
    bucket_mib: float = 64.0
    """Trainer → engine weight-sync bucket in MiB (peak extra memory of a sync ≈ one bucket + the largest tensor)."""
    check_every: int = 0
    """Every N syncs, compare engine and trainer logprobs on a probe batch → sync/logprob_gap (0: never)."""
    transport: Literal["gloo", "nccl"] = "gloo"
    """Disaggregated engines' weight transport: 'gloo' (CPU or GPU) or 'nccl' (CUDA on the trainer and the engines)."""
    timeout_s: float = 300.0
    """Disaggregated engines: the longest wait of a weight-transfer group or a replica's reply, in seconds."""
    rollback: Literal["copy", "resync"] = "copy"
    """A load failing mid-way: 'copy' (engine backs up its weights first, ~1 model of host RAM; keeps serving the
    old version) or 'resync' (no backup; engine unusable until re-synced). engine.sleep_level=2 loads as 'resync'
    (its weights were dropped: nothing to back up)."""


@dataclass
class TrainerConfig:
    precision: Literal["bf16", "fp32"] = "bf16"
    """'bf16': megatron's mixed precision (bf16 weights and activations, fp32 main parameters, gradients and Adam
    state; logprobs and the loss in fp32 from bf16 logits); 'fp32': everything fp32. The critic and the
    reference follow it; FP8 (``model.fp8``) runs on bf16."""
    offload_during_rollout: bool = False
    """Move the optimizer state and gradient buffers (the critic's too) and a frozen KL reference's weights to host
    memory while the engines generate (GPU)."""
    reference_on_host: bool = False
    """A KL penalty's frozen reference (``algo.kl_coef`` > 0 without LoRA) kept in host memory and copied into the
    policy's own model for its forward pass, the policy's weights put back after (as NeMo-RL does): no second model
    on the GPU, for 3 copies of this rank's weights over the host link a step. False: a model of its own beside the
    policy (offloaded while generating under ``offload_during_rollout``). Not with ``model.fp8``."""
    cpu_threads: int = 0
    """Compute threads of each trainer rank (0: megarl chooses: the node's cores split between its ranks, and with
    the replicas while generation runs beside training; see docs/cluster.md)."""
    packing: bool = True
    """Lay each micro-batch's sequences end to end (position ids restarting, attention within each sequence), so the
    forward holds no padding beyond what the layout needs (a multiple of TP under sequence parallelism, one length
    per step under PP); false: every row padded to the batch's longest. Same objective either way."""
    max_tokens_per_microbatch: int = 0
    """Token-balanced micro-batches (needs ``packing``): at most this many tokens each, rows spread over DP ranks
    with equal token loads and micro-batch counts; 0: off (``optim.micro_batch_size`` rows each). At least
    ``engine.max_model_len`` − 1, the longest row a rollout can give."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recompute in training passes (docs/parallelism.md#recompute): 'none' (every layer keeps its
    activations for the backward), 'selective' (each layer's core attention runs again in the backward: megatron's
    recompute_modules ['core_attn']), 'full' (a unit of ``recompute_layers`` layers keeps only its input and runs
    its forward again in the backward: about a third more training compute). Logprob passes keep nothing anyway."""
    recompute_layers: int = 1
    """trainer.recompute=full: layers per recompute unit (megatron's recompute_num_layers, method 'uniform'); must
    divide the layers of a model chunk (layers / (pp × vpp)). Larger: fewer kept inputs, one larger unit's
    activations live at once in the backward."""


@dataclass
class RewardConfig:
    fn: str = ""
    """'math' (math-verify), 'exact', 'addition', or 'package.module:function' ('' : the built-in task's own)."""
    format_coef: float = 0.0
    """Built-in rewards: added when the response ends in a well-formed answer (math: \\boxed{}),
    subtracted otherwise."""
    workers: int = 2
    """Reward worker processes (a hung call is killed with its worker, which is replaced)."""
    timeout_s: float = 10.0
    """Seconds one reward call may take before its worker is killed and the call scores ``on_error``."""
    on_error: float = 0.0
    """Reward given to a call that raised, timed out or returned something that is not a number."""
    max_failed_steps: int = 3
    """Stop the run (exit 1, not requeued) after this many steps in a row in which every reward call failed
    (0: never)."""


@dataclass
class EnvConfig:
    fn: str = ""
    """Multi-turn environment class 'package.module:Class' ('': single-turn); one instance per sample, built from
    its row's other columns as keyword arguments; ``step(response) -> str | dict | None`` (docs/environments.md).
    'tools': the built-in tool environment over ``tools``."""
    max_turns: int = 4
    """Model turns per episode at most (the environment is not asked after the last one)."""
    timeout_s: float = 10.0
    """Seconds one ``step`` call (or the instance's construction with its first step) may take; past it the
    worker is killed and the episode ends, counted in ``env/timeouts``."""
    workers: int = 2
    """Environment worker processes (each holds the instances of the samples it serves)."""
    tools: str = ""
    """``fn: tools``: the functions the model may call, comma-separated 'package.module:function' (called by
    name with the ``<tool_call>``'s arguments)."""


@dataclass
class EvalConfig:
    samples: int = 1
    """Samples per prompt: 1 is greedy pass@1; k > 1 also reports the unbiased pass@k (sampled)."""
    temperature: float = 1.0
    """Sampling temperature when ``samples`` > 1."""
    output: str = ""
    """Where ``megarl eval`` writes its JSON ('': beside a run checkpoint, RUN/eval_step_N.json; else
    <train.run_dir>/eval.json)."""


@dataclass
class LoraConfig:
    rank: int = 0
    """LoRA adapters' rank r (0: off, full fine-tuning); > 0 freezes the base weights and trains only the adapters
    (docs/lora.md)."""
    alpha: float = 16.0
    """Adapter scale numerator: each adapter adds (alpha / rank) · B A x to its layer's output."""
    dropout: float = 0.0
    """Dropout on an adapter's input while training, in [0, 1); masks tied over TP where the input is replicated."""
    targets: str = "linear_qkv,linear_proj,linear_fc1,linear_fc2"
    """Comma-separated layers that get adapters: 'linear_qkv' (attention QKV), 'linear_proj' (attention out),
    'linear_fc1', 'linear_fc2' (dense MLP in, out); 'experts' (every routed expert's in and out; parallel.etp 1 or
    parallel.tp's); the router never."""
    init: Literal["kaiming", "gaussian"] = "kaiming"
    """A's initialisation: 'kaiming' (uniform, PEFT's default) or 'gaussian' (std 1/rank); B starts at zero."""


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)


PRECISION_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
"""``trainer.precision`` → the (torch and vLLM) name of the dtype its weights are in."""


def resolved_engine_dtype(cfg: RunConfig) -> str:
    """``engine.dtype`` as vLLM takes it: 'auto' is the trainer's precision (``PRECISION_DTYPES``)."""
    return PRECISION_DTYPES[cfg.trainer.precision] if cfg.engine.dtype == "auto" else cfg.engine.dtype


def captures_routes(cfg: RunConfig, experts: int, gpu: bool = False) -> bool:
    """Whether the engines capture each token's routes (routing replay and the ``moe/*`` agreement metrics): MoE
    models with ``algo.routing_replay`` other than 'none', where the engines can (``route_capture_limit``)."""
    return bool(experts) and cfg.algo.routing_replay != "none" and not route_capture_limit(cfg, gpu)


def route_capture_limit(cfg: RunConfig, gpu: bool) -> str:
    """Why the engines cannot capture routes ('' when they can; ``engines/routes.py``): on CPU the router hook runs
    in the driver worker, which only a replica of engine TP 1 has in its own process. On GPUs every placement and
    engine TP captures them (vLLM's route output, on each engine's first TP rank)."""
    return engine_route_limit(cfg.engine.placement, cfg.engine.tensor_parallel_size, gpu)


def engine_route_limit(placement: str, engine_tp: int, gpu: bool) -> str:
    """``route_capture_limit`` of engines at ``placement`` and ``engine_tp`` (``megarl plan``'s layouts)."""
    if engine_tp > 1 and not gpu and placement == "disaggregated":
        return (f"engine.placement=disaggregated at engine.tensor_parallel_size={engine_tp} on CPU: a "
                "replica's routes are captured in its driver worker, which only a replica of engine TP 1 has in its "
                "own process")
    return ""


def resolved_routing_replay(cfg: RunConfig, experts: int, gpu: bool = False) -> str:
    """``algo.routing_replay`` as the run applies it ('auto': 'rollout' where routes are captured, else 'none')."""
    mode = cfg.algo.routing_replay
    if mode == "auto":
        return "rollout" if captures_routes(cfg, experts, gpu) else "none"
    return mode
