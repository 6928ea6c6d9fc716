"""Accept length of a draft without a server: the pure-torch DFlash loop (``sglang_dflash.reference``)
in float32 on the benchmark's held-out prompts, through the target's chat template.

    python -m sglang_dflash.bench.offline_accept_length --target T --draft D --datasets gsm8k \\
        --num-prompts 16 --max-new-tokens 256 --output tau.json

τ is counted as the servers report it: completion tokens / verify steps (the prefill's token counts
as a completion token, not as a step). Greedy, stopping at the end-of-turn token like the benchmark.
The target is recomputed over the whole sequence every step, so a 135M target on two CPU cores takes
about a minute per 256-token response.
"""

from __future__ import annotations

import json
import os
import sys

from .cli import comma_list, parser
from .datasets import add_dataset_options, load_dataset_prompts, problem_with_cache, problem_with_names


def main(argv=None) -> int:
    ap = parser(__doc__, prog="python -m sglang_dflash.bench.offline_accept_length")
    ap.add_argument("--target", required=True, help="target model folder (Hugging Face layout)")
    ap.add_argument("--draft", required=True, help="draft checkpoint folder (z-lab layout)")
    add_dataset_options(ap, "gsm8k")
    ap.add_argument("--num-prompts", type=int, default=16, help="the first N prompts of each dataset, as the benchmark")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="output length limit of every response")
    ap.add_argument("--output", help="write the per-dataset figures here (JSON)")
    args = ap.parse_args(argv)
    for flag, path in (("--target", args.target), ("--draft", args.draft)):
        if not os.path.isfile(os.path.join(path, "config.json")):
            ap.error(f"{flag} {path!r} has no config.json")
    if not os.path.isfile(os.path.join(args.draft, "model.safetensors")):
        ap.error(f"--draft {args.draft!r} has no model.safetensors")
    if args.num_prompts < 1 or args.max_new_tokens < 1:
        ap.error("--num-prompts and --max-new-tokens must be >= 1")
    datasets = comma_list(args.datasets)
    problem = problem_with_names(datasets) or problem_with_cache(datasets, args.data_dir)
    if problem:
        ap.error(f"--datasets: {problem}")

    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..reference import draft_proposer, speculative_generate
    from ..train.data import render
    from ..train.trainer import FrozenTarget, load_trained_draft

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    draft = load_trained_draft(args.draft)
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32)
    target = FrozenTarget(model, draft.cfg.target_layer_ids)
    propose = draft_proposer(draft, target)
    report = {"target": args.target, "draft": args.draft, "dtype": "float32",
              "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens, "datasets": {}}
    for name in datasets:
        prompts = load_dataset_prompts(name, args.data_dir, args.num_prompts)
        results = []
        for prompt in tqdm(prompts, desc=name):
            with torch.no_grad():
                results.append(speculative_generate(
                    target, propose, render(tokenizer, prompt), args.max_new_tokens, draft.cfg.block_size,
                    draft.cfg.mask_token_id, draft.cfg.target_layer_ids, stop_ids=[tokenizer.eos_token_id]))
        tokens, steps = sum(len(r.tokens) for r in results), sum(len(r.accept_lengths) for r in results)
        report["datasets"][name] = {
            "accept_length": tokens / steps if steps else float("nan"),
            "completion_tokens": tokens,
            "verify_steps": steps,
            "per_prompt": [round(len(r.tokens) / max(len(r.accept_lengths), 1), 3) for r in results],
        }
        print(f"{name}: accept length {report['datasets'][name]['accept_length']:.3f}", flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
