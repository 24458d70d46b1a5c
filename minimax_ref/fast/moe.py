"""The feed-forward twins (installed by `fast.apply`), each the same function as its reference:

* `FastExperts` (`FastPaths(moe=True)`): for a few tokens (decode steps) the reference groups tokens by expert,
  which needs the per-expert token counts on the host; this twin runs batched matmuls over the chosen experts
  instead, with static shapes and no host synchronisation. With packed stacks and `matmul="fused"` those matmuls
  read the chosen experts' packed bytes in place (`FastPackedWeight.matmul`). Equal to fp32 rounding.
* `FastRouter`: in a compiled region, the chosen experts unsorted (the order only changes the fp32 sum order of
  their outputs, and the sort is a kernel of its own).
* `FastMLP`: the SwiGLU output stored once when compiled (`compiled.materialize`), not recomputed per weight row.
"""

from __future__ import annotations

import torch

from ..mlp import MLP, swiglu_oai
from ..moe import Experts, Router, Routing, router_scores, routing_of
from ..packed import PackedWeight
from .compiled import materialize


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
        weight 0.
        """
        T, k = routing.expert_ids.shape
        E = len(self.local_experts)
        local = routing.expert_ids - self.local_experts.start
        mine = (local >= 0) & (local < E)
        weights = torch.where(mine, routing.weights, torch.zeros_like(routing.weights))  # fp32 [T, k]
        local = local.clamp(0, E - 1)
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

    def matmul(self, leaf: str, x: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
        """`x @ W^T` for the stack `leaf` ("w1", "w2", "w3"): x `[*B, M, K]` against every local expert (index
        None; `*B` broadcasts against `[E_local]`) or against the experts `index` (a LongTensor of any shape `I`;
        `*B` broadcasts against `I`). A packed stack multiplies through `PackedWeight.matmul` (fused, reading the
        gathered experts' bytes in place, when its twin's fused matmul is on)."""
        w = getattr(self, leaf)
        if isinstance(w, PackedWeight):
            return w.matmul(x, index)
        return torch.matmul(x, (w if index is None else w[index]).transpose(-1, -2))
