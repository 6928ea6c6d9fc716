"""Microseconds per call of a GPU function, as the lab's kernel benchmarks time it: CUDA events
around repeated calls, the median of a few repetitions.

    from lab.cuda_timing import event_us, graph_us      (lab/fa3_verify_bench.py, lab/verify_attention_bench.py)
    from lab.cuda_timing import flushed_event_us        (lab/gdn_verify_bench.py)
"""

import argparse
import statistics

import torch


def event_us(fn, calls: int = 50, reps: int = 7) -> float:
    """``fn`` called eagerly ``calls`` times per repetition (after one warm-up call)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times)


def flushed_event_us(fn, flush: torch.Tensor, calls: int = 50, warmup: int = 5) -> float:
    """``fn`` timed alone, call by call (median), each call after ``flush`` is zeroed: a buffer larger
    than the L2 cache empties it, as a real step's other layers would, and keeps the GPU busy while
    Python launches ``fn``, so the figure is GPU time without launch latency."""
    for _ in range(warmup):
        fn()
    events = []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        flush.zero_()
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) * 1000 for start, end in events)


def graph_us(fn, calls: int, reps: int = 7) -> float:
    """``fn`` replayed from one CUDA graph of ``calls`` calls, as a serving step replays it."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            fn()
    return event_us(graph.replay, 1, reps) / calls


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
