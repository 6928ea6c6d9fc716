"""Load each hybrid rig's tensor names into SGLang's own model classes, on the CPU, at tiny widths.

    PYTHONPATH=. python tests/sglang_rig_load.py     prints {shape/layout: {params, unloaded, not_found}} as JSON

Run in a process of its own (tests/test_rig.py does): it sets up a one-rank gloo group, which
would outlive a test. The rig's names and shapes come from ``rig_hybrid`` with every width cut
down, so SGLang's weight loaders check the same stacking and splitting they do at full size.
"""

import json
import logging
import os
import warnings
from dataclasses import replace

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")  # sglang.test reads its first character
warnings.filterwarnings("ignore")

import torch  # noqa: E402

from sglang_dflash.bench import rig_hybrid  # noqa: E402  (the checkout, on PYTHONPATH: tests/test_rig.py)


def tiny(s):
    widths = dict(hidden=64, layers=4, heads=2, kv_heads=1, head_dim=32, linear_key_heads=2, linear_value_heads=4,
                  linear_key_dim=16, linear_value_dim=16, vocab=256)
    moe = dict(experts=8, experts_per_tok=2, moe_intermediate=32, shared_intermediate=32)
    return replace(s, **widths, **(moe if s.moe else {"intermediate": 96}))


def main():
    from sglang.srt.configs.qwen3_5 import Qwen3_5Config, Qwen3_5MoeConfig, Qwen3_5MoeTextConfig, Qwen3_5TextConfig
    from sglang.srt.models import qwen3_5, qwen3_5_text
    from sglang.srt.runtime_context import get_context
    from sglang.test.layer_ut_utils import init_single_process_dist

    init_single_process_dist(int(os.environ.get("RIG_LOAD_PORT", "29657")))
    qwen3_5.get_rope = lambda *a, **k: torch.nn.Identity()  # no parameters; the CPU kernel needs vllm
    not_found = []

    class Catch(logging.Handler):
        def emit(self, record):
            if "not found" in record.getMessage():
                not_found.append(record.getMessage())

    logging.getLogger("sglang").addHandler(Catch())
    empty = os.path.join(os.environ.get("TMPDIR", "/tmp"), "rig-load-empty")
    os.makedirs(empty, exist_ok=True)  # model_path: no joint or pointer head to find
    out = {}
    for name, shape in rig_hybrid.SHAPES.items():
        s = tiny(shape)
        for layout in ("multimodal", "text"):
            raw = rig_hybrid.target_config(s, layout)
            if layout == "multimodal":
                config_cls, model_cls = ((Qwen3_5MoeConfig, qwen3_5.Qwen3_5MoeForConditionalGeneration) if s.moe
                                         else (Qwen3_5Config, qwen3_5.Qwen3_5ForConditionalGeneration))
            else:
                config_cls, model_cls = ((Qwen3_5MoeTextConfig, qwen3_5_text.Qwen3_5MoeForCausalLM) if s.moe
                                         else (Qwen3_5TextConfig, qwen3_5_text.Qwen3_5ForCausalLM))
            with get_context().override_server_args(device="cpu", model_path=empty):
                model = model_cls(config_cls(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")}))
                params = {n for n, _ in model.named_parameters()}
                del not_found[:]
                weights = ((k, torch.zeros(v, dtype=torch.bfloat16)) for k, v in rig_hybrid.target_tensors(s, layout).items())
                loaded = set(model.load_weights(weights) or ())
            out[f"{name}/{layout}"] = {"params": len(params), "unloaded": sorted(params - loaded),
                                       "not_found": list(not_found)}
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
