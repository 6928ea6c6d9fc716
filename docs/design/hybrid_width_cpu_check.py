"""CPU check for docs/design/hybrid-adaptive-width.md: SGLang's own GDN verify kernels and commit
scatter under adaptive width, run by the Triton interpreter (no GPU).

Per step a width w in {8, 4, 2, 1} (B = 8), random commit lengths 1..w per request, and every other
width-1 step a plain decode (state advanced in place, no commit). The verify writes into the one
B-pitched intermediate buffer (SSM snapshots and the pool's deduplicated conv window view); the
commit (SGLang's scatter, modelled in torch: its Triton kernel refuses CPU tensors) copies step
``commit - 1`` into the request's slot and, for some requests, a radix track step into a track slot. Reference: the committed tokens through
the same kernels one token at a time. Requests' state slots differ from their batch rows.

    TRITON_INTERPRET=1 python docs/design/hybrid_width_cpu_check.py               # installed SGLang
    SGLANG_TREE=/tmp/hd17 TRITON_INTERPRET=1 python docs/design/hybrid_width_cpu_check.py  # an unzipped wheel

(An unzipped 0.5.17 wheel on sys.path ahead of an installed 0.5.23 runs 0.5.17's kernel files.)
"""
import importlib
import os
import random
import sys
from types import SimpleNamespace

os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("SGLANG_TREE"):
    sys.path.insert(0, os.environ["SGLANG_TREE"])
import torch  # noqa: E402

import sglang  # noqa: E402


def load(*names):
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError(names)


recurrent = load("sglang.kernels.ops.attention.linear.fused_sigmoid_gating_recurrent",  # 0.5.23
                 "sglang.kernels.ops.attention.fla.fused_sigmoid_gating_recurrent")  # 0.5.17
gdn = recurrent.fused_sigmoid_gating_delta_rule_update
conv_update = load("sglang.kernels.ops.mamba.causal_conv1d_triton").causal_conv1d_update


def scatter(caches, slots, steps, track_slots, track_steps):
    """``scatter_mamba_states_after_mtp_verify`` in torch: SGLang's Triton scatter refuses CPU tensors
    (``fused_mamba_state_scatter_with_mask``), so this is the non-CUDA fallback of
    ``HybridLinearAttnBackend._scatter_speculative_state_with_mask``: dst[:, slot] = src[:, row, step]."""
    for dst_idx, step in ((slots, steps), (track_slots, track_steps)):
        for dst, src in ((caches.temporal, caches.intermediate_ssm), *zip(caches.conv, caches.intermediate_conv_window)):
            rows = torch.arange(len(step))
            keep = step >= 0
            dst[:, dst_idx.long()[keep]] = src[:, rows[keep], step[keep]]

torch.manual_seed(0)
random.seed(0)
H, HV, K, V, DIM, W, B, SLOTS, BS = 2, 4, 16, 16, 32, 4, 8, 8, 3
A_log, dt_bias = torch.randn(HV), torch.randn(HV)
conv_w, conv_b = torch.randn(DIM, W), torch.randn(DIM)


def run_gdn(q, k, v, a, b, ssm, slots, T, buf=None):
    n = len(slots)
    return gdn(A_log=A_log, dt_bias=dt_bias, q=q, k=k, v=v, a=a, b=b, initial_state_source=ssm,
               initial_state_indices=slots, cu_seqlens=torch.arange(0, n * T + 1, T, dtype=torch.int32),
               use_qk_l2norm_in_kernel=True, softplus_beta=1.0, softplus_threshold=20.0, is_kda=False,
               disable_state_update=buf is not None, intermediate_states_buffer=buf,
               intermediate_state_indices=torch.arange(n, dtype=torch.int32) if buf is not None else None,
               cache_steps=T if buf is not None else None)


def pools():
    ssm = torch.randn(1, SLOTS + 1, HV, V, K)
    conv = torch.randn(1, SLOTS + 1, W - 1, DIM).transpose(2, 3)  # contiguous along dim, as the kernel asks
    return ssm, conv


