#!/usr/bin/env python3
"""A gated-delta-net TARGET_VERIFY without per-token state snapshots, against SGLang's own: are the
committed states the same bits, and what does each way cost on the GPU?

SGLang verifies a draft block on a GDN layer with ``fused_sigmoid_gating_delta_rule_update``
(``disable_state_update=True``) and has it write a full fp32 state ``[HV, V, K]`` for every verify
token of every request (``intermediate_states_buffer``); the commit copies the accepted token's
snapshot into the request's state slot (``fused_mamba_state_scatter_with_mask``). The alternative
measured here keeps no snapshot: the verify is the same kernel with no snapshot buffer (outputs
only; the state is read, never written) and keeps a copy of its inputs q, k, v, a, b; the commit
re-runs the same kernel over each request's accepted tokens only (varlen ``cu_seqlens``,
``disable_state_update=False``), which writes the final state into the request's slot. Per case:

    A  snapshot:     verify with snapshots (as SGLang calls it) + commit copy of the accepted one
    B  output only:  verify without snapshots + copy of q, k, v, a, b into a record buffer
    C  replay:       gather of the accepted tokens from the record buffer + the kernel over them
    D  saved state:  copy of each request's state aside + the verify in place (no snapshots, state
                     update on: a fully accepted block is committed as it stands) + for the requests
                     that accepted less: the kernel over their accepted tokens from the saved state,
                     and a masked copy of the result into their slots

C replays every request's accepted tokens, so where every draft is accepted it runs the recurrence
twice; D replays only the requests that stopped short, at the price of one state copy a request.
B, C and D run twice: as described (no snapshot buffer), and "same launch", with a one-row snapshot
buffer whose row index is -1 for every request. The kernel stores no snapshot for a row index
below 0, but SGLang 0.5.23's wrapper picks its launch tile from whether a buffer is passed (on
SM90 at K = V = 128 and at most 64 requests a value tile of 4 for the verify, 32 otherwise), so
the same-launch variant runs B, C and D in the very tile A uses. The tiles used are in the JSON.

Before timing, every case checks on its own data that B's and D's outputs equal A's and that C's and
D's committed state pools equal A's, bitwise (``torch.equal``), that B wrote no state and that the same-launch
snapshot row stayed unwritten. Inputs are as SGLang's GDN backend hands them to the verify: q, k
``[1, bs*w, H, K]``, v ``[1, bs*w, HV, V]``, a, b ``[bs*w, HV]``, all bf16 and contiguous; A_log
fp32 and dt_bias bf16 ``[HV]`` (Qwen3.5 declares A_log fp32, dt_bias in the model dtype); the fp32
state pool ``[slots, HV, V, K]`` with requests in scattered slots; snapshot rows 0..bs-1.

Timing (GPU): each part is timed alone with CUDA events, median of ``--iters`` after ``--warmup``,
one GDN layer at a time. A 512 MiB memset before every timed call empties the L2 cache (a real
step's other layers would) and keeps the GPU busy while Python launches the part, so the figures
are GPU time without launch latency, as a CUDA-graph step sees it. Per-step figures are the
per-layer ones times the shape's GDN layers (SGLang's commit copy is one launch for all layers,
so its per-step figure counts a launch a layer where SGLang pays one). Bytes written are worked out
from the shapes. Not timed: building the gathers' token indices, ``cu_seqlens`` and D's masks from
the accept lengths (a few small integer ops on the GPU).

    source lab/gpu_setup.sh 0.5.23 || exit 1
    python3 -m lab.gdn_verify_bench $OUT/gdn_verify.json [--shape qwen3.5-4b] [--batch 1,8,32]
        [--widths 16,8] [--accepted 16,6] [--iters 50] [--warmup 5]
    TRITON_INTERPRET=1 python3 -m lab.gdn_verify_bench /tmp/x.json --check      # CPU, no GPU

``--check`` skips the timing and runs a small shape (HV 4, H 2, K = V = 32, batch 3, widths 4 and
2, uniform and mixed accept lengths); it exits 1 with one line if anything differs. On a machine
without CUDA it sets TRITON_INTERPRET=1 itself. The JSON is rewritten after every case. Supports
SGLang 0.5.23 and 0.5.17 (the kernel moved from ``attention/fla`` to ``attention/linear``).

Not measured: 0.5.23's own snapshot-free verify, ``--enable-linear-replayssm-spec`` (for GDN a
compact cached replay with compensated accumulation, not this kernel re-run; the ring-write and
bitwise fold, ``gdn_replayssm_spec_fold.py``, are used for KDA models only).
"""

