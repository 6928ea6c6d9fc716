"""Checkpoint parsing and start-up validation: each bad input gets one error naming its field."""

import json
import os
import struct
from types import SimpleNamespace

import pytest
import torch
from conftest import draft_config_dict, target_info, write_checkpoint

from sglang_dflash.config import (
    DFlashConfigError,
    DFlashDraftConfig,
    TargetInfo,
    default_target_layer_ids,
    load_and_validate,
)


def parse(**overrides):
    return DFlashDraftConfig.from_dict(draft_config_dict(**overrides))


def test_published_qwen3_8b_layout_parses():
    cfg = DFlashDraftConfig.from_dict({
        "architectures": ["DFlashDraftModel"], "hidden_size": 4096, "num_hidden_layers": 5,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288,
        "block_size": 16, "num_target_layers": 36,
        "dflash_config": {"target_layer_ids": [1, 9, 17, 25, 33], "mask_token_id": 151669},
    })
    assert (cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids) == (16, 151669, (1, 9, 17, 25, 33))
    assert cfg.layer_types == ("full_attention",) * 5 and not cfg.has_sliding_layers


def test_block_size_in_dflash_config_wins_over_top_level():
    cfg = parse(block_size=16, dflash_config={"block_size": 8, "target_layer_ids": [1], "mask_token_id": 3})
    assert cfg.block_size == 8
    assert parse(block_size=4).block_size == 4
    raw = draft_config_dict()
    del raw["block_size"]
    assert DFlashDraftConfig.from_dict(raw).block_size == 16


def test_default_target_layer_ids_match_published_drafts():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B-DFlash-b16
    assert default_target_layer_ids(40, 5) == [1, 10, 19, 28, 37]  # Qwen3.5-35B-A3B
    assert default_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]  # Qwen3.6-27B
    assert default_target_layer_ids(30, 1) == [15]
    cfg = parse(dflash_config={"mask_token_id": 1}).resolve_for_target(target_info())
    assert cfg.target_layer_ids == (1, 5)  # 8-layer target, 2 draft layers


def test_sliding_window_layers():
    cfg = parse(layer_types=["sliding_attention", "full_attention"], sliding_window=2048)
    assert cfg.has_sliding_layers and cfg.sliding_window == 2048
    assert parse(layer_types=["full_attention"] * 2, sliding_window=2048).sliding_window is None


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(architectures=["LlamaForCausalLM"]), "architectures"),
        (dict(block_size=1, dflash_config={"target_layer_ids": [1]}), "block_size"),
        (dict(dflash_config={"block_size": 0}), "block_size"),
        (dict(dflash_config={"target_layer_ids": []}), "target_layer_ids"),
        (dict(dflash_config={"target_layer_ids": [1, -2]}), "target_layer_ids[1]"),
        (dict(dflash_config={"mask_token_id": "x"}), "mask_token_id"),
        (dict(layer_types=["full_attention"]), "layer_types"),
        (dict(layer_types=["full_attention", "linear_attention"]), "layer_types[1]"),
        (dict(layer_types=["sliding_attention", "full_attention"]), "sliding_window"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(num_key_value_heads=3), "num_key_value_heads"),
        (dict(hidden_size=None), "hidden_size"),
    ],
)
def test_bad_config_fields_are_named(overrides, field):
    with pytest.raises(DFlashConfigError) as e:
        parse(**overrides)
    assert e.value.field == field
    assert field in str(e.value)


@pytest.mark.parametrize(
    "overrides, target, field",
    [
        ({}, TargetInfo(hidden_size=96, num_layers=8, vocab_size=256), "hidden_size"),
        ({}, TargetInfo(hidden_size=64, num_layers=4, vocab_size=256), "target_layer_ids[2]"),
        (dict(vocab_size=None), TargetInfo(hidden_size=64, num_layers=8, vocab_size=250), "mask_token_id"),
        (dict(vocab_size=300), target_info(), "vocab_size"),
        (dict(dflash_config={"block_size": 64, "mask_token_id": 1}),
         TargetInfo(hidden_size=64, num_layers=8, vocab_size=256, context_length=32), "block_size"),
    ],
)
def test_target_mismatches_are_named(overrides, target, field):
    with pytest.raises(DFlashConfigError) as e:
        parse(**overrides).resolve_for_target(target)
    assert e.value.field == field


