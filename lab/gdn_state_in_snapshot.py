#!/usr/bin/env python3
"""Can a GDN verify start from the snapshot its request was accepted at, with no commit copy?
(docs/design/gdn-commit-without-copy.md)

SGLang's verify writes a fp32 state snapshot per verify token into a buffer indexed by batch
position, and its commit copies each request's accepted snapshot into the request's state slot. The
alternative checked here keeps each request's state in the snapshot buffer: a row per request that
follows it through the batch (its request-table row; row 0 stays free), the slot's state staged into
step 0 of that row once, and every verify started from (row, last accepted step) of the same
buffer it then overwrites. The kernel loads each program's whole state tile before writing any
snapshot of it, so the read and the writes of one request do not race; rows by batch position would
let one request's snapshots clobber another's start state once the batch reorders.

Two verifies in a row, on SGLang's own ``fused_sigmoid_gating_delta_rule_update``, with mixed accept
lengths, the batch reordered and the width changed between them:

    A  SGLang's way: snapshots by batch position, then the accepted one copied into the slot
    E  state in the snapshot: request rows, start index row * pitch + accepted step, no copy
    E' the same with rows by batch position (expected to differ: why rows must follow requests)

Outputs of both verifies and each request's final state must be the same bits in A and E. Then
the plugin's keeper (``sglang_dflash.gdn_state.SnapshotState``, its copy kernel included) over a
request's life (``Lifecycle``): four verifies of changing width and order, a plain step that reads
the slots between them, a request that finishes and one that takes its row, a track copy, against A.

    TRITON_INTERPRET=1 python3 -m lab.gdn_state_in_snapshot /tmp/x.json     # CPU: Triton's interpreter

Exits 1 with one line if E or the keeper differs from A, or if E' does not (then the check could not
have failed).
Supports SGLang 0.5.23 and 0.5.17.
"""

import argparse
import json
import os
import sys

import torch

from lab.gdn_verify_bench import CHECK_SHAPE, load_kernel_module, random_inputs

PITCH = 4  # verify tokens a request the buffer holds (block size)
WIDTHS = (4, 2)  # the first verify's width, then the second's
LENGTHS = ((2, 4, 1), (1, 2, 2))  # accepted tokens a request (bonus included), in request order
ORDER = (2, 0, 1)  # the second verify's batch: request 2, then 0, then 1


def run_verify(problem, inputs, source, starts, buffer, rows, width, n):
    """SGLang's verify kernel over ``n`` requests of ``width`` tokens, with ``problem``'s gates:
    start states from ``source`` at ``starts``, snapshots into ``buffer`` at ``rows``; the outputs."""
    return problem.kernel(A_log=problem.A_log, dt_bias=problem.dt_bias, **inputs,
                          initial_state_source=source, initial_state_indices=starts,
                          cu_seqlens=torch.arange(0, n * width + 1, width, dtype=torch.int32),
                          use_qk_l2norm_in_kernel=True, softplus_beta=1.0, softplus_threshold=20.0, is_kda=False,
                          disable_state_update=True, intermediate_states_buffer=buffer,
                          intermediate_state_indices=rows, cache_steps=PITCH)


class Problem:
    def __init__(self, kernel, shape, seed):
        gen = torch.Generator().manual_seed(seed)
        self.kernel, self.shape, self.bs = kernel, shape, len(ORDER)
        HV, K, V = shape.value_heads, shape.key_dim, shape.value_dim
        self.A_log = torch.log(torch.rand(HV, generator=gen) * 15 + 1)
        self.dt_bias = torch.randn(HV, generator=gen).to(torch.bfloat16)
        slots = 2 * self.bs + 1
        self.pool0 = torch.randn(slots, HV, V, K, generator=gen) * 0.1
        self.slots = torch.randperm(slots, generator=gen)[: self.bs].to(torch.int32)
        self.inputs = [random_inputs(shape, self.bs * w, gen) for w in WIDTHS]
        self.orders = [list(range(self.bs)), list(ORDER)]

    def verify(self, step, source, starts, buffer, rows):
        """One verify of ``self.bs`` requests at ``WIDTHS[step]``: outputs; snapshots into ``buffer``."""
        return run_verify(self, self.inputs[step], source, starts, buffer, rows, WIDTHS[step], self.bs)

    def sglang_way(self):
        """A: outputs of both verifies and each request's final state (request order)."""
        pool = self.pool0.clone()
        buffer = torch.zeros(self.bs, PITCH, *pool.shape[1:])
        positions = torch.arange(self.bs, dtype=torch.int32)
        outputs = []
        for step, order in enumerate(self.orders):
            slots = self.slots[order]
            outputs.append(self.verify(step, pool, slots, buffer, positions).clone())
            last = torch.tensor([LENGTHS[step][r] - 1 for r in order])
            pool[slots.long()] = buffer[positions.long(), last]  # the commit copy
        return outputs, pool[self.slots.long()]

    def state_in_snapshot(self, rows_follow_requests=True):
        """E (or E' with rows by batch position): the same, the state kept in the snapshot buffer."""
        buffer = torch.zeros(self.bs + 1, PITCH, *self.pool0.shape[1:])  # row 0 is no request's
        request_row = torch.arange(1, self.bs + 1)
        live_row, live_step = request_row.clone(), torch.zeros(self.bs, dtype=torch.long)
        buffer[request_row, 0] = self.pool0[self.slots.long()]  # staged once, after the prefill
        flat = buffer.view(-1, *buffer.shape[2:])
        outputs = []
        for step, order in enumerate(self.orders):
            rows = request_row[order] if rows_follow_requests else torch.arange(1, self.bs + 1)
            starts = (live_row[order] * PITCH + live_step[order]).to(torch.int32)
            outputs.append(self.verify(step, flat, starts, buffer, rows.to(torch.int32)).clone())
            for position, r in enumerate(order):
                live_row[r], live_step[r] = rows[position], LENGTHS[step][r] - 1
        return outputs, buffer[live_row, live_step]


