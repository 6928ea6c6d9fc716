"""Hybrid targets: each request's gated-delta-net state kept in the verify's snapshot buffer.

SGLang's verify writes every request's SSM state after each verify token into a snapshot buffer,
and its commit then copies the accepted one into the request's state slot: 2 MiB a layer a
request read and written, 0.37 ms of a 21 ms step of the Qwen3.6-35B-A3B rig at c8
(docs/design/gdn-commit-without-copy.md). The state the commit would copy is already in the
buffer, so here the next verify starts from it instead:

- a request's snapshots go to its request-table row (SGLang's rows are batch positions, which a
  reordered batch would let one request overwrite while another reads them; row 0 is no request's);
- ``live_step[row]`` says where a request's state is: at that step of its row, or (-1) in its slot;
- before a verify, a state still in its slot is staged into step 0 of its row (after a prefill
  or a plain decode, once), and the verify reads each start state at ``row * pitch + live_step``;
- after it, ``live_step`` is the last accepted step: nothing is copied;
- before anything else reads a slot (a plain decode, an extend), :meth:`to_slots` copies the state
  back; a crossed radix track boundary copies its step into the track slot (:meth:`track`).

The verify kernel loads each program's whole start-state tile before it writes any snapshot of
that tile, so reading step s of a row and writing steps 0..T-1 of the same row in one launch is
exact: ``lab/gdn_state_in_snapshot.py`` checks it on SGLang's own kernel (Triton's interpreter).
The convolution state keeps SGLang's commit: its kernel writes the slot in place during the verify.
"""

from __future__ import annotations

import os

import torch

from .ops.state_copy import copy_states

NOT_IN_SNAPSHOT = -1
GDN_STATE_ENV = "SGLANG_DFLASH_GDN_STATE"  # "snapshot": keep the state there; "commit" (default): SGLang's copy


def keeps_state_in_snapshots() -> bool:
    """Whether the gated-delta-net state stays in the snapshot rows (not yet the default: its
    GPU checks are to come). Checked with the other switches before any process starts."""
    from .config import DFlashConfigError

    mode = os.environ.get(GDN_STATE_ENV, "commit").strip().lower()
    if mode not in ("commit", "snapshot"):
        raise DFlashConfigError(GDN_STATE_ENV, f"{mode!r} is not 'commit' or 'snapshot'")
    return mode == "snapshot"


# Keepers by the address of the snapshot buffer their verify writes: the redirect only touches
# the verifies of a server that keeps its state there.
_KEEPERS: dict[int, "SnapshotState"] = {}


def install_verify_redirect(keeper: "SnapshotState", dispatcher_class) -> None:
    """Wrap ``dispatcher_class.target_verify`` (SGLang's ``GDNKernelDispatcher``) once, so each
    verify that writes ``keeper``'s snapshots starts from them (:meth:`SnapshotState.verify_arguments`).
    Installed before the target's verify graphs are captured: they keep the keeper's buffers."""
    _KEEPERS[keeper.flat.untyped_storage().data_ptr()] = keeper
    if getattr(dispatcher_class.target_verify, "dflash_redirect", False):
        return
    original = dispatcher_class.target_verify

    def target_verify(self, *args, **kwargs):
        buffer = kwargs.get("intermediate_states_buffer")
        found = None if buffer is None else _KEEPERS.get(buffer.untyped_storage().data_ptr())
        if found is not None and kwargs.get("retrieve_parent_token") is None:  # a chain, not a tree
            kwargs = found.verify_arguments(kwargs)
        return original(self, *args, **kwargs)

    target_verify.dflash_redirect = True
    dispatcher_class.target_verify = target_verify


class SnapshotState:
    """Where each request's SSM state is, and the moves between a slot and its snapshot row.

    ``temporal``: SGLang's ``[layers, slots, *state]`` pool; ``snapshots``: the verify's
    ``[layers, rows, pitch, *state]`` buffer, a row per request-table row; ``max_bs``: the largest
    batch a verify runs (padded graph batches included)."""

    def __init__(self, temporal: torch.Tensor, snapshots: torch.Tensor, max_bs: int):
        if snapshots.shape[0] != temporal.shape[0] or snapshots.shape[3:] != temporal.shape[2:]:
            raise ValueError(f"snapshots {tuple(snapshots.shape)} do not match the state pool {tuple(temporal.shape)}")
        self.temporal = temporal
        self.pitch = snapshots.shape[2]
        self.flat = snapshots.flatten(1, 2)  # [layers, rows * pitch, *state]: a view, so the buffer is contiguous
        device = temporal.device
        self.live_step = torch.full((snapshots.shape[1],), NOT_IN_SNAPSHOT, dtype=torch.int64, device=device)
        # What the verify reads, refilled before each: captured graphs keep pointing at these.
        self.start_index = torch.full((max_bs,), -1, dtype=torch.int32, device=device)
        self.rows = torch.full((max_bs,), -1, dtype=torch.int32, device=device)

    def before_verify(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Stage the states still in their slots, and set each request's start index and row for
        the verify of this batch (``rows``: its requests' table rows; ``slots``: their state slots,
        as the verify's metadata holds them)."""
        rows = rows.long()
        live = self.live_step[rows]
        copy_states(self.flat, torch.where(live < 0, rows * self.pitch, -1), self.temporal, slots)
        live = live.clamp(min=0)  # live_step itself is set by after_verify, which follows every verify
        n = rows.shape[0]
        self.start_index[:n] = rows * self.pitch + live
        self.start_index[n:] = -1
        self.rows[:n] = rows
        self.rows[n:] = -1

    def verify_arguments(self, kwargs: dict) -> dict:
        """SGLang's verify keyword arguments for one layer, the start states and snapshots moved to
        the request rows: the source is that layer's snapshot buffer itself."""
        n = kwargs["cache_indices"].shape[0]
        if n > self.start_index.shape[0]:
            raise RuntimeError(f"a verify of {n} requests, past the {self.start_index.shape[0]} kept for")
        return {**kwargs, "ssm_states": kwargs["intermediate_states_buffer"].flatten(0, 1),
                "cache_indices": self.start_index[:n], "intermediate_state_indices": self.rows[:n]}

    def after_verify(self, rows: torch.Tensor, commit_len: torch.Tensor) -> None:
        """Each request's state is now its last accepted step (``commit_len`` tokens, bonus included)."""
        self.live_step[rows.long()] = commit_len.long() - 1

    def track(self, rows: torch.Tensor, steps: torch.Tensor, track_slots: torch.Tensor) -> None:
        """Copy step ``steps[i]`` of row ``rows[i]`` into ``track_slots[i]`` (skipped where either is
        below 0): the radix cache's checkpoint at a track boundary the verify crossed."""
        src = torch.where(steps >= 0, rows.long() * self.pitch + steps.long(), -1)
        copy_states(self.temporal, track_slots, self.flat, src)

    def to_slots(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Before a forward that reads the slots (a plain decode, an extend): copy back the states
        kept in the snapshots."""
        rows = rows.long()
        live = self.live_step[rows]
        copy_states(self.temporal, slots, self.flat, torch.where(live >= 0, rows * self.pitch + live, -1))
        self.live_step[rows] = NOT_IN_SNAPSHOT

    def released(self, rows: torch.Tensor) -> None:
        """The slots hold these rows' states now (a prefill wrote them; a new request took the row)."""
        self.live_step[rows.long()] = NOT_IN_SNAPSHOT