def test_checkpoint_with_and_without_model_prefix_loads(tmp_path):
    for prefix in ("", "model."):
        path = write_checkpoint(str(tmp_path / f"d{prefix}"), prefix=prefix)
        cfg = load_and_validate(path, target_info())
        assert cfg.num_context_features == 3


@pytest.mark.parametrize(
    "prefix, kwargs, needle",
    [
        ("", dict(drop=("layers.1.mlp.up_proj.weight",)), "missing tensors [layers.1.mlp.up_proj.weight]"),
        ("", dict(extra={"embed_tokens.weight": torch.zeros(256, 64)}), "unexpected tensors [embed_tokens.weight]"),
        ("", dict(shapes={"fc.weight": (64, 128)}), "fc.weight: has shape [64, 128], expected [64, 192]"),
        # A checkpoint with ``model.``-prefixed keys gets its own spelling back, so a grep finds them.
        ("model.", dict(drop=("layers.1.mlp.up_proj.weight",)), "missing tensors [model.layers.1.mlp.up_proj.weight]"),
        ("model.", dict(extra={"model.embed_tokens.weight": torch.zeros(256, 64)}),
         "unexpected tensors [model.embed_tokens.weight]"),
        ("model.", dict(shapes={"fc.weight": (64, 128)}), "model.fc.weight: has shape [64, 128], expected [64, 192]"),
    ],
)
def test_missing_extra_and_misshapen_tensors(tmp_path, prefix, kwargs, needle):
    path = write_checkpoint(str(tmp_path / "d"), prefix=prefix, **kwargs)
    with pytest.raises(DFlashConfigError) as e:
        load_and_validate(path, target_info())
    assert e.value.field in ("weights", prefix + "fc.weight") and needle in str(e.value)


def test_rotary_buffers_are_ignored(tmp_path):
    path = write_checkpoint(str(tmp_path / "d"), extra={"layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(8)})
    load_and_validate(path, target_info())


class HeaderOnlySafeOpen:
    """``safe_open`` as a reader that trusts the header and never checks the data: a truncated
    file gets past it, so only the plugin's own length check can refuse the file."""

    def __init__(self, path, framework):
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            self.header = {k: v for k, v in json.loads(f.read(header_len)).items() if k != "__metadata__"}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def keys(self):
        return list(self.header)

    def get_slice(self, key):
        return SimpleNamespace(get_shape=lambda: self.header[key]["shape"])


def cut_in_half(path):
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])  # the header, at the front, stays whole


# The errors are read by field and problem: the message also holds the checkpoint's path, and
# pytest names tmp_path after the test, so a pattern could match the path instead.
def test_truncated_safetensors_is_refused_naming_the_file(tmp_path):
    path = write_checkpoint(str(tmp_path / "d"))
    cut_in_half(os.path.join(path, "model.safetensors"))
    with pytest.raises(DFlashConfigError) as e:
        load_and_validate(path, target_info())
    assert e.value.field == "model.safetensors"
    assert e.value.problem.startswith("truncated: header promises")  # checked before safetensors reads it


def test_length_check_catches_a_truncated_file_behind_a_header_only_reader(tmp_path, monkeypatch):
    import safetensors

    path = write_checkpoint(str(tmp_path / "d"))
    weights = os.path.join(path, "model.safetensors")
    monkeypatch.setattr(safetensors, "safe_open", HeaderOnlySafeOpen)
    assert load_and_validate(path, target_info()).block_size == 16  # the whole file passes the reader
    cut_in_half(weights)
    with pytest.raises(DFlashConfigError) as e:
        load_and_validate(path, target_info())
    assert e.value.field == "model.safetensors"
    assert e.value.problem.startswith("truncated: header promises")
    assert e.value.problem.endswith(f"file has {os.path.getsize(weights)}")


def test_corrupt_safetensors_header(tmp_path):
    path = write_checkpoint(str(tmp_path / "d"))
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(DFlashConfigError) as e:
        load_and_validate(path, target_info())
    assert e.value.field == "model.safetensors" and e.value.problem.startswith("unreadable safetensors")


def test_wrong_path_and_broken_json(tmp_path):
    with pytest.raises(DFlashConfigError, match="is not a directory"):
        load_and_validate(str(tmp_path / "nope"), target_info())
    (tmp_path / "d").mkdir()
    with pytest.raises(DFlashConfigError, match="config.json: missing"):
        load_and_validate(str(tmp_path / "d"), target_info())
    (tmp_path / "d" / "config.json").write_text("{")
    with pytest.raises(DFlashConfigError, match="not valid JSON"):
        load_and_validate(str(tmp_path / "d"), target_info())
    (tmp_path / "d" / "config.json").write_text(json.dumps(draft_config_dict()))
    with pytest.raises(DFlashConfigError, match="no \\*.safetensors"):
        load_and_validate(str(tmp_path / "d"), target_info())


