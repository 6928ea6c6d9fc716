"""A GDN verify that keeps no state snapshots, and commits by re-running the accepted tokens, against
SGLang's snapshot verify, on the CPU.

lab/gdn_verify_bench.py --check runs the installed release's ``fused_sigmoid_gating_delta_rule_update``
under the Triton interpreter on a small shape: the verify with per-token snapshots and the commit copy
of the accepted one (SGLang's way); the verify without snapshots and the same kernel re-run over each
request's accepted tokens into its state slot; and the verify in place from a saved copy of each state,
with only the requests that accepted less than the block re-run from their copy. Outputs and committed
state pools must be the same bits, in every case.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_replaying_the_accepted_tokens_commits_the_snapshot_verifys_states_bit_for_bit(tmp_path):
    pytest.importorskip("triton")
    report_path = tmp_path / "x.json"
    out = subprocess.run([sys.executable, "-m", "lab.gdn_verify_bench", str(report_path), "--check"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert out.returncode == 0, out.stdout[-1000:] + out.stderr[-3000:]
    cases = json.loads(report_path.read_text())["cases"]
    assert len(cases) == 6
    assert {c["accepted"] for c in cases} >= {"mixed", 1}
    for c in cases:
        for suffix in ("", "_same_launch"):
            assert c["outputs_equal" + suffix] and c["states_equal" + suffix], c
            assert c["saved_outputs_equal" + suffix] and c["saved_states_equal" + suffix], c
            assert not c["output_only_wrote_state" + suffix], c
        assert c["same_launch_snapshot_unwritten"], c


def test_a_verify_can_start_from_its_requests_snapshot_row_with_no_commit_copy(tmp_path):
    """docs/design/gdn-commit-without-copy.md: SGLang's kernel reading each request's start state from
    the snapshot buffer it overwrites gives the commit copy's bits, once rows follow the requests."""
    pytest.importorskip("triton")
    report_path = tmp_path / "x.json"
    out = subprocess.run([sys.executable, "-m", "lab.gdn_state_in_snapshot", str(report_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stdout[-1000:] + out.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert all(report["rows_follow_requests"].values()), report
    assert not report["rows_by_batch_position"]["states_equal"], report  # a reordered batch clobbers them
    # sglang_dflash.gdn_state over a request's life: plain steps between verifies, a reused row, a track copy
    assert report["plugin_keeper"] == {"outputs_equal": True, "states_equal": True, "track_equal": True}, report


def test_the_state_copy_refuses_pools_it_cannot_copy_between():
    pytest.importorskip("triton")
    import torch

    from sglang_dflash.gdn_state import SnapshotState
    from sglang_dflash.ops.state_copy import copy_states

    pool, index = torch.zeros(2, 5, 3, 4), torch.zeros(2, dtype=torch.int32)
    for dst, src, why in ((pool, torch.zeros(3, 5, 3, 4), "layers"), (pool, torch.zeros(2, 5, 4, 3), "state shape"),
                          (pool, torch.zeros(2, 5, 3, 4, dtype=torch.float64), "dtype"),
                          (pool, torch.zeros(2, 5, 4, 3).transpose(2, 3), "contiguous")):
        with pytest.raises(ValueError, match=why):
            copy_states(dst, index, src, index)
    with pytest.raises(ValueError, match="2 destinations for 3 sources"):
        copy_states(pool, index, pool, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="do not match the state pool"):
        SnapshotState(pool, torch.zeros(2, 4, 2, 3, 5), max_bs=4)
    keeper = SnapshotState(pool, torch.zeros(2, 4, 2, 3, 4), max_bs=4)
    assert keeper.flat.shape == (2, 8, 3, 4) and keeper.live_step.tolist() == [-1] * 4
