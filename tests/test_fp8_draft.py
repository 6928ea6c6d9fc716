"""The draft in fp8 (``--speculative-draft-model-quantization fp8``): what runs on CPU.

The fp8 GEMM itself needs an sm89+ GPU: ``kernel_checks.check_fp8_head`` runs there."""

from types import SimpleNamespace

import pytest
import torch

from sglang_dflash import draft as draft_mod
from sglang_dflash.model import dense_weight, has_dense_weight
from sglang_dflash.ops.fp8 import FP8, FP8_MAX, Fp8RowwiseLinear, quantize_rows


def test_rows_quantise_within_fp8_precision_and_a_zero_row_stays_zero():
    torch.manual_seed(0)
    x = torch.randn(6, 64) * torch.tensor([1e-3, 1.0, 30.0, 1.0, 1.0, 1.0])[:, None]
    x[3] = 0.0
    q, scale = quantize_rows(x)
    assert q.dtype == FP8 and scale.shape == (6, 1)
    back = q.float() * scale
    assert torch.isfinite(back).all() and back[3].abs().max() == 0
    # e4m3 keeps 3 mantissa bits: each element within 1/16 of its row's largest, relative.
    err = (back - x).abs().amax(dim=-1) / x.abs().amax(dim=-1).clamp(min=1e-12)
    assert err.max() < 1 / 16
    assert q.float().abs().amax(dim=-1)[[0, 1, 2]].allclose(torch.full((3,), FP8_MAX))


def fp8_linear(weight: torch.Tensor, per_channel: bool = True, **extra):
    """A linear as SGLang's fp8 method leaves a 16-bit checkpoint: weight [in, out], scales per
    output channel (``[1, out]``) or one."""
    out_f, in_f = weight.shape
    if per_channel:
        q, s = quantize_rows(weight)
        scale = s.t().contiguous()
    else:
        s = weight.abs().max().float() / FP8_MAX
        q, scale = (weight / s).to(FP8), s.reshape(1)
    return SimpleNamespace(quant_method=object(), weight=q.t(), weight_scale=scale,
                           input_size_per_partition=in_f, output_size_per_partition=out_f, **extra)


@pytest.mark.parametrize("per_channel", [True, False])
def test_an_fp8_linear_gives_its_dequantised_weight_in_the_checkpoints_layout(per_channel):
    torch.manual_seed(1)
    w = torch.randn(48, 32)
    lin = fp8_linear(w, per_channel)
    assert has_dense_weight(lin)
    dense = dense_weight(lin, torch.float32)
    assert dense.shape == (48, 32)
    exact = lin.weight.t().float() * lin.weight_scale.float().reshape(-1, 1)
    torch.testing.assert_close(dense, exact)
    assert (dense - w).abs().max() < w.abs().max() / 8
    assert not (dense - w).abs().max() < 1e-6  # it is the fp8 weight, not a copy of the original


def test_other_quantisations_have_no_dense_weight():
    torch.manual_seed(2)
    block = fp8_linear(torch.randn(48, 32), weight_scale_inv=torch.ones(1))
    packed = SimpleNamespace(quant_method=object(), weight=torch.zeros(32, 6, dtype=torch.int32),
                             weight_scale=torch.ones(1, 48), input_size_per_partition=32,
                             output_size_per_partition=48)
    for lin in (block, packed):
        assert not has_dense_weight(lin) and dense_weight(lin, torch.float32) is None


def test_an_fp8_head_is_refused_where_torch_has_no_fp8_gemm():
    w = torch.randn(64, 32, dtype=torch.bfloat16)
    assert "sm89" in Fp8RowwiseLinear.eligible(w)
    assert "multiple of 16" in Fp8RowwiseLinear.eligible(torch.randn(64, 24, dtype=torch.bfloat16))
    assert "dense" in Fp8RowwiseLinear.eligible(w.to(FP8))


def test_the_greedy_draft_head_keeps_its_16_bit_weights_where_fp8_cannot_run(monkeypatch, caplog):
    monkeypatch.setattr(draft_mod, "get_tp_group", lambda: SimpleNamespace(world_size=1))
    monkeypatch.setattr(draft_mod, "get_parallel", lambda: SimpleNamespace(tp_rank=0))
    torch.manual_seed(3)
    lm_head = SimpleNamespace(weight=torch.randn(40, 32))
    hidden = torch.randn(3 * 4, 32)
    plain = draft_mod.GreedyDraftHead(lm_head, block_size=4, max_bs=3)
    with caplog.at_level("INFO", logger="sglang_dflash"):
        asked = draft_mod.GreedyDraftHead(lm_head, block_size=4, max_bs=3, fp8=True)
    assert asked.fp8 is None and "draft head stays in torch.float32" in caplog.text
    expected = (hidden.view(3, 4, 32)[:, 1:].reshape(-1, 32) @ lm_head.weight.T).argmax(-1)
    assert asked(hidden).tolist() == plain(hidden).tolist() == expected.tolist()


def test_the_head_is_fp8_only_when_the_drafts_linears_are():
    plain = torch.nn.Linear(8, 8)
    assert not draft_mod.draft_weights_fp8(plain)
    plain.weight.data = plain.weight.data.to(FP8)
    assert draft_mod.draft_weights_fp8(plain)


def test_the_stacked_context_weights_of_an_fp8_draft_are_its_dequantised_k_and_v_rows():
    from torch import nn

    from sglang_dflash.model import DFlashAttention, DFlashDraftModel

    torch.manual_seed(4)
    q_size, kv_size, hidden = 16, 8, 32
    originals, layers = [], []
    for _ in range(2):
        w = torch.randn(q_size + 2 * kv_size, hidden)
        attn = DFlashAttention.__new__(DFlashAttention)
        nn.Module.__init__(attn)
        attn.q_size = q_size
        attn.qkv_proj = fp8_linear(w, bias=None)
        attn.k_norm = SimpleNamespace(weight=torch.rand(4))
        originals.append(w)
        layers.append(SimpleNamespace(self_attn=attn))
    model = SimpleNamespace(layers=layers, fc=SimpleNamespace(weight=torch.zeros(1, dtype=torch.bfloat16)))
    weight, bias, norms = DFlashDraftModel._build_stacked_weights(model)
    assert weight.dtype == torch.bfloat16 and weight.shape == (2 * 2 * kv_size, hidden) and bias is None
    for i, layer in enumerate(layers):
        rows = weight[i * 2 * kv_size : (i + 1) * 2 * kv_size].float()
        torch.testing.assert_close(rows, dense_weight(layer.self_attn.qkv_proj, torch.bfloat16)[q_size:].float())
        assert (rows - originals[i][q_size:]).abs().max() < originals[i].abs().max() / 8
    assert norms.shape == (2, 4)
