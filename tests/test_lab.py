"""The lab's reference-server shim: SGLang's penalizers in one order, whatever the process."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIM = os.path.join(ROOT, "lab", "ordered-penalizers")

PROBE = """
import sys
from sglang.srt.sampling import penaltylib as p
from sglang.srt.sampling.penaltylib.orchestrator import BatchedPenalizerOrchestrator
class Batch:
    device, reqs = "cpu", []
classes = {p.BatchedRepetitionPenalizer, p.BatchedPresencePenalizer, p.BatchedMinNewTokensPenalizer,
           p.BatchedFrequencyPenalizer}
print(",".join(c.__name__ for c in BatchedPenalizerOrchestrator(8, Batch(), classes).penalizers))
print("next sitecustomize ran:", "next_ran" in sys.modules)
"""


def run_probe(tmp_path, with_shim: bool) -> list[str]:
    nxt = tmp_path / "next"
    nxt.mkdir(exist_ok=True)
    (nxt / "sitecustomize.py").write_text("import sys, types\nsys.modules['next_ran'] = types.ModuleType('next_ran')\n")
    path = [SHIM] if with_shim else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path + [str(nxt), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "Error in sitecustomize" not in out.stderr, out.stderr
    return out.stdout.split("\n")


def test_the_reference_server_applies_repetition_after_the_additive_penalties(tmp_path):
    order, chained, _ = run_probe(tmp_path, with_shim=True)
    assert order == ("BatchedFrequencyPenalizer,BatchedPresencePenalizer,BatchedMinNewTokensPenalizer,"
                     "BatchedRepetitionPenalizer")
    assert chained == "next sitecustomize ran: True"  # the kit's own shim still loads behind it
    order, chained, _ = run_probe(tmp_path, with_shim=False)
    assert set(order.split(",")) == {"BatchedFrequencyPenalizer", "BatchedPresencePenalizer",
                                     "BatchedMinNewTokensPenalizer", "BatchedRepetitionPenalizer"}
    assert chained == "next sitecustomize ran: True"
