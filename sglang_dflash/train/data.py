"""Training prompts and target-regenerated responses.

Held-out rule: the first ``HELD_OUT`` prompts of every benchmark set are what the benchmark
(``sglang_dflash.bench``, which takes the first ``--num-prompts``) measures on, so training only
ever sees prompts after them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from ..bench.datasets import HELDOUT, read_cached_prompts
from ..bench.heldout import Prompt, chat_messages
from .atomic import write_text_atomically
from .progress import progress_bar

HELD_OUT = {"gsm8k": 200, "math500": 100, "humaneval": 82, "mbpp": 200, "mt-bench": 40, "sharegpt": 0,
            "math": 0}  # math: training only (MATH test without MATH-500)


def training_prompts(datasets: Sequence[str], data_dir: str, per_dataset: int) -> list[str]:
    """Prompts from the cached sets, skipping the held-out heads; the frozen held-out sets never train."""
    frozen = [name for name in datasets if name in HELDOUT]
    if frozen:
        raise SystemExit(f"{', '.join(frozen)}: held out for issue 79's final measurement, never for training")
    out = []
    for name in datasets:
        cached = read_cached_prompts(name, data_dir)
        usable = cached[HELD_OUT.get(name, 0):][:per_dataset]
        if not usable:  # a name the user gave that adds nothing is a mistake, not a silent no-op
            why = (f"{data_dir} holds {len(cached)}, and the first {HELD_OUT[name]} are held out for the benchmark"
                   if cached and HELD_OUT.get(name) else f"{name}.jsonl in {data_dir} is empty")
            raise SystemExit(f"--datasets {name}: no training prompts: {why}")
        out += usable
    return out


@dataclass
class Example:
    ids: list[int]  # prompt + response token ids
    response_start: int  # loss is taken on response tokens only


def pad_id(tokenizer) -> int:
    """The id collated rows are padded with: the tokenizer's pad token, else its eos, else 0."""
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    return tokenizer.eos_token_id or 0


def render(tokenizer, prompt: Prompt) -> list[int]:
    msgs = chat_messages(prompt)
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer("\n\n".join(m["content"] for m in msgs))["input_ids"]


def regenerate(
    target_path: str,
    prompts: Iterable[str],
    max_new_tokens: int,
    engine: str = "auto",
    hf_model=None,
    tokenizer=None,
    max_prompt_tokens: Optional[int] = None,
    samples: int = 1,
    sampled_prefix: int = 0,
    temperature: float = 1.0,
) -> list[Example]:
    """Responses written by the target itself, so the draft learns the target's distribution.

    Responses are greedy. With ``sampled_prefix`` N each prompt gets ``samples`` responses whose
    first N tokens are sampled at ``temperature`` and the rest greedy: new greedy paths from a
    few prompts (what serving will meet) rather than ``samples`` copies of one.
    ``engine="sglang"`` uses ``sglang.Engine`` (GPU), ``"hf"`` uses transformers ``generate``;
    ``"auto"`` prefers SGLang when a GPU is present.
    """
    import torch

    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(target_path)
    encoded = [render(tokenizer, p) for p in prompts]
    if max_prompt_tokens is not None:  # longer prompts would be cut off in training anyway
        fitting = [ids for ids in encoded if len(ids) <= max_prompt_tokens]
        if encoded and not fitting:  # refused before the engine starts
            raise SystemExit(f"no prompt fits: all {len(encoded)} are longer than {max_prompt_tokens} tokens "
                             f"(--max-length minus 64); raise --max-length")
        encoded = fitting
    encoded = [ids for ids in encoded for _ in range(samples)]
    if engine == "auto":
        engine = "sglang" if torch.cuda.is_available() else "hf"
    generator = _SGLangGenerator(target_path) if engine == "sglang" else _HFGenerator(target_path, hf_model, tokenizer)
    with generator as gen:
        if not sampled_prefix:
            return [Example(ids + out, len(ids)) for ids, (out, _) in zip(encoded, gen(encoded, max_new_tokens, 0.0))]
        prefixes = gen(encoded, sampled_prefix, temperature)
        heads = [ids + out for ids, (out, _) in zip(encoded, prefixes)]
        open_ends = [i for i, (_, finished) in enumerate(prefixes) if not finished]
        rest = gen([heads[i] for i in open_ends], max_new_tokens - sampled_prefix, 0.0) if open_ends else []
        for i, (out, _) in zip(open_ends, rest):
            heads[i] = heads[i] + out
        return [Example(ids, len(prompt)) for ids, prompt in zip(heads, encoded)]


