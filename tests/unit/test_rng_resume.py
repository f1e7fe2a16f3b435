"""A run checkpoint's RNG states put back (``checkpoint/session_state.set_rng_state``): the dropout streams of
megatron's tracker where they are of this device's kind, and from ``train.seed`` with one warning where they were
written on the other (a GPU's Philox states, 16 bytes, into the CPU generators a CPU run has: it used to fail at the
first fork). In a subprocess: megarl's CPU adapter patches torch.cuda for the whole interpreter."""

import subprocess
import sys

from helpers.scripts import ROOT, worker_env

CODE = r"""
import random, warnings, torch
from megarl.compat.megatron import activate_cpu
from megarl.checkpoint.session_state import rng_state, set_rng_state
from megatron.core.tensor_parallel import get_cuda_rng_tracker
activate_cpu()
tracker = get_cuda_rng_tracker()
tracker.add("model-parallel-rng", 1234)
saved = rng_state()
with tracker.fork():
    want = torch.rand(4)
with tracker.fork():
    torch.rand(4)  # the stream moves on
with warnings.catch_warnings(record=True) as same:
    warnings.simplefilter("always")
    set_rng_state(saved)
with tracker.fork():
    assert torch.equal(torch.rand(4), want), "same-kind stream not restored"
gpu = dict(saved, tracker={"model-parallel-rng": torch.zeros(16, dtype=torch.uint8)})  # a CUDA Philox state
with warnings.catch_warnings(record=True) as other:
    warnings.simplefilter("always")
    set_rng_state(gpu)
with tracker.fork():
    torch.rand(4)  # forks on its own stream: no size error
assert not [w for w in same if "RNG" in str(w.message)], same
print([str(w.message) for w in other if "another kind of device" in str(w.message)])
"""


def test_dropout_streams_written_on_another_device_kind_restart_from_the_seed_with_a_warning():
    proc = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, cwd=ROOT, env=worker_env(),
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = proc.stdout.strip().splitlines()[-1]
    assert "written on another kind of device" in said and "start again from train.seed" in said
