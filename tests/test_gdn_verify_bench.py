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
