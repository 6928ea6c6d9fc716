"""Diagnostic: AR and plugin fp32 servers at once, info logs, then a short greedy comparison."""
import os, sys, time, json
sys.path.insert(0, os.getcwd())
from benchmark_sglang import Server, ServerSpec, run_requests, ServerError
sys.path.insert(0, os.path.join(os.getcwd(), "tests", "gpu")); sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
from test_server_gpu import prompts, greedy, COMMON
out = os.environ["OUT"]; tiny = os.environ["DFLASH_TINY_DIR"]
flags = [f for f in COMMON if f not in ("--log-level", "warning")] + ["--dtype", "float32", "--log-level", "info",
         "--cuda-graph-max-bs", "8", "--mem-fraction-static", "0.25"]
env = {"SGLANG_DFLASH_FP32_NORM": "1"}
specs = {"plugin": ServerSpec("plugin", f"{tiny}/target", f"{tiny}/draft", 16, flags, env),
         "ar": ServerSpec("ar", f"{tiny}/target", None, None, flags, env)}
servers = {k: Server(s, log_path=f"{out}/diag-{k}.log", timeout_s=240) for k, s in specs.items()}
import threading
errs = {}
def start(k):
    try: servers[k].start()
    except ServerError as e: errs[k] = str(e)
ts = [threading.Thread(target=start, args=(k,)) for k in servers]; [t.start() for t in ts]; [t.join() for t in ts]
print("start errors:", errs, flush=True)
try:
    if not errs:
        res = {k: run_requests(s.url, [greedy(p) for p in prompts(64, 4096)], 16)[0] for k, s in servers.items()}
        a, b = [[r.output_ids for r in res[k]] for k in ("plugin", "ar")]
        mism = [i for i in range(64) if a[i] != b[i]]
        tok = sum(r.completion_tokens for r in res["plugin"]); ver = sum(r.spec_verify_ct for r in res["plugin"])
        print(json.dumps({"errors": [r.error for r in res["plugin"] if not r.ok][:3], "mismatches": len(mism),
                          "first": mism[:5], "accept": tok / max(ver, 1)}), flush=True)
        for i in mism[:2]:
            print("plugin", a[i][:40]); print("ar    ", b[i][:40])
finally:
    for s in servers.values(): s.stop()
