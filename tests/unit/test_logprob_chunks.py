"""``optim.logprob_chunk`` bounds the logits a micro-batch holds at once by positions, whatever its rows: a padded
micro-batch of ``b`` rows computes ``chunk // b`` columns at a time (what ``megarl plan`` sizes), with the values
and gradients of the full logits."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from megarl.trainer.logprobs import chunked_token_logprobs, token_logprobs


class LogitsSizes(TorchFunctionMode):
    """The positions of every logits tensor a matmul with the output weight makes."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.positions = vocab, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.matmul and out.shape[-1] == self.vocab:
            self.positions.append(out.numel() // self.vocab)
        return out


@pytest.mark.parametrize("rows, chunk", [(8, 32), (1, 32), (8, 4), (3, 1024)])
def test_a_chunk_holds_at_most_its_positions_and_changes_no_value(rows, chunk):
    torch.manual_seed(0)
    seq, hidden_size, vocab = 40, 16, 50
    hidden = torch.randn(rows, seq, hidden_size, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, vocab, (rows, seq))
    sizes = LogitsSizes(vocab)
    with sizes:
        got = chunked_token_logprobs(hidden, weight, labels, chunk=chunk)
        got.sum().backward()
    # the backward recomputes each chunk's logits: every one of them is bounded too
    assert sizes.positions and max(sizes.positions) <= max(chunk, rows) and sum(sizes.positions) >= rows * seq
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    want = token_logprobs(torch.matmul(hidden, weight.t()), labels)
    want.sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grads[0], hidden.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grads[1], weight.grad, rtol=1e-10, atol=1e-12)
