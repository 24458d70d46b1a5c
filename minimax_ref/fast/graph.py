"""Decode steps captured in CUDA graphs.

`GraphStep`: one decode step of a model on one KV cache, recorded once and replayed. With the fast paths `moe` and
`static_kv` (no host synchronisation, static shapes) a decode step can be recorded; with compiled layers or the fused
matmul, after warm-up steps have compiled them.

`CapturedSteps`: what `FastMiniMaxM3.step` replays with `FastPaths(graph=True)`: the graphs of one KV cache, one per
step shape (batch, tokens per row), captured on that shape's first step.
"""

from __future__ import annotations

import sys
import time
import weakref

import torch

from ..cache import KVCache


class GraphStep:
    """One decode step of `model` on `cache` captured in a CUDA graph. `step(ids, pos)` copies the inputs into the
    captured buffers, replays, and returns the captured logits of the last position [B, V]; `step_all` returns those
    of every position [B, T, V]. Both are overwritten by the next replay.

    The warm-up and the capture run the step on `ids0` at `pos0`: they write K/V there, the same values the first
    replay (on the same inputs) writes again. The graph addresses the cache's buffers, so it keeps the cache."""

    def __init__(self, model, cache: KVCache, ids0: torch.Tensor, pos0: torch.Tensor):
        self.cache = cache
        self.ids, self.pos = ids0.clone(), pos0.clone()
        device = ids0.device
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up off the capture: allocator pools, cuBLAS handles, NCCL, compiles
            for _ in range(2):
                model(self.ids, positions=self.pos, cache=cache)
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.all_logits = model(self.ids, positions=self.pos, cache=cache)
        self.logits = self.all_logits[:, -1]

    def replay(self, ids: torch.Tensor, pos: torch.Tensor) -> None:
        self.ids.copy_(ids)
        self.pos.copy_(pos)
        self.graph.replay()

    def step(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.replay(ids, pos)
        return self.logits

    def step_all(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.replay(ids, pos)
        return self.all_logits


class CapturedSteps:
    """The CUDA graphs of the decode steps on one KV cache, one per step shape [B, T], each captured on its first
    step. The graphs keep the cache alive (they address its buffers); a new cache gets a new `CapturedSteps`, and
    dropping this one frees the graphs, their memory pool and the cache. `seen` (shared across caches, owned by the
    model) holds the shapes already compiled, so only the first capture of a shape, which compiles, is announced on
    `stream`."""

    def __init__(self, cache: KVCache, seen: set, stream=None):
        self.cache = weakref.ref(cache)  # strong references only through the graphs
        self.graphs: dict[tuple[int, ...], GraphStep] = {}
        self.seen = seen
        self.stream = stream or sys.stderr
        self.capture_seconds = 0.0

    def holds(self, cache: KVCache) -> bool:
        return self.cache() is cache

    def step(self, model, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, V] of the step `model(ids, positions=positions, cache=<this cache>)`, replayed from its
        graph (captured now if this shape has none yet). Valid until the next step."""
        shape = tuple(ids.shape)
        graph = self.graphs.get(shape)
        if graph is None:
            cache = self.cache()
            key = (shape, cache.max_seq_len, cache.fp8)
            first = key not in self.seen
            if first:
                print(f"[fast] first decode step of {shape[0]} sequence(s) x {shape[1]} token(s), cache of "
                      f"{cache.max_seq_len} slots: compiling and capturing it in a CUDA graph...",
                      file=self.stream, flush=True)
            t0 = time.perf_counter()
            graph = self.graphs[shape] = GraphStep(model, cache, ids, positions)
            seconds = time.perf_counter() - t0
            self.capture_seconds += seconds
            self.seen.add(key)
            if first:
                print(f"[fast] decode step compiled and captured in {seconds:.1f} s", file=self.stream, flush=True)
        return graph.step_all(ids, positions)
