"""Which verify width a step should use: the most committed tokens per second of step time.

A step at width w verifies the bonus and the first w - 1 drafts; width 1 is a plain decode step
(no draft pass). It commits on average ``1 + sum_{k<w} p_1 ... p_k`` tokens, where p_k is the
chance that draft k is accepted once drafts 1..k-1 were (:class:`AcceptanceByPosition`, kept per
batch-size bucket over the server's), and it costs the step time at that width and batch size
(:class:`StepCosts`, measured while serving).
:class:`WidthPolicy` picks the width with the best ratio, timing a width a few times per batch-size
bucket before trusting its cost, and measuring again now and then the widths that could still
win (and full width, whose steps alone show the deeper positions' acceptance). Changing width
never changes a token (the reference loop's ``width`` argument; ``tests/test_adaptive.py``): only
how many candidates are checked.
"""

from __future__ import annotations

import statistics
from collections import Counter, deque
from typing import Optional, Sequence


def candidate_widths(block_size: int) -> tuple[int, ...]:
    """block_size, block_size/2, ..., 2, 1."""
    widths, w = [], block_size
    while w > 1:
        widths.append(w)
        w //= 2
    return tuple(widths) + (1,)


def bucket(bs: int) -> int:
    """Batch sizes grouped by the next power of two (as CUDA graphs are captured)."""
    return 1 << (bs - 1).bit_length() if bs > 1 else 1


class AcceptanceByPosition:
    """Running conditional acceptance per drafted position, decayed so it follows the workload."""

    def __init__(self, block_size: int, decay: float = 0.995, prior: float = 0.5, prior_weight: float = 2.0,
                 parent: Optional["AcceptanceByPosition"] = None):
        self.block_size, self.decay = block_size, decay
        self.prior, self.prior_weight = prior, prior_weight  # pseudo-counts: a position never seen has `prior`
        self.parent = parent  # whose rates stand in for `prior`: a batch-size bucket's, the server's
        self.version = 0  # updates so far: what a child's cached expectation was read at
        self._parent_version = -1
        # Counts in units of `weight`, which grows by 1/decay a step: the older counts decay without
        # every position being touched each step (the policy's host time is a share of a short step).
        self.weight = 1.0
        self.accepted = [0.0] * block_size  # index k: draft k (1-based; 0 unused)
        self.tested = [0.0] * block_size
        # width -> the accept lengths' weighted histogram since the last fold: a step adds a count
        # per request, and the counts by position are summed only when a rate is read (every few
        # steps, where the policy decides), not in every step's host time.
        self.pending: dict[int, list[float]] = {}
        self._expected: Optional[list[float]] = None  # by width, until the next update

    def update(self, accept_lens: Sequence[int], width: int) -> None:
        """One step's accepted-draft counts (bonus excluded), one per request, at ``width``."""
        self.weight /= self.decay
        if self.weight > 1e12:  # back to 1 now and then, far inside a float's range and precision
            self._fold()
            self.accepted = [a / self.weight for a in self.accepted]
            self.tested = [t / self.weight for t in self.tested]
            self.weight = 1.0
        histogram = self.pending.get(width)
        if histogram is None:
            histogram = self.pending[width] = [0.0] * width
        top, w = width - 1, self.weight
        for a in accept_lens:
            histogram[a if a < top else top] += w
        self._expected = None
        self.version += 1

    def _fold(self) -> None:
        """Draft k was judged in every request that accepted at least k - 1 drafts (while k < width)
        and accepted in those that accepted at least k: the suffix sums of each width's histogram."""
        for width, exactly in self.pending.items():
            at_least = 0.0
            for k in range(width - 1, 0, -1):
                at_least += exactly[k]
                self.accepted[k] += at_least
                self.tested[k] += at_least + exactly[k - 1]
        self.pending.clear()

    def rate(self, k: int) -> float:
        if self.pending:
            self._fold()
        pseudo = self.prior_weight * self.weight
        prior = self.prior if self.parent is None else self.parent.rate(k)
        return (self.accepted[k] + prior * pseudo) / (self.tested[k] + pseudo)

    def expected_tokens(self, width: int) -> float:
        """Mean tokens a step at ``width`` commits, the bonus included."""
        if self.parent is not None and self.parent.version != self._parent_version:
            self._expected, self._parent_version = None, self.parent.version
        if self._expected is None:  # every width at once: the policy asks many times a step
            totals, total, run = [0.0, 1.0], 1.0, 1.0
            for k in range(1, self.block_size):
                run *= self.rate(k)
                total += run
                totals.append(total)
            self._expected = totals
        return self._expected[width]


