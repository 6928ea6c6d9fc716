"""A gated-delta-net verify that writes no per-token state snapshots (docs/design/hybrid-verify-state.md).

SGLang verifies a block on a GDN layer with ``fused_sigmoid_gating_delta_rule_update`` and has it
store a full fp32 recurrent state for every verify token (``intermediate_ssm``), so that the commit
can copy the accepted token's. At the Qwen3.5-4B shape that is 32 MiB a request a layer at block 16,
about half of the kernel's time. With ``SGLANG_DFLASH_GDN_STATE=saved`` the plugin instead:

- **verify** (inside the captured graph): copies each request's state aside (the saved state), keeps
  the layer's k, v, a, b, and runs the same kernel in place, state update on, storing no snapshot;
- **commit**: a request that accepted the whole block keeps the verify's final state as it stands;
  the others re-run their accepted tokens from the saved state, which is then copied into their
  slots; a crossed radix-cache track boundary re-runs up to it into the track slot. The conv windows
  are committed by SGLang's own scatter, as before.

Every run is SGLang's kernel in the launch the snapshot verify uses (a snapshot buffer is passed and
every row index is -1, so nothing is stored), from the same fp32 state over the same tokens: the
committed states are the snapshot path's bits (``tests/test_gdn_state.py``). The saved states and the
kept inputs live in the snapshot buffer itself, which this path no longer writes, so it takes no
memory of its own.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace
from typing import Optional

import torch
import torch.nn.functional as F

KERNEL_MODULES = ("sglang.kernels.ops.attention.linear.fused_sigmoid_gating_recurrent",  # 0.5.23
                  "sglang.kernels.ops.attention.fla.fused_sigmoid_gating_recurrent")  # 0.5.17-0.5.22
INPUTS = ("k", "v", "a", "b")  # the commit passes k as q too: q feeds the outputs, never the state
ALIGN = 256  # bytes, between the kept inputs
# Warm-up and padded batches may run more verify rows than the snapshot buffer holds (SGLang clamps
# those onto its padding row); the row indices the kernel reads are sized for this many.
MAX_VERIFY_ROWS = 8192


def recurrent_kernel():
    """SGLang's ``fused_sigmoid_gating_delta_rule_update`` (its module moved in 0.5.23)."""
    for name in KERNEL_MODULES:
        try:
            return importlib.import_module(name).fused_sigmoid_gating_delta_rule_update
        except ModuleNotFoundError:
            continue
    raise ImportError(f"fused_sigmoid_gating_delta_rule_update is in none of {', '.join(KERNEL_MODULES)}")


def saved_state_unserved(attn_backend) -> Optional[str]:
    """Why a hybrid target's verify must keep SGLang's snapshots, or None."""
    linear = getattr(attn_backend, "linear_attn_backend", None)
    dispatcher = getattr(linear, "kernel_dispatcher", None)
    if dispatcher is None or not hasattr(dispatcher, "target_verify"):
        return "the linear-attention backend has no kernel dispatcher"
    if getattr(dispatcher, "verify_kernel_is_flashinfer", False):
        return "FlashInfer's gated-delta-net verify"
    pool = getattr(linear, "req_to_token_pool", None)
    cache = getattr(getattr(pool, "mamba_pool", None), "mamba_cache", None)
    snapshots = getattr(cache, "intermediate_ssm", None)
    if snapshots is None or not hasattr(cache, "temporal"):
        return "no per-token state snapshots in the recurrent-state pool"
    if snapshots.shape[2] < 2 or not snapshots.is_contiguous():
        return "a snapshot buffer of fewer than two steps, or not contiguous"
    if getattr(cache, "replayssm_rawv", None) is not None or getattr(cache, "replayssm_d", None) is not None:
        return "--enable-linear-replayssm-spec"
    for side, field in (("short_conv_pool", "conv_state"), ("ngram_pool", "context")):
        if getattr(getattr(pool, side, None), field, None) is not None:
            return f"a side state beside the recurrent one ({side}; SGLang's commit rolls it forward)"
    if pp_spec_stable_rows():
        return "SGLANG_ENABLE_PP_SPEC (verify scratch rows by request, not by batch row)"
    return None


def pp_spec_stable_rows() -> bool:
    """SGLang 0.5.22+: whether verify scratch rows follow request pool indices (pipeline parallelism)."""
    try:
        from sglang.srt.layers.attention.linear.utils import pp_spec_stable_rows_enabled
    except ImportError:
        return False
    return bool(pp_spec_stable_rows_enabled())


