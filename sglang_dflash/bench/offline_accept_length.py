"""Accept length of a draft without a server, in float32 on the benchmark's held-out prompts, through
the target's chat template.

    python -m sglang_dflash.bench.offline_accept_length --target T --draft D --datasets gsm8k \\
        --num-prompts 16 --max-new-tokens 256 [--method walk|loop] --output tau.json

τ is counted as the servers report it: completion tokens / verify steps (the prefill's token counts
as a completion token, not as a step). Greedy, stopping at the end-of-turn token like the benchmark.

- ``--method loop``: the pure-torch DFlash loop (``reference.speculative_generate``), the definition.
  The target is recomputed over the whole sequence every step: a 135M target on two CPU cores takes
  about a minute per 256-token response.
- ``--method walk`` (default): the target writes its greedy response with its KV cache, then blocks
  anchored at every response position are drafted in a few batched passes and the response is walked
  step by step as serving would (``train/held_out.py``). The same steps as the loop
  (``tests/test_train.py``), several times faster.
"""

from __future__ import annotations

import json
import os
import sys

from .cli import comma_list, parser
from .datasets import add_dataset_options, load_dataset_prompts, problem_with_cache, problem_with_names


def steps_committing_at_least(committed: list[list[int]], block_size: int) -> list[float]:
    """Share of verify steps that commit at least k tokens, k = 1..block_size: where the draft's run of
    matches ends. Each response's last step is left out (the token budget cuts it)."""
    whole = [n for steps in committed for n in steps[:-1]]
    return [round(sum(n >= k for n in whole) / max(len(whole), 1), 4) for k in range(1, block_size + 1)]


def main(argv=None) -> int:
    ap = parser(__doc__, prog="python -m sglang_dflash.bench.offline_accept_length")
    ap.add_argument("--target", required=True, help="target model folder (Hugging Face layout)")
    ap.add_argument("--draft", required=True, help="draft checkpoint folder (z-lab layout)")
    add_dataset_options(ap, "gsm8k")
    ap.add_argument("--num-prompts", type=int, default=16, help="the first N prompts of each dataset, as the benchmark")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="output length limit of every response")
    ap.add_argument("--method", choices=["walk", "loop"], default="walk",
                    help="walk: greedy responses, then every block in batched passes; loop: the reference loop")
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
    from ..train.batch import FrozenTarget
    from ..train.data import pad_id, regenerate, render
    from ..train.held_out import accept_lengths_everywhere, served_steps
    from ..train.trainer import TrainConfig, load_trained_draft

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    draft = load_trained_draft(args.draft)
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32)
    target = FrozenTarget(model, draft.cfg.target_layer_ids)
    propose = draft_proposer(draft, target)
    report = {"target": args.target, "draft": args.draft, "dtype": "float32", "method": args.method,
              "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens, "datasets": {}}
    for name in datasets:
        prompts = load_dataset_prompts(name, args.data_dir, args.num_prompts)
        everywhere, committed = [], []  # committed: each response's tokens per step
        if args.method == "loop":
            steps = []
            for prompt in tqdm(prompts, desc=name):
                with torch.no_grad():
                    got = speculative_generate(
                        target, propose, render(tokenizer, prompt), args.max_new_tokens, draft.cfg.block_size,
                        draft.cfg.mask_token_id, draft.cfg.target_layer_ids, stop_ids=[tokenizer.eos_token_id])
                steps.append((len(got.tokens), len(got.accept_lengths)))
                committed.append(got.accept_lengths)
        else:
            examples = regenerate(args.target, prompts, args.max_new_tokens, "hf", hf_model=model, tokenizer=tokenizer)
            walk = TrainConfig(out_dir="", block_size=draft.cfg.block_size, batch_size=4,
                               max_length=max(len(e.ids) for e in examples))
            pad = pad_id(tokenizer)
            everywhere = accept_lengths_everywhere(draft, target, examples, walk, draft.cfg.mask_token_id, pad)
            committed = [served_steps(lengths) for lengths in everywhere]
            steps = [(len(e.ids) - e.response_start, len(c)) for e, c in zip(examples, committed)]
        tokens, n_steps = sum(t for t, _ in steps), sum(n for _, n in steps)
        report["datasets"][name] = {
            "accept_length": tokens / n_steps if n_steps else float("nan"),
            "completion_tokens": tokens,
            "verify_steps": n_steps,
            "per_prompt": [round(t / max(n, 1), 3) for t, n in steps],
            "steps_committing_at_least": steps_committing_at_least(committed, draft.cfg.block_size),
        }
        if everywhere:  # what a mean over random positions would report: above the served figure
            flat = [n for lengths in everywhere for n in lengths]
            report["datasets"][name]["accept_length_at_every_position"] = sum(flat) / max(len(flat), 1)
        print(f"{name}: accept length {report['datasets'][name]['accept_length']:.3f}", flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
