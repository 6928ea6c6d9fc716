"""SGLang's own gated-delta-net kernels verifying fewer tokens than the block, on the CPU.

docs/design/hybrid_width_cpu_check.py runs the installed release's verify and conv kernels under the
Triton interpreter with the width changing every step (plain decode steps mixed in), and compares
outputs, committed states and radix checkpoints with the same tokens run one at a time. It is what
makes a narrower verify on a hybrid target lossless (docs/design/hybrid-adaptive-width.md, §3a).
"""

import os
import subprocess
import sys

import pytest

CHECK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "design",
                     "hybrid_width_cpu_check.py")


def test_a_narrower_verify_in_the_block_sized_scratch_commits_the_states_of_one_token_at_a_time():
    pytest.importorskip("triton")
    out = subprocess.run([sys.executable, CHECK], capture_output=True, text=True, timeout=900,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert out.returncode == 0, out.stdout[-1000:] + out.stderr[-3000:]
    assert "(outputs, states, checkpoints): 0.0" in out.stdout, out.stdout