import argparse
import functools
import importlib
import json
import os
import sys
from dataclasses import asdict, dataclass

import torch

from lab.cuda_timing import flushed_event_us

KERNEL_MODULES = ("sglang.kernels.ops.attention.linear.fused_sigmoid_gating_recurrent",  # 0.5.23
                  "sglang.kernels.ops.attention.fla.fused_sigmoid_gating_recurrent")  # 0.5.17
SCATTER_MODULE = "sglang.kernels.ops.mamba.mamba_state_scatter_triton"
FLUSH_BYTES = 512 << 20
TOKEN_AXIS = {"q": 1, "k": 1, "v": 1, "a": 0, "b": 0}  # the axis of q, k, v [1, T, heads, dim] and a, b [T, HV]
INPUT_BYTES = 2  # bf16 q, k, v, a, b and outputs
STATE_BYTES = 4  # fp32 states


@dataclass(frozen=True)
class GdnShape:
    name: str
    value_heads: int  # HV
    key_heads: int  # H
    key_dim: int  # K
    value_dim: int  # V
    gdn_layers: int


CHECK_SHAPE = GdnShape("check", value_heads=4, key_heads=2, key_dim=32, value_dim=32, gdn_layers=1)


def rig_shape(name):
    from sglang_dflash.bench.rig_hybrid import LINEAR, SHAPES

    s = SHAPES[name]
    return GdnShape(name, s.linear_value_heads, s.linear_key_heads, s.linear_key_dim, s.linear_value_dim,
                    s.layer_types.count(LINEAR))


def load_kernel_module():
    for name in KERNEL_MODULES:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError:
            continue
    import sglang

    sys.exit(f"gdn_verify_bench: SGLang {sglang.__version__} has fused_sigmoid_gating_delta_rule_update in "
             f"none of {', '.join(KERNEL_MODULES)}; supported: 0.5.17, 0.5.23")


def random_inputs(shape, tokens: int, gen) -> dict:
    """q, k ``[1, tokens, H, K]``, v ``[1, tokens, HV, V]``, a, b ``[tokens, HV]``: bf16 on the CPU, as
    SGLang's GDN backend hands them to the verify."""
    HV, H, K, V = shape.value_heads, shape.key_heads, shape.key_dim, shape.value_dim
    sizes = {"q": (1, tokens, H, K), "k": (1, tokens, H, K), "v": (1, tokens, HV, V), "a": (tokens, HV), "b": (tokens, HV)}
    return {name: torch.randn(*size, generator=gen).to(torch.bfloat16) for name, size in sizes.items()}


