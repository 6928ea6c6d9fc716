"""The worker's wiring of ``sglang_dflash.gdn_state`` (SGLANG_DFLASH_GDN_STATE=snapshot), on fakes.

The keeper's bits against SGLang's commit copy are checked on SGLang's own kernel in
``tests/test_gdn_verify_bench.py``; here: when the worker keeps the state in the snapshots and
why not, the verify redirect touching only its own server's verifies, the commit keeping the
convolution windows and moving no SSM state, and SGLang's commit kept where streaming sessions are on.
"""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from sglang_dflash import compat, gdn_state, reference  # noqa: E402
from sglang_dflash.gdn_state import SnapshotState, install_verify_redirect, keeps_state_in_snapshots  # noqa: E402


@pytest.fixture(autouse=True)
def copies_in_torch(monkeypatch):
    """The copy kernel runs under Triton's interpreter in test_gdn_verify_bench.py; here its torch twin."""
    monkeypatch.setattr(gdn_state, "copy_states", reference.copy_states)


def fake_backend(rows=4, snapshots=True, side_conv=False):
    temporal = torch.zeros(2, 6, 3, 4)
    caches = SimpleNamespace(temporal=temporal, intermediate_ssm=torch.zeros(2, rows, 4, 3, 4) if snapshots else None,
                             conv=[torch.zeros(2, 6, 5, 2)], intermediate_conv_window=[torch.zeros(2, rows, 4, 5, 2)])
    pool = SimpleNamespace(size=3, get_speculative_mamba2_params_all_layers=lambda: caches,
                           short_conv_pool=SimpleNamespace(conv_state=torch.zeros(1)) if side_conv else None,
                           get_mamba_indices=lambda rows: rows + 1)
    physical = lambda idx: torch.where(idx >= 0, idx + 1, idx)  # noqa: E731  virtual slot -> physical
    linear = SimpleNamespace(req_to_token_pool=pool, _translate_mamba_indices=physical,
                             forward_metadata=SimpleNamespace(mamba_cache_indices=torch.tensor([7, 8, 9, -1])))
    return SimpleNamespace(linear_attn_backend=linear), caches


def test_the_mode_is_read_from_the_environment(monkeypatch):
    monkeypatch.delenv(gdn_state.GDN_STATE_ENV, raising=False)
    assert not keeps_state_in_snapshots()
    monkeypatch.setenv(gdn_state.GDN_STATE_ENV, "snapshot")
    assert keeps_state_in_snapshots()
    monkeypatch.setenv(gdn_state.GDN_STATE_ENV, "elsewhere")
    from sglang_dflash.config import DFlashConfigError

    with pytest.raises(DFlashConfigError, match="'elsewhere' is not 'commit' or 'snapshot'"):
        keeps_state_in_snapshots()


def test_the_state_stays_in_the_snapshots_only_where_nothing_else_reads_a_stale_slot():
    release = compat.running()

    def args(radix=True, strategy="extra_buffer", mixed=False, streaming_sessions=False):
        return SimpleNamespace(disable_radix_cache=not radix, mamba_radix_cache_strategy=strategy,
                               enable_mixed_chunk=mixed, enable_streaming_session=streaming_sessions)

    backend, _ = fake_backend()
    assert release.gdn_snapshot_unserved(backend, args()) is None
    assert release.gdn_snapshot_unserved(SimpleNamespace(), args()) == \
        "the recurrent-state pool is not laid out as SGLang's mamba pool"
    assert "replayssm" in release.gdn_snapshot_unserved(fake_backend(snapshots=False)[0], args())
    assert release.gdn_snapshot_unserved(fake_backend(rows=5)[0], args()) == "5 snapshot rows for 3 request rows"
    assert "short-conv" in release.gdn_snapshot_unserved(fake_backend(side_conv=True)[0], args())
    strided, caches = fake_backend()
    caches.temporal = torch.zeros(2, 6, 4, 3).transpose(2, 3)
    assert "not one contiguous block" in release.gdn_snapshot_unserved(strided, args())
    assert "no_buffer" in release.gdn_snapshot_unserved(backend, args(strategy="no_buffer"))
    assert release.gdn_snapshot_unserved(backend, args(radix=False, strategy="no_buffer")) is None
    assert "mixed-chunk" in release.gdn_snapshot_unserved(backend, args(radix=False, mixed=True))
    assert "--enable-streaming-session" in release.gdn_snapshot_unserved(backend, args(streaming_sessions=True))
    linear = backend.linear_attn_backend
    assert release.mamba_slots(linear, torch.tensor([1, 2])).tolist() == [3, 4]  # row -> slot -> physical