class Lifecycle:
    """The plugin's keeper of the state in the snapshots (``sglang_dflash.gdn_state.SnapshotState``)
    over a request's life, against SGLang's commit copy: four verifies of changing width and order,
    a plain step that reads the slots between them, a request that finishes and a new one that takes
    its table row with a prefilled slot, and a radix track copy."""

    # (kind, requests in batch order, width, accepted tokens a request in that order)
    STEPS = (("verify", (0, 1, 2), 4, (2, 4, 1)), ("verify", (2, 0, 1), 2, (1, 2, 2)),
             ("plain", (1, 2), 1, None), ("join", (3,), None, None),
             ("verify", (3, 2, 1), 3, (3, 1, 2)), ("verify", (1, 3, 2), 4, (4, 1, 3)))
    ROWS = (1, 2, 3, 1)  # request-table rows: request 3 takes request 0's once it has finished
    TRACKED = (4, 2, 0, 9)  # at the fifth step, request 2's step 0 goes to track slot 9

    def __init__(self, kernel, shape, seed):
        gen = torch.Generator().manual_seed(seed)
        self.kernel, self.shape = kernel, shape
        HV, K, V = shape.value_heads, shape.key_dim, shape.value_dim
        self.A_log = torch.log(torch.rand(HV, generator=gen) * 15 + 1)
        self.dt_bias = torch.randn(HV, generator=gen).to(torch.bfloat16)
        self.pool0 = torch.randn(10, HV, V, K, generator=gen) * 0.1  # slot 9: the track slot
        self.slots = torch.tensor([5, 2, 7, 0], dtype=torch.int32)
        self.prefilled = torch.randn(HV, V, K, generator=gen) * 0.1  # request 3's state after its prefill
        self.inputs = [random_inputs(shape, len(reqs) * w, gen) if w else None for _, reqs, w, _ in self.STEPS]

    def run(self, step, source, starts, buffer, snapshot_rows, width, n):
        return run_verify(self, self.inputs[step], source, starts, buffer, snapshot_rows, width, n).clone()

    def sglang_way(self):
        pool = self.pool0.clone()
        buffer = torch.zeros(3, PITCH, *pool.shape[1:])
        outputs = []
        for step, (kind, reqs, width, lengths) in enumerate(self.STEPS):
            slots = self.slots[list(reqs)]
            positions = torch.arange(len(reqs), dtype=torch.int32)
            if kind == "join":
                pool[slots.long()] = self.prefilled
                continue
            outputs.append(self.run(step, pool, slots, buffer, positions, width, len(reqs)))
            last = torch.tensor(lengths) - 1 if lengths else torch.zeros(len(reqs), dtype=torch.long)
            if self.TRACKED[0] == step:
                pool[self.TRACKED[3]] = buffer[reqs.index(self.TRACKED[1]), self.TRACKED[2]]
            pool[slots.long()] = buffer[positions.long(), last]  # the commit copy (a plain step's, in place)
        return outputs, pool[self.slots[1:].long()], pool[self.TRACKED[3]]

    def kept_in_snapshots(self):
        from sglang_dflash.gdn_state import SnapshotState

        pool = self.pool0.clone()
        snapshots = torch.zeros(1, 4, PITCH, *pool.shape[1:])  # one layer; row 0 is no request's
        keeper = SnapshotState(pool.unsqueeze(0), snapshots, max_bs=4)
        positional = torch.zeros(3, PITCH, *pool.shape[1:])
        outputs = []
        for step, (kind, reqs, width, lengths) in enumerate(self.STEPS):
            slots = self.slots[list(reqs)]
            rows = torch.tensor([self.ROWS[r] for r in reqs], dtype=torch.int32)
            positions = torch.arange(len(reqs), dtype=torch.int32)
            if kind == "join":
                pool[slots.long()] = self.prefilled
                keeper.released(rows)
                continue
            if kind == "plain":  # reads the slots: the states go back first, then it runs as in SGLang
                keeper.to_slots(rows, slots)
                outputs.append(self.run(step, pool, slots, positional, positions, width, len(reqs)))
                pool[slots.long()] = positional[positions.long(), 0]
                continue
            keeper.before_verify(rows, slots)
            # SGLang's dispatcher arguments for this layer, as the plugin's wrapper receives them
            kwargs = keeper.verify_arguments({"ssm_states": pool, "cache_indices": slots,
                                              "intermediate_states_buffer": snapshots[0],
                                              "intermediate_state_indices": positions})
            outputs.append(self.run(step, kwargs["ssm_states"], kwargs["cache_indices"],
                                    kwargs["intermediate_states_buffer"], kwargs["intermediate_state_indices"],
                                    width, len(reqs)))
            keeper.after_verify(rows, torch.tensor(lengths))
            if self.TRACKED[0] == step:
                at = reqs.index(self.TRACKED[1])
                keeper.track(rows[at:at + 1], torch.tensor([self.TRACKED[2]]), torch.tensor([self.TRACKED[3]]))
        live = self.slots[1:]
        keeper.to_slots(torch.tensor([self.ROWS[r] for r in (1, 2, 3)], dtype=torch.int32), live)
        return outputs, pool[live.long()], pool[self.TRACKED[3]]


