"""The feed-forward twins (installed by `fast.apply`), each the same function as its reference:

* `FastExperts` (`FastPaths(moe=True)`): for a few tokens (decode steps) the reference groups tokens by expert,
  which needs the per-expert token counts on the host; this twin runs batched matmuls over the chosen experts
  instead, with static shapes and no host synchronisation. With packed stacks and `matmul="fused"` those matmuls
  read the chosen experts' packed bytes in place (`FastPackedWeight.matmul`); with `grouped`, calls of more tokens
  multiply each chosen expert's decoded tiles by all the tokens at once and skip the experts no token chose
  (`forward_grouped`, `fast.grouped`). Equal to fp32 rounding.
* `FastRouter`: in a compiled region, the chosen experts unsorted (the order only changes the fp32 sum order of
  their outputs, and the sort is a kernel of its own).
* `FastMLP`: the SwiGLU output stored once when compiled (`compiled.materialize`), not recomputed per weight row.
"""

from __future__ import annotations

import torch

from ..model.mlp import MLP, swiglu_oai
from ..model.moe import Experts, Router, Routing, router_scores, routing_of
from ..weights.packed import PackedWeight
from .compiled import materialize
from .packed import FastPackedWeight


class FastRouter(Router):
    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> Routing:
        logits, scores, choice = router_scores(x, self.weight, self.e_score_correction_bias, self.top_k,
                                               self.mask_with(mask))
        ids = torch.topk(choice, self.top_k, dim=-1, sorted=not torch.compiler.is_compiling()).indices
        return routing_of(logits, scores, ids)


class FastMLP(MLP):
    def act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return materialize(super().act(gate, up))


class FastExperts(Experts):
    """`Experts` with the fast paths `paths` (a `FastPaths`, set by `fast.apply`). Same parameters."""

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        if self.paths.moe and not self.emulate_act_quant and x.shape[0] <= self.paths.sync_free_tokens:
            return self.forward_sync_free(x, routing)
        return super().forward(x, routing)

    def forward_sync_free(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """`forward` for a few tokens without host synchronisation and with static shapes (equal to `forward` up to
        fp32 rounding: the sum over a token's experts is taken in slot order instead of expert order).

        With P = T * k (token, slot) pairs and E local experts: when P < E, each pair's expert weights are gathered
        (decoding P experts, the chosen ones) and applied with batched matmuls; otherwise every local expert runs on
        every token (decoding each local expert once) and the outputs are combined with a dense [T, E] weight
        matrix whose unchosen entries are 0. Under expert parallelism, pairs routed to another rank's experts get
        weight 0. With `FastPaths.grouped` and more tokens than the fused matmul takes, `forward_grouped` instead.
        """
        T, k = routing.expert_ids.shape
        E = len(self.local_experts)
        local = routing.expert_ids - self.local_experts.start
        mine = (local >= 0) & (local < E)
        weights = torch.where(mine, routing.weights, torch.zeros_like(routing.weights))  # fp32 [T, k]
        local = local.clamp(0, E - 1)
        if self.takes_grouped(x):
            return self.forward_grouped(x, local, mine, weights)
        if T * k < E:
            # each token's row broadcast against its k experts (not repeated: the fused matmul reads x in place)
            xt = x[:, None, None]  # [T, 1, 1, H]
            gate = self.matmul("w1", xt, local)  # [T, k, 1, I]
            up = self.matmul("w3", xt, local)
            h = materialize(swiglu_oai(gate, up, self.alpha, self.limit))  # not recomputed per row of w2
            y = self.matmul("w2", h, local).view(T, k, -1)  # [T, k, H]
            return (y.float() * weights[..., None]).sum(1)
        dense = torch.zeros(T, E, dtype=torch.float32, device=x.device).scatter_add_(1, local, weights)
        gate = self.matmul("w1", x)  # [E, T, I]
        up = self.matmul("w3", x)
        h = materialize(swiglu_oai(gate, up, self.alpha, self.limit))
        y = self.matmul("w2", h)  # [E, T, H]
        return torch.einsum("te,eth->th", dense, y.float())

    def takes_grouped(self, x: torch.Tensor) -> bool:
        """Whether the three stacks are packed and multiply x's rows through the grouped kernel
        (`FastPackedWeight.takes_grouped`)."""
        stacks = [getattr(self, leaf) for leaf in ("w1", "w3", "w2")]
        return all(isinstance(w, FastPackedWeight) and w.takes_grouped(x, x.shape[0]) for w in stacks)

    def forward_grouped(self, x: torch.Tensor, local: torch.Tensor, mine: torch.Tensor,
                        weights: torch.Tensor) -> torch.Tensor:
        """`forward_sync_free` through the grouped kernel (`fast.grouped`): each local expert
        that a token of this call chose multiplies all T tokens (its weight tiles decoded once), the others are not
        read and give zero rows; each token then adds its k experts' rows, weighted, in slot order.

        x: `[T, H]` bf16; local: `[T, k]` local expert ids (clamped); mine: `[T, k]` whether the pair is this rank's;
        weights: fp32 `[T, k]`, 0 where not mine. Returns fp32 `[T, H]`, equal to `forward` to fp32 rounding (bf16
        products exact, fp32 sums in another order). Static shapes, no host synchronisation."""
        T, E = x.shape[0], len(self.local_experts)
        experts = torch.arange(E, device=x.device)
        active = ((local[..., None] == experts) & mine[..., None]).flatten(0, 1).any(0).to(torch.int32)  # [E]
        gate = self.matmul("w1", x, active=active)  # [E, T, I]
        up = self.matmul("w3", x, active=active)
        h = materialize(swiglu_oai(gate, up, self.alpha, self.limit))  # not recomputed per row of w2
        y = self.matmul("w2", h, active=active)  # [E, T, H]
        # each pair's row; a pair that is not mine has weight 0 and reads a computed (or zero) row
        picked = y[local, torch.arange(T, device=x.device)[:, None]]  # [T, k, H]
        return (picked.float() * weights[..., None]).sum(1)

    def matmul(self, leaf: str, x: torch.Tensor, index: torch.Tensor | None = None,
               active: torch.Tensor | None = None) -> torch.Tensor:
        """`x @ W^T` for the stack `leaf` ("w1", "w2", "w3"): x `[*B, M, K]` against every local expert (index
        None; `*B` broadcasts against `[E_local]`) or against the experts `index` (a LongTensor of any shape `I`;
        `*B` broadcasts against `I`). A packed stack multiplies through `PackedWeight.matmul` (fused, reading the
        gathered experts' bytes in place, when its twin's fused matmul is on). `active` (int32 `[E_local]`, index
        None): the experts whose rows are needed, which a grouped product reads alone (`FastPackedWeight.matmul`)."""
        w = getattr(self, leaf)
        if isinstance(w, FastPackedWeight):
            return w.matmul(x, index, active)
        if isinstance(w, PackedWeight):
            return w.matmul(x, index)
        return torch.matmul(x, (w if index is None else w[index]).transpose(-1, -2))
