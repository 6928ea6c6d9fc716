"""GPU: one greedy workload through several servers in turn; saves every output and the divergences.

    python scripts/gpu_compare_impls.py OUTDIR TINY_DIR DTYPE impl[:extra-flag] ...

Used to tell plugin bugs from kernel numerics: the built-in DFLASH runs the same workload.
"""
import json, os, sys
sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "tests", "gpu"), os.path.join(os.getcwd(), "tests")]
from benchmark_sglang import Server, ServerError, run_requests
from test_server_gpu import first_divergence, greedy, prompts, server_spec

out, tiny, dtype, impls = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
os.environ["DFLASH_TINY_DIR"] = tiny
work = [greedy(p) for p in prompts(200, 4096)]
runs = {}
for item in impls:
    impl, *extra = item.split(":")
    name = item.replace(":", "").replace("--", "-")
    try:
        with Server(server_spec(impl, dtype, 16, tuple(extra)), log_path=f"{out}/server-{name}.log", timeout_s=300) as s:
            res, wall = run_requests(s.url, work, 32, desc=name)
    except ServerError as e:
        print(name, "FAILED", e, e.log_tail[-1500:]); continue
    runs[name] = {"ids": [r.output_ids for r in res], "verify": [r.spec_verify_ct for r in res],
                  "errors": sum(not r.ok for r in res), "wall_s": wall}
ar = runs.get("ar")
summary = {}
for name, r in runs.items():
    pairs = enumerate(zip(r["ids"], ar["ids"] if ar else r["ids"]))
    div = [[i, first_divergence(a, b)] for i, (a, b) in pairs if a != b]
    toks = sum(len(x) for x in r["ids"])
    summary[name] = {"mismatches": len(div), "first_divergence": div[:12], "errors": r["errors"],
                     "accept": toks / max(sum(r["verify"]), 1), "wall_s": round(r["wall_s"], 2)}
print(json.dumps(summary, indent=1))
json.dump({"summary": summary, "runs": runs}, open(f"{out}/compare_{dtype}.json", "w"))
