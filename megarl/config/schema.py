"""Every setting of a megarl run, as typed dataclasses; each field's docstring is its doc.

YAML files map onto ``RunConfig`` strictly (see ``loader.py``): a key that is not
a field here, or a value of the wrong type, is an error naming the key and file.
"""

from __future__ import annotations

from dataclasses import dataclass, field

TINY_FAMILIES = ("qwen3_moe", "qwen2", "mixtral", "qwen2_moe")
"""Families ``megarl.models.tiny`` can build (``model.make_tiny``)."""


@dataclass
class ModelConfig:
    path: str = "runs/tiny_moe/model"
    """HF checkpoint directory (config.json, *.safetensors, tokenizer) of the policy."""
    make_tiny: str = ""
    """If set ('qwen3_moe', 'qwen2', 'mixtral', 'qwen2_moe') and ``path`` holds no checkpoint, create a tiny one there."""
    seed: int = 0
    """Seed of the tiny model's random weights (``make_tiny`` only)."""
    fp8: str = ""
    """FP8 training through Transformer Engine: '' (off), 'delayed', 'tensorwise', 'blockwise', 'mxfp8'."""
    transformer_engine: bool = False
    """Build layers from Transformer Engine's spec (fused norm+linear, grouped expert GEMMs) without
    FP8 too; needs TE on a GPU (FP8 always uses it)."""


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
    moe_dispatcher: str = "alltoall"
    """MoE token dispatcher: 'alltoall' or 'allgather'."""


@dataclass
class DataConfig:
    task: str = "addition"
    """Prompt source; 'addition' is the multi-digit addition task with a scratchpad."""
    max_digits: int = 6
    """Largest operand size in digits."""
    tail_alpha: float = 1.0
    """Power-law exponent of the operand size distribution (larger: more short problems)."""
    eval_size: int = 200
    """Held-out prompts for greedy pass@1."""
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
    mode: str = "sync"
    """Rollout scheduling: 'sync' (wait for the longest), 'on_policy' or 'partial' (SortedRL)."""
    oversubscription: float = 2.0
    """SortedRL: groups kept live per update group (the rollout batch is this × prompts_per_step)."""
    staleness_limit: int = 1
    """Partial mode: a sample whose oldest token is more than this many versions old is not resumed."""
    stale_action: str = "regenerate"
    """Partial mode: 'regenerate' a stale sample from scratch, or 'drop' its group and re-queue the prompt."""
    max_discards: int = 2
    """On-policy mode: a prompt discarded this often is protected from early termination."""
    token_budget: int = 0
    """End a phase once this many tokens were generated in it (0: off; needs one useful group)."""
    dispatch: str = "pull"
    """'pull' (FIFO) or 'lpt' (longest first once lengths from earlier epochs are known)."""
    max_update_groups: int = 0
    """Most groups one step trains (0: prompts_per_step); a phase still ends at prompts_per_step useful groups."""
    long_rounds: bool = True
    """On-policy starvation guard: tail batching (prompts discarded max_discards times run in a long round of their own); false: drain them in a pinned phase."""
    buffer_samples: int = 0
    """SortedRL admission budget: unfinished samples live at most while admitting for free slots (0: one per free slot)."""


@dataclass
class EngineConfig:
    max_model_len: int = 256
    """Longest prompt + response the engine accepts."""
    kv_cache_gib: float = 1.0
    """KV cache size per engine in GiB (vLLM's CPU default would take ~10 GiB)."""
    tensor_parallel_size: int = 1
    """vLLM tensor-parallel size (the engine spans this many trainer processes)."""
    slots: int = 256
    """Concurrent sequences per engine (vLLM max_num_seqs); the controller never exceeds it."""


@dataclass
class AlgoConfig:
    preset: str = ""
    """Named defaults for the keys below: grpo, dr_grpo, rloo, dapo, gspo, ppo, vapo (explicit keys win)."""
    advantage: str = "grpo"
    """'grpo' (group mean/std), 'dr_grpo' (group mean only), 'rloo' (leave-one-out), 'gae' (critic)."""
    policy_loss: str = "ppo"
    """'ppo' (token ratio, clipped) or 'gspo' (sequence ratio, length-normalised)."""
    clip_low: float = 0.2
    """PPO clip bound below: ratio ≥ 1 − clip_low (GSPO: its own, much smaller range)."""
    clip_high: float = 0.2
    """PPO clip bound above: ratio ≤ 1 + clip_high (clip-higher when > clip_low)."""
    dual_clip: float = 0.0
    """Dual-clip constant c > 1 bounding the loss of negative advantages (0: off)."""
    loss_agg: str = "token_mean"
    """'token_mean' (DAPO), 'seq_mean_token_mean' (GRPO), 'seq_mean_token_sum_norm' (Dr. GRPO)."""
    loss_norm_tokens: int = 0
    """Dr. GRPO's constant normaliser in tokens (0: rollout.max_new_tokens)."""
    kl_coef: float = 0.0
    """KL(π_θ ‖ π_ref) penalty coefficient; > 0 keeps a frozen reference model."""
    kl_estimator: str = "k3"
    """KL estimator: 'k1', 'k2' or 'k3'."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (loss −= coef · entropy)."""
    tis: str = "none"
    """Truncated importance sampling of the trainer/engine mismatch: 'none', 'token', 'sequence'."""
    tis_cap: float = 2.0
    """TIS cap C on the importance weight."""
    gamma: float = 1.0
    """GAE discount."""
    lam: float = 0.95
    """GAE λ (PPO); the value target's λ under VAPO is lam_critic."""
    lam_critic: float = 1.0
    """VAPO decoupled GAE: λ for the value targets."""
    length_adaptive_alpha: float = 0.0
    """VAPO length-adaptive λ_policy = 1 − 1/(α·l) (0: off, use lam)."""
    whiten_advantages: bool = False
    """Normalise GAE advantages to zero mean, unit std over the batch's tokens."""
    value_clip: float = 0.2
    """Clip range of the value loss around the old values (0: off)."""
    critic_lr: float = 1.0e-3
    """Learning rate of the critic."""
    critic_warmup_steps: int = 0
    """Value pre-training: RL steps that train only the critic before the policy moves."""
    positive_nll_coef: float = 0.0
    """VAPO: weight of the LM loss on samples with reward 1 (positive examples)."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards all match; a phase ends at prompts_per_step useful groups."""
    oversample_cap: float = 3.0
    """Dynamic sampling: stop a phase once this × prompts_per_step groups were released, useful or not."""
    overlong_filter: bool = False
    """Mask the loss of samples truncated by the length cap."""
    overlong_cache: int = 0
    """DAPO soft over-long punishment: length of the penalty ramp before the cap (0: off)."""
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
    lr_decay: str = "constant"
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
    """Compute logprobs from hidden states this many positions at a time (0: from full logits)."""
    distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks (megatron's distributed optimizer) when DP > 1."""


@dataclass
class WarmupConfig:
    steps: int = 0
    """Supervised steps on reference responses before RL (0: none)."""
    batch_size: int = 64
    """Problems per supervised step."""
    lr: float = 1e-3
    """Learning rate of the supervised phase."""


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
