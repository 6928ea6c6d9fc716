"""The Triton kernels of ``sglang_dflash.ops`` against the pure-torch reference, on CPU.

Triton's interpreter (``TRITON_INTERPRET=1``) runs the kernels on CPU tensors; it must be set
before triton is imported, so each check runs in a fresh interpreter. The GPU suite runs the
same checks on CUDA.
"""

import os
import subprocess
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("check", [
    "check_block_kernels", "check_accept_block_at_every_verify_width", "check_context_kv", "check_block_attention", "check_refused_tile", "check_worker_steps_follow_plain_decoding",
    "check_worker_steps_at_changing_widths_follow_plain_decoding"])
def test_kernel_matches_reference_in_triton_interpreter(check):
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(TESTS), TESTS, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", f"import kernel_checks; kernel_checks.{check}('cpu')"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_wide_query_tiles_run_eight_warps():
    """The hybrid targets' 128 x 256 tiles (block 16) at 8 warps; the 4B's 64 x 256 and every tile
    of heads up to 128 that the dense rigs timed stay at 4."""
    from sglang_dflash.ops.block_attention import query_rows, warps_for

    assert warps_for(query_rows(16, 8), 256) == 8  # Qwen3.6-35B-A3B: 16 query heads on 2 KV heads
    assert warps_for(query_rows(16, 6), 256) == 8  # Qwen3.5-27B: 24 on 4
    assert warps_for(query_rows(16, 4), 256) == 4  # Qwen3.5-4B: 16 on 4
    assert warps_for(query_rows(8, 8), 256) == 4
    assert warps_for(query_rows(16, 8), 128) == 4  # heads of 128 on a group of 8
    assert warps_for(query_rows(16, 4), 128) == 4  # the 8B-shape rig: 32 on 8
