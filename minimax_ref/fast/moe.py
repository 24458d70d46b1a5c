"""The feed-forward twins (installed by `fast.apply`), each the same function as its reference:

* `FastExperts` (`FastPaths(moe=True)`): for a few tokens (decode steps) the reference groups tokens by expert,
  which needs the per-expert token counts on the host; this twin runs batched matmuls over the chosen experts
  instead, with static shapes and no host synchronisation. For many tokens (prefill) it sorts the tokens by expert
  once and runs each projection as one grouped matmul over the chosen experts (`forward_sorted`) where
  `torch._grouped_mm` runs, instead of a dozen kernels per expert. With packed stacks and `matmul="fused"` those matmuls
  read the chosen experts' packed bytes in place (`FastPackedWeight.matmul`); with `grouped`, calls of more tokens
  multiply each chosen expert's decoded tiles by all the tokens at once and skip the experts no token chose
  (`forward_grouped`, `fast.grouped`; with `grouped_swiglu`, gate, up and their SwiGLU as one launch); with
  `prefill_experts="triton"`, prefill's sorted rows multiply the packed
  stacks in place too, each tile decoded in registers (`fast.prefill_experts`). Equal to fp32 rounding.
* `FastRouter`: in a compiled region, the logits of more than one row as a broadcast product summed
  (`attention.contract`: inductor's one reduction with the sigmoid and bias fused into it, where a few rows'
  `F.linear` is a cuBLAS matmul and its split-K sum; fp32 sums in another order) and the chosen experts unsorted
  (the order only changes the fp32 sum order of their outputs, and the sort is a kernel of its own).
* `FastMLP`: the SwiGLU output stored once when compiled (`compiled.materialize`), not recomputed per weight row; in
  prefill calls with `prefill_fusion`, one compiled kernel (`fast.prefill`); with `gemv="mma"` copies, gate_proj and
  up_proj as one product in decode-sized calls (`fast.joint`).
* `FastMoE`: in prefill calls with `prefill_fusion` on one rank, the routed experts' combine, the scaling, the shared
  expert's output and the rounding to the compute dtype as one compiled kernel (`fast.prefill.moe_output`).
"""

from __future__ import annotations

import math

import torch

from ..model.mlp import MLP, swiglu_oai
from ..model.moe import Experts, MoE, Router, Routing, router_scores, routing_of, scores_of
from ..weights.packed import PackedWeight
from . import grouped, mma_gemv, prefill_experts
from .attention import contract
from .compiled import materialize, top_k
from .joint import JointProduct, JointStack
from .packed import FastPackedWeight
from .prefill import fused_combine_sorted, fused_moe_output, fused_swiglu


class FastRouter(Router):
    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> Routing:
        compiling = torch.compiler.is_compiling()
        bias, mask = self.e_score_correction_bias, self.mask_with(mask)
        if compiling and x.numel() > x.shape[-1]:  # one row: inductor makes F.linear a reduction itself, a faster one
            logits, scores, choice = scores_of(contract("th,eh->te", x.float(), self.weight.float(), broadcast=True),
                                               bias, self.top_k, mask)
        else:
            logits, scores, choice = router_scores(x, self.weight, bias, self.top_k, mask)
        return routing_of(logits, scores, top_k(choice, self.top_k, self.paths.sort_topk)[1])


class FastMLP(MLP):
    def join_projections(self) -> None:
        """Hold gate_proj and up_proj as one product where they can be (`fast.joint.JointProduct`, the child
        `joint`): what `forward` then runs for decode-sized inputs."""
        joint = JointProduct.of([self.gate_proj, self.up_proj])
        if joint is not None:
            self.joint = joint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "joint" in self._modules and self.joint.takes(x):
            return self.down_proj(self.act(*self.joint(x)))
        return super().forward(x)

    def act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.paths.prefill_fusion and gate.numel() // gate.shape[-1] > self.paths.sync_free_tokens:
            return fused_swiglu(gate, up, self.alpha, self.limit)
        return materialize(super().act(gate, up))


def inverse_order(order: torch.Tensor) -> torch.Tensor:
    """The inverse of the permutation `order` [n]: each pair's row in the sorted order."""
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    return inv


