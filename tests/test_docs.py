"""The repository a user reads: every link in the README and docs resolves, every path the evidence
map names exists, and results/ stays a set of readings, not a log."""

import json
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
REPO_DIRS = ("results/", "tests/", "sglang_dflash/", "lab/", "scripts/", "docs/", ".ci/")
DRAFT = "results/smollm2-draft/model.safetensors"


def tracked(prefix: str = "") -> list[str]:
    """The files git tracks under prefix, or every file there when this is no git checkout."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--", prefix or "."], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout
        files = [f for f in out.split("\0") if f]
        if files:
            return files
    except (OSError, subprocess.CalledProcessError):
        pass
    found = []
    for base, dirs, names in os.walk(os.path.join(ROOT, prefix)):
        dirs[:] = [d for d in dirs if not d.startswith(".") or d == ".ci"]
        found += [os.path.relpath(os.path.join(base, n), ROOT) for n in names]
    return found


def pages() -> list[str]:
    """README.md, docs/*.md and the results' READMEs and evidence map."""
    out = ["README.md", "lab/README.md"]
    out += sorted(f"docs/{f}" for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))
    out += sorted(f for f in tracked("results") if f.endswith(".md") and os.path.basename(f) in ("README.md", "EVIDENCE.md"))
    return out


def slug(heading: str) -> str:
    """A heading's anchor as GitHub writes it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: str) -> set[str]:
    with open(path) as f:
        return {slug(line.lstrip("#")) for line in f if line.startswith("#")}


def test_the_readme_and_docs_exist():
    for page in ("README.md", "docs/architecture.md", "docs/method.md", "docs/gpu-lab.md",
                 "results/README.md", "results/EVIDENCE.md"):
        assert os.path.isfile(os.path.join(ROOT, page)), page


@pytest.mark.parametrize("page", pages())
def test_every_relative_link_points_to_an_existing_file(page):
    path = os.path.join(ROOT, page)
    with open(path) as f:
        text = f.read()
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
        if not os.path.exists(resolved):
            broken.append(target)
        elif anchor and resolved.endswith(".md") and anchor not in anchors(resolved):
            broken.append(target)
    assert not broken, f"{page}: links to nothing: {broken}"


def evidence_paths() -> list[str]:
    with open(os.path.join(ROOT, "results", "EVIDENCE.md")) as f:
        text = f.read()
    return sorted({p for p in re.findall(r"`([^`\s]+)`", text)
                   if p.startswith(REPO_DIRS) and not any(c in p for c in "$*{}<>")})


def test_every_path_the_evidence_map_names_exists():
    paths = evidence_paths()
    assert len(paths) >= 30  # the map names files, not only commands
    missing = [p for p in paths if not os.path.exists(os.path.join(ROOT, p))]
    assert not missing, f"results/EVIDENCE.md names missing files: {missing}"


def summary() -> dict:
    with open(os.path.join(ROOT, "results", "summary.json")) as f:
        return json.load(f)


def strings(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from strings(v)
    elif isinstance(value, str):
        yield value


def test_every_file_the_summary_names_exists():
    named = [s for s in strings(summary()) if s.startswith("results/") and " " not in s]
    assert named
    missing = [p for p in named if not os.path.exists(os.path.join(ROOT, p))]
    assert not missing, f"results/summary.json names missing files: {missing}"


def test_the_summary_is_short_and_each_claim_names_its_evidence():
    assert os.path.getsize(os.path.join(ROOT, "results", "summary.json")) <= 30 * 1024
    for name, claim in summary()["adaptive"].items():
        assert claim.get("evidence") and claim.get("command"), name


def test_the_readme_is_a_guide_that_starts_with_the_two_set_up_commands():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    assert len(text.splitlines()) <= 250
    first_block = text.split("```")[1]
    assert 'pip install -e ".[test]"' in first_block and "python -m pytest -q" in first_block


def test_results_stay_small():
    files = [f for f in tracked("results") if os.path.isfile(os.path.join(ROOT, f))]
    size = sum(os.path.getsize(os.path.join(ROOT, f)) for f in files if f != DRAFT)
    assert size <= 15 * 1000 * 1000, f"results/ holds {size / 1e6:.1f} MB besides the shipped draft"


def test_no_development_round_names_a_file_or_a_reading():
    named = [f for f in tracked() if "session" in f.lower()]
    assert not named, named
    texts = ["README.md"] + [f for f in tracked("docs") + tracked("results")
                             if f.endswith((".md", ".json", ".txt", ".log", ".jsonl"))]
    said = []
    for f in texts:
        path = os.path.join(ROOT, f)
        if os.path.isfile(path):
            with open(path, errors="replace") as fh:
                if re.search(r"session [0-9]", fh.read(), re.IGNORECASE):
                    said.append(f)
    assert not said, said