class GdnSavedState:
    """The saved states and kept inputs of every GDN layer, in SGLang's snapshot buffer
    ``intermediate_ssm [layers, rows, steps, HV, V, K]``: per layer, rows' saved states first
    (``[rows, HV, V, K]``), then k, v, a, b for ``rows * steps`` tokens."""

    def __init__(self, cache):
        self.cache = cache
        snapshots = cache.intermediate_ssm
        self.layers, self.rows, self.steps = snapshots.shape[:3]
        self.state_shape = tuple(snapshots.shape[3:])
        self.state_numel = snapshots[0, 0, 0].numel()
        self.kernel = recurrent_kernel()
        self.no_rows = torch.full((max(self.rows, MAX_VERIFY_ROWS),), -1, dtype=torch.int32, device=snapshots.device)
        self.gates: list = [None] * self.layers  # (A_log, dt_bias) of each layer, from its first verify
        self.inputs: Optional[dict] = None  # name -> [layers, rows * steps, ...], laid out on the first verify

    # ---- storage --------------------------------------------------------------------------

    def layer_of(self, snapshot_buffer) -> int:
        """Which GDN layer a verify runs, from the snapshot buffer SGLang hands it."""
        base = self.cache.intermediate_ssm
        return (snapshot_buffer.data_ptr() - base.data_ptr()) // (base.stride(0) * base.element_size())

    def saved(self) -> torch.Tensor:
        """``[layers, rows, HV, V, K]``: each layer's saved states, rows first in its buffer."""
        flat = self.cache.intermediate_ssm.view(self.layers, -1)
        return flat[:, : self.rows * self.state_numel].view(self.layers, self.rows, *self.state_shape)

    def _lay_out_inputs(self, k, v, a, b) -> None:
        tokens = self.rows * self.steps
        layer_bytes = self.cache.intermediate_ssm[0].numel() * self.cache.intermediate_ssm.element_size()
        raw = self.cache.intermediate_ssm.view(torch.uint8).view(self.layers, layer_bytes)
        offset = self.rows * self.state_numel * self.cache.intermediate_ssm.element_size()
        inputs = {}
        for name, t in zip(INPUTS, (k[0], v[0], a, b)):
            tail = tuple(t.shape[1:])
            size = tokens * t[0].numel() * t.element_size()
            offset = -(-offset // ALIGN) * ALIGN
            if offset + size > layer_bytes:
                raise RuntimeError(f"DFLASH: the GDN snapshot buffer ({layer_bytes} bytes a layer) cannot hold "
                                   f"the saved states and the verify inputs")
            inputs[name] = raw[:, offset: offset + size].view(t.dtype).view(self.layers, tokens, *tail)
            offset += size
        self.inputs = inputs

    # ---- verify (captured) ---------------------------------------------------------------

    def verify(self, A_log, dt_bias, q, k, v, a, b, *, ssm_states, cache_indices, query_start_loc,
               intermediate_states_buffer, cache_steps, **_):
        """SGLang's kernel dispatcher's ``target_verify``, for a linear draft chain."""
        layer = self.layer_of(intermediate_states_buffer)
        self.gates[layer] = (A_log, dt_bias)
        if self.inputs is None:
            self._lay_out_inputs(k, v, a, b)
        rows, tokens = query_start_loc.shape[0] - 1, k.shape[1]
        # Padded rows carry slot -1 (the kernel neither reads nor writes their state) and are never
        # committed: those past the buffer's rows are not kept, the others save slot 0's state.
        kept_rows, kept_tokens = min(rows, self.rows), min(tokens, self.rows * self.steps)
        torch.index_select(ssm_states, 0, cache_indices[:kept_rows].clamp(min=0),
                           out=self.saved()[layer, :kept_rows])
        for name, t in zip(INPUTS, (k[0], v[0], a, b)):
            self.inputs[name][layer, :kept_tokens].copy_(t[:kept_tokens])
        return self._run(layer, q, k, v, a, b, ssm_states, cache_indices, query_start_loc, cache_steps, rows)

    def _run(self, layer, q, k, v, a, b, states, indices, starts, width, rows):
        A_log, dt_bias = self.gates[layer]
        return self.kernel(
            A_log=A_log, dt_bias=dt_bias, q=q, k=k, v=v, a=a, b=b, initial_state_source=states,
            initial_state_indices=indices, cu_seqlens=starts, use_qk_l2norm_in_kernel=True, softplus_beta=1.0,
            softplus_threshold=20.0, is_kda=False, disable_state_update=False,
            # the snapshot verify's launch (its value tile), with no row stored
            intermediate_states_buffer=self.cache.intermediate_ssm[layer],
            intermediate_state_indices=self.no_rows[:rows], cache_steps=width,
        )

    # ---- commit (eager) ------------------------------------------------------------------

    def commit(self, slots, commit_len, width: int, verify_rows: int, track_slots=None, steps_to_track=None) -> None:
        """After a verify of ``width`` tokens a request over ``verify_rows`` rows (the batch, padded
        to its graph's size): ``slots`` are the batch's state slots (as the verify read them),
        ``commit_len`` their committed tokens (1..width); ``track_slots`` and ``steps_to_track``
        (-1: none) as SGLang's commit takes them."""
        last_steps = commit_len.to(torch.int64) - 1
        self._commit_conv_windows(slots, last_steps, track_slots, steps_to_track)
        bs = slots.shape[0]
        rows = torch.arange(bs, dtype=torch.int32, device=slots.device)
        temporal = self.cache.temporal
        if track_slots is not None:  # before the saved states move on to the commit
            crossed = (steps_to_track >= 0) & (track_slots >= 0)
            self._restore(track_slots, crossed)
            self._replay(lambda layer: temporal[layer], torch.where(crossed, track_slots.to(torch.int32), -1),
                         torch.where(crossed, steps_to_track + 1, 0), width, verify_rows)
        short = commit_len < width
        saved = self.saved()
        self._replay(lambda layer: saved[layer], torch.where(short, rows, -1), torch.where(short, commit_len, 0),
                     width, verify_rows)
        self._restore(slots, short)

    def _commit_conv_windows(self, slots, last_steps, track_slots, steps_to_track) -> None:
        from sglang.kernels.ops.mamba.mamba_state_scatter_triton import scatter_mamba_states_after_mtp_verify

        if not self.cache.conv:
            return
        conv_only = SimpleNamespace(temporal=self.cache.temporal[:0], intermediate_ssm=None, conv=self.cache.conv,
                                    intermediate_conv_window=self.cache.intermediate_conv_window)
        scatter_mamba_states_after_mtp_verify(conv_only, slots, last_steps, track_slots, steps_to_track)

    def _replay(self, states_of, indices, lengths, width: int, verify_rows: int) -> None:
        """Re-run each row's first ``lengths`` verify tokens from ``states_of(layer)[indices]``, in
        place; rows of index -1 and length 0 are untouched. Over as many rows as the verify ran:
        SGLang 0.5.22+ picks the kernel's value tile from the row count (SM90, at most 64 rows)."""
        pad = verify_rows - indices.shape[0]
        indices, lengths = F.pad(indices, (0, pad), value=-1), F.pad(lengths, (0, pad))
        bs = verify_rows
        device = indices.device
        starts = torch.zeros(bs + 1, dtype=torch.int32, device=device)
        starts[1:] = torch.cumsum(lengths, 0)
        step = torch.arange(width, device=device)
        verify_token = torch.arange(bs, device=device)[:, None] * width + step
        packed = torch.where(step < lengths[:, None], starts[:-1, None].to(torch.int64) + step, bs * width)
        gather = torch.zeros(bs * width + 1, dtype=torch.int64, device=device)
        gather.scatter_(0, packed.flatten(), verify_token.flatten())  # past the end: dropped
        replay = {name: t.index_select(1, gather[: bs * width]) for name, t in self.inputs.items()}
        for layer in range(self.layers):
            k = replay["k"][layer][None]
            self._run(layer, k, k, replay["v"][layer][None], replay["a"][layer], replay["b"][layer],
                      states_of(layer), indices, starts, width, bs)

    def _restore(self, slots, mask) -> None:
        """Copy the saved state of each row of ``mask`` into its slot, every layer."""
        temporal = self.cache.temporal
        if temporal.is_cuda:
            from sglang.kernels.ops.mamba.mamba_state_scatter_triton import fused_mamba_state_scatter_with_mask

            # rows of the saved states as steps-long source rows of one step: the buffer, contiguous
            source = self.cache.intermediate_ssm.view(self.layers, -1, 1, *self.state_shape)
            fused_mamba_state_scatter_with_mask(temporal, source, slots.to(torch.int32),
                                                torch.where(mask, 0, -1).to(torch.int32))
            return
        rows = mask.nonzero().squeeze(1)  # CPU (tests): a host sync costs nothing there
        temporal[:, slots[rows].long()] = self.saved()[:, rows]


def install(attn_backend, saved_state: GdnSavedState) -> None:
    """Route ``attn_backend``'s GDN TARGET_VERIFY through ``saved_state`` (tree drafts keep SGLang's)."""
    dispatcher = attn_backend.linear_attn_backend.kernel_dispatcher
    if getattr(dispatcher, "_dflash_saved_state", None) is saved_state:
        return
    snapshot_verify = type(dispatcher).target_verify.__get__(dispatcher)

    def target_verify(*args, retrieve_parent_token=None, **kwargs):
        if retrieve_parent_token is not None:
            return snapshot_verify(*args, retrieve_parent_token=retrieve_parent_token, **kwargs)
        return saved_state.verify(*args, **kwargs)

    dispatcher.target_verify = target_verify
    dispatcher._dflash_saved_state = saved_state