def test_block_size_flag_overrides_checkpoint(tmp_path):
    path = write_checkpoint(str(tmp_path / "d"))
    assert load_and_validate(path, target_info(), block_size=4).block_size == 4
    with pytest.raises(DFlashConfigError) as e:
        load_and_validate(path, target_info(), block_size=1)
    assert e.value.field == "block_size"  # not a match on the message: the path names this test


def test_target_info_reads_nested_text_config():
    t = TargetInfo.from_dict({"text_config": {"hidden_size": 8, "num_hidden_layers": 3, "vocab_size": 10}})
    assert (t.hidden_size, t.num_layers, t.vocab_size) == (8, 3, 10)



def test_hub_ids_are_fetched_and_local_folders_used_as_they_are(tmp_path, monkeypatch):
    import huggingface_hub

    from sglang_dflash.config import DFlashConfigError, is_hub_id, local_checkpoint

    assert is_hub_id("z-lab/Qwen3-8B-DFlash-b16")
    assert not is_hub_id(str(tmp_path)) and not is_hub_id("./draft") and not is_hub_id("a/b/c")
    assert local_checkpoint(str(tmp_path), "--model-path") == str(tmp_path)
    fetched = []

    def snapshot(repo, revision=None, allow_patterns=None):
        fetched.append((repo, revision, tuple(allow_patterns)))
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot)
    assert local_checkpoint("org/draft", "--speculative-draft-model-path", "main") == str(tmp_path)
    assert fetched == [("org/draft", "main", ("*.json", "*.safetensors"))]

    def offline(*a, **k):
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(DFlashConfigError, match="--speculative-draft-model-path.*not a local folder"):
        local_checkpoint("org/draft", "--speculative-draft-model-path")


def test_an_fa3_targets_draft_attends_on_triton_where_the_plugins_draft_graphs_can_serve(monkeypatch):
    """SGLang gives the draft the target's FA3, which the plugin's own draft graphs do not serve:
    Triton instead, unless the launch names a draft backend or the graphs could not serve anyway."""
    from sglang_dflash.config import BLOCK_ATTENTION_ENV, DRAFT_GRAPHS_ENV, draft_attention_default

    def pick(target="fa3", named=None, tp_size=1, window_size=None, draft_config=None, decode_graphs=True, **args):
        return draft_attention_default(SimpleNamespace(speculative_draft_attention_backend=named, **args), target,
                                       tp_size, window_size, draft_config, decode_graphs)

    monkeypatch.delenv(DRAFT_GRAPHS_ENV, raising=False)
    assert pick() == "triton" and pick(draft_config=parse(head_dim=128, layer_types=["full_attention"] * 2)) == "triton"
    for target in ("triton", "flashinfer", "fa4", None):  # measured on FA3 only; triton is triton already
        assert pick(target) is None
    assert pick(named="fa3") is None and pick(tp_size=2) is None and pick(window_size=2048) is None
    assert pick(decode_graphs=False) is None
    assert pick(draft_config=parse(head_dim=128, layer_types=["full_attention", "sliding_attention"],
                                   sliding_window=2048)) is None
    # The graphs need the block kernel for every call of the pass: a head size it serves, one-token
    # pages, a KV cache without fp8 scales, the kernel on.
    assert pick(draft_config=parse(head_dim=128)) == "triton" and pick(draft_config=parse(head_dim=96)) is None
    assert pick(draft_config=parse(hidden_size=2560, num_attention_heads=32, head_dim=None)) is None  # 80 a head
    assert pick(draft_config=parse(hidden_size=4096, num_attention_heads=32, head_dim=None)) == "triton"
    assert pick(page_size=16) is None and pick(kv_cache_dtype="fp8_e4m3") is None
    assert pick(page_size=1, kv_cache_dtype="auto") == "triton"
    monkeypatch.setenv(BLOCK_ATTENTION_ENV, "0")
    assert pick() is None
    monkeypatch.delenv(BLOCK_ATTENTION_ENV)
    monkeypatch.setenv(DRAFT_GRAPHS_ENV, "0")
    assert pick() is None
