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
    "check_block_kernels", "check_accept_block_at_every_verify_width", "check_context_kv", "check_block_attention", "check_worker_steps_follow_plain_decoding",
    "check_worker_steps_at_changing_widths_follow_plain_decoding"])
def test_kernel_matches_reference_in_triton_interpreter(check):
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(TESTS), TESTS, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", f"import kernel_checks; kernel_checks.{check}('cpu')"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
