"""A ragged block: each request verifies its own number of candidates, w_i (issue 27's per-request
fallback: a request whose drafts keep failing verifies its bonus token alone).

Lanes are packed request after request and padded to the verify's token count with 0, as SGLang pads
its own (a pad lane writes KV slot 0). The target's choices go back to the dense ``[bs, B]`` layout
that :func:`~sglang_dflash.ops.accept_block` reads, and the candidates past each request's width are
masked to -1, a token no target chooses: request i then accepts at most w_i - 1 drafts and takes
its bonus from a row it verified. The widths are host integers (decided from the accept history the
host already has), so building the lanes never waits on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..sampling import to_device_async

UNVERIFIED = -1  # a candidate no verified row matches


@dataclass
class RaggedLanes:
    widths: torch.Tensor  # [bs] each request's verified candidates (on the lanes' device)
    req: torch.Tensor  # [total] the request of each packed lane
    col: torch.Tensor  # [total] that lane's column in the dense block
    total: int  # real lanes: the sum of the widths
    padded: int  # lanes the verify runs (a captured token count), at least ``total``

    @classmethod
    def from_widths(cls, widths: Sequence[int], device, padded: Optional[int] = None) -> "RaggedLanes":
        w = torch.as_tensor(list(widths), dtype=torch.int64)
        if len(w) and int(w.min()) < 1:
            raise ValueError(f"every request verifies at least its bonus token: widths {w.tolist()}")
        total = int(w.sum())
        if padded is not None and padded < total:
            raise ValueError(f"{padded} verify lanes cannot hold {total} candidates")
        starts = torch.cumsum(w, 0) - w
        req = torch.repeat_interleave(torch.arange(len(w)), w)
        col = torch.arange(total) - torch.repeat_interleave(starts, w)
        send = lambda t: to_device_async(t, device)  # noqa: E731
        return cls(send(w), send(req), send(col), total, total if padded is None else padded)

    def pack(self, dense: torch.Tensor, pad=0) -> torch.Tensor:
        """``dense [bs, B, ...]`` -> ``[padded, ...]``: each request's first w_i entries, then pads."""
        out = dense.new_full((self.padded, *dense.shape[2:]), pad)
        out[: self.total] = dense[self.req, self.col]
        return out

    def unpack(self, packed: torch.Tensor, block_size: int, fill=0) -> torch.Tensor:
        """``packed [>= total, ...]`` -> ``[bs, block_size, ...]``; columns past a request's width hold
        ``fill`` (a valid token id by default: the accept step stores every column's choice)."""
        dense = packed.new_full((len(self.widths), block_size, *packed.shape[1:]), fill)
        dense[self.req, self.col] = packed[: self.total]
        return dense

    def mask_unverified(self, candidates: torch.Tensor) -> torch.Tensor:
        """``candidates [bs, B]`` with every column at or past a request's width set to
        :data:`UNVERIFIED`: request i accepts at most w_i - 1 drafts."""
        cols = torch.arange(candidates.shape[1], device=candidates.device)
        return candidates.masked_fill(cols[None, :] >= self.widths[:, None], UNVERIFIED)
