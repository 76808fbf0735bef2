"""A CUDA graph of a list of GPU calls, for the kernel benchmarks
(benchmarks/kernels.py, benchmarks/capture_bf16.py): how engines replay a
decode step."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def captured_graph(calls: Sequence[Callable[[], object]]) -> torch.cuda.CUDAGraph:
    """A graph that runs every call once, replayed once (its first replay
    pays one-time costs) and synchronized. The calls run twice on a side
    stream first, as capture requires (allocations and autotuning happen
    outside the graph)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            for call in calls:
                call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    return graph
