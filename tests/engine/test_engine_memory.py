"""Sleep mode and trainer offload around the loop's phases (``megarl/engines/memory.py``).

On CPU vLLM has no sleep mode and the trainer's state is in host memory: the calls are skipped
with one log line each and the run's results are unchanged. The real path is ``gpu``-marked.
"""

from __future__ import annotations

import pytest

from helpers.scripts import run_script
from megarl.config import ConfigError, load_config, validate


def test_sleep_level_is_checked_before_launch():
    with pytest.raises(ConfigError, match="engine.sleep_level must be one of 0, 1, 2; got 3"):
        validate(load_config(None, ["engine.sleep_level=3"]), 1)
    with pytest.raises(ConfigError, match="sync.check_every must be >= 0"):
        validate(load_config(None, ["sync.check_every=-1"]), 1)
    assert load_config(None, ["trainer.offload_during_rollout=true"]).trainer.offload_during_rollout


def test_an_engine_sized_in_bytes_starts_beside_a_trainer_holding_most_of_the_gpu():
    """vLLM 0.32's start check (``request_memory``, run here as vLLM runs it on a GPU's figures) wants
    ``gpu_memory_utilization`` × the GPU free even when ``kv_cache_memory_bytes`` sizes the cache: with its default
    a colocated engine's start or restart fails once the trainer holds more than 8%; with ``kv_cache_args`` it
    passes while the KV cache fits, and still fails where it does not."""
    from vllm.config import CacheConfig
    from vllm.utils.mem_utils import MemorySnapshot
    from vllm.v1.worker.utils import request_memory

    from megarl.engines.vllm_engine import kv_cache_args

    gib = 2**30

    def start(free_gib: float, **args) -> int:
        snapshot = MemorySnapshot(free_memory=int(free_gib * gib), total_memory=80 * gib, device="cpu",
                                  auto_measure=False)
        return request_memory(snapshot, CacheConfig(**args))

    ours = kv_cache_args(12.0, gpu=True, gpu_total_bytes=80 * gib)
    assert ours["kv_cache_memory_bytes"] == 12 * gib and ours["gpu_memory_utilization"] == 0.15
    with pytest.raises(ValueError, match="less than desired GPU memory utilization"):
        start(40.0, kv_cache_memory_bytes=12 * gib)  # the trainer holds half the GPU: vLLM's default share fails
    assert start(40.0, **ours) == 12 * gib  # the KV cache's own share: starts
    with pytest.raises(ValueError, match="less than desired GPU memory utilization"):
        start(10.0, **ours)  # 12 GiB of KV cache cannot fit in 10 GiB free: still refused
    assert kv_cache_args(12.0, gpu=True, gpu_memory_utilization=0.5) == {"gpu_memory_utilization": 0.5}
    assert kv_cache_args(12.0, gpu=False) == {}  # CPU: VLLM_CPU_KVCACHE_SPACE sizes it


def test_cpu_skips_sleep_and_offload_with_one_line_each():
    from types import SimpleNamespace

    from megarl.engines.memory import EngineSleep, Handover

    lines = []
    sleeper = EngineSleep(object(), 2, log=lines.append)  # what colocated engines hold (engine.sleep_level)
    engines = SimpleNamespace(sleep=sleeper.sleep, wake=sleeper.wake)
    h = Handover(engines, [object(), object()], offload=True, log=lines.append)  # (a policy and a critic)
    for _ in range(3):
        h.to_train()
        h.to_generate()
    assert len(lines) == 2
    assert "engine.sleep_level=2" in lines[0] and "skipped" in lines[0]
    assert "trainer.offload_during_rollout" in lines[1] and "skipped" in lines[1]
    assert not sleeper.asleep and not any(o.offloaded for o in h.offloads)



def test_a_level_2_sleep_loads_without_a_backup_copy():
    """Level 2 drops the weights, so the loads after a wake-up have nothing to back up: 'copy' becomes 'resync'
    (said once) where vLLM sleeps (GPUs: ``supported``); level 1, and CPU where nothing sleeps, keep 'copy'."""
    from megarl.engines.memory import EngineSleep

    lines = []
    cpu = EngineSleep(object(), 2, log=lines.append)
    assert not cpu.supported and cpu.rollback("copy") == "copy"
    for level, requested, applied in ((2, "copy", "resync"), (2, "resync", "resync"), (1, "copy", "copy")):
        sleeper = EngineSleep(object(), level, log=lines.append)
        sleeper.supported = True  # (as on a GPU with vLLM's sleep mode)
        before = len(lines)
        assert sleeper.rollback(requested) == applied
        said = lines[before:]
        assert (len(said) == 1 and "sync.rollback=copy has none to back up" in said[0]) == (applied != requested)
@pytest.mark.gpu
@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_and_restores_engine_memory_with_equal_outputs(tmp_path, level):
    r = run_script(["tests/workers/memory_checks.py", str(tmp_path), str(level)])
    assert r["freed_bytes"] > 0.5 * r["weights_bytes"]  # weights (and KV) left the device while asleep
    assert r["same_tokens"] and r["max_logprob_diff"] <= 1e-5  # and came back (level 2: from the sync)


@pytest.mark.gpu
def test_trainer_offload_moves_state_to_host_and_back_with_equal_results(tmp_path):
    r = run_script(["tests/workers/memory_checks.py", str(tmp_path), "offload"])
    assert r["freed_bytes"] > 0 and r["losses_equal"]
    assert r["reference_freed"] > 0 and r["reference_equal"]  # a frozen KL reference's weights, and back


def test_the_offload_moves_the_optimizers_own_tensors_never_the_models_parameters():
    """An fp32 run without the distributed optimizer steps the model's own parameters (megatron's FP32Optimizer):
    the offload moves Adam's state only (a parameter moved across devices would lose DDP's gradient hook); where
    the optimizer steps main copies, those go too. megatron's real optimizer classes, on CPU (in a process of its
    own: megarl's CPU adapter patches torch.cuda)."""
    import subprocess
    import sys

    from helpers.scripts import ROOT, worker_env

    proc = subprocess.run([sys.executable, "-c", OFFLOADABLE], cwd=ROOT, env=worker_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "ok"


OFFLOADABLE = """
import torch
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer.optimizer import ChainedOptimizer, FP32Optimizer

from megarl.compat.megatron import activate_cpu
from megarl.engines.memory import offloadable

activate_cpu()
model = torch.nn.Linear(4, 3)
mains = [p.detach().clone().requires_grad_() for p in model.parameters()]  # (a bf16 run's fp32 copies)
own = FP32Optimizer(torch.optim.Adam(model.parameters()), OptimizerConfig(lr=1e-3), lambda o: None)
copies = FP32Optimizer(torch.optim.Adam(mains), OptimizerConfig(lr=1e-3), lambda o: None)
for p in [*model.parameters(), *mains]:
    p.grad = torch.ones_like(p)
own.optimizer.step()
copies.optimizer.step()
cpu = torch.device("cpu")
params, state = offloadable(own, [model], cpu)
assert params == [] and {k for _, k in state} == {"exp_avg", "exp_avg_sq", "step"} and len(state) == 6, state
params, state = offloadable(ChainedOptimizer([own, copies]), [model], cpu)
assert [id(p) for p in params] == [id(p) for p in mains] and len(state) == 12
assert offloadable(own, [model], torch.device("meta")) == ([], [])  # (only what is on the trainer's device)
print("ok")
"""
