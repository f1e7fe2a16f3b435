"""LoRA adapters on Transformer Engine's layers (``model.transformer_engine=true``) compute what the same adapters on
megatron-core's own layers compute (the CPU-tested reference), in fp32 on one GPU: the base and the adapted model's
logprobs, and every adapter's gradient after one step (tests/workers/lora_te_checks.py). The fused norm+linear
layers' adapters take the normed input (``trainer.lora.normed_input``; tests/unit/test_lora_fused_norm.py checks its
arithmetic on CPU); the routed experts, adapted, are megatron's SequentialMLP of its own layers there. Marker
``gpu``: Transformer Engine exists on GPUs only."""

import pytest

from helpers.scripts import run_script

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_adapters_on_transformer_engine_layers_are_the_local_layers_adapters(tmp_path, family):
    out = run_script(["tests/workers/lora_te_checks.py", family, str(tmp_path)])
    assert "TELayerNormColumnParallelLinear" in out["te_layers"] and "TERowParallelLinear" in out["te_layers"]
    # (a and b) × 4 layers × the adapted modules of a layer (qwen3_moe: linear_qkv, linear_proj, 4 experts × 2, the
    # experts megatron's SequentialMLP under Transformer Engine too)
    assert out["same_names"] and out["adapters"] == 2 * 4 * (2 + 4 * 2 if family == "qwen3_moe" else 4)
    if family == "qwen3_moe":
        assert out["te_experts"] == ["SequentialMLP"] and "ColumnParallelLinear" in out["te_layers"]
    assert out["adapters_act"] > 1e-2  # (B random: the adapters move the logprobs)
    assert out["base_gap"] < 1e-4 and out["adapted_gap"] < 1e-4  # fp32, TF32 off: kernels' rounding only
    assert out["grad_gap"] < 1e-3
