"""GPU: DFLASH behind prefill-decode disaggregation on one GPU, token for token against plain decoding.

    bash lab/gpu_pd.sh OUTDIR [--prompts 100] [--new-tokens 64] [--backend mooncake_tcp]

Servers, tiny float32 pair, triton, each with a fixed KV pool, started together:
- ``ar``: plain decoding;
- a PD pair with the plugin installed and DFLASH asked for on both roles: ``prefill``
  (``--disaggregation-mode prefill``, which serves the bootstrap port) and ``decode``;
- SGLang's MiniLB (``sglang_router``) in front of the pair.

The plugin hands both roles to SGLang's built-in (``config.builtin_serves``), and each role's log
must say so. Greedy prompts sent through the router must give plain decoding's tokens, and both PD
servers' KV pools must be back to 0 afterwards. ``pd.json`` is rewritten after every stage. Exit 1
on a mismatch, an error, a missing log line or a busy pool.
"""

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from sglang_dflash import compat
from sglang_dflash.bench.client import get_json, kv_loads, post_json
from sglang_dflash.bench.server import Server, ServerSpec, exit_on_sigterm, free_port, start_together, stop_all
from lab.tiny_pair import DEFAULT_DIR, ensure_tiny_pair

# Decode graphs for every batch the pool admits: the built-in's eager draft step crashes in float32
# (bfloat16 input embeddings against float32 weights, seen with graphs up to bs 8 only).
FLAGS = ["--attention-backend", "triton", "--grammar-backend", "none", "--disable-prefill-cuda-graph",
         "--cuda-graph-max-bs-decode", "32", "--mem-fraction-static", "0.25", "--max-total-tokens", "65536",
         "--max-running-requests", "32", "--log-level", "warning", "--dtype", "float32"]
# Float32 norms and IEEE dots as in lab/lossless_pair.py; the transfer engine on the loopback address
# (SGLang's local-IP probe needs a network otherwise).
ENV = {"SGLANG_DFLASH_FP32_NORM": "1", "TRITON_F32_DEFAULT": "ieee", "SGLANG_HOST_IP": "127.0.0.1",
       "MC_TCP_ENABLE_CONNECTION_POOL": "true"}
BUILTIN_LINE = "DFLASH is served by SGLang's built-in implementation: PD disaggregation (--disaggregation-mode {})"


def payloads(n: int, new_tokens: int, vocab: int, length: int = 32) -> list[dict]:
    rng = random.Random(0)
    return [{"input_ids": [rng.randrange(10, vocab) for _ in range(length)],
             "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0}} for _ in range(n)]


def generate_all(url: str, work: list[dict]) -> list[dict]:
    def one(p):
        try:
            return post_json(url + "/generate", p)
        except (OSError, ValueError) as e:
            return {"error": f"{type(e).__name__}: {e}"}

    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(one, work))


def tokens(out: dict):
    return out.get("output_ids", out.get("text")) if "error" not in out else None


def start_router(prefill: Server, decode: Server, bootstrap: int, log_path: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
                                 "--mini-lb", "--prefill", prefill.url, str(bootstrap), "--decode", decode.url,
                                 "--host", "127.0.0.1", "--port", str(port)],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        try:
            get_json(url + "/health", timeout=5)
            return proc, url
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"the router did not come up (exit code {proc.poll()}); see {log_path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="folder for pd.json and the server logs")
    parser.add_argument("--prompts", type=int, default=100, help="greedy prompts (default 100)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens per prompt (default 64)")
    parser.add_argument("--backend", default="mooncake_tcp", help="--disaggregation-transfer-backend (default mooncake_tcp)")
    parser.add_argument("--tiny-dir", default=DEFAULT_DIR, help="the tiny pair (made if absent)")
    args = parser.parse_args()
    exit_on_sigterm()
    os.makedirs(args.out, exist_ok=True)
    target, draft, vocab = ensure_tiny_pair(args.tiny_dir)
    record = {"sglang": compat.running().version, "transfer_backend": args.backend, "dtype": "float32",
              "prompts": args.prompts, "new_tokens": args.new_tokens, "stage": "start"}
    path = os.path.join(args.out, "pd.json")

    def save(**kw):
        record.update(kw)
        with open(path, "w") as f:
            json.dump(record, f, indent=1)

    bootstrap = free_port()

    def pd(role):
        flags = FLAGS + ["--disaggregation-mode", role, "--disaggregation-transfer-backend", args.backend,
                         "--disaggregation-bootstrap-port", str(bootstrap)]
        return Server(ServerSpec("plugin", target, draft, 16, flags, ENV), health_path="/health",
                      log_path=os.path.join(args.out, f"server-{role}.log"), timeout_s=480)

    servers = {"ar": Server(ServerSpec("ar", target, extra_args=FLAGS, extra_env=ENV),
                            log_path=os.path.join(args.out, "server-ar.log"), timeout_s=480),
               "prefill": pd("prefill"), "decode": pd("decode")}
    router = None
    work = payloads(args.prompts, args.new_tokens, vocab)
    try:
        start_together(list(servers.values()))
        router, router_url = start_router(servers["prefill"], servers["decode"], bootstrap,
                                          os.path.join(args.out, "router.log"))
        save(stage="servers up")
        generate_all(router_url, work[:2])  # kernels compile, the transfer connects
        pd_outs = generate_all(router_url, work)
        ar_outs = generate_all(servers["ar"].url, work)
        mismatched = [i for i, (a, b) in enumerate(zip(ar_outs, pd_outs)) if tokens(a) is None or tokens(a) != tokens(b)]
        errors = sum("error" in o for o in pd_outs + ar_outs)
        save(stage="compared", mismatches=len(mismatched), first_mismatches=mismatched[:10], errors=errors,
             first_error=next((o["error"] for o in pd_outs + ar_outs if "error" in o), None),
             kv_after={n: kv_loads(servers[n].url) for n in ("prefill", "decode")})
    finally:
        if router is not None and router.poll() is None:
            os.killpg(router.pid, signal.SIGTERM)
        stop_all(list(servers.values()))
    logs = {role: open(servers[role].log_path, errors="replace").read() for role in ("prefill", "decode")}
    builtin = {role: BUILTIN_LINE.format(role) in text for role, text in logs.items()}
    idle = all(kv.get("num_used_tokens") == 0 for kv in record.get("kv_after", {}).values()) and "kv_after" in record
    save(stage="done", served_by_builtin_logged=builtin, kv_idle=idle)
    print(json.dumps(record))
    ok = record.get("mismatches") == 0 and not record.get("errors") and all(builtin.values()) and idle
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
