"""RoPE of packed rows from one cos/sin table per micro-batch (``compat.megatron.cache_packed_rope``) gives
megatron-core's own ``thd`` RoPE (``rope_utils.apply_rotary_pos_emb``) bit for bit, forward and backward."""

import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.transformer import attention

from megarl.compat.megatron import cache_packed_rope


class GroupOfOne:
    """Context parallelism of one process (what megatron's ``thd`` RoPE asks its group)."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


class Config:
    apply_rope_fusion = False
    multi_latent_attention = False

    def __init__(self, interleaved: bool) -> None:
        self.rotary_interleaved = interleaved


# (cu_seqlens, positions in the rotary table): rows of several lengths with a padding segment; rows of one
# length; one row; a table with one entry per position of the pack (megatron's other mapping)
PACKS = [([0, 4, 5, 9, 12], 4), ([0, 3, 6, 9], 3), ([0, 7], 7), ([0, 2, 9], 9)]


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("cu,table", PACKS)
@pytest.mark.parametrize("mscale", [1.0, 1.3])
def test_packed_rope_equals_megatrons_thd_rope(cu, table, interleaved, mscale):
    cache_packed_rope()
    cache_packed_rope()  # idempotent: one wrapper
    assert attention.apply_rotary_pos_emb is not rope_utils.apply_rotary_pos_emb
    g = torch.Generator().manual_seed(len(cu) + table)
    cu = torch.tensor(cu, dtype=torch.int32)
    freqs = torch.randn(table, 1, 1, 8, generator=g)
    config, group = Config(interleaved), GroupOfOne()
    for heads in (4, 2):  # q, then k of fewer heads: the same table
        t = torch.randn(int(cu[-1]), heads, 8, generator=g, requires_grad=True)
        theirs = rope_utils.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=cu, mscale=mscale, cp_group=group)
        ours = attention.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=cu, mscale=mscale, cp_group=group)
        assert ours.shape == theirs.shape and torch.equal(ours, theirs)
        weights = torch.randn(theirs.shape, generator=g)
        (grad_theirs,) = torch.autograd.grad((theirs * weights).sum(), t)
        (grad_ours,) = torch.autograd.grad((ours * weights).sum(), t)
        assert torch.equal(grad_ours, grad_theirs)


def test_a_new_pack_gets_its_own_table():
    """The table is kept for one pack (its ``cu_seqlens`` tensor): the next pack's rows restart where theirs do."""
    cache_packed_rope()
    freqs, config, group = torch.randn(8, 1, 1, 4), Config(False), GroupOfOne()  # (8: positions restart per row)
    t = torch.randn(6, 1, 4)
    for cu in ([0, 6], [0, 3, 6], [0, 1, 6]):
        cu = torch.tensor(cu, dtype=torch.int32)
        theirs = rope_utils.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=cu, cp_group=group)
        assert torch.equal(attention.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=cu, cp_group=group), theirs)


class GroupOf:
    """Rank ``rank`` of a context-parallel group of ``size`` (all megatron's ``thd`` RoPE asks of it)."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@pytest.mark.parametrize("cp,rank", [(2, 0), (2, 1), (4, 3)])
@pytest.mark.parametrize("cu,table", [([0, 16, 24, 40], 16), ([0, 16], 16)])  # (one row: a table per position)
def test_packed_rope_of_a_context_parallel_rank_equals_megatrons(cu, table, cp, rank):
    """Under context parallelism a rank holds chunks ``rank`` and 2·CP−1−``rank`` of every segment: the cached table
    gives them the positions megatron's ``thd`` RoPE gives them (``_get_thd_freqs_on_this_cp_rank``)."""
    cache_packed_rope()
    g = torch.Generator().manual_seed(cp + rank + table)
    cu = torch.tensor(cu, dtype=torch.int32)
    freqs, config, group = torch.randn(table, 1, 1, 8, generator=g), Config(False), GroupOf(cp, rank)
    t = torch.randn(int(cu[-1]) // cp, 2, 8, generator=g)
    theirs = rope_utils.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=cu, cp_group=group)
    assert torch.equal(attention.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=cu, cp_group=group), theirs)
