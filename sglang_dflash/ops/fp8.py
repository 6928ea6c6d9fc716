"""An fp8 copy of a dense weight for the draft's greedy head (``x @ W.T``, rowwise scales).

The draft only proposes: the target verifies every token, so a draft head in fp8 changes which
tokens are proposed on near-ties and never which tokens are committed. At one stream the head is
a read of the whole vocabulary each step (1.2 GB for Qwen3-8B), and fp8 halves it.
"""

from __future__ import annotations

from typing import Optional

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
_CHUNK_ROWS = 8192  # quantise a vocabulary in slices: a float32 copy of it all would be 2.4 GB


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric fp8: ``x ~= q * scale`` with ``scale`` [rows, 1] in float32."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp_(min=1e-12) / FP8_MAX
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_supported(device: torch.device) -> bool:
    """torch's fp8 GEMM with rowwise scales runs on sm89 and later."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


class Fp8RowwiseLinear:
    """``x @ W.T`` with W in fp8 per output row and x quantised per row on the fly."""

    def __init__(self, weight: torch.Tensor):
        rows, cols = weight.shape
        self.q = torch.empty(rows, cols, dtype=FP8, device=weight.device)
        self.row_scale = torch.empty(rows, 1, dtype=torch.float32, device=weight.device)
        self.weight_t = self.q.t()  # column-major [in, out], the layout torch._scaled_mm takes
        self.scale = self.row_scale.view(1, rows)
        self.refill(weight)

    def refill(self, weight: torch.Tensor) -> None:
        """Quantise ``weight`` (same shape) into the buffers in place: CUDA graphs keep reading them."""
        for start in range(0, weight.shape[0], _CHUNK_ROWS):
            q, s = quantize_rows(weight[start : start + _CHUNK_ROWS])
            self.q[start : start + _CHUNK_ROWS].copy_(q)
            self.row_scale[start : start + _CHUNK_ROWS].copy_(s)

    @staticmethod
    def eligible(weight: torch.Tensor) -> Optional[str]:
        """Why this weight cannot have an fp8 copy, or None."""
        if weight.dim() != 2 or weight.element_size() < 2 or not torch.is_floating_point(weight):
            return f"weight {weight.dtype} is not a dense half or full precision matrix"
        if weight.shape[0] % 16 or weight.shape[1] % 16:
            return f"shape {list(weight.shape)} is not a multiple of 16 (torch._scaled_mm)"
        if not fp8_supported(weight.device):
            return "fp8 GEMMs need an sm89+ GPU"
        return None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        qx, sx = quantize_rows(x)
        return torch._scaled_mm(qx, self.weight_t, scale_a=sx, scale_b=self.scale, out_dtype=torch.bfloat16)
