"""Per request: a request whose drafts keep failing verifies its bonus token alone, inside the batch.

The width policy (:mod:`sglang_dflash.adaptive`) picks one width for the step; :class:`DraftHealth`
takes the requests that keep failing out of it (width 1, a plain decode in the batch) and gives them a
draft again now and then. :func:`sglang_dflash.adaptive.step_widths` and ``learn_step`` call it in
the worker's order; ``/get_server_info`` counts its requests under ``dflash.fallback``.
"""

from __future__ import annotations

from itertools import compress
from operator import not_
from typing import Optional, Sequence


class DraftHealth:
    """Per-request fallback: a request whose drafts keep failing verifies its bonus token alone.

    After ``misses`` verified steps in a row that accepted no draft, a request goes to width 1 (a
    plain decode inside the batch) and every ``retry_every``-th step of its fallback it is given the
    batch's width again; a retry that accepts a draft brings it back. Accept lengths arrive one step
    late (the overlap schedule), so a width is chosen from the history up to the step before. Only
    the requests in the current batch are remembered: one that leaves and comes back starts healthy.

    Its calls run in every decode step's host time (about 23 us a step at c32 on the H200 host,
    2026-11-28, with a loop over the batch in each): a request's fallback steps are counted from
    the step it fell back at, so a padded verify's check touches no request unless the batch
    could be all in fallback (:meth:`all_fallen`), and :meth:`observe` loops over the batch once
    to find the misses, then only over the requests that missed or are in fallback.
    """

    FALLEN_RATE = 0.1  # weight of the newest verify in :attr:`fallen_tokens`

    def __init__(self, misses: int = 4, retry_every: int = 16):
        if misses < 1 or retry_every < 1:
            raise ValueError("misses and retry_every are at least 1")
        self.misses_to_fallback, self.retry_every = misses, retry_every
        self.misses: dict = {}  # rid -> verified steps in a row without an accepted draft
        self.fell_at: dict = {}  # rid -> :attr:`steps` when it fell back (absent: healthy)
        self.steps = 0  # steps asked for widths, full ones (a width-1 batch retries nobody)
        self.pruned_for: Optional[list] = None  # the batch whose departed requests left the tables last
        self.fallback_requests = 0  # requests that went to fallback, counted once per entry
        # Tokens a request in fallback commits when verified with drafts (its retries), a running
        # mean from 1 (drafts that keep failing): what a plain step gives up for the time it saves.
        self.fallen_tokens = 1.0

    def _prune(self, rids: Sequence) -> None:
        """Departed requests leave the tables; nothing to do while the batch and the tables stand."""
        if (self.misses or self.fell_at) and rids != self.pruned_for:
            live = set(rids)
            for table in (self.misses, self.fell_at):
                for rid in table.keys() - live:
                    del table[rid]
            self.pruned_for = list(rids)

    def _retrying(self, rid) -> bool:
        return (self.steps - self.fell_at[rid]) % self.retry_every == 0

    def widths(self, rids: Sequence, batch_width: int) -> list[int]:
        """This step's width per request: ``batch_width``, or 1 in fallback except on a retry."""
        self._prune(rids)
        if batch_width == 1:
            return [1] * len(rids)
        self.steps += 1
        if not self.fell_at:
            return [batch_width] * len(rids)
        fell_at = self.fell_at
        return [batch_width if rid not in fell_at or self._retrying(rid) else 1 for rid in rids]

    def all_fallen(self, rids: Sequence) -> bool:
        """Whether every request of this step is in fallback and none retries: :meth:`widths` at a
        full width, all of them 1, for a step that verifies every request at one width."""
        self._prune(rids)
        self.steps += 1
        if len(self.fell_at) < len(rids):  # the tables hold this batch's requests alone
            return False
        return not any(self._retrying(rid) for rid in rids)

    def observe(self, rids: Sequence, widths: Sequence[int], accept_lens: Sequence[int]) -> None:
        """One verified step: each request's width and its accepted drafts (the bonus excluded)."""
        if 1 in widths:  # those at width 1 judged no draft
            judged = [i for i, w in enumerate(widths) if w > 1]
            rids, accept_lens = [rids[i] for i in judged], [accept_lens[i] for i in judged]
        misses, fell_at = self.misses, self.fell_at
        missed = list(compress(rids, map(not_, accept_lens)))  # C loops over the batch: no bytecode a request
        if misses and len(missed) < len(rids):  # an accepted draft ends a run of misses
            gone = set(missed)
            for rid in [rid for rid in misses if rid not in gone]:
                del misses[rid]
        if fell_at:
            for rid, accepted in list(compress(zip(rids, accept_lens), map(fell_at.__contains__, rids))):
                self.fallen_tokens += self.FALLEN_RATE * (1 + accepted - self.fallen_tokens)
                if accepted > 0:
                    del fell_at[rid]
        for rid in missed:
            if rid in fell_at:
                continue  # a failed retry: stay, and wait for the next one
            count = misses.get(rid, 0) + 1
            if count == 1:
                self.pruned_for = None  # a new entry: the next batch is checked for departures again
            if count < self.misses_to_fallback:
                misses[rid] = count
            else:
                misses.pop(rid, None)
                fell_at[rid] = self.steps
                self.fallback_requests += 1
                self.pruned_for = None

    def in_fallback(self, running: Optional[set] = None) -> int:
        """Requests in fallback: of the last batch, or of ``running`` (the scheduler's requests), so
        an idle server counts none although its last batch's tables stand until the next step."""
        return len(self.fell_at) if running is None else len(self.fell_at.keys() & running)


class ForcedFallback:
    """Requests in and out of fallback on a fixed pattern, whatever they accept, so a lossless
    check crosses every case: every third step the whole batch falls back (a plain decode step),
    and on the others every other request does, the pattern shifting by one each step. Same
    interface as :class:`DraftHealth`."""

    def __init__(self):
        self.steps = 0
        self.seen: set = set()  # requests in the batch that have fallen back at least once
        self.fallback_requests = 0
        self.fallen: set = set()  # the requests of the last step at width 1
        self.fallen_tokens = 1.0

    def widths(self, rids: Sequence, batch_width: int) -> list[int]:
        self.steps += 1
        if self.steps % 3 == 0:
            out = [1] * len(rids)
        else:
            out = [1 if (i + self.steps) % 2 else batch_width for i in range(len(rids))]
        self.seen &= set(rids)
        fell = {rid for rid, w in zip(rids, out) if w == 1}
        self.fallback_requests += len(fell - self.seen)
        self.seen |= fell
        self.fallen = fell
        return out

    def all_fallen(self, rids: Sequence) -> bool:
        return max(self.widths(rids, 2), default=1) == 1

    def observe(self, rids: Sequence, widths: Sequence[int], accept_lens: Sequence[int]) -> None:
        pass

    def in_fallback(self, running: Optional[set] = None) -> int:
        return len(self.fallen if running is None else self.fallen & running)


def make_fallback(mode: str):
    """``on`` (:class:`DraftHealth`), ``force`` (:class:`ForcedFallback`) or ``off`` (None)."""
    return {"on": DraftHealth, "force": ForcedFallback}.get(mode, lambda: None)()