def compare_lifecycle(a, k) -> dict:
    (out_a, states_a, track_a), (out_k, states_k, track_k) = a, k
    return {"outputs_equal": all(torch.equal(x, y) for x, y in zip(out_a, out_k)) and len(out_a) == len(out_k),
            "states_equal": torch.equal(states_a, states_k), "track_equal": torch.equal(track_a, track_k)}


def compare(a, e) -> dict:
    (out_a, state_a), (out_e, state_e) = a, e
    return {"first_outputs_equal": torch.equal(out_a[0], out_e[0]),
            "second_outputs_equal": torch.equal(out_a[1], out_e[1]), "states_equal": torch.equal(state_a, state_e)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("out", help="the JSON report")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if torch.cuda.is_available():
        sys.exit("gdn_state_in_snapshot: a CPU check (Triton's interpreter): run it where no GPU is visible")
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when SGLang's kernels are decorated, on import
    module = load_kernel_module()
    import sglang

    problem = Problem(module.fused_sigmoid_gating_delta_rule_update, CHECK_SHAPE, args.seed)
    reference = problem.sglang_way()
    report = {"check": "lab/gdn_state_in_snapshot.py", "sglang": sglang.__version__,
              "kernel_module": module.__name__, "widths": WIDTHS, "accepted": LENGTHS, "second_order": ORDER,
              "rows_follow_requests": compare(reference, problem.state_in_snapshot()),
              "rows_by_batch_position": compare(reference, problem.state_in_snapshot(rows_follow_requests=False))}
    life = Lifecycle(module.fused_sigmoid_gating_delta_rule_update, CHECK_SHAPE, args.seed)
    report["plugin_keeper"] = compare_lifecycle(life.sglang_way(), life.kept_in_snapshots())
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    exact = all(report["rows_follow_requests"].values())
    clobbered = not all(report["rows_by_batch_position"].values())
    if not exact:
        sys.exit(f"gdn_state_in_snapshot: the state kept in the snapshot differs from SGLang's commit copy: "
                 f"{report['rows_follow_requests']}")
    if not all(report["plugin_keeper"].values()):
        sys.exit(f"gdn_state_in_snapshot: sglang_dflash.gdn_state over a request's life differs from SGLang's "
                 f"commit copy: {report['plugin_keeper']}")
    if not clobbered:
        sys.exit("gdn_state_in_snapshot: rows by batch position matched too, so the reordered batch tested nothing")
    print("gdn_state_in_snapshot: outputs and final states bitwise equal to SGLang's commit copy with request "
          "rows; rows by batch position differ, as they must")


if __name__ == "__main__":
    main()
