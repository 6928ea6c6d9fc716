"""Bad configurations through the real launcher: one clear line, exit code != 0, nothing left up.

``python -m sglang.launch_server --device cpu`` runs SGLang's whole argument pipeline, the plugin's
hooks included, on a machine without a GPU; every case here must stop there, before any process,
port or GPU memory is taken. ``DFLASH_EVIDENCE_DIR`` names a folder for a JSON record of the run.
"""

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from sglang_dflash import compat

RELEASE = compat.running()

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PORT = 31999


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    out = tmp_path_factory.mktemp("pair")
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_tiny_pair.py"), str(out), "--hidden", "64",
                    "--layers", "4", "--vocab", "512", "--draft-layers", "1"], check=True, capture_output=True)
    return str(out / "target"), str(out / "draft")


def draft_variant(src, dst, config=None, weights=None, config_text=None):
    shutil.copytree(src, dst)
    if config_text is not None:
        with open(os.path.join(dst, "config.json"), "w") as f:
            f.write(config_text)
    if config:
        with open(os.path.join(dst, "config.json")) as f:
            cfg = json.load(f)
        config(cfg)
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(cfg, f)
    if weights:
        path = os.path.join(dst, "model.safetensors")
        with open(path, "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(weights(data))
    return dst


# name: (draft variant or None for the good draft, extra flags, words the one line must contain)
CASES = {
    "wrong draft path": ("missing", [], "'{draft}' does not exist"),
    "unknown hub id": ("hub", [], "is not a local folder and the hub has no copy"),
    "draft config.json that is not JSON": ({"config_text": '{"architectures": ["DFlashDraftModel"],'}, [],
                                          "config.json: not valid JSON"),
    "draft config without model_type": ({"config": lambda c: c.pop("model_type")}, [], "model_type: missing"),
    "draft folder without config.json": ("empty", [], "has no config.json"),
    "draft for another hidden size": ({"config": lambda c: c.update(hidden_size=128)}, [], "hidden_size"),
    "draft for another vocab": ({"config": lambda c: c.update(vocab_size=1000)}, [], "vocab_size"),
    "corrupt safetensors": ({"weights": lambda b: b"\x10" + b"\x00" * 7 + b"{garbage"}, [], "unreadable safetensors"),
    "truncated safetensors": ({"weights": lambda b: b[: len(b) // 2]}, [], "model.safetensors: truncated: header"),
    "block larger than the context": (None, ["--context-length", "8", "--speculative-num-draft-tokens", "16"],
                                      "exceeds the context length 8"),
    "pipeline parallel": (None, ["--pp-size", "2"], "--pp-size"),
}
DP_ATTENTION = (["--attn-dp-size", "2", "--tp-size", "2"] if RELEASE.has("attn_dp_size")
                else ["--enable-dp-attention", "--dp-size", "2", "--tp-size", "2"])
if not RELEASE.has("builtin_dp_attention"):  # where the built-in serves it, it is the built-in's to check
    CASES["DP attention"] = (None, DP_ATTENTION, "--attn-dp-size" if RELEASE.has("attn_dp_size")
                             else "--enable-dp-attention")
RECORD = []


def port_is_free(port):
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.parametrize("name", list(CASES))
def test_bad_configuration_fails_at_start_with_one_line(name, pair, tmp_path):
    target, good = pair
    variant, flags, words = CASES[name]
    if variant is None:
        draft = good
    elif variant == "missing":
        draft = str(tmp_path / "no-such-draft")
    elif variant == "hub":
        draft = "no-such-org/no-such-draft"
    elif variant == "empty":
        draft = str(tmp_path / "empty")
        os.makedirs(draft)
    else:
        draft = draft_variant(good, str(tmp_path / "draft"), **variant)
    assert port_is_free(PORT)
    out = launch(target, draft, flags)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    RECORD.append({"case": name, "exit_code": out.returncode, "message": last,
                   "traceback": "Traceback" in out.stderr, "port_free_after": port_is_free(PORT)})
    assert out.returncode != 0
    assert last.startswith("sglang-dflash: ") and words.format(draft=draft) in last, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert port_is_free(PORT)  # nothing was left listening


def launch(target, draft, flags):
    return subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--model-path", target, "--speculative-algorithm", "DFLASH",
         "--speculative-draft-model-path", draft, "--device", "cpu", "--port", str(PORT), *flags],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "SGLANG_PLUGINS": "dflash", "HF_HUB_OFFLINE": "1"},
    )


@pytest.mark.skipif(not RELEASE.has("builtin_dp_attention"), reason="the built-in serves DP attention from 0.5.23")
def test_dp_attention_is_left_to_the_builtin_with_a_log_line(pair):
    target, draft = pair
    out = launch(target, draft, DP_ATTENTION)
    assert "DFLASH is served by SGLang's built-in implementation: DP attention is served by the built-in only" \
        in out.stderr, out.stderr[-2000:]


def test_write_evidence():
    evidence = os.environ.get("DFLASH_EVIDENCE_DIR")
    if not evidence:
        pytest.skip("DFLASH_EVIDENCE_DIR not set")
    assert len(RECORD) == len(CASES)
    os.makedirs(evidence, exist_ok=True)
    with open(os.path.join(evidence, "startup_errors.json"), "w") as f:
        json.dump({"cases": len(RECORD), "clear_one_line_errors": sum(
            r["exit_code"] != 0 and r["message"].startswith("sglang-dflash: ") and not r["traceback"] for r in RECORD),
            "runs": RECORD}, f, indent=1)
