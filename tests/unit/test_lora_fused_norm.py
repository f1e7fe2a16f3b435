"""``trainer.lora.normed_input``: an adapter on a fused norm+linear layer (Transformer Engine's ``LayerNormLinear``,
the layer's input norm inside it) takes the input the layer's weight multiplies, ``x`` through that norm. Checked
here against torch's own RMSNorm and LayerNorm (what megatron's local spec runs) with the same parameters; the
layer itself exists on GPUs only, where tests/gpu/test_lora_te_gpu.py checks the whole adapted model against the
local layers. The holder below carries the parameters under the names ``LayerNormLinear`` keeps them."""

import pytest
import torch

from megarl.trainer.lora import normed_input

H = 16


class FusedNormParams(torch.nn.Module):
    """The norm's parameters and settings as Transformer Engine's LayerNormLinear holds them."""

    def __init__(self, normalization: str, zero_centered: bool, bias: bool) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.normalization, self.zero_centered_gamma, self.eps = normalization, zero_centered, 1e-5
        self.layer_norm_weight = torch.nn.Parameter(torch.randn(H, generator=g) * 0.1 + (0 if zero_centered else 1))
        self.layer_norm_bias = torch.nn.Parameter(torch.randn(H, generator=g) * 0.1) if bias else None


@pytest.mark.parametrize("normalization,zero_centered,bias", [("RMSNorm", False, False), ("RMSNorm", True, False),
                                                              ("LayerNorm", False, True), ("LayerNorm", True, True)])
def test_the_adapter_input_of_a_fused_norm_layer_is_the_normed_input(normalization, zero_centered, bias):
    layer = FusedNormParams(normalization, zero_centered, bias)
    ref = (torch.nn.RMSNorm if normalization == "RMSNorm" else torch.nn.LayerNorm)(H, eps=layer.eps)
    with torch.no_grad():
        ref.weight.copy_(layer.layer_norm_weight + (1 if zero_centered else 0))
        if bias:
            ref.bias.copy_(layer.layer_norm_bias)
    x = torch.randn(5, 2, H, generator=torch.Generator().manual_seed(2)) * 3 + 1
    torch.testing.assert_close(normed_input(layer, x), ref(x), rtol=1e-6, atol=1e-6)
    # bf16 activations: normed in bf16 (torch accumulates in fp32, as the layer does), handed back in bf16
    got = normed_input(layer, x.bfloat16())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref(x.bfloat16().float()), rtol=1e-2, atol=1e-2)
    # a gradient reaches x through the norm (the adapters of earlier layers train through it)
    x.requires_grad_()
    normed_input(layer, x).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_a_plain_linear_takes_its_input_as_it_is_and_an_unknown_norm_is_refused():
    x = torch.randn(3, 1, H)
    assert normed_input(torch.nn.Linear(H, H), x) is x
    with pytest.raises(ValueError, match="fused 'L2Norm' norm takes no adapter"):
        normed_input(FusedNormParams("L2Norm", False, False), x)
