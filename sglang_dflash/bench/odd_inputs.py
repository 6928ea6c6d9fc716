"""Odd requests against plain decoding, SGLang's built-in DFLASH and the plugin, one server at a time.

    python -m sglang_dflash.bench.odd_inputs --model-path TARGET --draft-model-path DRAFT \\
        --impls ar,builtin,plugin --output-dir OUT [--server-args "..."]

Each request is sent to a healthy server and read as ``served`` (200), ``refused`` (a 4xx with a
message), ``error`` (any other answer from a server that stays up) or ``crashed`` (the server did
not answer /health_generate afterwards; it is restarted for the next request). A served request is
also checked for sense where the case says what sense is (``insane`` names what failed). The
prompts come from the target's own tokenizer: an empty text stays empty where it adds no BOS.

``OUT/odd.json``: ``{case: {impl: {outcome, status, message, ...}}}`` after every server, and
``problems``: each request the plugin did not serve or refuse, or refused where plain decoding
served it. Exit code 1 when there is one.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable, Optional, Union

from .cli import comma_list, parser

CRASH_MARKERS = ("Error", "Exception", "error:", "Traceback")


@dataclass(frozen=True)
class OddCase:
    body: Union[dict, str]  # a str goes out as it is, not as JSON
    path: str = "/generate"
    # For a served request: why its answer makes no sense, or None.
    check: Optional[Callable[[Union[dict, list]], Optional[str]]] = None


def _outputs(body) -> list:
    return body if isinstance(body, list) else [body]


def _tokens_at_most(limit: int):
    def check(body):
        counts = [o.get("meta_info", {}).get("completion_tokens") for o in _outputs(body)]
        return None if all(c is not None and c <= limit for c in counts) else f"completion_tokens {counts} > {limit}"
    return check


def _every_token_is(token: int):
    def check(body):
        ids = [t for o in _outputs(body) for t in (o.get("output_ids") or [])]
        return None if ids and all(t == token for t in ids) else f"output ids {ids[:12]} are not all {token}"
    return check


def _outputs_count(n: int):
    def check(body):
        got = len(_outputs(body))
        return None if got == n else f"{got} outputs, asked for {n}"
    return check


def _top_logprobs_per_token(k: int):
    def check(body):
        meta = _outputs(body)[0].get("meta_info", {})
        tops = meta.get("output_top_logprobs") or []
        if len(tops) != meta.get("completion_tokens"):
            return f"{len(tops)} top-logprob lists for {meta.get('completion_tokens')} tokens"
        return None if all(len(t) == k for t in tops) else f"top lists of {sorted({len(t) for t in tops})}, asked {k}"
    return check


# Requests that ended a 0.5.23 server of plain decoding or the built-in: sent last, so a run cut
# short during the restarts they cause has measured the rest.
ENDED_A_SERVER = ("token id past the vocabulary", "negative token id", "huge top_logprobs_num",
                  "empty prompt on /v1/completions", "empty text")


def odd_cases(vocab: int, context: int, special_ids: list[int], special_text: str) -> dict[str, OddCase]:
    """The requests, by name. ``special_ids``/``special_text``: the tokenizer's special tokens alone."""
    def gen(prompt: Union[str, list], max_new_tokens: int = 8, **params) -> dict:
        key = "text" if isinstance(prompt, str) else "input_ids"
        return {key: prompt, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, **params}}

    hello = "Write one sentence about the sea."
    cases = {
        "empty text": OddCase(gen("")),
        "whitespace-only text": OddCase(gen(" \n\t  ")),
        "only special tokens (text)": OddCase(gen(special_text)),
        "only special tokens (ids)": OddCase(gen(list(special_ids))),
        "token id past the vocabulary": OddCase(gen([1, 2, vocab + 7])),
        "negative token id": OddCase(gen([1, -3, 2])),
        "prompt past the context": OddCase(gen([100 + i % 1000 for i in range(context + 16)])),
        "max_new_tokens 0": OddCase(gen(hello, 0), check=_tokens_at_most(0)),
        "max_new_tokens far past the context": OddCase(gen(hello, 10 * context), check=_tokens_at_most(context)),
        "min_new_tokens above max_new_tokens": OddCase(gen(hello, 8, min_new_tokens=16), check=_tokens_at_most(8)),
        "negative temperature": OddCase(gen(hello, temperature=-1.0)),
        # JSON has no NaN; Python's encoder writes the token anyway, as careless clients do.
        "NaN temperature": OddCase(json.dumps(gen(hello, temperature=math.nan))),
        "top_p 0": OddCase(gen(hello, temperature=0.8, top_p=0.0)),
        "top_p above 1": OddCase(gen(hello, temperature=0.8, top_p=1.5)),
        "top_k 0": OddCase(gen(hello, temperature=0.8, top_k=0)),
        "penalties at 0": OddCase(gen(hello, 16, frequency_penalty=0.0, presence_penalty=0.0),
                                  check=_tokens_at_most(16)),
        "repetition_penalty 0": OddCase(gen(hello, repetition_penalty=0.0)),
        "penalties at their largest": OddCase(gen(hello, 16, frequency_penalty=2.0, presence_penalty=2.0,
                                                  repetition_penalty=2.0), check=_tokens_at_most(16)),
        "huge penalties": OddCase(gen(hello, frequency_penalty=1e9, presence_penalty=1e9, repetition_penalty=1e9)),
        "n 0": OddCase(gen(hello, n=0)),
        "n 2": OddCase(gen(hello, 8, n=2, temperature=0.8), check=_outputs_count(2)),
        "empty stop string": OddCase(gen(hello, 16, stop=[""]), check=_tokens_at_most(16)),
        "invalid regex": OddCase(gen(hello, regex="((")),
        "invalid JSON schema": OddCase(gen(hello, json_schema="{not json")),
        "logit_bias with unknown ids": OddCase(gen(hello, logit_bias={str(vocab + 5): 10.0})),
        # Greedy with one id pushed far up: every position, the drafted ones too, must take it.
        "logit_bias on one id": OddCase(gen(hello, 12, logit_bias={"42": 100.0}), check=_every_token_is(42)),
        "logprob_start_len past the prompt": OddCase({**gen(hello), "return_logprob": True,
                                                      "logprob_start_len": 10 * context}),
        "huge top_logprobs_num": OddCase({**gen(hello), "return_logprob": True, "top_logprobs_num": 10 * vocab}),
        "top_logprobs_num 5": OddCase({**gen(hello), "return_logprob": True, "top_logprobs_num": 5},
                                      check=_top_logprobs_per_token(5)),
        "unknown ids in token_ids_logprob": OddCase({**gen(hello), "return_logprob": True,
                                                     "token_ids_logprob": [3, vocab + 9]}),
        "body not JSON": OddCase("this is not JSON {"),
        "empty prompt on /v1/completions": OddCase({"model": "default", "prompt": "", "max_tokens": 8,
                                                    "temperature": 0}, path="/v1/completions"),
    }
    return {**{k: v for k, v in cases.items() if k not in ENDED_A_SERVER}, **{k: cases[k] for k in ENDED_A_SERVER}}


