"""With GPUs, the default group takes host tensors too (``bootstrap.process_group_backend``: gloo beside NCCL):
every step's ``any_rank`` and the routing statistics all-reduce host tensors, which a group of NCCL alone refuses
(the worker shows both). Marker ``gpu``: CUDA torch with NCCL."""

import pytest

from helpers.scripts import run_script

pytestmark = pytest.mark.gpu
TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]


def test_host_tensor_collectives_run_over_the_default_group_on_gpus():
    out = run_script([*TORCHRUN, "tests/workers/host_collectives_checks.py"], timeout=300)
    assert out["cuda"] and out["world"] == 2 and "gloo" in out["backend"] and "nccl" in out["backend"]
    assert "error" not in out, out
    assert out["any_rank"] == [True, False, True] and out["host_sum"] == [1.0, 2.0]
    assert out.get("cuda_sum", 2.0) == 2.0  # (run where each rank has a GPU of its own)
    alone = run_script([*TORCHRUN, "tests/workers/host_collectives_checks.py", "nccl"], timeout=300)
    assert "No backend type associated with device type cpu" in alone["error"]  # what the group was before
