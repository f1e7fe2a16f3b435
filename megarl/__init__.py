"""megarl: RL post-training for large language models on megatron-core and vLLM."""

__version__ = "0.1.0"
