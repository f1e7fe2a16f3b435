import subprocess
import sys

import pytest
import torch

from helpers.scripts import ROOT
from megarl.config import ConfigError, RunConfig, load_config, parse_override, validate
from megarl.models.tiny import TinyShape, hf_config

MOE = hf_config(TinyShape(family="qwen3_moe"), eos_id=1, pad_id=0)  # 4 heads, 2 kv, 4 layers, 4 experts


def write(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_yaml_and_overrides_apply_in_order(tmp_path):
    path = write(tmp_path, "optim:\n  lr: 0.5\nrollout:\n  samples_per_prompt: 4\n")
    cfg = load_config(path, ["optim.lr=3e-4", "parallel.sequence_parallel=true"])
    assert cfg.optim.lr == pytest.approx(3e-4)
    assert cfg.rollout.samples_per_prompt == 4
    assert cfg.parallel.sequence_parallel is True


def test_unknown_key_names_key_and_file(tmp_path):
    path = write(tmp_path, "optim:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "optim.learning_rate" in str(err.value) and str(path) in str(err.value)
    assert "lr" in str(err.value)  # lists the valid keys


def test_wrong_type_names_key_and_expected_type(tmp_path):
    path = write(tmp_path, "rollout:\n  prompts_per_step: many\n")
    with pytest.raises(ConfigError, match=r"rollout\.prompts_per_step' must be int"):
        load_config(path)
    with pytest.raises(ConfigError, match="must be int"):
        load_config(None, ["train.steps=1.5"])


def test_int_is_accepted_for_float_but_bool_is_not_int():
    assert load_config(None, ["optim.lr=1"]).optim.lr == 1.0
    with pytest.raises(ConfigError):
        load_config(None, ["train.steps=true"])


@pytest.mark.parametrize("text", ["optim.lr", "=3", "optim..lr=1", "optim.lr=[1"])
def test_bad_override_is_rejected(text):
    with pytest.raises(ConfigError, match="override"):
        load_config(None, [text])


def test_section_must_be_mapping(tmp_path):
    with pytest.raises(ConfigError, match="'optim' must be a mapping"):
        load_config(write(tmp_path, "optim: 3\n"))


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        (["parallel.tp=3"], 2, "must divide the world size 2"),
        (["parallel.tp=2", "parallel.sequence_parallel=true"], 2, None),
        (["parallel.tp=4"], 4, r"parallel.tp=4 must divide attention heads \(4\) and KV heads \(2\); valid: \[1, 2\]"),
        (["parallel.pp=3"], 3, r"parallel.pp=3 must divide the number of layers \(4\); valid: \[1, 2, 4\]"),
        (["parallel.ep=3"], 3, r"parallel.ep=3 must divide the number of experts \(4\)"),
        (["parallel.sequence_parallel=true"], 1, "needs parallel.tp > 1"),
        (["parallel.vpp=2"], 1, r"parallel.vpp=2 needs parallel.pp > 1"),
        (["parallel.pp=2", "parallel.vpp=4"], 2,
         r"pp × vpp = 8 must divide the number of layers \(4\); valid vpp: \[1, 2\]"),
        (["parallel.pp=2", "parallel.vpp=2"], 2, None),
        (["rollout.samples_per_prompt=1"], 1, "samples_per_prompt must be >= 2"),
        # context parallelism (parallel.cp): its world, packed rows, token budget, R2 and the expert group
        (["parallel.cp=2"], 2, None),
        (["parallel.cp=0"], 1, "parallel.cp must be >= 1"),
        (["parallel.cp=3"], 2, r"parallel.cp=3: tp × pp × cp = 1×1×3 must divide the world size 2; valid cp: \[1, 2\]"),
        (["parallel.cp=2", "trainer.packing=false"], 2, "parallel.cp=2 .* set trainer.packing=true"),
        (["parallel.cp=2", "trainer.max_tokens_per_microbatch=30"], 2,
         r"trainer.max_tokens_per_microbatch=30 must be a multiple of 2 × parallel.cp = 4 .*e.g. 32"),
        (["parallel.cp=2", "algo.routing_replay=trainer"], 2, "algo.routing_replay=trainer .* parallel.cp=2"),
        (["parallel.cp=2", "parallel.ep=2"], 2, None),  # the expert group spans the CP ranks (megatron's layout)
        (["parallel.cp=2", "parallel.ep=4"], 2, r"parallel.ep=4 × parallel.etp=1 = 4 must divide tp×cp×dp = 2"),
    ],
)
def test_impossible_layouts_are_explained(overrides, world, message):
    cfg = load_config(None, overrides)
    if message is None:
        validate(cfg, world, MOE)
        return
    with pytest.raises(ConfigError, match=message):
        validate(cfg, world, MOE)


