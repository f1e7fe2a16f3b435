"""Context parallelism on GPUs: Transformer Engine's attention does CP itself (``parallel.cp_comm_type``, 'p2p'),
fed the packed rows cut in 2·CP chunks as on CPU (``algo.packing.split_for_context_parallel``, the padded
``cu_seqlens``). CP 2 on two GPUs against one GPU, bf16 (tests/workers/context_parallel_checks.py; the CPU path's
fp32 exactness is tests/distributed/test_context_parallel.py). Needs two GPUs and Transformer Engine."""

import pytest
import torch

from helpers.scripts import run_script
from megarl.models.tiny import TinyShape, make_tiny_model

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="context parallelism 2 needs two GPUs")
@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_transformer_engine_cp2_tracks_one_gpu(tmp_path, family):
    pytest.importorskip("transformer_engine")
    model = make_tiny_model(tmp_path / "model", TinyShape(family=family), seed=3)
    got = {}
    for layout, launcher in (("single", []), ("cp2", ["-m", "torch.distributed.run", "--standalone",
                                                      "--nproc-per-node=2"])):
        out = tmp_path / f"{layout}.pt"
        run_script([*launcher, "tests/workers/context_parallel_checks.py", layout, str(model), str(out), "lm",
                    "full", "te", "bf16"])
        got[layout] = torch.load(out)
    ref, cp = got["single"], got["cp2"]
    mask = ref["mask"]
    assert float(((cp["logprobs"] - ref["logprobs"]).abs() * mask).sum() / mask.sum()) < 0.01  # bf16 rounding
    for want, have in zip(ref["steps"], cp["steps"]):
        for key in ("loss", "grad_norm"):
            assert have[key] == pytest.approx(want[key], rel=0.02), key
