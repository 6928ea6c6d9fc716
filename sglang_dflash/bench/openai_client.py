"""The OpenAI-compatible API through the official ``openai`` client: a server's answers, and two
servers' answers compared (the plugin against plain decoding, greedy).

    python -m sglang_dflash.bench.openai_client --model-path TARGET --draft-model-path DRAFT \\
        --impls ar,plugin --output-dir OUT [--float32] [--server-args "..."]

Per server, :func:`collect` asks every case once and records the texts (and, for logprobs, the
tokens and their top lists). Checks inside one server: each stream's pieces join to the text of
the same request unstreamed, and the usage a stream reports last equals the unstreamed usage.
:func:`compare` then reads two servers' records case by case: ``same`` or ``differs``.
``--float32`` runs both servers where every text is exact (float32, Triton attention, prefills
eager), each asked every case once before the recorded round: float32 Triton compiles each new
shape on first use.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Optional

from .cli import comma_list, parser

PROMPTS = [
    "Explain in three sentences why the sky is blue.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
]
MAX_TOKENS = 96
# The SGLang snippet on the z-lab DFlash model cards: /v1/completions, "Once upon a time,", 512
# tokens at temperature 0.5. It is compared greedy; sampled, it is only served and counted.
CARD_PROMPT, CARD_MAX_TOKENS, CARD_TEMPERATURE = "Once upon a time,", 512, 0.5
STOP_PLACES = 6  # stop strings cut from the greedy answer at this many places
# Servers whose greedy texts are exact: float32 weights and norms, IEEE float32 in Triton's dots;
# prefills eager (capturing SGLang's prefill graphs in float32 compiles for minutes a server).
FLOAT32_FLAGS = ["--dtype", "float32", "--attention-backend", "triton", "--disable-prefill-cuda-graph"]
FLOAT32_ENV = {"SGLANG_DFLASH_FP32_NORM": "1", "TRITON_F32_DEFAULT": "ieee"}


def chat(client, prompt: str, **kw):
    return client.chat.completions.create(model="default", messages=[{"role": "user", "content": prompt}],
                                          temperature=0, max_tokens=kw.pop("max_tokens", MAX_TOKENS), **kw)


def streamed_chat(client, prompt: str, **kw) -> tuple[str, Optional[dict]]:
    """The joined text of a streamed chat, and the usage its last chunk reports."""
    pieces, usage = [], None
    for chunk in chat(client, prompt, stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = usage_of(chunk.usage)
        for choice in chunk.choices:
            if choice.delta and choice.delta.content:
                pieces.append(choice.delta.content)
    return "".join(pieces), usage


def usage_of(usage) -> dict:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens}


def stop_strings(text: str, places: int = STOP_PLACES) -> list[str]:
    """Short pieces of ``text`` at spread places, each the first time it occurs there (a stop cuts at
    its first occurrence), none all whitespace: most end inside a multi-token step."""
    out = []
    step = max(1, (len(text) - 8) // (places + 1))
    for k in range(step, len(text) - 4, step):
        piece = text[k:k + 4]
        if piece.strip() and text.find(piece) == k and piece not in out:
            out.append(piece)
        if len(out) == places:
            break
    return out


def collect(base_url: str) -> dict:
    """Every case against one server."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url + "/v1", api_key="EMPTY", timeout=600)
    rec: dict = {"chat": [], "chat_stream": [], "chat_usage": [], "chat_stream_usage": []}
    for prompt in PROMPTS:
        r = chat(client, prompt)
        rec["chat"].append(r.choices[0].message.content)
        rec["chat_usage"].append(usage_of(r.usage))
        text, usage = streamed_chat(client, prompt)
        rec["chat_stream"].append(text)
        rec["chat_stream_usage"].append(usage)
    stops = stop_strings(rec["chat"][0])
    rec["stops"] = {s: chat(client, PROMPTS[0], stop=[s]).choices[0].message.content for s in stops}
    r = chat(client, PROMPTS[1], logprobs=True, top_logprobs=3, max_tokens=48)
    rec["logprobs"] = [{"token": t.token, "logprob": t.logprob, "top": [x.token for x in t.top_logprobs]}
                       for t in r.choices[0].logprobs.content]
    r = chat(client, PROMPTS[2], n=2)
    rec["n2"] = [c.message.content for c in r.choices]
    r = client.completions.create(model="default", prompt=CARD_PROMPT, max_tokens=CARD_MAX_TOKENS, temperature=0)
    rec["card"] = r.choices[0].text
    pieces = [c.choices[0].text for c in client.completions.create(
        model="default", prompt=CARD_PROMPT, max_tokens=CARD_MAX_TOKENS, temperature=0, stream=True) if c.choices]
    rec["card_stream"] = "".join(pieces)
    r = client.completions.create(model="default", prompt=CARD_PROMPT, max_tokens=CARD_MAX_TOKENS,
                                  temperature=CARD_TEMPERATURE)
    rec["card_sampled"] = {"completion_tokens": r.usage.completion_tokens, "finish_reason": r.choices[0].finish_reason}
    return rec


