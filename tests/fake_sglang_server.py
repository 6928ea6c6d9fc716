"""A stand-in for an SGLang server on localhost, for CPU tests of the benchmark (sglang_dflash.bench).

    python tests/fake_sglang_server.py --port P [--accept 3.0] [--fail-every N] [--delay-ms D] [--leak-on-abort]
                                       [--compile-at N]

Speaks the parts of SGLang's HTTP API the benchmark uses: streamed ``/generate`` with
``meta_info`` counters (``spec_verify_ct`` = tokens / accept), ``/health_generate``,
``/flush_cache``, ``/v1/loads`` and ``/server_info``. Every N-th request fails with HTTP 500.
``/v1/loads`` counts the tokens of requests in flight; ``--leak-on-abort`` keeps those of requests
whose client went away, as a server that leaks KV on aborts would.
"""

import argparse
import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def make_handler(args):
    lock = threading.Lock()
    count = {"n": 0, "used": 0, "running": 0}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _json(self, code, obj):
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path in ("/health_generate", "/flush_cache"):
                return self._json(200, {"ok": True})
            if self.path == "/v1/loads":
                with lock:
                    used, running = count["used"], count["running"]
                return self._json(200, {"loads": [{"num_used_tokens": used, "max_total_num_tokens": 100000,
                                                   "num_running_reqs": running, "num_waiting_reqs": 0,
                                                   "token_usage": used / 100000}]})
            if self.path == "/server_info":
                state = {"avg_spec_accept_length": args.accept}
                if args.accept > 1:  # the plugin's entry; its GC count moves with each request served
                    state["dflash"] = {"block_size": 16, "host_pauses": {"gc_full_collections": count["n"]},
                                       "decode_steps": 4 * count["n"], "eager_drafts": count["n"] // 2,
                                       "eager_verifies": {"16": count["n"] // 2, "4": 1},
                                       "stalls": {"calls": 5 * count["n"], "over_ms": 50.0, "stalls": count["n"] // 3,
                                                  "stall_ms": 60.0 * (count["n"] // 3),
                                                  "recent": [[5 * count["n"], "decode>extend", 2, 256, 60.0, 1.0]],
                                                  "decode_host": {"calls": 4 * count["n"], "call_ms": 8.0 * count["n"],
                                                                  "gap_ms": 4.0 * count["n"], "policy_ms": 0.2 * count["n"],
                                                                  "phases_ms": {"verify": 4.8 * count["n"], "accept": 1.2 * count["n"]}},
                                                  # per request: 4 decode steps (8 ms in calls, 4 before),
                                                  # one admission (3 ms in the call, 1 before): of its call
                                                  # the target's prefill 2 ms, the draft context 0.5
                                                  "admission_host": {"phases_ms": {"target": 2.0 * count["n"],
                                                                                   "draft context": 0.5 * count["n"]}},
                                                  "by_mode": {
                                                      "decode": {"calls": 4 * count["n"], "tokens": 0,
                                                                 "call_ms": 8.0 * count["n"], "gap_ms": 4.0 * count["n"]},
                                                      "extend": {"calls": count["n"], "tokens": 100 * count["n"],
                                                                 "call_ms": 3.0 * count["n"], "gap_ms": 1.0 * count["n"]}},
                                                  # of the 4 decode steps, one right after the admission: 6 of the 12 ms
                                                  "by_transition": {
                                                      "extend>decode": {"calls": count["n"], "call_ms": 4.0 * count["n"],
                                                                        "gap_ms": 2.0 * count["n"]},
                                                      "decode>decode": {"calls": 3 * count["n"], "call_ms": 4.0 * count["n"],
                                                                        "gap_ms": 2.0 * count["n"]}}}}
                return self._json(200, {"internal_states": [state]})
            self._json(404, {"error": "not found"})

        def do_POST(self):
            if self.path == "/flush_cache":
                return self._json(200, {"ok": True})
            if self.path != "/generate":
                return self._json(404, {"error": "not found"})
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                count["n"] += 1
                n = count["n"]
            if args.fail_every and n % args.fail_every == 0:
                return self._json(500, {"error": "injected failure"})
            if args.compile_at == n:  # SGLang 0.5.23's warning for a Triton compile while serving
                print("[2026-11-25 04:33:36] Triton kernel '_fwd_kernel' took 1.18 s to compile after serving "
                      "started. Serving-time compilation can stall the engine; pre-compile it during engine init.",
                      flush=True)
            params = req.get("sampling_params", {})
            prompt = req.get("text") or " ".join(map(str, req.get("input_ids", [])))
            # an EOS after a few tokens, as SGLang does unless the request ignores it
            total = params.get("max_new_tokens", 16)
            if not params.get("ignore_eos"):
                total = min(total, 4 + len(prompt) % 29)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            step = max(1, int(args.accept))
            with lock:
                count["used"] += total + len(prompt)
                count["running"] += 1
            aborted = False
            try:
                for done in range(step, total + step, step):
                    done = min(done, total)
                    time.sleep(args.delay_ms / 1000)
                    meta = {"completion_tokens": done, "prompt_tokens": len(prompt), "finish_reason": None}
                    if args.accept > 1:
                        meta["spec_verify_ct"] = math.ceil(done / args.accept)
                    if done == total:
                        meta["finish_reason"] = {"type": "length", "length": total}
                    chunk = {"text": "x" * done, "output_ids": list(range(done)), "meta_info": meta}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")
            except (BrokenPipeError, ConnectionResetError):
                aborted = True
            finally:
                with lock:
                    count["running"] -= 1
                    if not (aborted and args.leak_on_abort):
                        count["used"] -= total + len(prompt)

    return Handler


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--accept", type=float, default=1.0)
    ap.add_argument("--fail-every", type=int, default=0)
    ap.add_argument("--delay-ms", type=float, default=1.0)
    ap.add_argument("--leak-on-abort", action="store_true")
    ap.add_argument("--compile-at", type=int, default=0, help="log a serving-time Triton compile at request N")
    args, _ = ap.parse_known_args()
    ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(args)).serve_forever()


if __name__ == "__main__":
    main()
