"""The near-tie rule of the GPU lossless tests, kept apart so that CPU tests can check it.

A greedy divergence between a speculative server and plain decoding is excused only when plain
decoding itself could have picked the speculative token: its log-prob there is within ``near_tie``
nats of the best one. bf16 logits come in steps of 0.125-0.25 nats, so ties are often 3-way; a
top-2 check would call the third tied token a failure.
"""

import math
import random


def gap_to_best(top_logprobs, token):
    """Log-prob gap between plain decoding's best token and ``token``; inf when ``token`` is not
    among ``top_logprobs`` (SGLang's ``output_top_logprobs`` entry: (logprob, id, text), best first)."""
    best = top_logprobs[0][0]
    for logprob, token_id, *_ in top_logprobs:
        if token_id == token:
            return best - logprob
    return math.inf


def with_token_entry(top_logprobs, token_logprobs, token):
    """``top_logprobs`` with ``token``'s own entry (from ``output_token_ids_logprobs``) after them
    when it is not among them: on a flat position the speculative token may sit below the top few
    and still within the near-tie bound."""
    top = [tuple(t[:2]) for t in top_logprobs]
    if token not in (t[1] for t in top):
        top += [tuple(t[:2]) for t in token_logprobs if t[1] == token]
    return top


def is_near_tie(top_logprobs, token, near_tie):
    return gap_to_best(top_logprobs, token) <= near_tie


def chat_prompt_ids(tokenizer, texts, seed=0):
    """Chat-templated token ids of ``texts``, in a seeded order: a real model on random ids has flat,
    tie-ridden distributions that no near-tie rule can decide on."""
    from sglang_dflash.train.data import render  # the trainer's templating, so both see the same ids

    order = list(texts)
    random.Random(seed).shuffle(order)
    return [render(tokenizer, t) for t in order]