class StepCosts:
    """Step seconds by (width, batch-size bucket): the least of the last few measured. The first
    step of a key is not counted: it pays for first use (a graph's first replay, a JIT build).
    Noise in a step's time is one-sided (a late host, a scheduler turn, a new request's prefill
    only add time; seen on SmolLM2, where one width read 4.9 and 18.5 ms at one batch size), so
    the least is the estimate a median would only reach with most samples clean."""

    def __init__(self, window: int = 8):
        self.samples: dict[tuple[int, int], deque] = {}  # (order, the policy's step, seconds), the last `window`
        self.seconds: dict[tuple[int, int], float] = {}  # each key's estimate, kept as samples arrive
        self.least_ever: dict[tuple[int, int], float] = {}  # what bounds the other keys
        self.seen: set = set()  # keys whose first step was left out
        self.window = window
        self.order = 0  # samples observed so far, of every key: which of two was timed first

    def observe(self, width: int, bs: int, seconds: float, step: int = 0) -> None:
        """One step's seconds; ``step``: the policy's step count when they arrived."""
        key = (width, bucket(bs))
        samples = self.samples.get(key)
        if samples is None:
            if key not in self.seen:
                self.seen.add(key)
                return
            samples = self.samples[key] = deque(maxlen=self.window)
        self.order += 1
        # The least of the window kept as samples arrive: scanned again only when it leaves.
        leaving = samples[0][2] if len(samples) == self.window else None
        samples.append((self.order, step, seconds))
        least = self.seconds.get(key)
        if least is None or seconds <= least:
            self.seconds[key] = seconds
        elif leaving == least:
            self.seconds[key] = min(s for _, _, s in samples)
        if seconds < self.least_ever.get(key, float("inf")):
            self.least_ever[key] = seconds

    def count(self, width: int, bs: int) -> int:
        return len(self.samples.get((width, bucket(bs)), ()))

    def estimate(self, width: int, bs: int) -> Optional[float]:
        return self.seconds.get((width, bucket(bs)))

    def typical(self, width: int, bs: int) -> Optional[float]:
        """The median of (width, bs)'s kept samples: what one more sample is as likely to beat as not."""
        samples = self.samples.get((width, bucket(bs)))
        return statistics.median(s for _, _, s in samples) if samples else None

    def newest_since(self, width: int, bs: int, step: int) -> Optional[tuple[float, int]]:
        """The newest sample of (width, bs), ``(seconds, order)``, if it was taken at ``step`` or later."""
        samples = self.samples.get((width, bucket(bs)))
        if not samples or samples[-1][1] < step:
            return None
        order, _, seconds = samples[-1]
        return seconds, order

    def timed_after(self, width: int, bs: int, order: int) -> bool:
        """Whether a (width, bs) sample kept in its window was timed after the sample ``order``."""
        return any(k > order for k, _, _ in self.samples.get((width, bucket(bs)), ()))

    def lower_bound(self, width: int, bs: int, min_count: int = 1, narrower: bool = True) -> Optional[float]:
        """What a step at (width, bs) costs at least, from the least ever measured at the other
        keys measured ``min_count`` times or more (one unlucky sample would raise the bound, and
        so would a slow stretch): a smaller batch never costs more, nor (``narrower``) does a
        narrower width. None when no such key was measured."""
        b = bucket(bs)
        below = [least for (w, k), least in self.least_ever.items()
                 if (w <= width if narrower else w == width) and k <= b and (w, k) != (width, b)
                 and len(self.samples[w, k]) >= min_count]
        return max(below) if below else None