def test_the_redirect_moves_only_its_own_servers_verifies_to_the_request_rows():
    class Dispatcher:
        def target_verify(self, *args, **kwargs):
            return kwargs

    _, caches = fake_backend()
    keeper = SnapshotState(caches.temporal, caches.intermediate_ssm, max_bs=4)
    install_verify_redirect(keeper, Dispatcher)
    install_verify_redirect(keeper, Dispatcher)  # once: a second server's keeper joins the same wrapper
    keeper.before_verify(torch.tensor([2, 1]), torch.tensor([4, 3]))
    layer = caches.intermediate_ssm[1]
    slots = torch.tensor([4, 3, -1])  # a graph batch padded to 3
    got = Dispatcher().target_verify(ssm_states=caches.temporal[1], cache_indices=slots,
                                     intermediate_states_buffer=layer, intermediate_state_indices=torch.arange(3))
    assert got["ssm_states"].data_ptr() == layer.data_ptr() and got["ssm_states"].shape == (16, 3, 4)
    assert got["cache_indices"].tolist() == [8, 4, -1]  # row * 4 steps + step 0 (staged), padding -1
    assert got["intermediate_state_indices"].tolist() == [2, 1, -1]
    other = torch.zeros(4, 4, 3, 4)
    untouched = Dispatcher().target_verify(ssm_states=caches.temporal[1], cache_indices=slots,
                                           intermediate_states_buffer=other, intermediate_state_indices=torch.arange(3))
    assert untouched["cache_indices"] is slots  # another server's verify (or none kept)
    with pytest.raises(RuntimeError, match="past the 4 kept for"):
        keeper.verify_arguments({"cache_indices": torch.zeros(5), "intermediate_states_buffer": layer})


def test_a_verify_commits_the_convolution_windows_and_leaves_the_ssm_state_in_place(monkeypatch):
    from sglang.kernels.ops.mamba import mamba_state_scatter_triton as scatter

    from sglang_dflash.worker import DFlashWorker

    calls = []
    monkeypatch.setattr(scatter, "scatter_mamba_states_after_mtp_verify", lambda caches, *args: calls.append((caches, args)))
    backend, caches = fake_backend()
    caches.intermediate_ssm.copy_(torch.arange(caches.intermediate_ssm.numel()).view_as(caches.intermediate_ssm))
    worker = object.__new__(DFlashWorker)
    worker.release, worker.width_pairs = compat.running(), {16: (backend, None)}
    worker.gdn_state = keeper = SnapshotState(caches.temporal, caches.intermediate_ssm, max_bs=4)
    worker.verify_track = __import__("collections").Counter()
    worker.may_reach_track = lambda batch, committed: True
    worker.release._track_interval = 4
    batch = SimpleNamespace(mamba_track_indices=torch.tensor([2, -1, 3]), seq_lens=torch.tensor([3, 9, 14]),
                            req_pool_indices=torch.tensor([3, 1, 2]))
    accepted = SimpleNamespace(commit_len=torch.tensor([2, 1, 4]))
    DFlashWorker.commit_recurrent_state(worker, batch, accepted, 16, None)
    (conv_only, args), = calls
    assert conv_only.temporal.numel() == 0 and conv_only.conv is caches.conv  # SGLang's scatter skips the SSM pool
    dst, last, track, steps = args
    assert dst.tolist() == [7, 8, 9] and last.tolist() == [1, 0, 3] and track.tolist() == [3, -1, 4]
    assert steps.tolist() == [0, -1, 1]  # 3 -> 5 and 14 -> 18 cross a boundary every 4 tokens
    assert keeper.live_step.tolist() == [-1, 0, 3, 1]  # each request's state: its last accepted step
    # the SSM checkpoints come from the request rows: request row 3's step 0, row 2's step 1
    assert torch.equal(caches.temporal[:, 3], caches.intermediate_ssm[:, 3, 0])
    assert torch.equal(caches.temporal[:, 4], caches.intermediate_ssm[:, 2, 1])
    assert caches.temporal[:, :3].abs().sum() == 0 and caches.temporal[:, 5].abs().sum() == 0  # no other slot