class Case:
    """One (batch, width, accept lengths) problem on one GDN layer: inputs, state pool, buffers."""

    def __init__(self, shape, bs, width, lengths, gen, device):
        HV, K, V = shape.value_heads, shape.key_dim, shape.value_dim
        tokens = bs * width
        self.width = width

        def randn(*size, scale=1.0):
            return torch.randn(*size, generator=gen) * scale

        self.tokens = {name: t.to(device) for name, t in random_inputs(shape, tokens, gen).items()}
        self.A_log = torch.log(torch.rand(HV, generator=gen) * 15 + 1).to(device)  # A = exp(A_log) in [1, 16]
        self.dt_bias = randn(HV).to(device, torch.bfloat16)
        slots = 2 * bs + 1
        self.pool0 = randn(slots, HV, V, K, scale=0.1).to(device)
        self.slots = torch.randperm(slots, generator=gen)[:bs].to(device, torch.int32)
        self.rows = torch.arange(bs, dtype=torch.int32, device=device)
        self.verify_starts = torch.arange(0, tokens + 1, width, dtype=torch.int32, device=device)
        self.snapshots = torch.empty(bs, width, HV, V, K, device=device)
        self.last_steps = torch.tensor(lengths, dtype=torch.int32, device=device) - 1
        # Same launch: a buffer is passed, so the wrapper picks its verify tile; no row is ever written.
        self.unwritten_snapshot = torch.full((1, 1, HV, V, K), float("nan"), device=device)
        self.no_rows = torch.full((bs,), -1, dtype=torch.int32, device=device)
        self.record = {name: torch.empty_like(t) for name, t in self.tokens.items()}
        self.commit_tokens = torch.cat([r * width + torch.arange(n) for r, n in enumerate(lengths)]).to(device)
        self.commit_starts = torch.tensor([0] + lengths, device=device).cumsum(0).to(torch.int32)
        self.replay_inputs = {name: t.index_select(TOKEN_AXIS[name], self.commit_tokens)
                              for name, t in self.record.items()}
        # D: rows that accepted less than the width replay from their saved state; the others keep the
        # verify's final state (row index -1: the kernel neither loads nor stores, and gets no tokens).
        short = [n < width for n in lengths]
        self.saved = torch.empty(bs, HV, V, K, device=device)
        self.short_rows = torch.tensor([r if s else -1 for r, s in enumerate(short)], dtype=torch.int32,
                                       device=device)
        self.short_steps = torch.tensor([0 if s else -1 for s in short], dtype=torch.int32, device=device)
        short_lengths = [n if s else 0 for n, s in zip(lengths, short)]
        self.short_tokens = torch.cat([r * width + torch.arange(n) for r, n in enumerate(short_lengths)]
                                      + [torch.zeros(0, dtype=torch.int64)]).to(device)
        self.short_starts = torch.tensor([0] + short_lengths, device=device).cumsum(0).to(torch.int32)
        self.short_inputs = {name: t.index_select(TOKEN_AXIS[name], self.short_tokens)
                             for name, t in self.record.items()}


