"""One simulated server through levels c1..c64, the width policy and the per-request fallback run
as the worker runs them (padded verify), against fixed 16 on the same requests.

A host-bound cost model after SmolLM2 on an H200 (measured November 2026): every drafting width costs
the same, width 1 15% less, a single narrower verify 0.7 ms more, the first verify after plain steps
1 ms more; 10% noise and one-sided hiccups. Each request's drafts pass through easy and hard
stretches. Prints adaptive / fixed 16 per level, the share of steps asleep (``WidthPolicy.sleeping``)
and the steps not at width 16, by rule.

    python3 lab/simulate_policy.py [--seeds 4] [--host [--cuda] | --mixed-waves DRAFT_COST]

``--mixed-waves`` runs instead waves of mixed sets against plain decoding, each request keeping its
own acceptance, a step with drafts at ``DRAFT_COST`` plain steps (docs/design/wave-tails.md).
``--host`` prints instead the policy's own host time a step (``step_widths`` and ``learn_step``)
at bs 1-64, on this machine's CPU; ``--cuda`` adds the CUDA calls with which the worker times a
step (an event recorded, then queried and read against the step before's).

To run another checkout's ``sglang_dflash``, put it first on the path:
``PYTHONPATH=/tmp/old python3 lab/simulate_policy.py`` (``git worktree add /tmp/old HEAD~3``).
"""

import argparse
import random
import statistics
from collections import Counter


class Request:
    def __init__(self, rng, easy, hard, tokens):
        self.rng, self.easy, self.hard, self.left = rng, easy, hard, tokens
        self.p = easy if rng.random() < 0.7 else hard

    def drafts(self):
        """Drafts the target would accept at full width this step."""
        if self.rng.random() < 0.05:
            self.p = self.easy if self.rng.random() < 0.7 else self.hard
        a = 0
        while a < 15 and self.rng.random() < self.p:
            a += 1
        return a


def step_seconds(rng, width, prev, bs):
    cost = (2.5 + 0.02 * bs) * (0.85 if width == 1 else 1.0)
    if prev is not None and width != prev:
        cost += 0.7 if width not in (1, 16) else 0.0
        cost += 1.0 if prev == 1 else 0.0
    cost *= 1 + 0.1 * rng.random()
    if rng.random() < 0.2:
        cost *= 1 + rng.expovariate(3)
    return cost / 1000


def draft_health():
    try:
        from sglang_dflash.fallback import DraftHealth
    except ImportError:  # a checkout (--code) from before fallback.py: it lived in adaptive.py
        from sglang_dflash.adaptive import DraftHealth
    return DraftHealth


def serve(adaptive, seed, easy, hard, levels=(1, 2, 4, 8, 16, 32, 64), waves=12, tokens=256):
    from sglang_dflash import adaptive as widths_module
    from sglang_dflash.adaptive import WidthPolicy

    DraftHealth = draft_health()

    rng = random.Random(seed)
    policy, health = (WidthPolicy(16), DraftHealth()) if adaptive else (None, None)
    prev, per_level, rid = None, {}, 0
    for conc in levels:
        out, seconds = 0, 0.0
        for wave in range(waves):
            live = {}
            for i in range(conc):
                live[rid] = Request(random.Random(hash((seed, conc, wave, i))), easy, hard, tokens)
                rid += 1
            if policy is not None and hasattr(policy, "admitted"):  # the wave's prefill
                policy.admitted(conc, conc)
            while live:
                rids = list(live)
                bs = len(rids)
                width, widths = 16, None
                if policy is not None and hasattr(widths_module, "step_widths"):  # the worker's own calls
                    width, widths = widths_module.step_widths(policy, health, rids, bs, 16)
                elif policy is not None:  # a checkout before step_widths
                    if max(health.widths(rids, 16)) > 1:
                        width = policy.choose(bs)
                    elif hasattr(health, "fallen_tokens"):
                        width = policy.fallback_width(bs, health.fallen_tokens)
                    else:  # before 7ee7025
                        width = policy.fallback_width(bs)
                    widths = [width] * bs
                accepted = [min(live[r].drafts(), width - 1) for r in rids]
                cost = step_seconds(rng, width, prev, bs)
                prev = width
                if policy is not None and hasattr(widths_module, "learn_step"):
                    widths_module.learn_step(policy, health, width, bs, rids, widths, accepted, cost)
                elif policy is not None:
                    health.observe(rids, widths, accepted)
                    policy.record(width, bs, accepted, cost)
                seconds += cost
                for r, a in zip(rids, accepted):
                    n = min(a + 1, live[r].left)
                    live[r].left -= n
                    out += n
                    if live[r].left <= 0:
                        del live[r]
        per_level[conc] = (out / seconds, Counter(policy.reasons) if policy else None)
    return per_level


