"""Engine-side mistakes a new user makes: each is refused before launch
(exit 2, naming the key, the value and what would be valid), or contained instead of spinning or crashing.

Slow: the real vLLM reproduction of the silent spin (a failed generation's requests left holding the engine's
slots) and of the lost default process group after a restart (tests/workers/engine_stall_checks.py, ~1 min here), and a
real ``megarl train`` whose engine stalls (the engine_stall test hook), contained by the keeper (~30 s here)."""

from __future__ import annotations

import pytest

from helpers.scripts import ROOT, run_script
from megarl.cli import main as cli_main
from megarl.compat.vllm import cpu_attention_head_sizes
from megarl.config import ConfigError, load_config, validate
from megarl.config.validate.limits import check_engine_head_size, check_local_engine_memory
from megarl.config.validate.limits import cuda_available as _cuda
from megarl.models.tiny import TinyShape, hf_config
from megarl.rollout.controller import STALL_STEPS, ControllerConfig, EngineStalled, PromptItem, RolloutController
from megarl.rollout.sim.engines import SimulatedEngine, StepTimeModel
from megarl.types import StepReport


def tiny_args(tmp_path) -> list[str]:
    """A run on a tiny model that is never created (its config is known from its shape): nothing launches."""
    return [f"model.path={tmp_path}/model", "model.make_tiny=qwen2", f"train.run_dir={tmp_path}/run"]


# ---- max_model_len against the prompt and the response ---------------------------------------------

def test_max_model_len_below_prompt_plus_response_names_the_three_values():
    cfg = load_config(None, ["engine.max_model_len=24", "data.max_prompt_tokens=32", "rollout.max_new_tokens=12"])
    with pytest.raises(ConfigError, match=r"engine.max_model_len=24 < data.max_prompt_tokens \(32\) \+ "
                                          r"rollout.max_new_tokens \(12\) = 44"):
        validate(cfg, 1)
    cfg = load_config(None, ["engine.max_model_len=12", "rollout.max_new_tokens=12"])  # max_prompt_tokens=0
    with pytest.raises(ConfigError, match=r"engine.max_model_len=12 must exceed rollout.max_new_tokens \(12\)"):
        validate(cfg, 1)
    validate(load_config(None, ["engine.max_model_len=44", "data.max_prompt_tokens=32",
                                "rollout.max_new_tokens=12"]), 1)


def test_an_engine_error_is_logged_as_rank_0_without_a_process_group(capsys):
    """The fault policy's engine-error path (count, log, stop past ``engine.max_restarts``) in one process with no
    torch.distributed group (the keeper called ``dist.get_rank()`` there once and crashed with 'Default process
    group has not been initialized')."""
    import torch.distributed as dist

    from megarl.distributed.collectives import rank_and_world
    from megarl.faults import Action, FaultPolicy
    from megarl.logging.console import configure

    configure()  # as every entry point does (its handlers write to the sys.stderr of the moment: capsys's here)
    assert not dist.is_initialized()
    policy = FaultPolicy(max_restarts=3, max_bad_steps=0, max_failed_reward_steps=0, rank=rank_and_world()[0])
    policy.failing = 3
    decision = policy.engine_error(ValueError("maximum context length is 8 tokens"), "step 1: engine error mid-phase",
                                   "0 live groups restored")
    assert decision.action is Action.STOP and "engine failed 4 times in a row" in decision.reason
    assert "rank 0 step 1: engine error mid-phase (ValueError: maximum context length is 8 tokens)" in \
        capsys.readouterr().err  # (a fault: a warning)
    assert policy.restarts == 1


# ---- ranges, --nproc, the KV cache against this machine's memory ------------------------------------

@pytest.mark.parametrize("override, message", [
    ("optim.lr=-1", r"optim.lr must be >= 0, got -1.0"),
    ("optim.lr=.nan", r"optim.lr must be >= 0, got nan"),
    ("optim.weight_decay=-0.1", r"optim.weight_decay must be >= 0"),
    ("optim.adam_beta2=1.0", r"optim.adam_beta2 must be in \[0, 1\), got 1.0"),
    ("optim.micro_batch_size=0", r"optim.micro_batch_size must be >= 1, got 0"),
    ("warmup.lr=-1e-3", r"warmup.lr must be >= 0"),
    ("train.steps=-1", r"train.steps must be >= 0, got -1"),
    ("rollout.top_p=0", r"rollout.top_p must be in \(0, 1\], got 0.0"),
    ("engine.kv_cache_gib=0", r"engine.kv_cache_gib must be > 0, got 0.0"),
])
def test_out_of_range_values_are_config_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        validate(load_config(None, [override]), 1)