ssm, conv = pools()
ref_ssm, ref_conv = ssm.clone(), conv.clone()
inter_ssm = torch.zeros(1, BS + 1, B, HV, V, K)  # [layers, batch rows + pad, B, HV, V, K]
phys = torch.zeros(1, BS + 1, B + W - 2, DIM).transpose(2, 3)  # the pool's deduplicated window
inter_conv = phys.as_strided((1, BS + 1, B, DIM, W - 1),
                             (phys.stride(0), phys.stride(1), phys.stride(3), phys.stride(2), phys.stride(3)))
slot_of = torch.tensor([5, 1, 3], dtype=torch.int32)
track_slot = torch.tensor([6, 7, 4], dtype=torch.int64)
worst, widths, tracked = 0.0, [], 0
for step in range(24):
    w = random.choice([8, 4, 2, 1])
    decode = w == 1 and step % 2 == 0
    widths.append("d" if decode else w)
    q, k = torch.randn(1, BS * w, H, K), torch.randn(1, BS * w, H, K)
    v, a, b = torch.randn(1, BS * w, HV, V), torch.randn(BS * w, HV), torch.randn(BS * w, HV)
    x = torch.randn(BS, w, DIM).transpose(1, 2)  # (bs, dim, w), as GDN's verify hands it to the conv
    if decode:
        x_out = conv_update(x[:, :, 0].clone(), conv[0], conv_w, conv_b, "silu", conv_state_indices=slot_of)[:, :, None]
        out = run_gdn(q, k, v, a, b, ssm[0], slot_of, 1)
        commit, track_step = [1] * BS, [-1] * BS
    else:
        x_out = conv_update(x.clone(), conv[0], conv_w, conv_b, "silu", conv_state_indices=slot_of,
                            intermediate_conv_window=inter_conv[0], intermediate_state_indices=torch.arange(BS, dtype=torch.int32))
        out = run_gdn(q, k, v, a, b, ssm[0], slot_of, w, buf=inter_ssm[0])
        commit = [random.randint(1, w) for _ in range(BS)]
        track_step = [random.randint(0, c - 1) if random.random() < 0.5 else -1 for c in commit]
        scatter(SimpleNamespace(temporal=ssm, intermediate_ssm=inter_ssm, conv=[conv], intermediate_conv_window=[inter_conv]),
                slot_of, torch.tensor(commit) - 1, track_slot, torch.tensor(track_step))
    for r in range(BS):  # the committed tokens one at a time
        for t in range(commit[r]):
            i = [r * w + t]
            o1 = conv_update(x[r:r + 1, :, t].clone(), ref_conv[0], conv_w, conv_b, "silu", conv_state_indices=slot_of[r:r + 1])
            o2 = run_gdn(q[:, i], k[:, i], v[:, i], a[i], b[i], ref_ssm[0], slot_of[r:r + 1], 1)
            worst = max(worst, (o1 - x_out[r:r + 1, :, t]).abs().max().item(),
                        (o2.reshape(-1) - out.reshape(1, BS, w, -1)[0, r, t]).abs().max().item())
            if t == track_step[r]:
                tracked += 1
                worst = max(worst, (ssm[0, track_slot[r]] - ref_ssm[0, slot_of[r]]).abs().max().item(),
                            (conv[0, track_slot[r]] - ref_conv[0, slot_of[r]]).abs().max().item())
    worst = max(worst, (ssm[0, slot_of.long()] - ref_ssm[0, slot_of.long()]).abs().max().item(),
                (conv[0, slot_of.long()] - ref_conv[0, slot_of.long()]).abs().max().item())
print(f"SGLang from {os.path.dirname(sglang.__file__)}; widths per step {widths}; {tracked} track checkpoints")
print(f"max |difference| from the one-token reference (outputs, states, checkpoints): {worst}")
assert worst < 1e-5, worst
