"""The routes a trainer rank holds (``trainer/route_store.py``), in one process: its share of a batch's samples'
routes, and the views ``TrainBatch`` takes of it (the exchange between ranks: tests/engine/test_routing_replay.py)."""

from __future__ import annotations

import numpy as np
import torch

from megarl.algo.batch import batch_routes, build_batch
from megarl.trainer.route_store import row_holders, sequence_chunk, store_of_arrays
from megarl.types import no_route


def _samples():
    rng = np.random.default_rng(0)
    prompts, responses = [[1, 2], [3], [4, 5, 6]], [[7, 8, 9], [10], [11, 12]]
    arrays = [rng.integers(0, 8, (len(p) + len(r) - 1, 4, 2)).astype(np.uint8) for p, r in zip(prompts, responses)]
    return build_batch(prompts, responses), arrays


def test_a_rank_holds_its_rows_layers_and_chunk_to_each_rows_end():
    batch, arrays = _samples()  # row lengths 4, 1, 4 of width 4
    holder = row_holders(batch.size, 2)
    assert holder == [0, 0, 1] and row_holders(3, 2, [[], []]) == [0, 0, 0]
    full = store_of_arrays(arrays, batch.row_lengths(), [0] * 3, 0, [0, 1, 2, 3], None, batch.seq_len)
    assert full.nbytes() == sum(a.nbytes for a in arrays)  # no padding held
    mine = store_of_arrays(arrays, batch.row_lengths(), holder, 1, [1, 3], sequence_chunk(batch.seq_len, 2, 1),
                           batch.seq_len)
    assert sorted(mine.held) == [2] and mine.nbytes() == 2 * 2 * 2  # row 2, positions 2-3, columns 1 and 3
    assert torch.equal(mine.held[2], torch.from_numpy(arrays[2][2:4][:, [1, 3]]))


def test_the_views_of_a_batch_fetch_what_the_whole_tensor_holds():
    batch, arrays = _samples()
    dense = batch_routes(arrays, batch.seq_len)
    batch.routes = store_of_arrays(arrays, batch.row_lengths(), [0] * 3, 0, [0, 1, 2, 3], None, batch.seq_len)
    picked = batch.select(torch.tensor([2, 0])).pad_rows(1).pad_columns(2)
    got = picked.routes.fetch()
    assert got.shape == (3, 6, 4, 2)
    assert torch.equal(got[:2, :4], dense[[2, 0]]) and (got[2] == no_route(torch.uint8)).all()
    assert (got[:, 4:] == no_route(torch.uint8)).all()
    assert torch.equal(batch.routes.dense(), dense)
    assert store_of_arrays([None] * 3, [4] * 3, [0] * 3, 0, [0], None, 4) is None  # no sample captured routes


def test_routes_cross_the_wire_as_bytes_whatever_their_dtype():
    """NCCL has no int16 (the ids of 255 experts or more): routes are sent and received as their bytes, a receive
    writing the typed buffer it views."""
    from megarl.trainer.route_store import as_bytes

    for dtype, top in ((torch.uint8, 255), (torch.int16, 300)):
        sent = torch.randint(-1, top, (3, 5, 4, 2)).to(dtype)
        wire = as_bytes(sent)
        assert wire.dtype == torch.uint8 and wire.numel() == sent.numel() * sent.element_size()
        buf = torch.empty_like(sent)
        as_bytes(buf).copy_(wire)  # what a receive into ``as_bytes(buf)`` does
        assert torch.equal(buf, sent)