def _choice_fields():
    import dataclasses
    import typing

    for section in dataclasses.fields(RunConfig):
        cls = section.default_factory
        for f in dataclasses.fields(cls):
            typ = typing.get_type_hints(cls)[f.name]
            if typing.get_origin(typ) is typing.Literal:
                yield f"{section.name}.{f.name}", typing.get_args(typ)


def test_every_choice_setting_is_refused_by_its_type_naming_key_source_and_values(tmp_path):
    """One generic check for every ``Literal`` setting: a bad value in an override (or a file) is refused at load,
    naming the key, where it came from and the valid values; a config built in code is checked by ``validate``."""
    import dataclasses

    from megarl.config.loader import check_choices

    fields = dict(_choice_fields())
    assert {"rollout.mode", "engine.placement", "algo.loss_agg", "sync.rollback", "engine.sleep_level"} <= set(fields)
    del fields["algo.preset"]  # applied where it is given, before the layer's other keys: its own message
    for key, choices in fields.items():
        bad = 7 if isinstance(choices[0], str) else "seven"
        with pytest.raises(ConfigError, match=rf"override '{key}={bad}': {key} must be one of "
                                              rf"{', '.join(map(repr, choices))}; got {bad!r}"):
            load_config(None, [f"{key}={bad}"])
        for good in choices:
            load_config(None, [f"{key}={good!r}" if good == "" else f"{key}={good}"])
    cfg = RunConfig()
    cfg.rollout = dataclasses.replace(cfg.rollout, mode="eager")
    with pytest.raises(ConfigError, match="rollout.mode must be one of 'sync', 'on_policy', 'partial'; got 'eager'"):
        check_choices(cfg)
    with pytest.raises(ConfigError, match="rollout.mode must be one of"):
        validate(cfg, 1, MOE)
    path = write(tmp_path, "algo:\n  loss_agg: mean\n")
    with pytest.raises(ConfigError, match=rf"{path}: algo.loss_agg must be one of"):
        load_config(path)


def test_ep_on_dense_model_is_an_error():
    dense = hf_config(TinyShape(family="qwen2"), eos_id=1, pad_id=0)
    with pytest.raises(ConfigError, match="needs an MoE model"):
        validate(load_config(None, ["parallel.ep=2"]), 2, dense)


def test_defaults_validate():
    validate(RunConfig(), 1, MOE)