class WidthPolicy:
    """Per step: the width with the most expected tokens per second at this batch size.

    A width is first tried at a batch-size bucket only if it could beat the best measured there
    at the least it can cost (:meth:`StepCosts.lower_bound`: what a narrower width or a smaller
    batch was measured at): with every draft accepted, width 16 and width 1 settle a bucket, and
    later buckets need width 16 alone. Costs drift and are noisy, so every ``refresh_every``
    steps one width is measured again, in turn among those that could still win: a width whose
    expected tokens would not beat the current choice even at ``1 - margin`` of its measured cost
    is not worth a step. Full width is verified every ``8 * refresh_every`` steps whatever it
    costs: the deeper positions' acceptance is only seen there, and without it a workload that
    turns easy would stay narrow; where even every draft after the first accepted could not pay
    for it, a width-2 step measures the first draft instead (:meth:`_deep_width`). A new choice
    must beat the current one by ``margin / 4``, so near-equal widths do not flip on noise. A
    bucket's probes (refresh and confirm steps) come at most every ``probe_gap`` steps, which doubles
    with each probe up to ``MAX_PROBE_GAP`` and starts again from ``refresh_every`` when the held
    width changes: where the held width keeps winning, a probe only costs. Once
    settled, a bucket's choice is reconsidered every ``decide_every`` steps and at each scheduled
    re-measurement, not every step: on a host-bound pair the policy's own host time is a share of
    the step. For the same reason what each step teaches waits for the next decision
    (:meth:`record_later`), and a bucket that keeps full width sleeps (:meth:`sleeping`)."""

    SURE_AFTER = 3  # measured steps before a width's cost may keep it from being measured again
    CONFIRM_LAG = 3  # steps until a step's time reaches the policy (the overlap schedule reports late)
    # The most steps between a bucket's probes. SmolLM2 on an H200 (2026-11-28, mt-bench): width 8,
    # within 1.5% of width 16's tokens at about its cost, was probed every 16 steps (4-7% of a level's
    # steps) and never won; at bs 1-2 a single width-8 call took 0.5-0.9 ms more host time than width 16's.
    MAX_PROBE_GAP = 256
    MAX_UNLEARNED = 16  # steps whose lesson may wait for a decision (:meth:`record_later`)
    # A bucket that has held full width AWAKE_STEPS steps since it chose it or last woke sleeps
    # SLEEP_STEPS (:meth:`sleeping`), twice as long each time it wakes on schedule to the same
    # choice, up to LONGEST_SLEEP. SmolLM2 on an H200: width 16 in 98-99.9% of steps at c1-c64; the
    # policy's calls took 1.5-1.9% of fixed 16's host time a step awake (2026-11-29), the whole of
    # the 0.98 goal's margin, and 0.6-0.8% with every sleep SLEEP_STEPS long (2026-11-29, 78-86% of
    # steps asleep), nearly all of it in the awake steps. It wakes early where its drafts'
    # acceptance falls (:meth:`watch`), and a changed choice starts again from SLEEP_STEPS.
    AWAKE_STEPS = 64
    SLEEP_STEPS = 448
    LONGEST_SLEEP = 8 * SLEEP_STEPS
    WAKE_BELOW = 0.8  # of the drafts a full-width step was expected to accept when the bucket fell asleep
    FRESH_STEPS = 2  # full-width steps of a bucket held narrow once its batch is mostly new (:meth:`admitted`)

    def __init__(self, block_size: int, widths: Optional[Sequence[int]] = None, refresh_every: int = 16,
                 margin: float = 0.1, decide_every: int = 8, sleeps: bool = True):
        self.widths = tuple(widths or candidate_widths(block_size))
        if max(self.widths) > block_size or min(self.widths) < 1:
            raise ValueError(f"widths must lie in 1..{block_size}, got {self.widths}")
        self.acceptance = AcceptanceByPosition(block_size)  # every request's
        # Each batch-size bucket's own, the server's standing in where it has few steps: where a
        # wave's batch has shrunk to the requests that accept least, its buckets see those alone
        # (docs/design/wave-tails.md).
        self.by_bucket: dict[int, AcceptanceByPosition] = {}
        self.costs = StepCosts()
        self.refresh_every, self.margin = refresh_every, margin
        self.steps = 0
        self.current: dict[int, int] = {}  # batch-size bucket -> the width chosen last
        self.confirming: dict[int, int] = {}  # bucket -> a width to time before it may replace the held one
        self.confirm_asked: dict[int, int] = {}  # bucket -> the step its last confirm step was asked for
        self.first_wins: dict[int, tuple[int, int]] = {}  # bucket -> (challenger, the sample it won on once)
        self.probe_gap: dict[int, int] = {}  # bucket -> steps from its last probe to the next (absent: refresh_every)
        self.last_probe: dict[int, int] = {}  # bucket -> the step of its last refresh or confirm
        self.decide_every = decide_every
        self.settled: dict[int, tuple[int, int]] = {}  # bucket -> (best width, the step it is held until)
        self.refreshes = 0
        self.reasons: Counter = Counter()  # (bucket, width, why) -> steps: which rule chose each width
        self.switch_log: deque = deque(maxlen=32)  # the latest changes of a bucket's held width, and why
        self.unlearned: list = []  # (width, bs, accept lens, timing, step) of steps not yet recorded
        self.sleeps = sleeps  # False: every step decided, timed and learned from (A/B runs)
        self.calm_since: dict[int, int] = {}  # bucket -> the step its held width was chosen or it last woke
        # bucket -> (full width, the step it wakes at, its reasons key, the drafts a request was
        # expected to accept at full width when it fell asleep)
        self.asleep: dict[int, tuple] = {}
        self.sleep_steps: dict[int, int] = {}  # bucket -> the length of its next sleep (absent: SLEEP_STEPS)
        self.fresh: dict[int, int] = {}  # bucket -> full-width steps still due to its new requests

    def accepts_at(self, bs: int) -> AcceptanceByPosition:
        """The acceptance a step at batch size ``bs`` is judged on: its bucket's."""
        return self.by_bucket.get(bucket(bs)) or self.acceptance

    def admitted(self, joined: int, bs: int) -> None:
        """``joined`` requests entered a batch now ``bs`` strong (a prefill): where they are half of
        it or more and its bucket holds a narrower width than full, the bucket's acceptance
        described requests mostly gone, and the bucket is judged on the server's again from its next
        decision (at c1, a request that accepts most drafts after one that accepted none would
        otherwise run at the narrow width chosen for the one before it: narrow steps teach nothing
        of the deeper drafts, and the old steps outweigh a probe's). The bucket's next
        ``FRESH_STEPS`` steps verify the full width, so its new acceptance starts from the new
        requests' own. A bucket at full width keeps learning as it is, asleep or not."""
        b = bucket(bs)
        if 2 * joined >= bs and self.current.get(b, max(self.widths)) < max(self.widths):
            self.by_bucket.pop(b, None)
            self.settled.pop(b, None)
            self.fresh[b] = self.FRESH_STEPS

    def throughput(self, width: int, bs: int) -> Optional[float]:
        seconds = self.costs.estimate(width, bs)
        return None if seconds is None else self.accepts_at(bs).expected_tokens(width) / seconds

    def best_possible(self, width: int, bs: int) -> float:
        """Expected tokens per second at the least a step of ``width`` can cost (unbounded when
        nothing measured bounds it). Full width is bounded by its own smaller batches alone: a
        narrower width does not always read cheaper (SmolLM2 on fa3, 2026-11-26: width 8 read 1.6x
        width 16 in the policy's timings), and bounded by one, width 16 went untried at a whole
        batch size."""
        floor = self.costs.lower_bound(width, bs, self.SURE_AFTER, narrower=width < max(self.widths))
        return self.accepts_at(bs).expected_tokens(width) / floor if floor else float("inf")

    def sleeping(self, bs: int) -> Optional[int]:
        """Full width for this step if its bucket sleeps (a step of the policy's), else None: then
        :meth:`choose` decides as usual. Callers ask before :meth:`choose`. A sleeping step is not
        timed, only its acceptance is learned (:meth:`watch`), and no request's fallback is checked:
        it runs at full width, as fixed 16 would."""
        if not self.asleep:
            return None
        b = bucket(bs)
        nap = self.asleep.get(b)
        if nap is None:
            return None
        if self.steps + 1 >= nap[1]:  # this step is awake: chosen, timed and learned from as usual
            del self.asleep[b]
            self.calm_since[b] = self.steps + 1
            return None
        self.steps += 1
        self.reasons[nap[2]] += 1
        return nap[0]

    def watch(self, width: int, bs: int, accept_lens: Sequence[int]) -> None:
        """A sleeping bucket's step: its acceptance is learned (its cost is not timed), and the
        bucket wakes once full width is expected to accept fewer than ``WAKE_BELOW`` of the drafts
        it was when it fell asleep, by the bucket's own acceptance (:meth:`accepts_at`). Judged
        where the steps are learned, every ``MAX_UNLEARNED``."""
        self.record_later(width, bs, accept_lens, None)
        if self.unlearned:
            return
        b = bucket(bs)
        nap = self.asleep.get(b)
        if nap is not None and self.accepts_at(bs).expected_tokens(nap[0]) - 1 < self.WAKE_BELOW * nap[3]:
            del self.asleep[b]
            self.calm_since[b] = self.steps
            self.sleep_steps.pop(b, None)

    def choose(self, bs: int, timed: bool = True) -> int:
        """The width of a step at batch size ``bs``. ``timed``: whether the step's time will be read
        (:class:`~sglang_dflash.step_clock.StepClock`: not after a prefill). An untimed step takes
        the bucket's held width and is no step of the policy's: its probes wait for a timed one.
        Spent on untimed steps, they were lost (SmolLM2 under a c64 load of mixed parameters,
        H200, 2026-12-02: more prefills than decode steps, width 1's 31 tries at bs 64 gave too few
        samples to confirm it, and width 16 held 2,493 steps at 38.5 ms for 2.05 tokens against
        width 1's 9.6 ms for 1)."""
        b = bucket(bs)
        if self.fresh and b in self.fresh:  # a batch mostly new to a narrow bucket (:meth:`admitted`)
            self.fresh[b] -= 1
            if not self.fresh[b]:
                del self.fresh[b]
            self.steps += timed
            self.reasons[b, max(self.widths), "admitted"] += 1
            return max(self.widths)
        held = self.settled.get(b)
        if not timed:
            width = held[0] if held is not None else self.current.get(b, max(self.widths))
            self.reasons[b, width, "untimed"] += 1
            return width
        self.steps += 1
        if held is not None and self.steps < held[1] and self.steps % self.refresh_every:
            width, why = held[0], "best"
        else:
            self._learn()
            width, why = self._decide(bs)
        self.reasons[b, width, why] += 1
        return width

    def _decide(self, bs: int) -> tuple[int, str]:
        measured = self._measured(bs)
        width = self._first_try(bs, measured)
        if width is not None:
            return width, "first_try"
        if self.steps % (8 * self.refresh_every) == 0:
            return self._deep_width(bs), "deep_refresh"
        width, sure = self._best(bs, measured)
        b = bucket(bs)
        challenger = self.confirming.pop(b, None)
        if challenger is not None:
            return challenger, "confirm"  # the held width stays settled-free: decide again once it is timed
        # Not sure: the held width is timed beside a challenger's sample first, so decide next step.
        self.settled[b] = (width, self.steps + (self.decide_every if sure else 1))
        if self.steps % self.refresh_every == 0 and self._probe_due(b):
            refresh = self._worth_measuring(bs, width)
            if refresh is not None:
                self._probed(b)
                return refresh, "refresh"
        if (self.sleeps and sure and width == max(self.widths) == self.current.get(b)
                and b not in self.confirming and b not in self.first_wins
                and self.steps - self.calm_since.get(b, self.steps) >= self.AWAKE_STEPS):
            accepted = self.accepts_at(bs).expected_tokens(width) - 1
            length = self.sleep_steps.get(b, self.SLEEP_STEPS)
            self.sleep_steps[b] = min(2 * length, self.LONGEST_SLEEP)
            self.asleep[b] = (width, self.steps + length, (b, width, "asleep"), accepted)
        return width, "best"

    def _probe_due(self, b: int) -> bool:
        return self.steps - self.last_probe.get(b, -self.MAX_PROBE_GAP) >= self.probe_gap.get(b, self.refresh_every)

    def _probed(self, b: int) -> None:
        self.last_probe[b] = self.steps
        self.probe_gap[b] = min(2 * self.probe_gap.get(b, self.refresh_every), self.MAX_PROBE_GAP)

    def _deep_width(self, bs: int) -> int:
        """Full width, unless it could not beat the width held here even if every draft after the
        first were accepted: then the narrowest width that judges a draft. That keeps the first
        draft's rate, which bounds every deeper one, fresh at a fraction of the cost (8B rig,
        random weights, bs 64: a full-width step costs 2.7x width 1, a width-2 step 1.4x)."""
        full = max(self.widths)
        drafting = [w for w in self.widths if w > 1]
        held = self.current.get(bucket(bs))
        cost = self.costs.estimate(full, bs)
        if len(drafting) < 2 or held is None or cost is None or self.costs.estimate(held, bs) is None:
            return full
        at_most = (1 + self.accepts_at(bs).rate(1) * (full - 1)) / cost
        return full if at_most > self.throughput(held, bs) else min(drafting)

    def _measured(self, bs: int) -> list[int]:
        """Widths measured often enough here to be judged by their cost: a host hiccup only ever
        adds time, so a width seen once or twice may just have been unlucky."""
        return [w for w in self.widths if self.costs.count(w, bs) >= self.SURE_AFTER]

    def _first_try(self, bs: int, measured: list[int]) -> Optional[int]:
        """An unmeasured width that could beat every ``measured`` one at this bucket: the unbounded
        first (full width, then width 1: together they bound the rest), then the most promising.
        Width 1, a plain step, is timed once at every bucket whatever its bound: what a draft costs
        grows with the batch in ways a smaller batch's plain step does not bound (SmolLM2 on an
        H200, 2026-11-30: held-out prompts at c64 ran at 0.85x plain decoding, with width 16 held in
        99% of the steps and no width-1 step ever timed at bs 64)."""
        best = max((self.throughput(w, bs) for w in measured), default=0.0)
        untried = [w for w in self.widths if w not in measured
                   and ((w == 1 and not self.costs.count(1, bs)) or self.best_possible(w, bs) > best)]
        if not untried:
            return None
        return min(untried, key=lambda w: (-self.best_possible(w, bs), w != max(self.widths), w != 1))

    def _best(self, bs: int, measured: list[int]) -> tuple[int, bool]:
        """The measured width with the most expected tokens per second, and whether that is
        settled. Another than the width held (full width before a bucket's first choice) replaces
        it only on a sample of its own taken in the last ``refresh_every`` steps (a ``confirm``
        step when there is none) that beats, by ``margin / 4``, the held width's samples just
        before and after it (waited for: not settled): their median for a wider width; their
        least, on two such samples, for a narrower one, which commits fewer tokens and can win on
        its cost alone. The held width is timed every step, the others now and then, on a host
        whose speed drifts in stretches: a challenger's older samples come from other stretches
        than the held width's recent ones (SmolLM2 on fa3, 2026-11-26:
        width 8, timed long before in a quiet stretch, held for hundreds of steps at the cost of
        width 16), and one sample of its own can fall in a quiet moment between slow ones
        (2026-11-27, H200: width 8 held for 30-47% of a level's steps after single readings such
        as 16 at 5.2 ms against 8 at 4.1, where steady runs of each cost the same)."""
        b = bucket(bs)
        best = max(measured, key=lambda w: self.throughput(w, bs))
        # A bucket's first choice is a switch from full width: a narrower width read cheapest on its
        # few first tries, where every width costs the same, was otherwise held until full width
        # won a confirm (2026-11-27, H200, SmolLM2 mt-bench: width 8 for 16-22% of the first level).
        held = self.current.get(b, max(self.widths))
        if best == held:
            self.first_wins.pop(b, None)  # a win counts only while its width still reads best
        elif self.costs.estimate(held, bs) is None:
            # Not timed at this bucket yet (full width bounded out of its first tries by a slow
            # smaller bucket): time it before another replaces it (2026-11-28, H200, SmolLM2
            # gsm8k c32: width 8 held for 590 steps that way, until deep refreshes timed width 16).
            return held, False
        else:
            fresh = self.costs.newest_since(best, bs, self.steps - self.refresh_every)
            won = self.first_wins.get(b)
            if fresh is None or (won is not None and won == (best, fresh[1])):
                if self.steps - self.confirm_asked.get(b, -self.refresh_every) <= self.CONFIRM_LAG:
                    return held, False  # its confirm step's time is not in yet
                if won is None and not self._probe_due(b):
                    return held, True  # probed again once the bucket's gap has passed
                return self._confirm(b, best, held)
            seconds, order = fresh
            if not self.costs.timed_after(held, bs, order):
                return held, False
            # Its window holds samples from both sides now. A wider challenger's one sample is set
            # against their median, as likely beaten as not on equal costs; a narrower one's against
            # their least: the least of several, set against one, would keep a narrower width held
            # on a noisy host (2026-11-27, H200: width 8 held at bs 8-32 through 27 confirm steps
            # of width 16, whose least read 15% cheaper than width 8's).
            beside = self.costs.typical(held, bs) if best > held else self.costs.estimate(held, bs)
            accepts = self.accepts_at(bs)
            rate = accepts.expected_tokens(best) / seconds
            if rate <= (1 + self.margin / 4) * accepts.expected_tokens(held) / beside:
                self.first_wins.pop(b, None)
                return held, True
            if best < held and (won is None or won[0] != best):  # narrower: time it again first
                self.first_wins[b] = (best, order)
                return self._confirm(b, best, held)
            self.first_wins.pop(b, None)
            self._log_switch(b, held, best, seconds)
        if self.current.get(b) != best:
            self.probe_gap.pop(b, None)  # a new held width: what may beat it is probed afresh
            self.calm_since[b] = self.steps
            self.sleep_steps.pop(b, None)
        self.current[b] = best
        return best, True

    def _confirm(self, b: int, challenger: int, held: int) -> tuple[int, bool]:
        """Time ``challenger`` in this step (a ``confirm`` step); the held width stays held."""
        self.confirming[b] = challenger
        self.confirm_asked[b] = self.steps
        self._probed(b)
        return held, True

    def _log_switch(self, b: int, held: int, best: int, fresh: float) -> None:
        """What a bucket's held width was replaced on: each width's cost estimate (the least of its
        recent samples, the held width's from both sides of the new one's), the new width's own
        fresh sample, and the tokens each is expected to commit."""
        accepts = self.accepts_at(b)
        self.switch_log.append({
            "step": self.steps, "bucket": b, "from": held, "to": best,
            "from_ms": round(self.costs.estimate(held, b) * 1000, 3),
            "to_ms": round(self.costs.estimate(best, b) * 1000, 3), "to_fresh_ms": round(fresh * 1000, 3),
            "from_tokens": round(accepts.expected_tokens(held), 3),
            "to_tokens": round(accepts.expected_tokens(best), 3)})

    def _worth_measuring(self, bs: int, chosen: int) -> Optional[int]:
        """The next width in turn that could beat ``chosen`` if it cost ``margin`` less; a width
        measured fewer than ``SURE_AFTER`` times is judged by the least it can cost instead (a slow
        first use must not keep a width out), against ``chosen`` itself, as for a first try: that
        least is already a bound, and with the margin too, a width that got no first try was timed
        by refreshes alone (8B rig, every draft accepted, fa3, 2026-11-27: width 8 at bs 32, 4 steps)."""
        held = self.throughput(chosen, bs)
        if held is None:  # the held width is not timed at this bucket yet (:meth:`_best`): this step times it
            return None
        bar = held * (1 - self.margin)
        accepts = self.accepts_at(bs)

        def could_win(w: int) -> bool:
            if self.costs.count(w, bs) < self.SURE_AFTER:
                return self.best_possible(w, bs) > held
            cost = self.costs.estimate(w, bs)
            if w == max(self.widths) and self.costs.count(w, bs) < self.costs.window:
                # Its few samples may all have come in a slow stretch, and once another width is
                # chosen only refreshes add more: judge it by its smaller batches' cost too, each
                # measured once at least (the nearest bounds closest: on the 8B rig bs 64 costs 2.5x bs 1).
                cost = min(cost, self.costs.lower_bound(w, bs, 1, narrower=False) or cost)
            return accepts.expected_tokens(w) / cost >= bar

        candidates = [w for w in self.widths if w != chosen and could_win(w)]
        if not candidates:
            return None
        self.refreshes += 1
        return candidates[self.refreshes % len(candidates)]

    def record(self, width: int, bs: int, accept_lens: Sequence[int], seconds: Optional[float],
               step: Optional[int] = None) -> None:
        """One step's accepted-draft counts and, when it was timed, its seconds (``step``: the
        policy's step count when they arrived, default now)."""
        if seconds is not None:
            self.costs.observe(width, bs, seconds, self.steps if step is None else step)
        if width > 1:
            self.acceptance.update(accept_lens, width)
            b = bucket(bs)
            own = self.by_bucket.get(b)
            if own is None:
                own = self.by_bucket[b] = AcceptanceByPosition(self.acceptance.block_size, parent=self.acceptance)
            own.update(accept_lens, width)

    @staticmethod
    def read_timing(timing) -> Optional[float]:
        """A step's seconds from what :meth:`record_later` was given: here the seconds themselves;
        the worker reads its CUDA events instead."""
        return timing

    def record_later(self, width: int, bs: int, accept_lens: Sequence[int], timing) -> None:
        """:meth:`record`, once the policy next decides (or reports): a step whose width is held
        reads nothing learned. Several steps learned in one go run the policy's code once warm, not
        every step cold after the scheduler's own work (2026-11-28, H200: the policy's calls took
        72 us a step at c32, learning every step). What is decided is the same: every step is
        learned, in order, before any decision."""
        self.unlearned.append((width, bs, accept_lens, timing, self.steps))
        if len(self.unlearned) >= self.MAX_UNLEARNED:
            self._learn()

    def _learn(self) -> None:
        if self.unlearned:
            unlearned, self.unlearned = self.unlearned, []
            for width, bs, accept_lens, timing, step in unlearned:
                self.record(width, bs, accept_lens, self.read_timing(timing), step)

    def count(self, bs: int, width: int, why: str) -> None:
        """A step whose width was set outside the policy (every request in fallback)."""
        self.reasons[bucket(bs), width, why] += 1

    def fallback_width(self, bs: int, fallen_tokens: float = 1.0, timed: bool = True) -> int:
        """For a batch whose every request is in fallback: a plain decode step (width 1) where its
        typical step costs ``margin`` less per token than every other width measured here, a
        request in fallback committing ``fallen_tokens`` a step when verified with drafts
        (:attr:`sglang_dflash.fallback.DraftHealth.fallen_tokens`), or where width 1 is not measured
        yet; else the policy's choice. On a host-bound pair every width costs about the same, so
        skipping the draft saves nothing and loses the drafts it would have accepted (SmolLM2
        mt-bench at c1: 1.87 tokens a step against 2.13; 2026-11-28, H200: 3-9% of c1's steps were
        plain, on a width 1 whose least read 12-15% below width 16's, where the requests' retries showed
        what the drafts would have added). Width 1's median, not its least: its first step after a
        verify reads low (2026-11-26)."""
        self._learn()
        one = self.costs.typical(1, bs)
        others = [s for w in self.widths if w != 1 and (s := self.costs.estimate(w, bs)) is not None]
        if one is None or not others or one * fallen_tokens <= (1 - self.margin) * min(others):
            self.count(bs, 1, "fallback")
            return 1
        return self.choose(bs, timed)

    def widths_used(self) -> dict[int, int]:
        used: Counter = Counter()
        for (_, width, _), n in self.reasons.items():
            used[width] += n
        return dict(sorted(used.items(), reverse=True))

    def step_ms(self) -> dict[str, float]:
        """The measured step costs, as ``"width@batch bucket": ms``."""
        self._learn()
        return {f"{w}@{b}": round(s * 1000, 3) for (w, b), s in sorted(self.costs.seconds.items())}

    def choices(self) -> dict[str, dict[str, int]]:
        """Steps per ``"width@batch bucket"`` and the rule that chose them (``first_try``, ``best``,
        ``refresh``, ``deep_refresh``, ``confirm``, ``asleep``, ``untimed``, ``fallback``,
        ``admitted``): why a width ran where its cost says it should not."""
        out: dict[str, dict[str, int]] = {}
        for (b, w, why), n in sorted(self.reasons.items(), key=lambda kv: (kv[0][0], -kv[0][1], kv[0][2])):
            out.setdefault(f"{w}@{b}", {})[why] = n
        return out

    def held(self) -> dict[str, dict]:
        """What each bucket's held width is chosen on now: ``{bucket: {"width", "by_width": {width:
        {"ms", "tokens", "tokens_per_ms"}}}}``, each measured width's cost estimate and the tokens
        it is expected to commit a step, so a choice can be checked against the figures it read.
        A bucket timed but never decided on holds full width, and is shown with its figures too
        (SmolLM2 under a c64 load of mixed parameters, H200, 2026-12-02: bs 64 ran 2,493 steps of
        width 16 against a width 1 that read twice its tokens a millisecond, and was missing here)."""
        self._learn()
        out: dict[str, dict] = {}
        for b in sorted(set(self.current) | {b for _, b in self.costs.seconds}):
            by_width, accepts = {}, self.accepts_at(b)
            for w in self.widths:
                seconds = self.costs.estimate(w, b)
                if seconds is not None:
                    tokens = accepts.expected_tokens(w)
                    by_width[str(w)] = {"ms": round(seconds * 1000, 3), "tokens": round(tokens, 3),
                                        "tokens_per_ms": round(tokens / seconds / 1000, 3)}
            out[str(b)] = {"width": self.current.get(b, max(self.widths)), "by_width": by_width}
        return out

    def switches(self) -> list[dict]:
        """The latest changes of a bucket's held width (``best`` steps), oldest first, each with
        the costs and expected tokens it was made on: why a width was held where its cost, read
        later, says it should not have been."""
        return list(self.switch_log)

    def acceptance_rates(self) -> list[float]:
        """The running acceptance of drafts 1..B-1, each given the ones before it were accepted."""
        self._learn()
        return [round(self.acceptance.rate(k), 4) for k in range(1, self.acceptance.block_size)]