class Paths:
    """The three paths' parts on one case, each a call that can be timed alone."""

    def __init__(self, kernel, scatter, case):
        self.kernel, self.scatter, self.c = kernel, scatter, case

    def _gdn(self, tokens, pool, starts, indices=None, **mode):
        c = self.c
        return self.kernel(A_log=c.A_log, dt_bias=c.dt_bias, q=tokens["q"], k=tokens["k"], v=tokens["v"],
                           a=tokens["a"], b=tokens["b"], initial_state_source=pool,
                           initial_state_indices=c.slots if indices is None else indices,
                           cu_seqlens=starts, use_qk_l2norm_in_kernel=True, softplus_beta=1.0,
                           softplus_threshold=20.0, is_kda=False, **mode)

    def _no_snapshot(self, same_launch):
        if not same_launch:
            return {}
        return {"intermediate_states_buffer": self.c.unwritten_snapshot, "intermediate_state_indices": self.c.no_rows}

    def snapshot_verify(self, pool):
        c = self.c
        return self._gdn(c.tokens, pool, c.verify_starts, disable_state_update=True,
                         intermediate_states_buffer=c.snapshots, intermediate_state_indices=c.rows,
                         cache_steps=c.width)

    def snapshot_commit(self, pool):
        c = self.c
        if self.scatter:
            self.scatter(pool[None], c.snapshots[None], c.slots, c.last_steps)
        else:
            pool[c.slots.long()] = c.snapshots[c.rows.long(), c.last_steps.long()]

    def output_only_verify(self, pool, same_launch=False):
        c = self.c
        return self._gdn(c.tokens, pool, c.verify_starts, disable_state_update=True, **self._no_snapshot(same_launch))

    def record_copy(self):
        for name, t in self.c.tokens.items():
            self.c.record[name].copy_(t)

    def replay_gather(self):
        c = self.c
        for name, t in c.record.items():
            torch.index_select(t, TOKEN_AXIS[name], c.commit_tokens, out=c.replay_inputs[name])

    def replay_commit(self, pool, same_launch=False):
        c = self.c
        return self._gdn(c.replay_inputs, pool, c.commit_starts, disable_state_update=False,
                         **self._no_snapshot(same_launch))

    def saved_copy(self, pool):
        torch.index_select(pool, 0, self.c.slots, out=self.c.saved)

    def in_place_verify(self, pool, same_launch=False):
        c = self.c
        return self._gdn(c.tokens, pool, c.verify_starts, disable_state_update=False,
                         **self._no_snapshot(same_launch))

    def saved_gather(self):
        c = self.c
        for name, t in c.record.items():
            torch.index_select(t, TOKEN_AXIS[name], c.short_tokens, out=c.short_inputs[name])

    def saved_replay(self, same_launch=False):
        c = self.c
        return self._gdn(c.short_inputs, c.saved, c.short_starts, indices=c.short_rows, disable_state_update=False,
                         **self._no_snapshot(same_launch))

    def saved_restore(self, pool):
        c = self.c
        if self.scatter:
            self.scatter(pool[None], c.saved[None, :, None], c.slots, c.short_steps)
        else:
            rows = (c.short_steps >= 0).nonzero().squeeze(1)
            pool[c.slots[rows].long()] = c.saved[rows]

    def saved_commit(self, pool, same_launch=False):
        self.saved_gather()
        self.saved_replay(same_launch)
        self.saved_restore(pool)


def max_abs_difference(x, y):
    return (x.double() - y.double()).abs().nan_to_num(float("inf")).max().item()


def compare(found, prefix, suffix, out, pool, out_a, pool_a):
    """Outputs and committed pool against A's, bitwise, as ``found[prefix + "outputs_equal" + suffix]``..."""
    for what, x, y in (("outputs", out, out_a), ("states", pool, pool_a)):
        equal = torch.equal(x, y)
        found[f"{prefix}{what}_equal{suffix}"] = equal
        if not equal:
            found[f"{prefix}{what}_max_abs_difference{suffix}"] = max_abs_difference(x, y)


def exactness(paths):
    """A's outputs and committed pool against B's and C's and D's (plain and same launch), bitwise."""
    c = paths.c
    pool_a = c.pool0.clone()
    out_a = paths.snapshot_verify(pool_a)
    paths.snapshot_commit(pool_a)
    found = {}
    for same_launch, suffix in ((False, ""), (True, "_same_launch")):
        pool = c.pool0.clone()
        out = paths.output_only_verify(pool, same_launch)
        found["output_only_wrote_state" + suffix] = not torch.equal(pool, c.pool0)
        paths.record_copy()
        paths.replay_gather()
        paths.replay_commit(pool, same_launch)
        compare(found, "", suffix, out, pool, out_a, pool_a)
        pool = c.pool0.clone()
        paths.saved_copy(pool)
        out = paths.in_place_verify(pool, same_launch)
        paths.record_copy()
        paths.saved_commit(pool, same_launch)
        compare(found, "saved_", suffix, out, pool, out_a, pool_a)
    found["same_launch_snapshot_unwritten"] = bool(c.unwritten_snapshot.isnan().all())
    return found


def exact(found):
    return (all(v for k, v in found.items() if "_equal" in k)
            and found["same_launch_snapshot_unwritten"]
            and not any(v for k, v in found.items() if k.startswith("output_only_wrote_state")))


