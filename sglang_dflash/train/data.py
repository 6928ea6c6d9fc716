"""Training prompts and target-regenerated responses.

Held-out rule: the first ``HELD_OUT`` prompts of every benchmark set are what
``benchmark_sglang.py`` measures on, so training only ever sees prompts after them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

HELD_OUT = {"gsm8k": 200, "math500": 100, "humaneval": 82, "mbpp": 200, "mt-bench": 40, "sharegpt": 0,
            "math": 0}  # math: training only (MATH test without MATH-500)


def read_cached_prompts(name: str, data_dir: str) -> list[str]:
    """All prompts of a set cached by ``scripts/fetch_datasets.py`` (the benchmark reads these too)."""
    path = os.path.join(data_dir, f"{name}.jsonl")
    if not os.path.isfile(path):
        raise SystemExit(f"dataset {name!r} is not cached in {data_dir}: run scripts/fetch_datasets.py --datasets {name}")
    with open(path) as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def training_prompts(datasets: Sequence[str], data_dir: str, per_dataset: int) -> list[str]:
    """Prompts from the cached sets, skipping the held-out heads."""
    out = []
    for name in datasets:
        out += read_cached_prompts(name, data_dir)[HELD_OUT.get(name, 0):][:per_dataset]
    return out


@dataclass
class Example:
    ids: list[int]  # prompt + response token ids
    response_start: int  # loss is taken on response tokens only


def render(tokenizer, prompt: str) -> list[int]:
    msgs = [{"role": "user", "content": prompt}]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt)["input_ids"]


def regenerate(
    target_path: str,
    prompts: Iterable[str],
    max_new_tokens: int,
    engine: str = "auto",
    hf_model=None,
    tokenizer=None,
    temperature: float = 0.0,
    max_prompt_tokens: Optional[int] = None,
) -> list[Example]:
    """Responses written by the target itself, so the draft learns the target's distribution.

    ``engine="sglang"`` uses ``sglang.Engine`` (GPU), ``"hf"`` uses transformers ``generate``;
    ``"auto"`` prefers SGLang when a GPU is present.
    """
    import torch

    prompts = list(prompts)
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(target_path)
    encoded = [render(tokenizer, p) for p in prompts]
    if max_prompt_tokens is not None:  # longer prompts would be cut off in training anyway
        encoded = [ids for ids in encoded if len(ids) <= max_prompt_tokens]
    if engine == "auto":
        engine = "sglang" if torch.cuda.is_available() else "hf"
    params = {"max_new_tokens": max_new_tokens, "temperature": temperature}
    out: list[Example] = []
    if engine == "sglang":
        import sglang

        llm = sglang.Engine(model_path=target_path, attention_backend="triton", grammar_backend="none",
                            log_level="warning", mem_fraction_static=0.5,
                            cuda_graph_backend_prefill="disabled")  # piecewise capture: slow start, no gain here
        try:
            results = llm.generate(input_ids=encoded, sampling_params=params)
        finally:
            llm.shutdown()
        for ids, r in zip(encoded, results):
            out.append(Example(ids + list(r["output_ids"]), len(ids)))
        return out
    from tqdm import tqdm

    model = hf_model
    if model is None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    device = next(model.parameters()).device
    for ids in tqdm(encoded, desc="regenerating responses", leave=False):
        with torch.no_grad():
            gen = model.generate(
                torch.tensor([ids], device=device), max_new_tokens=max_new_tokens,
                do_sample=temperature > 0, temperature=temperature or None, top_p=None, top_k=None,
                pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
            )
        out.append(Example(gen[0].tolist(), len(ids)))
    return out


def save_examples(examples: Sequence[Example], path: str) -> None:
    with open(path, "w") as f:
        for e in examples:
            f.write(json.dumps({"ids": e.ids, "response_start": e.response_start}) + "\n")


def load_examples(path: str, limit: Optional[int] = None) -> list[Example]:
    """Examples saved by :func:`save_examples`; a ``.xz`` file is read compressed."""
    import lzma

    with (lzma.open(path, "rt") if path.endswith(".xz") else open(path)) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [Example(r["ids"], r["response_start"]) for r in rows[:limit]]