def post(url: str, body: Union[dict, str], timeout: float = 300) -> tuple[int, Union[dict, list, str]]:
    """(HTTP status, decoded body) without raising on 4xx/5xx; status 0 when nothing answered."""
    data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    except OSError as e:
        return 0, f"{type(e).__name__}: {e}"
    text = raw.decode(errors="replace")
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def error_message(body) -> str:
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            return str(err.get("message") or "")
        if err:
            return str(err)
        return str(body.get("message") or body.get("detail") or body)
    return str(body)


def outcome(status: int, body, alive: bool, case: OddCase) -> dict:
    """What one request came to, as the suite records it."""
    if not alive:
        return {"outcome": "crashed", "status": status}
    if status == 200:
        insane = case.check(body) if case.check else None
        return {"outcome": "served", "status": status, **({"insane": insane} if insane else {})}
    message = error_message(body)
    if 400 <= status < 500 and message.strip():
        return {"outcome": "refused", "status": status, "message": message[:300]}
    return {"outcome": "error", "status": status, "message": message[:300]}


def crash_line(log_tail: str) -> str:
    """The last line of a dead server's log that names an error (its exception, usually)."""
    lines = [ln.strip() for ln in log_tail.splitlines() if any(m in ln for m in CRASH_MARKERS)]
    return lines[-1][:300] if lines else ""


def problems(results: dict, subject: str = "plugin", reference: str = "ar") -> list[str]:
    """Each request the subject crashed on, answered with a 5xx, served senselessly, or refused
    where the reference served it."""
    found = []
    for name, by_impl in results.items():
        got, ref = by_impl.get(subject), by_impl.get(reference)
        if got is None:
            continue
        if got["outcome"] in ("crashed", "error"):
            found.append(f"{name}: {subject} {got['outcome']} ({got.get('message') or got.get('cause') or got['status']})")
        elif got.get("insane"):
            found.append(f"{name}: {subject} served it wrongly ({got['insane']})")
        elif got["outcome"] == "refused" and ref is not None and ref["outcome"] == "served":
            found.append(f"{name}: {subject} refused what {reference} serves ({got['message']})")
    return found


