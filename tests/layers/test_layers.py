"""Layer building blocks through the CPU ops backend: the oneDNN-prepacked linear against F.linear,
RMSNorm against HF's formula."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minisgl.backends.cpu import CpuOps, PackedWeight, onednn_linear_available, packed_linear
from minisgl.layers import Linear, RMSNorm

needs_onednn = pytest.mark.skipif(
    not onednn_linear_available(torch.empty(2, 2)), reason="this torch build has no oneDNN"
)


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear_and_is_batch_invariant(bias: bool) -> None:
    torch.manual_seed(0)
    lin = Linear(96, 160, bias, torch.float32, "cpu")
    lin.ops = ops = CpuOps()  # prefill passes: oneDNN
    with torch.no_grad():
        lin.weight.normal_(0, 0.05)
        if lin.bias is not None:
            lin.bias.normal_()
    x = torch.randn(300, 96)
    with torch.inference_mode():
        full = lin(x)  # (300, 160)
        assert ops._packs[id(lin.weight)].packed is not None  # the oneDNN path ran
        torch.testing.assert_close(full, F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)
        for m in (1, 3, 16, 17, 64):  # a row's result does not depend on the rest of the batch
            assert torch.equal(lin(x[:m].clone()), full[:m])
        assert lin(x.view(3, 100, 96)).shape == (3, 100, 160)


@needs_onednn
def test_packed_weight_follows_in_place_writes_and_replacement() -> None:
    lin = Linear(8, 4, False, torch.float32, "cpu")
    lin.ops = CpuOps()
    x = torch.randn(5, 8)
    with torch.no_grad():
        lin.weight.fill_(1.0)
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), x.sum(-1, keepdim=True).expand(5, 4))
    with torch.no_grad():
        lin.weight.fill_(2.0)  # in place: a new version of the same storage
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), 2 * x.sum(-1, keepdim=True).expand(5, 4))
    lin.weight = torch.nn.Parameter(torch.zeros(4, 8), requires_grad=False)  # a new tensor
    with torch.inference_mode():
        assert torch.equal(lin(x), torch.zeros(5, 4))


def test_non_float32_takes_f_linear() -> None:
    w = torch.randn(4, 8, dtype=torch.bfloat16)
    pack = PackedWeight()
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    assert torch.equal(packed_linear(x, w, None, pack, decode=False), F.linear(x, w))
    assert pack.packed is None


@pytest.mark.parametrize("rows", [1, 16, 1000])
def test_rmsnorm_float32_is_bitwise_the_hf_formula(rows: int) -> None:
    torch.manual_seed(rows)
    norm = RMSNorm(576, 1e-5, torch.float32, "cpu")
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1)
    x = torch.randn(rows, 576) * 3
    ref = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))  # HF's LlamaRMSNorm
    with torch.inference_mode():
        assert torch.equal(norm(x), ref)
