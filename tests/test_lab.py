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


def load_matrix():
    import importlib.util
    if os.path.join(ROOT, "lab") not in sys.path:  # as when run as a script: the lab's own modules import
        sys.path.insert(0, os.path.join(ROOT, "lab"))
    spec = importlib.util.spec_from_file_location("request_params_matrix",
                                                  os.path.join(ROOT, "lab", "request_params_matrix.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_matrix_measures_every_row_before_the_ones_that_crash_servers():
    m = load_matrix()
    order = m.row_order(list(m.rows([[1, 2, 3]], 8, True, {0: "ab"})))
    assert order[-3:] == ["sampled", "n", "token_ids_logprob"]
    assert {"plain", "penalties_together", "stop", "stream", "return_logprob", "json_schema", "regex"} <= set(order)


def test_the_matrix_sampled_row_compares_each_position_not_only_whole_sequences():
    from collections import Counter
    m = load_matrix()
    a = Counter({(1, 2, 3, 4): 1, (1, 2, 3, 5): 1, (1, 2, 3, 6): 1, (1, 2, 3, 7): 1})
    b = Counter({(1, 2, 3, 8): 1, (1, 2, 3, 9): 1, (1, 2, 3, 10): 1, (1, 2, 3, 11): 1})
    assert m.total_variation(a, b) == 1.0  # disjoint sequences
    assert m.marginal_tv(a, b) == 1.0  # ... told apart by their last position alone
    assert m.marginal_tv(a, Counter({(1, 2, 3, 4): 2, (1, 2, 3, 5): 2})) == 0.5
    assert m.total_variation(a, Counter()) == 1.0  # a crashed server's empty sample


def test_the_matrix_does_not_count_a_row_the_reference_failed():
    m = load_matrix()
    ok = [{"output_ids": [1, 2], "meta_info": {"finish_reason": "length"}}]
    summary = m.compare({"ar-sync": [[{"error": "boom"}], ok], "plugin": [ok, ok]})
    assert summary["reference_errors"] == 1 and summary["plugin"]["mismatches"] == 1