def test_cli_refuses_bad_values_and_nproc_before_launch(tmp_path, capsys):
    for args, message in [(["optim.lr=-1"], "optim.lr must be >= 0, got -1.0"),
                          (["--nproc", "0", "parallel.tp=2"], "--nproc 0: the processes to launch on this machine "
                                                               "must be >= 1"),
                          (["--nproc", "-2"], "--nproc -2"),
                          (["engine.max_model_len=24", "data.max_prompt_tokens=32", "rollout.max_new_tokens=12"],
                           "engine.max_model_len=24 < data.max_prompt_tokens (32)"),
                          *([(["engine.kv_cache_gib=100000"], "engine.kv_cache_gib=100000 (100000 GiB asked of "
                                                              "vLLM's CPU engine) is more than the ")]
                            if not _cuda() else [])]:
        assert cli_main(["train", *tiny_args(tmp_path), *args]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists() and not (tmp_path / "model").exists()


@pytest.mark.skipif(_cuda(), reason="gpu: vLLM sizes a GPU engine's KV cache from GPU memory")
def test_kv_cache_larger_than_this_machines_memory_is_a_config_error():
    import psutil

    cfg = load_config(None, ["engine.kv_cache_gib=100000"])
    with pytest.raises(ConfigError) as err:
        check_local_engine_memory(cfg)
    text = str(err.value)
    assert text.startswith("engine.kv_cache_gib=100000 (100000 GiB asked of vLLM's CPU engine) is more than the ")
    available = float(text.split("more than the ")[1].split(" GiB")[0])
    assert abs(available - psutil.virtual_memory().available / 2**30) < 2
    suggested = float(text.split("set engine.kv_cache_gib=")[1].split(" ")[0])
    assert 0 < suggested <= available
    check_local_engine_memory(load_config(None, [f"engine.kv_cache_gib={suggested}"]))
    check_local_engine_memory(load_config(None, ["engine.kv_cache_gib=0.25"]))  # asks vLLM for 1 GiB
    many = int(available) + 2  # colocated: one engine (1 GiB at least) per process launched here
    with pytest.raises(ConfigError,
                       match=rf"engine.kv_cache_gib=0.25 \({many} engine processes × 1 GiB = {many} GiB\)"):
        check_local_engine_memory(load_config(None, ["engine.kv_cache_gib=0.25"]), many)


# ---- a head size vLLM's CPU engine cannot run; a phase that cannot progress -------------------------

HD16 = hf_config(TinyShape(family="qwen2", hidden_size=64, num_layers=2), eos_id=1, pad_id=0)  # 4 heads: 16


@pytest.mark.skipif(_cuda(), reason="gpu: the head sizes checked are vLLM's CPU attention's")
def test_head_size_the_cpu_engine_cannot_run_is_refused_by_validate_not_by_plan(tmp_path, capsys):
    import json

    sizes = list(cpu_attention_head_sizes())  # = vLLM's CPUAttentionBackend.get_supported_head_sizes() (slow test)
    assert 16 not in sizes and 32 in sizes
    cfg = load_config(None, [f"model.path={tmp_path}/hd16"])
    with pytest.raises(ConfigError) as err:
        validate(cfg, 1, HD16)
    assert str(err.value) == (
        f"{tmp_path}/hd16/config.json: attention head size 16 (hidden_size 64 / num_attention_heads 4 = 16) cannot "
        f"run on this machine's vLLM engine: the installed vLLM's CPU attention supports head sizes {sizes}; with "
        "hidden_size 64, num_attention_heads in [1, 2] would give a supported size")
    (tmp_path / "hd16").mkdir()
    (tmp_path / "hd16" / "config.json").write_text(json.dumps(HD16))
    from megarl.launch.plan import main as plan_main

    # megarl plan sizes a GPU cluster, typically from a login node: this machine's CPU attention is not the GPUs'
    # (a login node with vLLM's GPU build installed refused head sizes only the CPU backend lacks)
    assert plan_main(["--model", str(tmp_path / "hd16"), "--nodes", "1", "--gpus-per-node", "1"]) == 0
    assert "attention head size" not in capsys.readouterr().err
    validate(cfg, 1, hf_config(TinyShape(family="qwen2", hidden_size=64, num_heads=2, num_kv_heads=2,
                                         num_layers=2), eos_id=1, pad_id=0))


@pytest.mark.skipif(_cuda(), reason="gpu: the head sizes checked are vLLM's CPU attention's")
def test_make_tiny_model_documented_examples_make_models_the_cpu_engine_runs(tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_tiny_model", ROOT / "tools" / "make_tiny_model.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    examples = [line.split("make_tiny_model.py", 1)[1].split() for line in tool.__doc__.splitlines()
                if "python tools/make_tiny_model.py" in line]
    assert len(examples) == 2
    for argv in examples:
        _, shape, _ = tool.parse(argv)
        check_engine_head_size(hf_config(shape, eos_id=1, pad_id=0), " ".join(argv))
    assert tool.main([str(tmp_path / "hd16"), "--family", "qwen2", "--hidden-size", "64", "--layers", "2"]) == 2
    assert "attention head size 16" in capsys.readouterr().err and not (tmp_path / "hd16").exists()


class HeldSlotsEngine(SimulatedEngine):
    """vLLM's state after a generation raised and left its batch behind: every step schedules nothing."""

    def step(self) -> StepReport:
        return StepReport([], 1e-4, self.num_active())


class SlowPrefillEngine(SimulatedEngine):
    """A working engine whose first token of each request comes after many token-less steps (long prefills)."""

    def __init__(self, *args, quiet_steps: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.quiet_steps, self.steps = quiet_steps, 0

    def step(self) -> StepReport:
        self.steps += 1
        if self.steps % (self.quiet_steps + 1):
            return StepReport([], 1e-4, self.num_active())
        return super().step()


def controller(engine, mode="partial"):
    cfg = ControllerConfig(mode=mode, group_size=2, update_groups=2, rollout_groups=4, max_tokens=8)
    counter = iter(range(10**6))
    return RolloutController(cfg, [engine], lambda: PromptItem(next(counter), [1, 2, 3], key=0))


@pytest.mark.parametrize("mode", ["sync", "on_policy", "partial"])
def test_a_phase_whose_engine_makes_no_progress_ends_with_an_engine_error(mode):
    engine = HeldSlotsEngine(8, lambda key: 4, StepTimeModel("constant", 1.0))
    calls = 0
    step = engine.step

    def counted():
        nonlocal calls
        calls += 1
        return step()

    engine.step = counted
    with pytest.raises(EngineStalled, match=f"engine 0 made no progress: {STALL_STEPS} steps in a row produced no "
                                            r"token while \d+ of its requests were outstanding"):
        controller(engine, mode).run_phase(0)
    assert calls == STALL_STEPS
    ok = SlowPrefillEngine(8, lambda key: 4, StepTimeModel("constant", 1.0), quiet_steps=STALL_STEPS - 1)
    groups, _ = controller(ok, mode).run_phase(0)
    assert len(groups) >= 2


@pytest.mark.slow
def test_real_vllm_failed_generation_leaves_no_request_and_restart_keeps_the_default_group(tmp_path):
    r = run_script(["tests/workers/engine_stall_checks.py", str(tmp_path)], env={"OMP_NUM_THREADS": "1"}, timeout=900)
    assert r["generate_error"].startswith("RuntimeError: Unsupported CPU attention configuration: head_dim=16")
    assert r["held_after_failed_generate"] == 0
    assert r["phase_error"].startswith("RuntimeError: Unsupported CPU attention configuration")  # not a spin
    assert r["rank_after_restart"] == 0 and r["restart_generates"] == 4
    assert r["long_prompt_error"] == "VLLMValidationError" and r["rank_after_second_restart"] == 0  # group kept
    assert r["head_sizes_read"] == r["head_sizes_asked"]  # the config check's reading = vLLM's own answer


@pytest.mark.slow
def test_a_stalled_engine_in_a_real_run_is_contained_by_the_keeper(tmp_path):
    """``megarl train`` with the engine_stall test hook (vllm_engine.py: from the 3rd engine step of RL step 2 every
    step schedules nothing, as vLLM did with its slots held): the phase ends with EngineStalled, the keeper
    restarts the engine and reruns the phase, and the run completes (it spun silently before)."""
    import json
    import os
    import re
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "megarl.cli", "train", "--config", "configs/demo.yaml", "warmup.steps=0",
           "train.steps=3", "train.time_limit_s=0", f"train.run_dir={tmp_path / 'run'}",
           f"model.path={tmp_path / 'model'}", "model.make_tiny=qwen2", "data.eval_size=2", "data.max_digits=2",
           "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=8", "engine.slots=4",
           "engine.kv_cache_gib=0.25", "engine.max_model_len=64", "optim.micro_batch_size=4"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "MEGARL_TEST_FAULT": "engine_stall@2"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert re.search(r"rank 0 step 2: engine error mid-phase \(megarl\.[\w.]+\.EngineStalled: engine 0 "
                     rf"made no progress: {STALL_STEPS} steps in a row produced no token while \d+ of its requests "
                     r"were outstanding\); .*restart 1/3", out), out[-6000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in records if "faults/engine_restarts" in r}
    assert steps[1]["faults/engine_restarts"] == 0 and steps[3]["faults/engine_restarts"] == 1
