"""Shared fixtures: tiny DFlash checkpoints on disk; the GPU suite only when asked for.

``pytest`` runs the CPU suite on any machine. The ``gpu`` tests run only under a marker expression
that names them (``python -m pytest -m gpu tests/gpu``, ``-m "gpu and not hybrid"``), and only
where CUDA is available: a plain ``pytest`` on a GPU machine does not start SGLang servers.
"""

import json
import os
import re

import pytest
import torch
from safetensors.torch import save_file

from sglang_dflash.config import WIDTHS_ENV, DFlashDraftConfig, TargetInfo, expected_draft_tensors


def pytest_collection_modifyitems(config, items):
    if not re.search(r"\bgpu\b", config.getoption("markexpr") or ""):
        skip = pytest.mark.skip(reason="GPU suite: run it with -m gpu")
    elif not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
    else:
        return
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def widths_switch_restored():
    """The launch hook writes the verify widths into os.environ (SGLang's processes inherit them):
    each test leaves them as it found them."""
    from sglang_dflash import config

    before = os.environ.get(WIDTHS_ENV)
    yield
    config._widths_fixed_by_flag = False
    if before is None:
        os.environ.pop(WIDTHS_ENV, None)
    else:
        os.environ[WIDTHS_ENV] = before


TARGET = dict(hidden_size=64, num_hidden_layers=8, vocab_size=256, max_position_embeddings=512)


def target_info():
    return TargetInfo(
        hidden_size=TARGET["hidden_size"], num_layers=TARGET["num_hidden_layers"],
        vocab_size=TARGET["vocab_size"], context_length=TARGET["max_position_embeddings"],
    )


def draft_config_dict(**overrides):
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "vocab_size": 256,
        "num_target_layers": 8,
        "block_size": 16,
        "dflash_config": {"target_layer_ids": [1, 3, 5], "mask_token_id": 250},
    }
    cfg.update(overrides)
    return cfg


def write_checkpoint(path, config=None, prefix="", drop=(), extra=None, shapes=None):
    """A random draft in the z-lab layout; ``drop``/``extra``/``shapes`` corrupt it on purpose."""
    config = config or draft_config_dict()
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    cfg = DFlashDraftConfig.from_dict(config)
    if cfg.target_layer_ids is None:
        cfg = cfg.resolve_for_target(target_info())
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for name, shape in expected_draft_tensors(cfg).items():
        if name in drop:
            continue
        shape = (shapes or {}).get(name, shape)
        tensors[prefix + name] = torch.randn(*shape, generator=g) * 0.05
    tensors.update(extra or {})
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return path


def write_target(path, **overrides):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"architectures": ["Qwen3ForCausalLM"], **TARGET, **overrides}, f)
    return path


def write_char_tokenizer(path):
    """A character-level tokenizer with a chat template and a mask token, saved to ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<|im_end|>", "<|mask|>"] + [chr(c) for c in range(32, 127)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", mask_token="<|mask|>")
    fast.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "
    fast.save_pretrained(path)
    return fast
