"""megarl: RL post-training for large language models on megatron-core and vLLM."""

__version__ = "0.1.0"

from megarl.compat import lazy_compile as _lazy_compile  # noqa: E402

_lazy_compile.install()