def timings(paths, iters, warmup, flush):
    pool = paths.c.pool0.clone()
    parts = {
        "snapshot_verify_us": lambda: paths.snapshot_verify(pool),
        "snapshot_commit_us": lambda: paths.snapshot_commit(pool),
        "output_only_verify_us": lambda: paths.output_only_verify(pool),
        "record_copy_us": paths.record_copy,
        "replay_gather_us": paths.replay_gather,
        "replay_commit_us": lambda: paths.replay_commit(pool),
        "output_only_verify_same_launch_us": lambda: paths.output_only_verify(pool, same_launch=True),
        "replay_commit_same_launch_us": lambda: paths.replay_commit(pool, same_launch=True),
        "saved_copy_us": lambda: paths.saved_copy(pool),
        "in_place_verify_us": lambda: paths.in_place_verify(pool),
        "in_place_verify_same_launch_us": lambda: paths.in_place_verify(pool, same_launch=True),
        "saved_gather_us": paths.saved_gather,
        "saved_replay_us": paths.saved_replay,
        "saved_replay_same_launch_us": lambda: paths.saved_replay(same_launch=True),
        "saved_restore_us": lambda: paths.saved_restore(pool),
    }
    return {name: round(flushed_event_us(fn, flush, iters, warmup), 2) for name, fn in parts.items()}


def bytes_written(shape, bs, width, accepted_tokens, short_rows, short_tokens):
    """Per layer: fp32 states and snapshots, bf16 outputs and token inputs."""
    state = shape.value_heads * shape.value_dim * shape.key_dim * STATE_BYTES
    output = shape.value_heads * shape.value_dim * INPUT_BYTES
    token_inputs = (2 * shape.key_heads * shape.key_dim + shape.value_heads * shape.value_dim
                    + 2 * shape.value_heads) * INPUT_BYTES
    tokens = bs * width
    written = {"snapshot_verify": bs * width * state + tokens * output, "snapshot_commit": bs * state,
               "output_only_verify": tokens * output, "record_copy": tokens * token_inputs,
               "replay_gather": accepted_tokens * token_inputs,
               "replay_commit": bs * state + accepted_tokens * output}
    written.update(saved_copy=bs * state, in_place_verify=bs * state + tokens * output,
                   saved_gather=short_tokens * token_inputs,
                   saved_replay=short_rows * state + short_tokens * output, saved_restore=short_rows * state)
    written["snapshot_path"] = written["snapshot_verify"] + written["snapshot_commit"]
    written["replay_path"] = sum(written[k] for k in ("output_only_verify", "record_copy", "replay_gather",
                                                      "replay_commit"))
    written["saved_path"] = sum(written[k] for k in ("saved_copy", "in_place_verify", "record_copy", "saved_gather",
                                                     "saved_replay", "saved_restore"))
    return written


def value_tiles(module, shape, bs, width):
    """The value tile (BV) the wrapper launches each call with; None where the release fixes it at 32."""
    select = getattr(module, "_select_recurrent_launch_config", None)
    if select is None:
        return None

    def tile(with_buffer):
        return select(bs, shape.key_heads, shape.value_heads, shape.key_dim, shape.value_dim, False,
                      target_verify=with_buffer, cache_steps=width)[0]

    return {"snapshot_verify": tile(True), "output_only_and_replay": tile(False), "same_launch": tile(True)}


