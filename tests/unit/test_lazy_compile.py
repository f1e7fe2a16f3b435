"""megatron-core imported without torch's compiler (``compat/lazy_compile``): its ``torch.compile``-decorated
kernels compile on their first call with the arguments megatron gave, and nothing else sees a changed
``torch.compile``."""

from __future__ import annotations

import subprocess
import sys

import torch

from helpers.scripts import ROOT, worker_env
from megarl.compat.lazy_compile import deferring


def test_a_deferred_function_compiles_once_on_its_first_call_with_the_given_arguments():
    calls = []

    def compile_(fn, **kwargs):
        calls.append((fn, kwargs))
        return lambda *a, **k: ("compiled", fn(*a, **k))

    def square(x):
        return x * x

    deferred = deferring(compile_)
    run = deferred(square, dynamic=True)
    assert calls == [] and run.__name__ == "square"  # decorating compiles nothing
    assert run(3) == ("compiled", 9) and run(4) == ("compiled", 16)
    assert calls == [(square, {"dynamic": True})]  # compiled once, as asked
    run2 = deferred(mode="max-autotune")(square)  # @torch.compile(...) form
    assert run2(2) == ("compiled", 4) and calls[-1] == (square, {"mode": "max-autotune"})
    module = torch.nn.Linear(2, 2)
    deferred(module)
    assert calls[-1] == (module, {})  # a module is compiled at once, as torch.compile does


def test_importing_megatron_loads_no_compiler_and_leaves_torch_compile_alone():
    code = ("import sys, torch, megarl; real = torch.compile\n"
            "import megarl.trainer.model\n"
            "from megatron.core import jit\n"
            "from megatron.core.transformer.torch_norm import L2Norm\n"
            "assert 'torch._dynamo' not in sys.modules, 'the compiler was imported'\n"
            "assert torch.compile is real and jit.jit_fuser is not real\n"
            "assert L2Norm._norm.__wrapped_uncompiled__.__qualname__ == 'L2Norm._norm'  # compiled on its first call\n"
            "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=worker_env())
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
