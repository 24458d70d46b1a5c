"""`FastDSparkDrafter`: the DSpark drafter's pass with no host synchronisation, replayed from a CUDA graph.

The reference (`drafter.DSparkDrafter.block_hidden`) slices the context rows that any query of the batch can see, a
range read on the host (the smallest and largest position). The twin gathers, for each row, the L = min(window - 1,
cache length) slots before its position t instead: the union of what the block's queries can see (query t + i sees
positions t + i - (window - 1) .. t - 1; the widest is i = 0), with a static shape. Slots before position 0 are marked
at position t, which no query sees (only committed positions < t are visible). Same keys, same mask: equal to the
reference to fp32 rounding (the softmax sums run over another number of masked slots).

With `FastPaths(graph=True)` on CUDA, a greedy pass (`draft` with greedy sampling: the base logits, then the Markov
pass by argmax) is captured per draft cache and (batch, drafted tokens) and replayed (`fast.graph.record`); its outputs
are buffers the next pass rewrites. Sampled passes draw from the loop's generator on the host: they run eagerly.
"""

from __future__ import annotations

import weakref

import torch

from ..generation.drafter import Draft, DraftCache, DSparkDrafter
from ..generation.sampling import SamplingParams
from ..model.decoder import MiniMaxM3
from .graph import record


class CapturedDrafts:
    """The captured greedy passes over one draft cache, one per (batch, drafted tokens): the graph, its input buffers
    (anchors, positions) and its outputs (tokens, confidence)."""

    def __init__(self, cache: DraftCache):
        self.cache = weakref.ref(cache)  # strong references only through the graphs
        self.passes: dict[tuple[int, int], tuple] = {}

    def holds(self, cache: DraftCache) -> bool:
        return self.cache() is cache


class FastDSparkDrafter(DSparkDrafter):
    """`DSparkDrafter` with the fast paths `paths` (a `FastPaths`, set by `fast.apply`). Same parameters."""

    @torch.no_grad()
    def block_hidden(self, target: MiniMaxM3, cache: DraftCache, anchors: torch.Tensor,
                     positions: torch.Tensor) -> torch.Tensor:
        B, Bk, W = anchors.shape[0], self.block_size, self.config.sliding_window
        ids = torch.full((B, Bk), self.config.noise_token_id, dtype=torch.long, device=anchors.device)
        ids[:, 0] = anchors
        q_pos = positions[:, None] + torch.arange(Bk, device=positions.device)
        cos, sin = self._rope(q_pos)
        L = min(W - 1, cache.max_len)
        ctx_pos = positions[:, None] - L + torch.arange(L, device=positions.device)  # [B, L]: the L before t
        slots = ctx_pos.clamp(min=0)
        ctx_pos = torch.where(ctx_pos >= 0, ctx_pos, positions[:, None])  # before position 0: never visible
        rows = torch.arange(B, device=positions.device)[:, None]
        x = target.embed(ids).to(self.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, q_pos, cos, sin, cache.k[i][rows, slots], cache.v[i][rows, slots], ctx_pos, positions)
        return self.final_norm(x)

    @torch.no_grad()
    def draft(self, target: MiniMaxM3, cache: DraftCache, anchors: torch.Tensor, positions: torch.Tensor,
              num_tokens: int, sampling: SamplingParams, generator: torch.Generator | None) -> Draft:
        if not (self.paths.graph and sampling.greedy and anchors.is_cuda and 1 <= num_tokens <= self.block_size):
            return super().draft(target, cache, anchors, positions, num_tokens, sampling, generator)
        captured = getattr(self, "captured", None)
        if captured is None or not captured.holds(cache):
            self.captured = captured = CapturedDrafts(cache)
        key = (anchors.shape[0], num_tokens)
        if key not in captured.passes:
            inputs = (anchors.clone(), positions.clone())

            def greedy_pass() -> Draft:
                return super(FastDSparkDrafter, self).draft(target, cache, *inputs, num_tokens, sampling, None)

            graph, out = record(greedy_pass, anchors.device)
            captured.passes[key] = (graph, inputs, out)
        graph, (a, p), out = captured.passes[key]
        a.copy_(anchors)
        p.copy_(positions)
        graph.replay()
        return out
