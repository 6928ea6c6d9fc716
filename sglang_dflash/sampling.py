"""Request parameters at every verify position, as plain decoding applies them at that token.

Plain decoding updates a request's penalties after each token. A verify step judges B tokens at
once, so position k must see the output so far plus candidates 0..k of its block (candidate 0 is
the last committed token). SGLang's penalizers cannot give that: they advance by one token per
scheduler step, and under DFLASH nothing advances them at all. So the plugin keeps each
request's output counts on the GPU itself (:class:`OutputCounts`), advances them with the tokens
every step commits, and adjusts the whole block in one pass (:func:`penalize_block`).
``reference.RequestParams.adjust`` is the specification; the tests compare them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch


def to_device_async(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor sent to ``device`` without waiting: from pinned memory, since a copy from
    pageable memory first waits for the stream's queued work (the overlap loop must not)."""
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


# Logit entries a per-position pass (penalties, a sampled draw) works on at once. Each makes
# full-size float32 temporaries (the repetition penalty's where about four): at 64 requests x 16
# positions of a 248,320-token vocabulary that is about 1 GB a copy; this keeps a copy near 128 MB.
CHUNK_ENTRIES = 1 << 25


def row_chunks(rows: int, entries_per_row: int) -> list[slice]:
    """``rows`` in slices of at most :data:`CHUNK_ENTRIES` entries (one row at least)."""
    step = max(1, CHUNK_ENTRIES // entries_per_row)
    return [slice(lo, lo + step) for lo in range(0, rows, step)]


@dataclass
class Penalties:
    """Per-request parameters of one batch, rows aligned with the batch."""

    frequency: torch.Tensor  # [bs] float32, subtracted once per occurrence
    presence: torch.Tensor  # [bs] float32, subtracted once a token has occurred
    repetition: torch.Tensor  # [bs] float32, scales the logits of occurred tokens
    min_new_tokens: torch.Tensor  # [bs] int64
    stop_mask: torch.Tensor  # [bs, V] bool: tokens banned while the output is shorter than min_new_tokens


def _scale_seen(z: torch.Tensor, seen: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """SGLang's repetition penalty: negative logits multiplied, positive ones divided."""
    scaled = torch.where(z < 0, z * repetition, z / repetition)
    return torch.where(seen, scaled, z)


@torch.no_grad()
def penalize_block(
    logits: torch.Tensor, candidates: torch.Tensor, counts: torch.Tensor, n_out: torch.Tensor, p: Penalties
) -> None:
    """Adjust ``logits [bs, B, V]`` in place: position k as plain decoding after ``counts`` (the
    output before candidate 0, ``n_out`` tokens) and candidates 0..k.

    The block changes the counts of at most B columns per request, so the whole tensor takes the
    counts before the block, and only those columns are recomputed from the raw logits, per
    position, with the counts that include the block's tokens before them.
    """
    bs, B, V = logits.shape
    ids = candidates.long()
    cols = ids[:, None, :].expand(bs, B, B)  # [i, k, m] = column of candidate m
    raw = logits.gather(2, cols).float()

    # Every column, with the state before the block.
    seen = counts > 0
    logits.sub_((p.frequency[:, None] * counts + p.presence[:, None] * seen)[:, None, :])  # float32, as SGLang adds
    out_len = n_out[:, None] + 1 + torch.arange(B, device=logits.device)  # output length at position k
    banned = out_len < p.min_new_tokens[:, None]  # [bs, B]
    logits.masked_fill_(banned[:, :, None] & p.stop_mask[:, None, :], float("-inf"))
    logits.copy_(_scale_seen(logits, seen[:, None, :], p.repetition[:, None, None]))

    # The block's own columns: count of column m at position k = counts + occurrences in 0..k.
    same = ids[:, :, None] == ids[:, None, :]  # [i, m, n]
    upto = torch.ones(B, B, dtype=torch.bool, device=logits.device).tril()  # [k, n]: n <= k
    in_block = (same[:, None, :, :] & upto[None, :, None, :]).sum(-1)  # [i, k, m]
    c = counts.gather(1, ids)[:, None, :] + in_block
    # Summed before they are subtracted, as above and as SGLang accumulates its additive penalties.
    z = raw - (p.frequency[:, None, None] * c + p.presence[:, None, None] * (c > 0))
    stop = p.stop_mask.gather(1, ids)[:, None, :]
    z = z.masked_fill(banned[:, :, None] & stop, float("-inf"))
    z = _scale_seen(z, c > 0, p.repetition[:, None, None])
    logits.scatter_(2, cols, z.to(logits.dtype))  # a repeated column gets the same value each time


class OutputCounts:
    """Each penalized request's output token counts on the GPU, advanced on the GPU.

    A request gets a row at its prefill, from the output it already has (none, or what it had
    before a retraction); the counts exclude the pending bonus token, which every block carries
    as candidate 0. Each step adds the tokens it commits before the new bonus. Nothing waits for
    the host, so the overlap scheduler's one-step lag on the host side does not matter. Row 0 is
    neutral, for the requests of a batch that ask for no penalty.
    """

    def __init__(self, vocab_size: int, device, stop_ids: Callable[[object], Iterable[int]]):
        self.vocab_size, self.device, self.stop_ids = vocab_size, device, stop_ids
        self.rows: dict[str, tuple[int, object]] = {}  # rid -> (row, req)
        self.capacity = 0

    @staticmethod
    def wants(req) -> bool:
        sp = req.sampling_params
        return (sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0 or sp.repetition_penalty != 1.0
                or sp.min_new_tokens > 0)

    def _grow(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        cap = max(8, 2 * self.capacity, needed)
        old, V, dev = self.capacity, self.vocab_size, self.device
        fresh = {
            "counts": torch.zeros(cap, V, dtype=torch.float32, device=dev),
            "n_out": torch.zeros(cap, dtype=torch.int64, device=dev),
            "frequency": torch.zeros(cap, dtype=torch.float32, device=dev),
            "presence": torch.zeros(cap, dtype=torch.float32, device=dev),
            "repetition": torch.ones(cap, dtype=torch.float32, device=dev),
            "min_new_tokens": torch.zeros(cap, dtype=torch.int64, device=dev),
            "stop_mask": torch.zeros(cap, V, dtype=torch.bool, device=dev),
        }
        for name, t in fresh.items():
            if old:
                t[:old].copy_(getattr(self, name))
            setattr(self, name, t)
        self.capacity = cap

    def _free_rows(self) -> list[int]:
        used = {row for row, _ in self.rows.values()}
        return [r for r in range(1, self.capacity) if r not in used]

    def _release_finished(self, batch_rids: set) -> None:
        for rid in [rid for rid, (_, req) in self.rows.items() if rid not in batch_rids and req.finished()]:
            del self.rows[rid]

    def start(self, reqs) -> None:
        """At a prefill (each chunk; the last one counts): rows for the penalized requests."""
        wanted = [req for req in reqs if self.wants(req)]
        if not wanted:
            return
        self._release_finished({req.rid for req in reqs})
        new = [req for req in wanted if req.rid not in self.rows]
        free = self._free_rows()
        if len(new) > len(free):
            self._grow(1 + len(self.rows) + len(new))
            free = self._free_rows()
        for req, row in zip(new, free):
            self.rows[req.rid] = (row, req)
        for req in wanted:
            self._fill(self.rows[req.rid][0], req)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return to_device_async(t, self.device)

    def _fill(self, row: int, req) -> None:
        sp, V = req.sampling_params, self.vocab_size
        output = torch.tensor(list(req.output_ids), dtype=torch.int64)
        self.counts[row] = self._to_device(torch.bincount(output, minlength=V)[:V].float())
        self.n_out[row] = len(output)
        self.frequency[row], self.presence[row] = sp.frequency_penalty, sp.presence_penalty
        self.repetition[row], self.min_new_tokens[row] = sp.repetition_penalty, sp.min_new_tokens
        stops = torch.zeros(V, dtype=torch.bool)
        stops[[t for t in self.stop_ids(req) if t is not None and 0 <= t < V]] = True
        self.stop_mask[row] = self._to_device(stops)

    def batch_rows(self, reqs) -> Optional[torch.Tensor]:
        """Each request's row (0: no penalty), or None when no request of the batch has one."""
        if not self.rows:
            return None
        found = [self.rows.get(req.rid, (0, None))[0] for req in reqs]
        missing = [req for req, row in zip(reqs, found) if row == 0 and self.wants(req)]
        if missing:  # never prefilled here (not expected): start from what the host knows
            self.start(missing)
            found = [self.rows.get(req.rid, (0, None))[0] for req in reqs]
        if not any(found):
            return None
        return self._to_device(torch.tensor(found, dtype=torch.int64))

    def penalize(self, logits: torch.Tensor, candidates: torch.Tensor, rows: torch.Tensor) -> None:
        """``logits [bs, B, V]`` in place, a few requests at a time (:func:`row_chunks`)."""
        bs, B, V = logits.shape
        for part in row_chunks(bs, B * V):
            r = rows[part]
            p = Penalties(self.frequency[r], self.presence[r], self.repetition[r], self.min_new_tokens[r],
                          self.stop_mask[r])
            penalize_block(logits[part], candidates[part], self.counts[r], self.n_out[r], p)

    def commit(self, rows: torch.Tensor, candidates: torch.Tensor, commit_len: torch.Tensor) -> None:
        """Add candidates 0..commit_len-1 (the old bonus and the accepted drafts) to the counts."""
        bs, B = candidates.shape
        keep = (torch.arange(B, device=candidates.device)[None, :] < commit_len[:, None]) & (rows[:, None] > 0)
        flat = rows[:, None] * self.vocab_size + candidates.to(torch.int64)
        self.counts.view(-1).index_add_(0, flat.view(-1), keep.view(-1).to(torch.float32))
        self.n_out.index_add_(0, rows, torch.where(rows > 0, commit_len.to(torch.int64), 0))


class HalfVerifyLogits:
    """The target's verify logits left in the model's dtype; float32 only for the batches that use them.

    SGLang casts every logits row to float32 inside the verify (a kernel reading 2 and writing 4
    bytes a vocabulary entry, then an argmax reading 4): at 32 requests x 16 positions x 152k
    entries that is about 0.2 ms of a 15 ms step. A greedy batch with nothing per position needs
    only the argmax, and the argmax of half-precision values is the argmax of their (exact)
    float32 casts, ties included. So a TARGET_VERIFY forward writes the lm_head's output in the
    model's dtype straight into the float32 logits buffer SGLang shares across its CUDA graphs
    (its first half, as half-precision storage: no graph holds logits of its own), and
    :meth:`for_accept` casts to float32 where the batch asks for more: penalties, bias, custom
    processors, grammar, logprobs or sampling, which then see what SGLang would have given them.
    """

    def __init__(self, processor):
        self.processor = processor
        self.sglang_get_logits = processor._get_logits
        self.verifies = 0  # TARGET_VERIFY lm_heads written in the model's dtype (graph captures included)

    @staticmethod
    def unserved(processor, lm_head) -> Optional[str]:
        """Why the verify logits must stay SGLang's, or None: anything between the lm_head's GEMM
        and the logits that this class would skip (a gather across ranks, a soft cap, a float32
        or quantised or LoRA lm_head) keeps SGLang's own path."""
        if getattr(processor, "do_tensor_parallel_all_gather", False) or getattr(
                processor, "do_tensor_parallel_all_gather_dp_attn", False):
            return "logits gathered across ranks"
        if getattr(processor, "final_logit_softcapping", None):
            return "a soft-capped lm_head"
        if (getattr(processor, "use_fp32_lm_head", False) or getattr(processor, "use_fp32_lm_head_output", False)
                or getattr(processor, "rl_on_policy_target", None) is not None):
            return "a float32 lm_head"
        if hasattr(lm_head, "set_lora") or hasattr(lm_head, "apply_lora"):
            return "a LoRA lm_head"
        quant = getattr(lm_head, "quant_method", None)
        if quant is not None and type(quant).__name__ != "UnquantizedEmbeddingMethod":
            return "a quantised lm_head"
        weight = getattr(lm_head, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dtype not in (torch.float16, torch.bfloat16):
            return "a float32 model" if isinstance(weight, torch.Tensor) else "an lm_head without a weight"
        return None

    def install(self) -> None:
        self.processor._get_logits = self.get_logits

    def get_logits(self, hidden_states, lm_head, logits_metadata, embedding_bias=None, use_logits_buffer=True):
        """``LogitsProcessor._get_logits`` for this processor: the half-precision path for a
        TARGET_VERIFY forward, SGLang's for everything else (prefills and plain decode steps)."""
        weight = lm_head.weight
        if not logits_metadata.forward_mode.is_target_verify() or hidden_states.dtype != weight.dtype:
            return self.sglang_get_logits(hidden_states, lm_head, logits_metadata, embedding_bias, use_logits_buffer)
        shared = logits_metadata.next_token_logits_buffer if use_logits_buffer else None
        out = half_view(shared, hidden_states.shape[0], weight.shape[0], weight.dtype)
        logits = torch.mm(hidden_states, weight.t(), out=out) if out is not None else torch.mm(hidden_states, weight.t())
        if self.processor.logit_scale is not None:
            logits.mul_(self.processor.logit_scale)
        self.verifies += 1
        vocab = self.processor.vocab_size
        return logits[:, :vocab] if logits.shape[-1] > vocab else logits

    @staticmethod
    def for_accept(logits: torch.Tensor, argmax_only: bool) -> torch.Tensor:
        """The logits the accept step reads: as they are for a greedy argmax, else float32."""
        return logits if argmax_only or logits.dtype == torch.float32 else logits.float()


def half_view(shared: Optional[torch.Tensor], rows: int, cols: int, dtype) -> Optional[torch.Tensor]:
    """``rows x cols`` of ``dtype`` (2 bytes) over the start of a float32 buffer of ``rows`` rows,
    or None where it does not fit (no buffer, another row count, too narrow)."""
    if shared is None or shared.dtype != torch.float32 or not shared.is_contiguous() or shared.shape[0] != rows:
        return None
    flat = shared.view(-1).view(dtype)
    if flat.numel() < rows * cols:
        return None
    return flat[: rows * cols].view(rows, cols)


def argmax_only(batch, penalty_rows: Optional[torch.Tensor]) -> bool:
    """Whether a verify's accept needs nothing of its logits but each position's argmax: greedy,
    and no penalties, bias, custom processors, grammar or logprobs."""
    info = batch.sampling_info
    return (penalty_rows is None and not batch.has_grammar and not batch.return_logprob
            and (info is None or (info.is_all_greedy and info.logit_bias is None
                                  and not info.has_custom_logit_processor)))


@dataclass(frozen=True)
class PlainDecodingKernels:
    """The kernels SGLang's sampler draws plain decoding's unseeded top-k/top-p/min-p samples with
    on its ``flashinfer`` sampling backend (the CUDA default): rejection sampling over the
    probabilities, no sort of the vocabulary. The verify rows go through them as plain decoding's
    one row a request does, with the same filter semantics. The torch path (SGLang's ``pytorch``
    backend, and every seeded request) sorts each row: bs x B rows of the whole vocabulary a step."""

    top_k_top_p: Callable
    top_k_renorm: Callable
    top_p_renorm: Callable
    min_p: Callable

    def sample(self, probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor,
               need_min_p: bool) -> torch.Tensor:
        if need_min_p:
            probs = self.top_p_renorm(self.top_k_renorm(probs, top_ks), top_ps)
            return self.min_p(probs, min_ps)
        return self.top_k_top_p(probs.contiguous(), top_ks, top_ps, filter_apply_order="joint")


def plain_decoding_kernels(backend: Optional[str], sampler_module=None) -> Optional[PlainDecodingKernels]:
    """:class:`PlainDecodingKernels` where plain decoding samples with them (``backend``, SGLang's
    ``--sampling-backend``, is ``flashinfer`` and its sampler module holds them: CUDA builds), else
    None: the torch path, as SGLang's own sampler takes it then."""
    if backend != "flashinfer":
        return None
    if sampler_module is None:
        from sglang.srt.layers import sampler as sampler_module
    names = ("top_k_top_p_sampling_from_probs", "top_k_renorm_prob", "top_p_renorm_prob", "min_p_sampling_from_probs")
    found = [getattr(sampler_module, name, None) for name in names]
    return None if any(f is None for f in found) else PlainDecodingKernels(*found)