def test_cli_reports_config_errors_before_launch(tmp_path):
    bad = write(tmp_path, "train:\n  stepz: 3\n")
    proc = subprocess.run([sys.executable, "-m", "megarl.cli", "train", "--config", str(bad), "--nproc", "2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "train.stepz" in proc.stderr and str(bad) in proc.stderr


def test_override_value_is_parsed_as_yaml():
    assert parse_override("a.b=3e-4") == {"a": {"b": 3e-4}}
    assert parse_override("a=true") == {"a": True}
    assert parse_override("a=text") == {"a": "text"}


def test_moe_tensor_parallel_needs_sequence_parallel_and_a_fitting_etp():
    with pytest.raises(ConfigError, match="needs parallel.sequence_parallel=true"):
        validate(load_config(None, ["parallel.tp=2"]), 2, MOE)
    with pytest.raises(ConfigError, match=r"parallel.ep=2 × parallel.etp=2 = 4 must divide tp×dp = 2; valid ep .*: "
                                          r"\[1\] \(or set parallel.etp=1: valid ep \[1, 2\]\)"):
        validate(load_config(None, ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.etp=2",
                                    "parallel.ep=2"]), 2, MOE)
    with pytest.raises(ConfigError, match=r"parallel.ep=2 × parallel.etp=2 \(parallel.etp=0 → parallel.tp=2\) = 4"):
        validate(load_config(None, ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2"]), 2, MOE)
    validate(load_config(None, ["parallel.tp=2", "parallel.sequence_parallel=true"]), 2, MOE)
    validate(load_config(None, ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.etp=1"]), 2, MOE)


def test_fp8_without_transformer_engine_is_a_config_error():
    from megarl.config.validate.settings import transformer_engine_error

    with pytest.raises(ConfigError, match="model.fp8 must be"):
        validate(load_config(None, ["model.fp8=e5m2"]), 1, MOE)
    with pytest.raises(ConfigError, match="model.fp8='delayed' runs on megatron's bf16 mixed precision; set "
                                          "trainer.precision=bf16"):
        validate(load_config(None, ["model.fp8=delayed", "trainer.precision=fp32"]), 1, MOE)
    with pytest.raises(ConfigError, match=r"trainer.reference_on_host=true with model.fp8='delayed': .* stale; set "
                                          "trainer.reference_on_host=false"):
        validate(load_config(None, ["model.fp8=delayed", "trainer.reference_on_host=true"]), 1, MOE)
    if transformer_engine_error() is None:
        pytest.skip("gpu: Transformer Engine is importable here; the FP8 path is tested in test_fp8_gpu.py")
    with pytest.raises(ConfigError, match="needs Transformer Engine"):
        validate(load_config(None, ["model.fp8=delayed", "trainer.precision=bf16"]), 1, MOE)
    with pytest.raises(ConfigError, match="model.transformer_engine=true needs Transformer Engine"):
        validate(load_config(None, ["model.transformer_engine=true"]), 1, MOE)


def test_transformer_engine_auto_resolves_off_on_cpu_and_true_is_refused_here(tmp_path):
    """model.transformer_engine: auto | true | false, YAML booleans included; auto is off without CUDA and TE (this
    machine), true is refused before launch naming the key; trainer.recompute and its unit are checked too."""
    from megarl.config.validate.limits import cuda_available
    from megarl.config.validate.settings import resolved_transformer_engine, transformer_engine_error

    assert load_config(None, []).model.transformer_engine == "auto"
    (tmp_path / "te.yaml").write_text("model:\n  transformer_engine: false\n")
    assert load_config(tmp_path / "te.yaml").model.transformer_engine is False
    assert load_config(None, ["model.transformer_engine=true"]).model.transformer_engine is True
    with pytest.raises(ConfigError, match="model.transformer_engine must be one of 'auto', True, False; got 'gpu'"):
        load_config(None, ["model.transformer_engine=gpu"])
    if cuda_available() and transformer_engine_error() is None:
        pytest.skip("gpu: CUDA and Transformer Engine are here; auto resolves on (tests/gpu)")
    assert resolved_transformer_engine(load_config(None, [])) is False
    assert resolved_transformer_engine(load_config(None, ["model.transformer_engine=false"])) is False
    validate(load_config(None, []), 1, MOE)  # auto: no refusal on CPU
    with pytest.raises(ConfigError, match="model.transformer_engine=true needs Transformer Engine on a GPU"):
        validate(load_config(None, ["model.transformer_engine=true"]), 1, MOE)


def test_recompute_keys_are_checked_before_launch(capsys):
    from megarl.config.validate.limits import unread_keys

    with pytest.raises(ConfigError, match="trainer.recompute must be one of 'none', 'selective', 'full'"):
        load_config(None, ["trainer.recompute=block"])
    with pytest.raises(ConfigError, match="trainer.recompute_layers must be >= 1"):
        validate(load_config(None, ["trainer.recompute=full", "trainer.recompute_layers=0"]), 1, MOE)
    # 4 layers at PP 2: 2 a stage; units of 4 would run past a stage's last layer
    with pytest.raises(ConfigError, match=r"trainer.recompute_layers=4 must divide the layers of a model chunk under "
                                          r"trainer.recompute=full: 4 layers / \(parallel.pp=2 × parallel.vpp=1\) = 2; "
                                          r"valid: \[1, 2\]"):
        validate(load_config(None, ["trainer.recompute=full", "trainer.recompute_layers=4", "parallel.pp=2"]), 2, MOE)
    validate(load_config(None, ["trainer.recompute=full", "trainer.recompute_layers=2", "parallel.pp=2"]), 2, MOE)
    validate(load_config(None, ["trainer.recompute=selective", "algo.routing_replay=trainer"]), 1, MOE)
    assert unread_keys(load_config(None, ["trainer.recompute_layers=2"])) == [
        "trainer.recompute_layers=2 is not read with trainer.recompute=none (only with full)"]


def test_a_float16_engine_under_a_bf16_trainer_is_said_before_launch(tmp_path, capsys):
    """The overflow the note names is real: a bf16 weight the sync casts to the engine's float16 becomes inf."""
    from megarl.config.validate.limits import FLOAT16_MAX
    from megarl.config.validate.prelaunch import checked_config

    weight = torch.tensor([1.0, 2 * FLOAT16_MAX], dtype=torch.bfloat16)
    assert torch.isfinite(weight).all() and torch.isinf(weight.to(torch.float16)).tolist() == [False, True]
    run = [f"train.run_dir={tmp_path}", f"model.path={tmp_path / 'model'}", "model.make_tiny=qwen3_moe"]
    checked_config(None, [*run, "engine.dtype=float16"], 1, command="plan")
    err = capsys.readouterr().err
    assert "megarl: note: engine.dtype=float16 under trainer.precision=bf16: float16 overflows above 65504" in err
    checked_config(None, run, 1, command="plan")  # auto: the trainer's precision, nothing to say
    assert "float16" not in capsys.readouterr().err


def test_precision_and_engine_numerics_keys():
    from megarl.config.schema import resolved_engine_dtype

    assert resolved_engine_dtype(load_config(None, ["trainer.precision=bf16"])) == "bfloat16"
    assert resolved_engine_dtype(load_config(None, ["trainer.precision=fp32"])) == "float32"
    assert resolved_engine_dtype(load_config(None, ["trainer.precision=bf16", "engine.dtype=float32"])) == "float32"
    with pytest.raises(ConfigError, match="trainer.precision must be one of 'bf16', 'fp32'; got 'fp16'"):
        load_config(None, ["trainer.precision=fp16"])
    with pytest.raises(ConfigError, match="engine.dtype must be one of 'auto', 'bfloat16', 'float16', 'float32'"):
        load_config(None, ["engine.dtype=half"])
    with pytest.raises(ConfigError, match=r"engine.gpu_memory_utilization must be in \[0, 1\)"):
        validate(load_config(None, ["engine.gpu_memory_utilization=1.5"]), 1, MOE)
    validate(load_config(None, ["engine.enforce_eager=true"]), 1, MOE)
    if not torch.cuda.is_available():  # vLLM's CPU backend has no CUDA graphs to ask for
        with pytest.raises(ConfigError, match="engine.enforce_eager=false asks vLLM for CUDA graphs"):
            validate(load_config(None, ["engine.enforce_eager=false"]), 1, MOE)


def test_cli_accepts_overrides_after_options(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "megarl.cli", "train", "--config", "configs/demo.yaml", "--nproc", "2",
                           "parallel.tp=3"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2
    assert "parallel.tp × parallel.pp = 3×1 must divide the world size 2" in proc.stderr


@pytest.mark.parametrize("overlap", ["one_step", "async"])
def test_overlap_needs_disaggregated_engines_and_says_why(overlap):
    with pytest.raises(ConfigError, match=f"rollout.overlap={overlap} needs engine.placement=disaggregated"):
        validate(load_config(None, [f"rollout.overlap={overlap}"]), 1, MOE)
    with pytest.raises(ConfigError, match=r"rollout.overlap.*'none', 'one_step', 'async'"):
        load_config(None, ["rollout.overlap=always"])
    validate(load_config(None, [f"rollout.overlap={overlap}", "engine.placement=disaggregated"]), 1, MOE)


def test_async_staleness_is_read():
    from megarl.config.validate.limits import unread_keys

    def notes(*overrides):
        return unread_keys(load_config(None, ["engine.placement=disaggregated", *overrides]))

    assert any("rollout.staleness_limit=3 is not read" in n for n in notes("rollout.staleness_limit=3"))
    assert not any("staleness_limit" in n and "not read" in n
                   for n in notes("rollout.staleness_limit=3", "rollout.overlap=async"))
    # (stale data without an off-policy correction: validate/algo.py's algo_notes, test_config_algo.py)
