"""Mixture of experts: sigmoid router with a selection bias, routed SwiGLU-OAI experts, one shared
expert.

Contract (spec `model.md`, "Feed-forward"):
* router logits `l = x_f32 @ gate_f32^T` [T, E], scores `p = sigmoid(l)` (fp32);
* experts chosen by `topk(p + e_score_correction_bias, k)`: the bias only chooses;
* weights `w = p[chosen] / sum(p[chosen])` (no epsilon);
* `y = routed_scaling_factor * sum_j w_j * expert_j(x) + shared_expert(x)`.

Accumulation (decided here): each expert's output (compute dtype) is cast to fp32, multiplied by
its fp32 routing weight and summed in fp32; the scaling and the shared expert's output are added in
fp32 and the result cast once to the compute dtype. In fp32 mode every step is fp32.

Packed weights (`weights="packed"`): each expert stack is a `packed.PackedWeight` and an expert is
decoded when it has tokens, to the same bits as a decoded-at-load stack.

Tensor parallelism (parallel.py): the router is replicated, so every rank makes the same choice.
The routed experts are either split like an MLP (TP mode: each rank holds intermediate/TP channels
of every expert) or whole (expert-parallel: each rank holds E/TP experts and computes only those,
for the tokens routed to them). Either way a rank's routed sum and its shared-expert output are
partial sums; they are added in fp32 and all-reduced once per block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from ..weights.packed import PackedWeight
from .linear import emulate_activation_quant
from .mlp import MLP, swiglu_oai
from .parallel import World


@dataclass
class Routing:
    """One MoE layer's decision for T tokens: expert ids [T, k] (long), weights [T, k] (fp32),
    and the raw router logits [T, E] (fp32).

    Slot j of a token is its j-th choice: `weights[t, j]` is the normalised weight of expert
    `expert_ids[t, j]`, and the slots are in decreasing order of the choice score (sigmoid score plus
    selection bias, `router_scores`), not of the weight. A computation whose result does not depend on the slot
    order may leave them unsorted; the pairing of ids and weights holds either way.
    """

    expert_ids: torch.Tensor
    weights: torch.Tensor
    logits: torch.Tensor


def route(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    expert_mask: torch.Tensor | None = None,
) -> Routing:
    """Sigmoid top-k routing of `x` [T, H] by `gate_weight` [E, H] (any float dtype; used in fp32).

    `bias` [E] is added to the scores for the choice only. `expert_mask` [E] bool, when given,
    removes the experts marked False from the choice (used to emulate pruning). Ties in top-k are
    broken as `torch.topk` does (implementation-defined).
    """
    logits, scores, choice = router_scores(x, gate_weight, bias, top_k, expert_mask)
    return routing_of(logits, scores, torch.topk(choice, top_k, dim=-1).indices)


def router_scores(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor | None, top_k: int,
                  expert_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`route`'s fp32 logits [T, E], sigmoid scores [T, E] and the scores the choice ranks (bias added, masked
    experts at -inf)."""
    return scores_of(F.linear(x.float(), gate_weight.float()), bias, top_k, expert_mask)