def expert_ends(key: torch.Tensor, experts: int) -> torch.Tensor:
    """Where each of experts 0 .. `experts` - 1 ends among the pairs `key` [P] (their expert ids, each < `experts`)
    sorted by expert: int32 `[experts]`, cumulative, on the device. Counted by a scatter-add, since CUDA's bincount
    reads the ids' max on the host."""
    ones = torch.ones_like(key, dtype=torch.int32)
    return torch.zeros(experts, dtype=torch.int32, device=key.device).scatter_add_(0, key, ones).cumsum(
        0, dtype=torch.int32)


# Decoded expert weights one grouped product of `FastExperts.forward_sorted` may hold at once (the three stacks of a
# group of experts): all 16 experts of a release-width layer in one group, 128 in a few.
SORTED_DECODED_BYTES = 2 << 30


def grouped_mm_runs(x: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` multiplies x's dtype on x's device: any dtype on a CPU; bf16 on a CUDA device of
    compute capability 9.0 or later (its grouped kernel's requirement)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cpu":
        return True
    return (x.device.type == "cuda" and x.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device) >= (9, 0))


class FastExperts(Experts):
    """`Experts` with the fast paths `paths` (a `FastPaths`, set by `fast.apply`). Same parameters. Where the gate and
    up stacks are one allocation read in place by `fast.mma_gemv` (`fast.joint.JointStack`, the child `joint`), a
    decode step's gate and up products are one launch."""

    def join_projections(self) -> None:
        """Hold the gate and up stacks as one where their bytes allow (`fast.joint.JointStack.of`)."""
        joint = JointStack.of(self.w1, self.w3)
        if joint is not None:
            self.joint = joint

    def joins(self, x: torch.Tensor, rows: int | None = None) -> bool:
        """Whether x's gate and up products go through the joint stack: one of `rows` rows each (None: rows sorted
        by expert, `forward_ranges`), no hook on the experts (offload's staging)."""
        if "joint" not in self._modules or hasattr(self, "_hf_hook"):
            return False
        return self.joint.takes_ranged(x) if rows is None else self.joint.takes(x, rows)

    def gate_up(self, x: torch.Tensor, ids: torch.Tensor | None = None, active: torch.Tensor | None = None,
                busy: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The gate and up products of x: each token's row `[T, H]` times its chosen experts `ids` (`[T, k]`: each
        `[T, k, 1, I]`), or x `[T, H]` times every expert (flagged in `active`: each `[E, T, I]`); through the joint
        stack where it takes them (`joins`), else a product a stack."""
        if ids is not None:
            if self.joins(x, 1):
                return self.joint.by_ids(x, ids)
            xt = x[:, None, None]  # [T, 1, 1, H]: each token's row broadcast against its k experts, not repeated
            return self.matmul("w1", xt, ids), self.matmul("w3", xt, ids)
        if self.joins(x, x.shape[0]):
            return self.joint.by_flags(x, active, busy)
        return (self.matmul("w1", x, active=active, busy=busy), self.matmul("w3", x, active=active, busy=busy))

    def forward(self, x: torch.Tensor, routing: Routing, sorted_rows: bool = False):
        """`Experts.forward`; with `sorted_rows` (where `sorts(x)`), `sorted_products` instead: the expert outputs
        before their weighting (`FastMoE` finishes them with the shared expert's). Called through the module, so
        that hooks on it (offload's staging of the chosen experts) run either way."""
        if sorted_rows:
            return self.sorted_products(x, routing)
        if self.paths.moe and not self.emulate_act_quant and x.shape[0] <= self.paths.sync_free_tokens:
            return self.forward_sync_free(x, routing)
        if self.sorts(x):
            return self.forward_sorted(x, routing)
        return super().forward(x, routing)

    def sorts(self, x: torch.Tensor) -> bool:
        """Whether `forward` takes the tokens x [T, H] through `forward_sorted` (many tokens, `torch._grouped_mm`)."""
        return (self.paths.moe and not self.emulate_act_quant and x.shape[0] > self.paths.sync_free_tokens
                and grouped_mm_runs(x))

    def forward_sorted(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """`forward` for many tokens (prefill) in a few kernels a layer instead of a dozen per expert: the (token,
        slot) pairs sorted by expert, the tokens gathered once in that order, each projection one grouped matmul over
        the chosen experts (`torch._grouped_mm`: expert e multiplies its contiguous rows, bf16 products summed in
        fp32 as `F.linear`), the activation once, then each pair's row weighted in fp32 and each token's k rows
        summed in slot order. Equal to `forward` up to fp32 rounding (the reference adds a token's experts in expert
        order). Where every pair is this rank's and the whole stacks are plain, multiply from their packed bytes
        (`multiplies_sorted_packed`: `fast.prefill_experts`) or decode within `SORTED_DECODED_BYTES`, one call over
        every local expert with the offsets on the device (no host read); otherwise, like `forward`, it reads the
        per-expert counts on the host and decodes the chosen experts' weights (packed stacks) in groups of at most
        `SORTED_DECODED_BYTES`. Pairs routed to another rank's experts (expert parallel) contribute nothing. With
        `prefill_fusion` the weighting and the sum are one kernel (`fast.prefill.combine_sorted`).

        x: `[T, H]`; returns fp32 `[T, H]` (this rank's partial sum under tensor parallelism)."""
        T, k = routing.expert_ids.shape
        y, everything, mine = self.sorted_products(x, routing)
        if self.paths.prefill_fusion:  # each pair's row in y, then one kernel reads each row once
            return fused_combine_sorted(y, inverse_order(everything).view(T, k), routing.weights, mine)
        order = everything[:mine]
        pairs = torch.zeros(T * k, x.shape[1], dtype=torch.float32, device=x.device)
        pairs.index_copy_(0, order, y.float() * routing.weights.flatten()[order, None])
        return pairs.view(T, k, -1).sum(1)

    def sorted_products(self, x: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The chosen experts of this rank on the (token, slot) pairs of x [T, H], sorted by expert: (y [mine, H] in
        x's dtype, the expert outputs in sorted order; `everything` [T*k], the pairs (token * k + slot) in that order
        followed by the pairs of other ranks' experts; mine, the rows of y)."""
        T, k = routing.expert_ids.shape
        E = len(self.local_experts)
        local = (routing.expert_ids - self.local_experts.start).flatten()
        key = torch.where((local >= 0) & (local < E), local, E)  # another rank's pairs sort last
        everything = torch.argsort(key, stable=True)
        per_expert = sum(math.prod(getattr(self, leaf).shape[1:]) for leaf in ("w1", "w2", "w3")) * x.element_size()
        packed = isinstance(self.w1, PackedWeight)
        at_once = not packed or self.multiplies_sorted_packed(x, T * k, E) or E * per_expert <= SORTED_DECODED_BYTES
        if not self.expert_parallel and at_once:
            # every pair is this rank's and the whole stacks are at hand (or decode at once): the groups' offsets
            # stay on the device, so the host does not wait for the GPU here (an expert no pair chose is an empty
            # group)
            return self.grouped(x[everything // k], None, expert_ends(key, E)), everything, T * k
        counts = torch.bincount(key, minlength=E + 1)[:E].tolist()
        mine = sum(counts)
        xs = x[everything[:mine] // k]
        group: list[int] = []
        start = 0
        outs = []  # each group's rows; one group (all the chosen experts' weights fit) is y itself, no copy
        chosen = [e for e in range(E) if counts[e]]
        for j, e in enumerate(chosen):
            group.append(e)
            last = j + 1 == len(chosen)
            if last or (len(group) + 1) * per_expert > SORTED_DECODED_BYTES:
                n = sum(counts[g] for g in group)
                offs = torch.tensor([counts[g] for g in group], device=x.device).cumsum(0).to(torch.int32)
                outs.append(self.grouped(xs[start:start + n], torch.tensor(group, device=x.device), offs))
                start += n
                group = []
        if len(outs) == 1:
            y = outs[0]
        else:  # several groups, or none of this rank's pairs
            y = torch.cat(outs) if outs else x.new_empty(0, x.shape[1])
        return y, everything, mine

    def multiplies_sorted_packed(self, x: torch.Tensor, rows: int, experts: int) -> bool:
        """Whether the three stacks multiply `rows` sorted rows of x's dtype and device over `experts` of their
        entries from their packed bytes (`FastPackedWeight.sorted_matmul`) rather than decoded first: where they
        can, as `FastPaths.prefill_experts` says for that many rows an expert (`prefill_experts.
        multiplies_in_registers`)."""
        return (prefill_experts.multiplies_in_registers(self.paths.prefill_experts, rows, experts)
                and all(isinstance(w, FastPackedWeight) and w.takes_sorted(x) for w in (self.w1, self.w3, self.w2)))

    def grouped(self, xs: torch.Tensor, index: torch.Tensor | None, offs: torch.Tensor) -> torch.Tensor:
        """The local experts `index` (a LongTensor; None: every local expert) on their rows of `xs`: expert i's rows
        end at offs[i] (int32, cumulative, on the device; equal ends: no rows), each projection one
        `torch._grouped_mm` on the decoded weights, or one `fast.prefill_experts` kernel on the packed ones
        (`multiplies_sorted_packed`); [rows, H] in x's dtype."""
        act = fused_swiglu if self.paths.prefill_fusion else swiglu_oai
        if self.multiplies_sorted_packed(xs, xs.shape[0], len(self.local_experts) if index is None else len(index)):
            gate = self.w1.sorted_matmul(xs, offs, index)
            up = self.w3.sorted_matmul(xs, offs, index)
            return self.w2.sorted_matmul(act(gate, up, self.alpha, self.limit), offs, index)
        w1, w3, w2 = (self.weight(leaf, index) for leaf in ("w1", "w3", "w2"))  # decoded [n, out, in]
        gate = torch._grouped_mm(xs, w1.transpose(-2, -1), offs=offs)
        up = torch._grouped_mm(xs, w3.transpose(-2, -1), offs=offs)
        h = act(gate, up, self.alpha, self.limit)
        return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)

    def forward_sync_free(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """`forward` for a few tokens without host synchronisation and with static shapes (equal to `forward` up to
        fp32 rounding: the sum over a token's experts is taken in slot order instead of expert order).

        With P = T * k (token, slot) pairs and E local experts: when P < E, each pair's expert weights are gathered
        (decoding P experts, the chosen ones) and applied with batched matmuls; otherwise every local expert runs on
        every token (decoding each local expert once) and the outputs are combined with a dense [T, E] weight
        matrix whose unchosen entries are 0. Under expert parallelism, pairs routed to another rank's experts get
        weight 0. With `FastPaths.expert_ranges` and more tokens than a row group, `forward_ranges` instead (each
        chosen expert times its own tokens). With `FastPaths.grouped` and more tokens than the fused matmul takes,
        `forward_grouped` instead,
        except that with P < E, where the stacks multiply one row by `fast.gemv` / `fast.mma_gemv`
        (`gathers_through_kernel`), each pair's expert is read through the kernel's entry ids: a launch over the P
        pairs, not over the E experts' flags (whose unchosen entries still take programs that write zeros).
        """
        T, k = routing.expert_ids.shape
        E = len(self.local_experts)
        local = routing.expert_ids - self.local_experts.start
        mine = (local >= 0) & (local < E)
        weights = torch.where(mine, routing.weights, torch.zeros_like(routing.weights))  # fp32 [T, k]
        local = local.clamp(0, E - 1)
        if self.takes_ranges(x):
            return self.forward_ranges(x, local, weights)
        if self.takes_grouped(x) and not (T * k < E and self.gathers_through_kernel(x)):
            return self.forward_grouped(x, local, mine, weights)
        if T * k < E:
            gate, up = self.gate_up(x, local)  # [T, k, 1, I]
            h = materialize(swiglu_oai(gate, up, self.alpha, self.limit))  # not recomputed per row of w2
            y = self.matmul("w2", h, local).view(T, k, -1)  # [T, k, H]
            return (y.float() * weights[..., None]).sum(1)
        dense = torch.zeros(T, E, dtype=torch.float32, device=x.device).scatter_add_(1, local, weights)
        gate, up = self.gate_up(x)  # [E, T, I]
        h = materialize(swiglu_oai(gate, up, self.alpha, self.limit))
        y = self.matmul("w2", h)  # [E, T, H]
        return torch.einsum("te,eth->th", dense, y.float())

    def takes_ranges(self, x: torch.Tensor) -> bool:
        """Whether `forward_sync_free` takes x's `[T, H]` tokens through `forward_ranges`: `FastPaths.expert_ranges`
        on, more tokens than one row group of the MMA kernel (up to 8 tokens every chosen expert multiplies all of
        them at the same cost), and all three stacks multiplied by `fast.mma_gemv`'s ranges
        (`FastPackedWeight.takes_ranged`)."""
        return (self.paths.expert_ranges and x.dim() == 2 and x.shape[0] > mma_gemv.X_GROUP
                and all(isinstance(w, FastPackedWeight) and w.takes_ranged(x) for w in (self.w1, self.w3, self.w2)))

    def forward_ranges(self, x: torch.Tensor, local: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """`forward_sync_free` with each chosen expert multiplying its own tokens only: the T * k (token, choice)
        pairs sorted by expert (a stable sort of the local ids), the tokens gathered in that order, each projection
        one launch of `fast.mma_gemv` over the experts' ranges of rows (`FastPackedWeight.ranged_product`: an expert
        no pair chose reads nothing, the others their own rows' MMAs), the SwiGLU once, then each pair's row back in
        token order, weighted, and a token's k rows added in slot order.

        x: `[T, H]` bf16; local: `[T, k]` local expert ids (clamped: another rank's pairs read a local expert and
        have weight 0); weights: fp32 `[T, k]`. Returns fp32 `[T, H]`, equal to `forward` to fp32 rounding (bf16
        products exact, fp32 sums in another order). Static shapes, no host synchronisation."""
        T, k = local.shape
        E = len(self.local_experts)
        key = local.flatten()
        order = torch.argsort(key, stable=True)
        ends = expert_ends(key, E)
        xs = x[order // k]
        if self.joins(xs):
            gate, up = self.joint.by_ranges(xs, ends)
        else:
            gate, up = self.w1.ranged_product(xs, ends), self.w3.ranged_product(xs, ends)
        h = materialize(swiglu_oai(gate, up, self.alpha, self.limit))  # not recomputed per row of w2
        y = self.w2.ranged_product(h, ends)  # [T * k, H], sorted
        picked = y[inverse_order(order)].view(T, k, -1)
        return (picked.float() * weights[..., None]).sum(1)

    def gathers_through_kernel(self, x: torch.Tensor) -> bool:
        """Whether the three stacks multiply a pair's one row of x by `fast.gemv` or `fast.mma_gemv`
        (`FastPackedWeight.takes_gemv`), which read the chosen entries by id."""
        return all(isinstance(w, FastPackedWeight) and w.takes_gemv(x, 1) for w in (self.w1, self.w3, self.w2))

    def takes_grouped(self, x: torch.Tensor) -> bool:
        """Whether the three stacks are packed and multiply x's rows through the grouped kernel
        (`FastPackedWeight.takes_grouped`) or `fast.gemv` (`takes_gemv`: from one token on, each chosen expert read
        once for all tokens)."""
        stacks = [getattr(self, leaf) for leaf in ("w1", "w3", "w2")]
        return all(isinstance(w, FastPackedWeight) and (w.takes_gemv(x, x.shape[0]) or w.takes_grouped(x, x.shape[0]))
                   for w in stacks)

    def forward_grouped(self, x: torch.Tensor, local: torch.Tensor, mine: torch.Tensor,
                        weights: torch.Tensor) -> torch.Tensor:
        """`forward_sync_free` through the grouped kernel (`fast.grouped`) or `fast.gemv`: each local expert
        that a token of this call chose multiplies all T tokens (its weight tiles decoded once), the others are not
        read and give zero rows; each token then adds its k experts' rows, weighted, in slot order.

        x: `[T, H]` bf16; local: `[T, k]` local expert ids (clamped); mine: `[T, k]` whether the pair is this rank's;
        weights: fp32 `[T, k]`, 0 where not mine. Returns fp32 `[T, H]`, equal to `forward` to fp32 rounding (bf16
        products exact, fp32 sums in another order). Static shapes, no host synchronisation."""
        T, E = x.shape[0], len(self.local_experts)
        experts = torch.arange(E, device=x.device)
        active = ((local[..., None] == experts) & mine[..., None]).flatten(0, 1).any(0).to(torch.int32)  # [E]
        busy = min(E, local.numel())  # at most one expert a (token, slot) pair
        h = self.swiglu_pair(x, active)  # [E, T, I]
        if h is None:
            gate, up = self.gate_up(x, active=active, busy=busy)  # [E, T, I]
            h = materialize(swiglu_oai(gate, up, self.alpha, self.limit))  # not recomputed per row of w2
        y = self.matmul("w2", h, active=active, busy=busy)  # [E, T, H]
        # each pair's row; a pair that is not mine has weight 0 and reads a computed (or zero) row
        picked = y[local, torch.arange(T, device=x.device)[:, None]]  # [T, k, H]
        return (picked.float() * weights[..., None]).sum(1)

    def swiglu_pair(self, x: torch.Tensor, active: torch.Tensor) -> torch.Tensor | None:
        """The SwiGLU of x's `[T, H]` gate and up products with every flagged expert (`active`), both products in one
        grouped launch (`fast.grouped.swiglu_pair_grouped`): bf16 `[E, T, I]`, where `FastPaths.grouped_swiglu` is on
        and both stacks multiply x through the grouped kernel with one launch configuration at one K split; None
        elsewhere (then two products and the activation)."""
        w1, w3, rows = self.w1, self.w3, x.shape[0]
        if not (self.paths.grouped_swiglu and x.dim() == 2 and isinstance(w1, FastPackedWeight)
                and isinstance(w3, FastPackedWeight)):
            return None
        if any(w.takes_gemv(x, rows) or not w.takes_grouped(x, rows) for w in (w1, w3)):
            return None
        tiles, split = w1.grouped_launch
        if ((w1.fmt, w1.shape, w1.table, w1.grouped_launch) != (w3.fmt, w3.shape, w3.table, w3.grouped_launch)
                or split != 1 or tiles.x_major or tiles.planes):
            return None
        return grouped.swiglu_pair_grouped(x, w1.fmt, w1.parts(), w3.parts(), self.alpha, self.limit, active=active,
                                           tiles=tiles, table=w1.table)

    def matmul(self, leaf: str, x: torch.Tensor, index: torch.Tensor | None = None,
               active: torch.Tensor | None = None, busy: int | None = None) -> torch.Tensor:
        """`x @ W^T` for the stack `leaf` ("w1", "w2", "w3"): x `[*B, M, K]` against every local expert (index
        None; `*B` broadcasts against `[E_local]`) or against the experts `index` (a LongTensor of any shape `I`;
        `*B` broadcasts against `I`). A packed stack multiplies through `PackedWeight.matmul` (fused, reading the
        gathered experts' bytes in place, when its twin's fused matmul is on). `active` (int32 `[E_local]`, index
        None): the experts whose rows are needed, which a grouped product reads alone (`FastPackedWeight.matmul`);
        `busy`: at most this many are flagged."""
        w = getattr(self, leaf)
        if isinstance(w, FastPackedWeight):
            return w.matmul(x, index, active, busy)
        if isinstance(w, PackedWeight):
            return w.matmul(x, index)
        return torch.matmul(x, (w if index is None else w[index]).transpose(-1, -2))


class FastMoE(MoE):
    """`MoE` whose prefill calls on one rank (no all-reduce between the sum and the rounding) finish in one kernel:
    the routed experts' sorted rows weighted and summed, scaled, the shared expert's output added and the result
    rounded to the compute dtype (`fast.prefill.moe_output`), where the experts take the sorted path with
    `prefill_fusion`. Other calls (decode steps, compiled regions, tensor parallelism) are `MoE.forward`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts = self.experts
        flat = x.reshape(-1, x.shape[-1])
        if not (self.paths.prefill_fusion and self.world.size == 1 and isinstance(experts, FastExperts)
                and experts.sorts(flat) and not torch.compiler.is_compiling()):
            return super().forward(x)
        routing = self.gate(flat)
        y, everything, mine = experts(flat, routing, sorted_rows=True)
        shared = self.shared_experts(flat) if self.shared_experts is not None else None
        inv = inverse_order(everything).view(routing.expert_ids.shape)
        return fused_moe_output(y, inv, routing.weights, mine, self.scaling, shared).reshape(x.shape)
