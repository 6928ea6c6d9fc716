"""Run by tests/test_gdn_state.py: the plugin's GDN verify without snapshots (sglang_dflash/gdn_state.py)
against SGLang's snapshot verify and commit, over steps of changing width, accept lengths, track
boundaries and padded rows. Prints one JSON line: per step, whether outputs and the whole state pool
are equal. On the CPU under the Triton interpreter (TRITON_INTERPRET=1, set before SGLang's kernels
are imported); with ``cuda`` as its argument on a GPU, where the commit's restore runs through
SGLang's scatter kernel and the verify in its SM90 launch."""

import json
import sys
from types import SimpleNamespace

import torch

from sglang_dflash.gdn_state import GdnSavedState, recurrent_kernel

DEVICE = sys.argv[1] if len(sys.argv) > 1 else "cpu"
LAYERS, HV, H = 2, 4, 2
K = V = 128 if DEVICE == "cuda" else 32  # 128: the real head size, and SGLang's SM90 verify tile
SLOTS, ROWS, STEPS = 11, 6, 4  # slot 0: SGLang's padding slot


def gdn_inputs(gen, tokens):
    randn = lambda *size: torch.randn(*size, generator=gen).to(DEVICE, torch.bfloat16)  # noqa: E731
    return [dict(q=randn(1, tokens, H, K), k=randn(1, tokens, H, K), v=randn(1, tokens, HV, V),
                 a=randn(tokens, HV), b=randn(tokens, HV)) for _ in range(LAYERS)]


def snapshot_step(kernel, gates, pool, snapshots, inputs, cache_indices, starts, width):
    """SGLang's verify: per-token snapshots, the pool untouched."""
    rows = torch.arange(cache_indices.shape[0], dtype=torch.int32, device=DEVICE).clamp(max=ROWS - 1)  # padding row
    outs = []
    for layer, x in enumerate(inputs):
        A_log, dt_bias = gates[layer]
        outs.append(kernel(A_log=A_log, dt_bias=dt_bias, **x, initial_state_source=pool[layer],
                           initial_state_indices=cache_indices, cu_seqlens=starts, use_qk_l2norm_in_kernel=True,
                           softplus_beta=1.0, softplus_threshold=20.0, is_kda=False, disable_state_update=True,
                           intermediate_states_buffer=snapshots[layer], intermediate_state_indices=rows,
                           cache_steps=width))
    return outs


def snapshot_commit(pool, snapshots, slots, commit_len, track_slots, steps_to_track):
    for r in range(slots.shape[0]):
        pool[:, slots[r]] = snapshots[:, r, commit_len[r] - 1]
        if track_slots is not None and steps_to_track[r] >= 0 and track_slots[r] >= 0:
            pool[:, track_slots[r]] = snapshots[:, r, steps_to_track[r]]


def main():
    gen = torch.Generator().manual_seed(0)
    kernel = recurrent_kernel()
    gates = [(torch.log(torch.rand(HV, generator=gen) * 15 + 1).to(DEVICE),
              torch.randn(HV, generator=gen).to(DEVICE, torch.bfloat16)) for _ in range(LAYERS)]
    pool0 = (torch.randn(LAYERS, SLOTS, HV, V, K, generator=gen) * 0.1).to(DEVICE)
    reference, plugin = pool0.clone(), pool0.clone()
    snapshots = torch.zeros(LAYERS, ROWS, STEPS, HV, V, K, device=DEVICE)
    cache = SimpleNamespace(temporal=plugin, intermediate_ssm=torch.zeros(LAYERS, ROWS, STEPS, HV, V, K, device=DEVICE),
                            conv=[], intermediate_conv_window=[])
    saved = GdnSavedState(cache)
    t = lambda *x: torch.tensor(x, dtype=torch.int32, device=DEVICE)  # noqa: E731
    # (width, cache indices as the verify reads them, commit lengths, track slots, steps to track)
    steps = [
        (4, t(3, 7, 5), t(1, 3, 4), t(9, 2, 10), t(-1, 1, 3)),  # short, short crossing at step 1, whole crossing at 3
        (2, t(7, 3, 5), t(2, 1, 2), None, None),
        (4, t(5, 3, 7, -1), t(4, 4, 2), t(-1, 9, 2), t(0, 2, 0)),  # a padded row; a track row with no slot
        (1, t(3, 5), t(1, 1), t(2, 10), t(0, -1)),
        (4, t(7, 3, 5), t(2, 4, 1), None, None),
        (2, t(5, 7, 3, -1, -1, -1, -1, -1), t(1, 2, 2), None, None),  # padded past the buffer's rows
        # padded past 64 rows, where SGLang's SM90 verify changes its value tile: the re-runs must follow
        (2, t(3, 5, *[-1] * 68), t(1, 2), t(9, 10), t(0, -1)),
    ]
    found = []
    for width, cache_indices, commit_len, track_slots, steps_to_track in steps:
        verify_rows = cache_indices.shape[0]
        starts = torch.arange(0, verify_rows * width + 1, width, dtype=torch.int32, device=DEVICE)
        inputs = gdn_inputs(gen, verify_rows * width)
        out_ref = snapshot_step(kernel, gates, reference, snapshots, inputs, cache_indices, starts, width)
        out = [saved.verify(*gates[layer], **x, ssm_states=plugin[layer], cache_indices=cache_indices,
                            query_start_loc=starts, intermediate_states_buffer=cache.intermediate_ssm[layer],
                            intermediate_state_indices=None, cache_steps=width)
               for layer, x in enumerate(inputs)]
        bs = commit_len.shape[0]
        slots = cache_indices[:bs]
        snapshot_commit(reference, snapshots, slots, commit_len, track_slots, steps_to_track)
        saved.commit(slots, commit_len, width, verify_rows, track_slots, steps_to_track)
        found.append({"width": width, "outputs_equal": all(torch.equal(x, y) for x, y in zip(out, out_ref)),
                      "states_equal": torch.equal(plugin, reference),
                      "states_moved": not torch.equal(plugin, pool0)})
    print(json.dumps(found))
    sys.exit(0 if all(f["outputs_equal"] and f["states_equal"] for f in found) else 1)


if __name__ == "__main__":
    main()
