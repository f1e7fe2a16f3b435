"""Generator states made from a seed without touching the process's own generators."""

from __future__ import annotations

import torch


def seeded_rng_state(seed: int) -> torch.Tensor:
    """The state of a generator seeded with ``seed`` on the device kernels draw on: this process's CUDA device where
    there is one (as megatron's RNG tracker makes its streams), else the CPU; the process's own generators left as
    they were."""
    seed %= 2**63
    if not torch.cuda.is_available():
        return torch.Generator().manual_seed(seed).get_state()
    before = torch.cuda.get_rng_state()
    torch.cuda.manual_seed(seed)
    state = torch.cuda.get_rng_state()
    torch.cuda.set_rng_state(before)
    return state
