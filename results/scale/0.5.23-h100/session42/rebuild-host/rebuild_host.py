# Does DraftVocab.rebuild (topk + sort + index_select) block the host? Time its host call with ~20 ms of GPU work queued ahead.
import json, time, torch
dev = "cuda"
rows, size = 151936, 32768
counts = torch.linspace(1e-3, 0.0, rows, device=dev) + torch.rand(rows, device=dev)
full = torch.randn(rows, 4096, device=dev, dtype=torch.bfloat16)
weight = torch.empty(size, 4096, device=dev, dtype=torch.bfloat16)
ids = torch.empty(size, dtype=torch.int64, device=dev)
a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
torch.cuda.synchronize()

def rebuild():
    top = torch.topk(counts, size, sorted=False).indices.sort().values
    ids.copy_(top)
    torch.index_select(full, 0, top, out=weight)
    counts.mul_(0.5)

def rebuild_no_sort():
    mask = torch.zeros(rows, dtype=torch.bool, device=dev)
    mask[torch.topk(counts, size, sorted=False).indices] = True
    top = torch.nonzero_static(mask, size=size).view(-1)
    ids.copy_(top)
    torch.index_select(full, 0, top, out=weight)
    counts.mul_(0.5)

out = {}
for name, fn in (("topk_sort", rebuild), ("topk_nonzero_static", rebuild_no_sort)):
    host, queued = [], []
    for i in range(10):
        t = time.perf_counter()
        for _ in range(20):
            a @ a
        queued.append(round((time.perf_counter() - t) * 1e3, 2))
        t0 = time.perf_counter(); fn(); t1 = time.perf_counter()
        host.append(round((t1 - t0) * 1e3, 3))
        torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record(); fn(); e1.record(); torch.cuda.synchronize()
    out[name] = {"host_ms_per_call": host, "gpu_ms": round(e0.elapsed_time(e1), 3), "launch_ms_of_queued_matmuls": queued}
print(json.dumps(out))