def self_checks(rec: dict) -> dict:
    """What one server must agree with itself on: {case: "same" | "differs"}."""
    same = lambda ok: "same" if ok else "differs"  # noqa: E731
    return {
        "chat stream joins to the unstreamed text": same(rec["chat_stream"] == rec["chat"]),
        "chat stream usage (include_usage) equals the unstreamed usage": same(
            rec["chat_stream_usage"] == rec["chat_usage"]),
        "completions stream joins to the unstreamed text": same(rec["card_stream"] == rec["card"]),
        "stops cut the greedy answer at their first occurrence": same(all(
            cut == rec["chat"][0][: rec["chat"][0].find(s)] for s, cut in rec["stops"].items())),
        "n=2 greedy gives the one answer twice": same(len(rec["n2"]) == 2 and rec["n2"][0] == rec["n2"][1]),
        "card request sampled at 0.5 is served": same(rec["card_sampled"]["completion_tokens"] > 0),
    }


def compare(ref: dict, got: dict, logprob_tol: float = 0.05) -> dict:
    """The subject server against the reference, case by case: {case: "same" | "differs"}."""
    same = lambda ok: "same" if ok else "differs"  # noqa: E731
    lp_ref, lp_got = ref["logprobs"], got["logprobs"]
    tokens_same = [a["token"] for a in lp_ref] == [b["token"] for b in lp_got]
    return {
        "/v1/chat/completions": same(got["chat"] == ref["chat"]),
        "/v1/chat/completions streamed, include_usage": same(
            got["chat_stream"] == ref["chat_stream"] and got["chat_stream_usage"] == ref["chat_stream_usage"]),
        "stop sequences inside multi-token steps": same(got["stops"] == ref["stops"]),
        "logprobs with top_logprobs": same(tokens_same and all(
            a["top"][0] == b["top"][0] and abs(a["logprob"] - b["logprob"]) <= logprob_tol
            for a, b in zip(lp_ref, lp_got))),
        "n=2": same(got["n2"] == ref["n2"]),
        "the card's example request (/v1/completions, greedy)": same(got["card"] == ref["card"]),
        "/v1/completions streamed": same(got["card_stream"] == ref["card_stream"]),
    }


def compare_servers(model_path: str, draft_path: Optional[str], impls: list, flags: list, env: dict,
                    log_dir: str, warm: bool = False, logprob_tol: float = 0.05) -> dict:
    """Each of ``impls`` (the reference, then the subject) started in turn and asked every case
    (``warm``: twice, the first round unrecorded); their records, the comparison and each one's own
    checks."""
    from .server import Server, ServerSpec

    records = {}
    for impl in impls:
        spec = ServerSpec(impl, model_path, draft_path, None, list(flags), dict(env))
        with Server(spec, log_path=os.path.join(log_dir, f"server-openai-{impl}.log"), timeout_s=600) as srv:
            if warm:
                collect(srv.url)
            records[impl] = collect(srv.url)
    ref, sub = impls
    return {"compare": compare(records[ref], records[sub], logprob_tol=logprob_tol),
            "self": {impl: self_checks(rec) for impl, rec in records.items()}, "records": records}


def verdicts(report: dict) -> dict:
    return {**report["compare"], **{f"{k} ({i})": v for i, c in report["self"].items() for k, v in c.items()}}


def main(argv=None) -> int:
    import shlex

    ap = parser(__doc__, prog="python -m sglang_dflash.bench.openai_client")
    ap.add_argument("--model-path", required=True, help="the target")
    ap.add_argument("--draft-model-path", help="the DFlash draft, for DFLASH servers")
    ap.add_argument("--impls", type=comma_list, default=["ar", "plugin"], help="reference first, then the subject")
    ap.add_argument("--server-args", default="", help="more flags for every server")
    ap.add_argument("--float32", action="store_true",
                    help="float32 servers, where every text is exact; each warmed by one unrecorded round")
    ap.add_argument("--output-dir", required=True, help="openai.json and the server logs")
    args = ap.parse_args(argv)
    if len(args.impls) != 2:
        ap.error("--impls takes two servers: the reference, then the subject")
    os.makedirs(args.output_dir, exist_ok=True)
    flags = (FLOAT32_FLAGS if args.float32 else []) + shlex.split(args.server_args)
    report = compare_servers(args.model_path, args.draft_model_path, args.impls, flags,
                             FLOAT32_ENV if args.float32 else {}, args.output_dir, warm=args.float32,
                             logprob_tol=1e-3 if args.float32 else 0.05)
    with open(os.path.join(args.output_dir, "openai.json"), "w") as f:
        json.dump(report, f, indent=1)
    found = verdicts(report)
    for case, verdict in found.items():
        print(f"{verdict:<8} {case}")
    return 0 if all(v == "same" for v in found.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