def path_totals(t, gdn_layers):
    """Per-layer totals of each path, their ratios, and per-step milliseconds."""
    snapshot = t["snapshot_verify_us"] + t["snapshot_commit_us"]
    kept_inputs = t["record_copy_us"] + t["replay_gather_us"]
    replay = t["output_only_verify_us"] + kept_inputs + t["replay_commit_us"]
    same_launch = t["output_only_verify_same_launch_us"] + kept_inputs + t["replay_commit_same_launch_us"]
    saved_parts = t["saved_copy_us"] + t["record_copy_us"] + t["saved_gather_us"] + t["saved_restore_us"]
    saved = saved_parts + t["in_place_verify_us"] + t["saved_replay_us"]
    saved_same_launch = saved_parts + t["in_place_verify_same_launch_us"] + t["saved_replay_same_launch_us"]
    return {"snapshot_total_us": round(snapshot, 2), "replay_total_us": round(replay, 2),
            "replay_total_same_launch_us": round(same_launch, 2), "saved_total_us": round(saved, 2),
            "saved_total_same_launch_us": round(saved_same_launch, 2), "ratio": round(snapshot / replay, 3),
            "ratio_same_launch": round(snapshot / same_launch, 3), "ratio_saved": round(snapshot / saved, 3),
            "ratio_saved_same_launch": round(snapshot / saved_same_launch, 3),
            "step_ms": {name: round(us * gdn_layers / 1000, 3) for name, us in (
                ("snapshot", snapshot), ("replay", replay), ("replay_same_launch", same_launch),
                ("saved", saved), ("saved_same_launch", saved_same_launch))}}


def run_case(module, scatter, shape, spec, gen, device, timer=None):
    """One case's JSON row: exactness always, then the parts' times when a timer is given."""
    bs, width, accepted, lengths = spec
    paths = Paths(module.fused_sigmoid_gating_delta_rule_update, scatter,
                  Case(shape, bs, width, lengths, gen, device))
    found = exactness(paths)
    row = {"bs": bs, "width": width, "accepted": accepted, "accepted_tokens": sum(lengths), **found,
           "exact": exact(found), "value_tiles": value_tiles(module, shape, bs, width),
           "bytes_written": bytes_written(shape, bs, width, sum(lengths), sum(n < width for n in lengths),
                                          sum(n for n in lengths if n < width))}
    if timer:
        t = timer(paths)
        row.update(t, **path_totals(t, shape.gdn_layers))
    return row


def cases_for(batches, widths, accepted):
    """Uniform accept lengths (bonus included, clipped to the width) and one mixed case cycling 1..w."""
    out = []
    for bs in batches:
        for width in widths:
            candidates = [(min(n, width), [min(n, width)] * bs) for n in accepted]
            candidates.append(("mixed", [r % width + 1 for r in range(bs)]))
            seen = set()
            for label, lengths in candidates:
                if tuple(lengths) not in seen:  # clipping, and batch 1's mixed case, can repeat a case
                    seen.add(tuple(lengths))
                    out.append((bs, width, label, lengths))
    return out


def int_list(text):
    return [int(x) for x in text.split(",") if x]


