"""Microseconds per call of a GPU function, as the lab's kernel benchmarks time it: CUDA events
around repeated calls, the median of a few repetitions.

    from lab.cuda_timing import event_us, graph_us      (lab/fa3_verify_bench.py, lab/verify_attention_bench.py)
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