class _SGLangGenerator:
    """``gen(inputs, max_new_tokens, temperature) -> [(new_ids, finished)]`` on one ``sglang.Engine``."""

    def __init__(self, target_path: str):
        self.target_path = target_path

    def __enter__(self):
        import sglang

        self.llm = sglang.Engine(model_path=self.target_path, attention_backend="triton", grammar_backend="none",
                                 log_level="warning", mem_fraction_static=0.5,
                                 cuda_graph_backend_prefill="disabled")  # piecewise capture: slow start, no gain here
        return self

    def __exit__(self, *exc):
        self.llm.shutdown()

    def __call__(self, inputs, max_new_tokens: int, temperature: float):
        import asyncio

        params = {"max_new_tokens": max_new_tokens, "temperature": temperature}
        # All requests in flight at once (the scheduler batches them as one generate() call would);
        # awaiting each on its own lets the bar count them as they finish.
        with progress_bar(len(inputs), "regenerating responses") as bar:
            async def one(ids):
                result = await self.llm.async_generate(input_ids=ids, sampling_params=params)
                bar.update(1)
                return result

            async def every():
                return await asyncio.gather(*(one(ids) for ids in inputs))

            loop = getattr(self.llm, "loop", None) or asyncio.get_event_loop()
            results = loop.run_until_complete(every())
        finished = [(r["meta_info"].get("finish_reason") or {}).get("type") != "length" for r in results]
        return [(list(r["output_ids"]), done) for r, done in zip(results, finished)]


class _HFGenerator:
    """The same interface on transformers ``generate``, one prompt at a time (CPU, tests)."""

    def __init__(self, target_path: str, model, tokenizer):
        self.target_path, self.model, self.tokenizer = target_path, model, tokenizer

    def __enter__(self):
        if self.model is None:
            import torch
            from transformers import AutoModelForCausalLM

            self.model = AutoModelForCausalLM.from_pretrained(self.target_path, dtype=torch.float32).eval()
        return self

    def __exit__(self, *exc):
        pass

    def __call__(self, inputs, max_new_tokens: int, temperature: float):
        import torch

        device = next(self.model.parameters()).device
        eos = self.tokenizer.eos_token_id
        out = []
        bar = progress_bar(len(inputs), "regenerating responses")
        for ids in inputs:
            with torch.no_grad():
                gen = self.model.generate(
                    torch.tensor([ids], device=device), max_new_tokens=max_new_tokens,
                    do_sample=temperature > 0, temperature=temperature or None, top_p=None, top_k=None,
                    pad_token_id=self.tokenizer.pad_token_id or eos,
                )
            new = gen[0, len(ids):].tolist()
            out.append((new, eos in new))
            bar.update(1)
        bar.close()
        return out


def save_examples(examples: Sequence[Example], path: str) -> None:
    """Whole or not at all: a resumed run trusts this cache instead of regenerating."""
    write_text_atomically(path, "".join(json.dumps({"ids": e.ids, "response_start": e.response_start}) + "\n"
                                        for e in examples))


def load_examples(path: str, limit: Optional[int] = None) -> list[Example]:
    """Examples saved by :func:`save_examples`; a ``.xz`` file is read compressed."""
    import lzma

    with (lzma.open(path, "rt") if path.endswith(".xz") else open(path)) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [Example(r["ids"], r["response_start"]) for r in rows[:limit]]