def serve_waves(kind, seed, classes, conc, waves=24, tokens=256, draft_cost=1.5, plain_cost=1.05):
    """Waves of ``conc`` requests, each of a class ``(share, p)`` drawn per request and keeping its
    draft acceptance ``p`` to the end (a mixed set: math that accepts most drafts beside chat that
    accepts few). ``kind``: ``ar`` (plain decoding), ``fixed`` (width 16), ``adaptive`` (the policy
    and the fallback, one server through all waves). A step costs a plain decoding step at its batch
    size times ``draft_cost`` with drafts, ``plain_cost`` at width 1 (the speculative step's own
    overhead), 1 for plain decoding; ``oracle`` knows each request's ``p`` and steps at width 1
    once no request in the batch would commit enough a step to pay for drafts. Returns each
    wave's seconds: a wave lasts until its slowest request has its ``tokens``."""
    from sglang_dflash.adaptive import WidthPolicy, learn_step, step_widths

    rng = random.Random(seed)
    policy, health = (WidthPolicy(16), draft_health()()) if kind == "adaptive" else (None, None)
    out = []
    for wave in range(waves):
        wave_rng = random.Random(hash((seed, conc, wave)))
        live = {}
        for i in range(conc):
            draw, p = wave_rng.random(), classes[-1][1]
            for share, p_class in classes:
                if draw < share:
                    p = p_class
                    break
                draw -= share
            live[(wave, i)] = [p, tokens]
        seconds = 0.0
        if policy is not None and hasattr(policy, "admitted"):  # the wave's prefill
            policy.admitted(conc, conc)
        while live:
            rids = list(live)
            bs = len(rids)
            width, widths = (1, None) if kind == "ar" else (16, None)
            if kind == "oracle":  # knows each request's acceptance: plain steps once drafts cannot pay
                best = max(live[r][0] for r in rids)
                width = 16 if (1 - best ** 16) / (1 - best) > draft_cost / plain_cost else 1
            if policy is not None:
                width, widths = step_widths(policy, health, rids, bs, 16)
            accepted = []
            for r in rids:
                a = 0
                while a < width - 1 and rng.random() < live[r][0]:
                    a += 1
                accepted.append(a)
            cost = (2.5 + 0.02 * bs) * (1.0 if kind == "ar" else plain_cost if width == 1 else draft_cost)
            cost *= 1 + 0.05 * rng.random()
            seconds += cost / 1000
            if policy is not None:
                learn_step(policy, health, width, bs, rids, widths, accepted, cost / 1000)
            for r, a in zip(rids, accepted):
                live[r][1] -= a + 1
                if live[r][1] <= 0:
                    del live[r]
        out.append(seconds)
    return out


def mixed_waves(seeds: int, draft_cost: float) -> None:
    """A mixed set in waves against plain decoding: each wave's speed-up, geometric mean over waves."""
    for name, classes in (("math+chat", ((0.5, 0.85), (0.5, 0.25))), ("mostly math", ((0.9, 0.85), (0.1, 0.25))),
                          ("chat", ((1.0, 0.3),))):
        for conc in (1, 8, 32, 64):
            ratios = {"fixed": [], "adaptive": [], "oracle": []}
            for seed in range(seeds):
                ar = serve_waves("ar", seed, classes, conc, draft_cost=draft_cost)
                for kind in ratios:
                    ratios[kind] += [a / s for a, s in zip(ar, serve_waves(kind, seed, classes, conc, draft_cost=draft_cost))]
            print(f"{name:12s} c{conc:<3d} over plain decoding: " + ", ".join(
                f"{kind} {statistics.geometric_mean(r):.3f}" for kind, r in ratios.items()))