def run_cases(server, cases: dict[str, OddCase], alive: Callable[[str], bool], restart: Callable[[], None],
              only: Optional[list[str]] = None, out: Optional[dict] = None,
              recorded: Callable[[], None] = lambda: None) -> dict:
    """Every case against one server, restarting it after a crash. Each outcome goes into ``out``
    as it comes, and ``recorded`` is called after it: a run cut off keeps what it measured."""
    out = {} if out is None else out
    names = [name for name in cases if not only or name in only]
    for i, name in enumerate(names):
        case = cases[name]
        status, body = post(server.url + case.path, case.body)
        up = alive(server.url)
        out[name] = outcome(status, body, up, case)
        if not up:
            out[name]["cause"] = crash_line(server.log_tail(200))
        recorded()
        if not up and i + 1 < len(names):  # a restart takes a minute: only for a request still to come
            restart()
    return out


class Restarter:
    """Starts a server again after a crash, its log in a file of its own (``STEM-1.log``, ...).
    ``starting``: a lock held while any server starts (0.5.23 refuses to start where another
    start moved memory under its reading); a start that fails is tried once more."""

    def __init__(self, server, log_stem: str, starting=None):
        self.server, self.log_stem, self.starting = server, log_stem, starting
        self.restarts = 0

    def __call__(self) -> None:
        from .server import ServerError

        self.server.stop(grace_s=5)
        self.restarts += 1
        self.server.log_path = f"{self.log_stem}-{self.restarts}.log"
        with self.starting or contextlib.nullcontext():
            try:
                self.server.start()
            except ServerError:  # memory moved under its reading (a neighbour's start or load)
                self.server.stop(grace_s=5)
                self.server.start()


def tokenizer_facts(model_path: str) -> tuple[int, list[int], str]:
    """(vocab size of the embedding, the special token ids, their text) of the target."""
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    vocab = int(AutoConfig.from_pretrained(model_path).vocab_size)
    specials = [i for i in tok.all_special_ids if i is not None][:4] or [0]
    return vocab, specials, "".join(tok.convert_ids_to_tokens(specials))


def main(argv=None) -> int:
    import shlex

    from .server import Server, ServerSpec
    from .stress import alive

    ap = parser(__doc__, prog="python -m sglang_dflash.bench.odd_inputs")
    ap.add_argument("--model-path", required=True, help="the target (a real tokenizer)")
    ap.add_argument("--draft-model-path", help="the DFlash draft, for the DFLASH servers")
    ap.add_argument("--impls", type=comma_list, default=["ar", "builtin", "plugin"], help="servers, in order")
    ap.add_argument("--context-length", type=int, default=4096, help="the servers' --context-length")
    ap.add_argument("--server-args", default="", help="more flags for every server")
    ap.add_argument("--cases", type=comma_list, help="only these cases (names as in odd.json)")
    ap.add_argument("--output-dir", required=True, help="odd.json and the server logs")
    args = ap.parse_args(argv)
    os.makedirs(args.output_dir, exist_ok=True)
    vocab, specials, special_text = tokenizer_facts(args.model_path)
    cases = odd_cases(vocab, args.context_length, specials, special_text)
    unknown = sorted(set(args.cases or []) - set(cases))
    if unknown:
        ap.error(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(cases)}")
    results: dict = {name: {} for name in cases if not args.cases or name in args.cases}
    report = {"vocab": vocab, "context_length": args.context_length, "cases": results, "starts": {}}
    flags = ["--context-length", str(args.context_length), *shlex.split(args.server_args)]

    def save() -> None:
        with open(os.path.join(args.output_dir, "odd.json"), "w") as f:
            json.dump(report, f, indent=1)

    for impl in args.impls:
        spec = ServerSpec(impl, args.model_path, args.draft_model_path, None, flags)
        stem = os.path.join(args.output_dir, f"server-{impl}")
        server = Server(spec, log_path=stem + ".log", timeout_s=600)
        restart, got = Restarter(server, stem), {}

        def recorded(impl=impl, got=got, restart=restart) -> None:  # each outcome kept as it comes
            name = next(reversed(got))
            results[name][impl] = got[name]
            report["starts"][impl] = 1 + restart.restarts
            print(f"{impl:>8}  {name:<40} {got[name]['outcome']:<8} "
                  f"{got[name].get('message') or got[name].get('cause') or ''}"[:160], flush=True)
            save()

        with server:
            run_cases(server, cases, alive, restart, args.cases, out=got, recorded=recorded)
        report["problems"] = problems(results) if "plugin" in args.impls else []
        save()
    for line in report["problems"]:
        print("PROBLEM", line)
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
