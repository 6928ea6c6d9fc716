"""Prompts that would take a DFLASH server down, refused at the tokenizer with a 400.

SGLang 0.5.17-0.5.23 pass two kinds of prompt to the scheduler that no forward can run:
- an empty one (``{"text": ""}`` with a tokenizer that adds no BOS, ``/v1/completions`` with
  ``"prompt": ""``): the prefill has 0 tokens and the target's rotary embedding reshapes them to
  ``[0, -1, head_dim]``, which torch refuses;
- token ids outside ``[0, vocab_size)``: 0.5.23 checks them nowhere, and 0.5.17 defines
  ``TokenizerManager._validate_input_ids_in_vocab`` but never calls it; the embedding lookup then
  fails on the GPU;
- ``top_logprobs_num`` above the vocabulary: the scheduler asks ``topk`` for more entries than a
  row has (``layers/logprob_processor.py``, ``get_top_logprobs_raw``).

Each exception ends the scheduler and every request in flight on it. The plugin's servers refuse
both in ``TokenizerManager._validate_one_request``, where SGLang refuses a prompt past the context
length, so the client gets the same kind of answer: HTTP 400 with the reason.
"""

from __future__ import annotations

from typing import Optional, Sequence


def prompt_problem(input_ids: Optional[Sequence[int]], vocab_size: int, has_session: bool = False) -> Optional[str]:
    """Why no forward can run this tokenized prompt, or None. ``input_ids`` is None for a request
    given as embeddings; a session's request may be empty, its history supplying the prompt."""
    if input_ids is None:
        return None
    if len(input_ids) == 0:
        if has_session:
            return None
        return ("The prompt is empty: it tokenized to 0 tokens (the tokenizer adds no BOS token), "
                "and a prefill needs at least one.")
    low, high = min(input_ids), max(input_ids)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        return f"The prompt holds token id {bad}, outside the model's vocabulary [0, {vocab_size})."
    return None


def top_logprobs_problem(obj, vocab_size: int) -> Optional[str]:
    """Why the request's ``top_logprobs_num`` cannot be served, or None."""
    if not getattr(obj, "return_logprob", False):
        return None
    asked = getattr(obj, "top_logprobs_num", None)
    asked = max(asked) if isinstance(asked, (list, tuple)) and asked else asked
    if isinstance(asked, int) and asked > vocab_size:
        return f"top_logprobs_num is {asked}, more than the model's vocabulary of {vocab_size} tokens."
    return None


def has_session(obj) -> bool:
    params = getattr(obj, "session_params", None)
    return bool(isinstance(params, dict) and params.get("id"))