class CyclingWidths:
    """Widths in turn, ``hold`` steps each: with ``hold=1`` no step shares its width with the one
    before, so a lossless check crosses every switch. Longer holds time each width in runs: the
    step costs are kept apart for the first step of a run (a switch) and the others (steady), so a
    width whose steps cost more shows whether it pays for the switch or for itself. Same interface
    as :class:`WidthPolicy`."""

    def __init__(self, widths: Sequence[int], hold: int = 1):
        if hold < 1:
            raise ValueError(f"hold is at least 1 step, got {hold}")
        self.widths, self.hold = tuple(widths), hold
        self.steps = 0
        self.used: Counter = Counter()
        self.seconds: dict[tuple[int, int, bool], deque] = {}  # (width, bucket, after a switch) -> last 256
        self.last_width: Optional[int] = None

    def sleeping(self, bs: int) -> None:
        return None  # every step its turn

    def admitted(self, joined: int, bs: int) -> None:
        pass  # it learns nothing to forget

    def choose(self, bs: int, timed: bool = True) -> int:
        width = self.widths[self.steps // self.hold % len(self.widths)]
        self.steps += 1
        self.used[width] += 1
        return width

    def record(self, width: int, bs: int, accept_lens: Sequence[int], seconds: Optional[float]) -> None:
        # Steps are recorded in the order they ran: the first of each run is the one after a switch.
        switched, self.last_width = width != self.last_width, width
        if seconds is not None and self.hold > 1:
            self.seconds.setdefault((width, bucket(bs), switched), deque(maxlen=256)).append(seconds)

    read_timing = staticmethod(WidthPolicy.read_timing)

    def record_later(self, width: int, bs: int, accept_lens: Sequence[int], timing) -> None:
        self.record(width, bs, accept_lens, self.read_timing(timing))  # it decides nothing: no wait

    def count(self, bs: int, width: int, why: str) -> None:
        self.used[width] += 1

    def fallback_width(self, bs: int, fallen_tokens: float = 1.0, timed: bool = True) -> int:
        self.count(bs, 1, "fallback")
        return 1

    def widths_used(self) -> dict[int, int]:
        return dict(sorted(self.used.items(), reverse=True))

    def step_ms(self) -> dict[str, float]:
        """Median step cost as ``"width@bucket"`` (steady) and ``"width@bucket/switch"`` (the first
        step of a run), with holds longer than one step."""
        return {f"{w}@{b}" + ("/switch" if switched else ""): round(statistics.median(kept) * 1000, 3)
                for (w, b, switched), kept in sorted(self.seconds.items(), key=lambda kv: (-kv[0][0], kv[0][1], kv[0][2]))}


ASLEEP = object()  # :func:`step_widths`' request widths for a step of a sleeping bucket (:meth:`WidthPolicy.sleeping`)


def step_widths(policy, fallback, rids: Sequence, bs: int, block_size: int,
                ragged: bool = False, timed: bool = True) -> tuple[int, Optional[list[int]]]:
    """A decode step's verify width and, with a fallback, the width each request is verified at
    (the worker's order of calls, which the simulation and the tests replay). When every request
    is in fallback the step is plain (width 1) unless width 1 saves too little there
    (:meth:`WidthPolicy.fallback_width`). A ragged verify gives a request in fallback a lane of width
    1; a padded one checks every request at the batch's width, so each keeps what it accepts
    there: masking would only throw tokens away (7% of the accept length on SmolLM2 gsm8k). A step
    of a sleeping bucket (:meth:`WidthPolicy.sleeping`; never with a ragged verify, which lays out each
    request's lane) takes full width and ``ASLEEP``. ``timed``: whether the step's time will be
    read (:meth:`WidthPolicy.choose`)."""
    if not ragged:
        held = policy.sleeping(bs)
        if held is not None:
            return held, ASLEEP
    if fallback is None:
        return policy.choose(bs, timed), None
    if ragged:
        widths = fallback.widths(rids, block_size)
        all_fallen = max(widths, default=1) == 1
    else:  # a padded verify needs no request's own width, only whether all are plain
        widths, all_fallen = None, fallback.all_fallen(rids)
    if all_fallen:
        if ragged:
            policy.count(bs, 1, "fallback")
            width = 1
        else:
            width = policy.fallback_width(bs, fallback.fallen_tokens, timed)
        return width, [width] * len(rids)
    width = policy.choose(bs, timed)
    return width, ([min(w, width) for w in widths] if ragged else [width] * len(rids))


def learn_step(policy, fallback, width: int, bs: int, rids: Sequence, widths: Optional[Sequence[int]],
               accept_lens: Sequence[int], timing) -> None:
    """What a step of :func:`step_widths` teaches: the fallback each request's accept length, now
    (the next step's widths read it), the policy the batch's acceptance by position (from the
    requests verified at the batch's width) and, when it was timed, the step's cost, by its next
    decision (``record_later``; ``timing``: seconds or None, or what the policy's ``read_timing`` reads).
    A sleeping bucket's step (``widths`` ``ASLEEP``) teaches the acceptance alone
    (:meth:`WidthPolicy.watch`)."""
    if widths is ASLEEP:
        policy.watch(width, bs, accept_lens)
        return
    if widths is not None:
        fallback.observe(rids, widths, accept_lens)
        if widths.count(width) != len(widths):  # a padded verify checks all at the batch's width
            accept_lens = [a for a, w in zip(accept_lens, widths) if w == width]
    policy.record_later(width, bs, accept_lens, timing)


def make_width_policy(kind: str, block_size: int, widths: Sequence[int], fallback: str = "on"):
    """``throughput`` (:class:`WidthPolicy`), ``awake`` (the same, never sleeping), ``cycle``
    (:class:`CyclingWidths`, a new width every step), ``cycle:N`` (each width for N steps in turn)
    or ``hold:W`` (width W every step, one of ``widths``). With the fallback forced (``fallback``
    ``force``, a lossless check's pattern) no bucket sleeps either: a sleeping step would skip the
    pattern."""
    name, _, hold = kind.partition(":")
    if name == "cycle":
        return CyclingWidths(widths, int(hold or 1))
    if name == "hold":
        from .config import check_held_width

        check_held_width(kind, widths)
        return CyclingWidths((int(hold),))
    return WidthPolicy(block_size, widths, sleeps=name != "awake" and fallback != "force")
