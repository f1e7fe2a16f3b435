"""``lora.*`` config: bad values, unknown or unbuilt targets, targets the model lacks and combinations this stage
of LoRA does not run stop the run before launch, naming the key (megarl/config/validate/lora.py). Pure config."""

import pytest

from megarl.config import ConfigError, load_config, validate
from megarl.config.validate.lora import check_lora_run, lora_on_experts, lora_targets, validate_lora
from megarl.models.tiny import TinyShape, hf_config

DENSE = hf_config(TinyShape(family="qwen2"), eos_id=1, pad_id=0)
MOE = hf_config(TinyShape(family="qwen3_moe"), eos_id=1, pad_id=0)


def check(*overrides: str, hf: dict = DENSE, world: int = 1) -> None:
    validate(load_config(None, ["model.transformer_engine=false", *overrides]), world, hf)


def test_lora_is_off_by_default_and_a_valid_section_passes():
    cfg = load_config(None, [])
    assert cfg.lora.rank == 0
    check_lora_run(cfg)  # off: nothing to refuse
    check("lora.rank=8", "lora.alpha=16", "lora.dropout=0.05", "lora.init=gaussian")
    assert lora_targets(load_config(None, ["lora.targets= linear_qkv , linear_proj"]).lora) == ("linear_qkv",
                                                                                               "linear_proj")


@pytest.mark.parametrize("override, words", [
    ("lora.rank=-1", "lora.rank must be >= 0"),
    ("lora.alpha=0", "lora.alpha must be > 0"),
    ("lora.dropout=1.0", "lora.dropout must be in [0, 1)"),
    ("lora.targets=linear_qkv,q_proj", "'q_proj' is not a layer kind; valid: linear_qkv, linear_proj"),
    ("lora.targets=router", "'router': the MoE router never gets an adapter"),
    ("lora.targets=linear_qkv,linear_qkv", "names a layer kind twice"),
    ("lora.targets=''", "lora.targets is empty"),
])
def test_bad_values_are_refused_naming_the_key(override, words):
    with pytest.raises(ConfigError, match="lora") as err:
        check("lora.rank=8", override)
    assert words in str(err.value)


def test_targets_the_model_lacks_and_unbuilt_combinations_are_refused():
    with pytest.raises(ConfigError, match="'linear_fc1'.*no dense MLP layer"):
        check("lora.rank=8", "parallel.ep=1", hf=MOE)  # every Qwen3-MoE layer routes to experts
    check("lora.rank=8", "lora.targets=linear_qkv,linear_proj", hf=MOE)
    check("lora.rank=8", "lora.targets=linear_qkv,experts", "parallel.ep=2", "parallel.etp=1", hf=MOE, world=2)
    with pytest.raises(ConfigError, match="'experts'.*model.path=.* is a dense model"):
        check("lora.rank=8", "lora.targets=linear_qkv,experts")
    check("lora.rank=8", "lora.targets=experts", "parallel.tp=2", "parallel.sequence_parallel=true", hf=MOE,
          world=2)  # etp 0 → tp
    with pytest.raises(ConfigError, match=r"at parallel.etp=2, parallel.tp=1.*set parallel.etp=1 or 1"):
        check("lora.rank=8", "lora.targets=experts", "parallel.etp=2", "parallel.ep=1", hf=MOE, world=2)
    check("lora.rank=8", "lora.dropout=0.1", "parallel.tp=2", world=2)  # (built: masks tied over TP)
    check("lora.rank=8", "lora.dropout=0.1", "trainer.recompute=full")  # (built: the adapters' gradients kept)
    with pytest.raises(ConfigError, match="model.fp8='delayed'.*not built"):  # (a GPU's check, made here)
        validate_lora(load_config(None, ["lora.rank=8", "model.fp8=delayed"]), DENSE)
    # Transformer Engine's linears take adapters (tests/gpu/test_lora_te_gpu.py), its experts as SequentialMLP's
    validate_lora(load_config(None, ["lora.rank=8", "model.transformer_engine=true"]), DENSE)
    experts = load_config(None, ["lora.rank=8", "model.transformer_engine=true", "parallel.ep=1",
                                 "lora.targets=linear_qkv,experts"])
    validate_lora(experts, MOE)
    assert lora_on_experts(experts.lora) and not lora_on_experts(load_config(None, ["lora.rank=8"]).lora)
    assert not lora_on_experts(load_config(None, ["lora.targets=linear_qkv,experts"]).lora)  # (rank 0: off)


def test_transformer_engine_auto_is_megatrons_own_layers_under_lora_on_gpus_too():
    """'auto' (the default) takes Transformer Engine's layers on a GPU machine, but not with adapters, which sit on
    megatron's own linears: a LoRA run on GPUs needs no setting, and the plan sizes what the trainer runs."""
    from megarl.config.validate.settings import transformer_engine_planned

    lora, full = load_config(None, ["lora.rank=8"]), load_config(None, [])
    validate_lora(lora, DENSE)  # 'auto': not refused
    assert transformer_engine_planned(full, gpu=True) and not transformer_engine_planned(lora, gpu=True)
    assert not transformer_engine_planned(full, gpu=False)


def test_a_run_with_engines_is_refused_where_the_adapter_sync_cannot_serve_it(tmp_path):
    check_lora_run(load_config(None, ["lora.rank=8"]))  # colocated, HF base: the adapters alone are synced
    check_lora_run(load_config(None, ["lora.rank=8", "engine.placement=disaggregated"]))  # replicas: the same
    with pytest.raises(ConfigError, match="engine.sleep_level=2.*sleep_level=1 or 0"):
        check_lora_run(load_config(None, ["lora.rank=8", "engine.sleep_level=2"]))
    with pytest.raises(ConfigError, match="lora.rank=1024: vLLM serves adapters up to rank 512"):
        check_lora_run(load_config(None, ["lora.rank=1024"]))
    (tmp_path / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')  # a megatron dist checkpoint:
    check_lora_run(load_config(None, ["lora.rank=8", f"model.path={tmp_path}"]))  # converted for the engines


def test_resuming_with_other_adapters_than_the_checkpoints_is_refused_before_launch(tmp_path):
    """train.resume=auto finds a checkpoint saved with rank 4, alpha 8 (its layout file): other lora settings, or
    none, are a ConfigError naming both before any process starts; the same settings pass."""
    import json

    from megarl.checkpoint.dist import LAYOUT_FILE
    from megarl.config.validate.model import check_resume_lora

    policy = tmp_path / "checkpoints" / "step_000002" / "policy"
    policy.mkdir(parents=True)
    (policy / "metadata.json").write_text("{}")
    (policy / LAYOUT_FILE).write_text(json.dumps({"precision": "fp32", "lora": {"rank": 4, "alpha": 8.0}}))
    run = [f"train.run_dir={tmp_path}"]
    check_resume_lora(load_config(None, [*run, "lora.rank=4", "lora.alpha=8"]))
    for other in (["lora.rank=8", "lora.alpha=8"], ["lora.rank=4"], []):
        with pytest.raises(ConfigError, match="saved with lora.rank=4 lora.alpha=8; resume with those"):
            check_resume_lora(load_config(None, [*run, *other]))
    (policy / LAYOUT_FILE).write_text(json.dumps({"precision": "fp32"}))  # a full fine-tuning run's
    check_resume_lora(load_config(None, run))
    with pytest.raises(ConfigError, match=r"saved with lora.rank=0 \(no adapters\)"):
        check_resume_lora(load_config(None, [*run, "lora.rank=4"]))