def host_time(batch_sizes=(1, 4, 16, 64), steps=20000, warm=2000):
    """Microseconds a step of the policy's own calls take, as the worker makes them: the widths
    before the step, what it taught after it (requests leaving now and then)."""
    import time

    from sglang_dflash.adaptive import WidthPolicy, learn_step, step_widths

    DraftHealth = draft_health()

    for bs in batch_sizes:
        policy, health, rng = WidthPolicy(16), DraftHealth(), random.Random(0)
        rids = [f"req-{i:032x}" for i in range(bs)]
        before = after = 0.0
        for step in range(steps):
            t0 = time.perf_counter()
            width, widths = step_widths(policy, health, rids, bs, 16)
            t1 = time.perf_counter()
            accepted = [min(width - 1, int(rng.expovariate(0.5))) for _ in rids]
            t2 = time.perf_counter()
            learn_step(policy, health, width, bs, rids, widths, accepted, 0.003 * (1 + 0.1 * rng.random()))
            t3 = time.perf_counter()
            if step >= warm:
                before, after = before + t1 - t0, after + t3 - t2
            if rng.random() < 0.01:
                rids[rng.randrange(bs)] = f"req-{rng.getrandbits(128):032x}"
        n = steps - warm
        print(f"bs {bs:3d}: step_widths {1e6 * before / n:5.1f} us, learn_step {1e6 * after / n:5.1f} us a step")


def cuda_calls(calls=2000):
    """Microseconds a call of what ``DFlashWorker.time_step`` and ``on_verify_complete_cpu`` add to
    a step's host time, beside a stream lookup and one small kernel launch for scale."""
    import time

    import torch

    stream, x = torch.cuda.current_stream(), torch.zeros(1, device="cuda")
    events = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
    timed = {}

    def clock(name, body):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        body()
        timed[name] = 1e6 * (time.perf_counter() - t0) / calls

    clock("event record", lambda: [e.record(stream) for e in events])
    clock("event query", lambda: [e.query() for e in events])
    clock("event elapsed_time", lambda: [a.elapsed_time(b) for a, b in zip(events, events[1:] + events[:1])])
    from sglang_dflash.step_clock import StepClock

    step_clock = StepClock()
    clock("StepClock.seconds", lambda: [step_clock.seconds(pair) for pair in zip(events, events[1:] + events[:1])])
    clock("current_stream", lambda: [torch.cuda.current_stream() for _ in range(calls)])
    clock("kernel launch (add_)", lambda: [x.add_(1) for _ in range(calls)])
    print(", ".join(f"{name} {us:.2f} us" for name, us in timed.items()))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--host", action="store_true", help="print the policy's host time a step instead")
    ap.add_argument("--cuda", action="store_true", help="with --host: also the CUDA calls that time a step")
    ap.add_argument("--mixed-waves", type=float, metavar="DRAFT_COST",
                    help="a mixed set in waves against plain decoding instead, a step with drafts costing "
                         "DRAFT_COST plain steps")
    args = ap.parse_args()
    if args.mixed_waves and args.host:
        ap.error("--mixed-waves and --host are two runs")
    if args.mixed_waves:
        return mixed_waves(args.seeds, args.mixed_waves)
    if args.cuda and not args.host:
        ap.error("--cuda goes with --host")
    if args.host:
        host_time()
        return cuda_calls() if args.cuda else None
    for name, easy, hard in (("gsm8k-like", 0.85, 0.45), ("mt-bench-like", 0.7, 0.2)):
        rows = {}
        for seed in range(args.seeds):
            adaptive, fixed = serve(True, seed, easy, hard), serve(False, seed, easy, hard)
            before = Counter()
            for conc, (tok_s, reasons) in adaptive.items():
                level = reasons - before
                before = reasons
                off = Counter({f"{w}:{why}": n for (_, w, why), n in level.items() if w != 16})
                asleep = sum(n for (_, _, why), n in level.items() if why == "asleep")
                rows.setdefault(conc, []).append((tok_s / fixed[conc][0], sum(off.values()) / sum(level.values()), off,
                                                  asleep / sum(level.values())))
        for conc, runs in rows.items():
            print(f"{name:14s} c{conc:<3d} adaptive / fixed 16 {statistics.mean(r[0] for r in runs):.3f} "
                  f"(least {min(r[0] for r in runs):.3f}), asleep {statistics.mean(r[3] for r in runs):5.1%}, "
                  f"not width 16: {statistics.mean(r[1] for r in runs):5.1%} {dict(runs[0][2].most_common(3))}")


if __name__ == "__main__":
    main()