def scores_of(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int,
              expert_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`router_scores` from the fp32 logits [T, E]."""
    scores = torch.sigmoid(logits)
    choice = scores if bias is None else scores + bias.float()
    if expert_mask is not None:
        kept = int(expert_mask.sum())
        if kept < top_k:  # topk would silently pick masked (-inf) experts
            raise ConfigError(f"expert_mask keeps {kept} experts but routing chooses {top_k} per token")
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    return logits, scores, choice


def routing_of(logits: torch.Tensor, scores: torch.Tensor, expert_ids: torch.Tensor) -> Routing:
    """The routing of the chosen `expert_ids` [T, k]: weights = their scores, normalised to sum 1."""
    chosen = scores.gather(-1, expert_ids)
    return Routing(expert_ids, chosen / chosen.sum(-1, keepdim=True), logits)


class Router(nn.Module):
    """`gate.weight` [E, H] and `e_score_correction_bias` [E], kept in fp32."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, use_bias: bool):
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(num_experts, dtype=torch.float32), requires_grad=False) if use_bias else None
        )
        self.register_buffer("expert_mask", None, persistent=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> Routing:
        """The routing of tokens x [T, H] (`route`): experts that `expert_mask` (the module's buffer, set by
        pruning emulation) or `mask` (bool [E]) mark False are never chosen."""
        return route(x, self.weight, self.e_score_correction_bias, self.top_k, self.mask_with(mask))

    def mask_with(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        """The experts left choosable by the module's `expert_mask` and `mask` together (None: all)."""
        if mask is None:
            return self.expert_mask
        mask = mask.to(self.weight.device)
        return mask if self.expert_mask is None else mask & self.expert_mask


class Experts(nn.Module):
    """The routed experts of one layer held by this rank, stacked: `w1` (gate) and `w3` (up)
    [E_local, I_local, H], `w2` (down) [E_local, H, I_local], in the compute dtype, or as
    `packed.PackedWeight` stacks of the same logical shapes (`weights="packed"`). For NVFP4
    activation emulation each expert keeps its `input_scale` per projection ([E_local] fp32 buffers).

    `local_experts`: the global expert ids held here (all of them, or E/TP consecutive ones when
    expert-parallel); `channels`: the slice of each expert's intermediate channels held here (all
    of them when expert-parallel, intermediate/TP in TP mode).
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, alpha: float, limit: float,
                 world: World | None = None, expert_parallel: bool = False, act_format: str | None = None,
                 emulate: bool = False):
        super().__init__()
        world = world or World.single()
        self.num_experts = num_experts
        self.expert_parallel = expert_parallel
        if expert_parallel:
            owned = world.split(num_experts, "num_local_experts")
            self.local_experts = range(owned.start, owned.stop)
            self.channels = slice(0, intermediate)
        else:
            self.local_experts = range(num_experts)
            self.channels = world.split(intermediate, "routed expert intermediate_size")
        E, I = len(self.local_experts), self.channels.stop - self.channels.start  # noqa: E741
        self.w1 = nn.Parameter(torch.empty(E, I, hidden), requires_grad=False)
        self.w3 = nn.Parameter(torch.empty(E, I, hidden), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(E, hidden, I), requires_grad=False)
        self.alpha, self.limit = alpha, limit
        self.act_format = act_format  # on-disk format of the stacks, for activation emulation (linear.py)
        self.emulate_act_quant = emulate and act_format is not None
        for leaf in ("w1", "w2", "w3"):
            self.register_buffer(f"{leaf}_input_scale", None, persistent=False)

    def slices(self, leaf: str) -> tuple[slice | None, slice | None]:
        """The [rows, cols] part of one expert's checkpoint weight `leaf` ("w1", "w2", "w3") held here."""
        if self.expert_parallel:
            return None, None  # whole experts
        return (None, self.channels) if leaf == "w2" else (self.channels, None)

    def weight(self, leaf: str, index: int | torch.Tensor | None = None) -> torch.Tensor:
        """Weights of `leaf` ("w1", "w2", "w3") in the compute dtype: the whole stack (index None), local
        expert `index` (an int), or the experts `index` (a LongTensor) stacked; decoded now if packed."""
        w = getattr(self, leaf)
        if isinstance(w, PackedWeight):
            return w.decode(index)
        return w if index is None else w[index]

    def unpack(self, leaf: str) -> None:
        """Decode the packed stack `leaf` once and keep it (what weights="dequant" loads; `packed.dequantize`)."""
        w = getattr(self, leaf).decode()
        delattr(self, leaf)
        setattr(self, leaf, nn.Parameter(w, requires_grad=False))

    def _act(self, x: torch.Tensor, leaf: str, e: int) -> torch.Tensor:
        if not self.emulate_act_quant:
            return x
        scales = getattr(self, f"{leaf}_input_scale")
        return emulate_activation_quant(x, self.act_format, None if scales is None else scales[e])

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Local expert `e` (index into the stack) on `x` [n, H] -> [n, H] in the compute dtype
        (in TP mode: this rank's partial output, from its intermediate channels)."""
        gate = F.linear(self._act(x, "w1", e), self.weight("w1", e))
        up = F.linear(self._act(x, "w3", e), self.weight("w3", e))
        h = swiglu_oai(gate, up, self.alpha, self.limit)
        return F.linear(self._act(h, "w2", e), self.weight("w2", e))

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """`sum_j w_j * expert_j(x)` for `x` [T, H], accumulated in fp32 -> fp32 [T, H].

        Tokens are grouped by expert so each selected expert runs once on all its tokens. Under
        tensor parallelism this is the rank's partial sum: its channels of every expert (TP mode) or
        its own experts only (expert-parallel); the caller all-reduces.
        """
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        flat_ids = routing.expert_ids.reshape(-1)
        flat_w = routing.weights.reshape(-1)
        token_of = torch.arange(x.shape[0], device=x.device).repeat_interleave(routing.expert_ids.shape[1])
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        start = 0
        for e, n in enumerate(counts):
            sel = order[start : start + n]
            start += n
            if n == 0 or e not in self.local_experts:
                continue  # expert-parallel: another rank computes expert e for these tokens
            tokens = token_of[sel]
            y = self.expert(e - self.local_experts.start, x[tokens])
            out.index_add_(0, tokens, y.float() * flat_w[sel, None])
        return out


class MoE(nn.Module):
    """`block_sparse_moe` of a layer: `gate` (router), `experts`, `shared_experts`."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int, shared_intermediate: int,
                 n_shared: int, scaling: float, use_bias: bool, alpha: float, limit: float,
                 world: World | None = None, expert_parallel: bool = False):
        super().__init__()
        self.world = world or World.single()
        self.gate = Router(hidden, num_experts, top_k, use_bias)  # replicated: same choice on every rank
        self.experts = Experts(num_experts, hidden, intermediate, alpha, limit, self.world, expert_parallel)
        # the shared expert's down_proj does not reduce: forward sums it with the routed experts first
        self.shared_experts = (MLP(hidden, shared_intermediate, alpha, limit, self.world, reduce_output=False)
                               if n_shared else None)
        self.scaling = scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`routed_scaling_factor * sum_j w_j * expert_j(x) + shared_expert(x)` for x [.., H] -> [.., H] in x's
        dtype (accumulated in fp32; module docstring). Under tensor parallelism, all-reduced once."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        y = self.experts(flat, self.gate(flat)) * self.scaling  # fp32; this rank's part under TP
        if self.shared_experts is not None:
            y = y + self.shared_experts(flat).float()  # this rank's partial shared-expert output
        y = self.world.all_reduce_fp32(y)  # the block's one all-reduce: routed + shared together
        return y.to(x.dtype).reshape(shape)