def markdown_table(report):
    layers = report["shape"]["gdn_layers"]
    head = ("| bs | w | accepted | A verify | A commit | B verify | B record | C gather | C commit | B' verify "
            "| C' commit | A step ms | B+C step ms | B'+C' step ms | D step ms | D' step ms | A / (B+C) "
            "| A / (B'+C') | A / D | A / D' | exact |")
    lines = [f"µs a layer (A snapshot, B output only, C replay, D saved state; ' = same launch); "
             f"step = x {layers} GDN layers",
             head, "|" + "---|" * (head.count("|") - 1)]
    for r in report["cases"]:
        cells = [r["bs"], r["width"], r["accepted"], r["snapshot_verify_us"], r["snapshot_commit_us"],
                 r["output_only_verify_us"], r["record_copy_us"], r["replay_gather_us"], r["replay_commit_us"],
                 r["output_only_verify_same_launch_us"], r["replay_commit_same_launch_us"],
                 r["step_ms"]["snapshot"], r["step_ms"]["replay"], r["step_ms"]["replay_same_launch"],
                 r["step_ms"]["saved"], r["step_ms"]["saved_same_launch"], r["ratio"], r["ratio_same_launch"],
                 r["ratio_saved"], r["ratio_saved_same_launch"], "yes" if r["exact"] else "NO"]
        lines.append("| " + " | ".join(str(x) for x in cells) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("out", help="the JSON report, rewritten after every case")
    ap.add_argument("--shape", default="qwen3.5-4b", help="a shape of sglang_dflash.bench.rig_hybrid.SHAPES")
    ap.add_argument("--batch", type=int_list, help="requests a step (default 1,8,32; --check: 3)")
    ap.add_argument("--widths", type=int_list, help="verify tokens a request (default 16,8; --check: 4,2)")
    ap.add_argument("--accepted", type=int_list,
                    help="accepted tokens a request, bonus included, clipped to the width; a mixed case "
                         "is always added (default 16,6; --check: 4,1)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", action="store_true",
                    help="no timing: a small shape compared bitwise; exits 1 if anything differs")
    args = ap.parse_args()

    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        if not args.check:
            sys.exit("gdn_verify_bench: timing needs a CUDA GPU; on a CPU run --check (Triton interpreter)")
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when SGLang's kernels are decorated, on import
    device = "cuda" if on_gpu else "cpu"
    module = load_kernel_module()
    import sglang
    import triton

    scatter = importlib.import_module(SCATTER_MODULE).fused_mamba_state_scatter_with_mask if on_gpu else None
    shape = CHECK_SHAPE if args.check else rig_shape(args.shape)
    batches = args.batch or ([3] if args.check else [1, 8, 32])
    widths = args.widths or ([4, 2] if args.check else [16, 8])
    accepted = args.accepted or ([4, 1] if args.check else [16, 6])
    cases = cases_for(batches, widths, accepted)

    report = {
        "bench": "lab/gdn_verify_bench.py", "mode": "check" if args.check else "timed",
        "sglang": sglang.__version__, "kernel_module": module.__name__,
        "device": torch.cuda.get_device_name() if on_gpu else "cpu", "torch": torch.__version__,
        "triton": triton.__version__, "triton_interpret": os.environ.get("TRITON_INTERPRET", ""),
        "shape": asdict(shape), "seed": args.seed,
        "snapshot_commit_copy": ("fused_mamba_state_scatter_with_mask" if scatter else
                                 "torch index copy (SGLang's scatter kernel takes CUDA tensors only)"),
        "units": "*_us: GPU microseconds a layer, median; step_ms: a layer x gdn_layers; bytes_written: a layer; "
                 "ratio: snapshot_total_us / replay_total_us, ratio_saved: snapshot_total_us / saved_total_us "
                 "(above 1: the snapshot-free path is faster)",
        "cases": [],
    }
    timer = None
    if not args.check:
        report.update(iters=args.iters, warmup=args.warmup, l2_flush_mib=FLUSH_BYTES >> 20)
        flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)
        timer = functools.partial(timings, iters=args.iters, warmup=args.warmup, flush=flush)
    gen = torch.Generator().manual_seed(args.seed)
    try:
        from tqdm import tqdm
        progress, say = tqdm(cases, desc="gdn verify cases"), tqdm.write
    except ImportError:
        progress, say = cases, print

    for spec in progress:
        row = run_case(module, scatter, shape, spec, gen, device, timer)
        report["cases"].append(row)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        say(f"bs {row['bs']} w {row['width']} accepted {row['accepted']}: "
            + ("exact" if row["exact"] else "DIFFERENT")
            + (f", snapshot {row['snapshot_total_us']} us vs replay {row['replay_total_us']} us, "
               f"saved state {row['saved_total_us']} us a layer"
               if timer else ""))
        if on_gpu:
            torch.cuda.empty_cache()

    different = [f"bs {r['bs']} w {r['width']} accepted {r['accepted']}" for r in report["cases"] if not r["exact"]]
    if not args.check:
        print(markdown_table(report))
    if different:
        message = (f"gdn_verify_bench: replay or saved state differs from the snapshot path in {len(different)} case(s): "
                   + "; ".join(different))
        if args.check:
            sys.exit(message)
        print(message)
    else:
        print(f"gdn_verify_bench: all {len(report['cases'])} cases bitwise equal (outputs and committed states)")


if __name__ == "__main__":
    main()
