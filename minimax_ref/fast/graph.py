"""A decode step captured in a CUDA graph (`GraphStep`): with the fast paths `moe` and `static_kv` (no host
synchronisation, static shapes) a decode step can be recorded once and replayed; with compiled layers or the fused
matmul, after the warm-up steps have compiled them."""

from __future__ import annotations

import torch

from ..cache import KVCache


class GraphStep:
    """One decode step of `model` on `cache` captured in a CUDA graph. `step(ids, pos)` copies the inputs into the
    captured buffers, replays, and returns the captured logits [B, V] (overwritten by the next replay).

    The warm-up and the capture write K/V at `pos0`, the position the first real step writes again."""

    def __init__(self, model, cache: KVCache, ids0: torch.Tensor, pos0: torch.Tensor):
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
            self.logits = model(self.ids, positions=self.pos, cache=cache)[:, -1]

    def step(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.ids.copy_(ids)
        self.pos.copy_(pos)
        self.graph.replay()
        return self.logits
