"""What a forward records and how it is edited, attached from outside the model by forward hooks.

`model(ids, trace=Trace(...))` (and `interventions=`) attaches the hooks below for the length of that forward
(`Trace.attached`); the model's modules compute the math and nothing else. The hook points, per decoder layer L
(`model.decoder.DecoderLayer`):

    a = self_attn(input_layernorm(x))               attention_output[L]; inside it, on MSA layers:
        blocks = self_attn.selection(iq, ik, ...)   blocks[L]; msa_blocks[L] replaces them
        o = self_attn.core(q, k, v, ...)            attention[L] (the core's operands, `attention_layers`)
    h = attention_residual(x + a)                   attention_residual[L] replaces h
    routing = gate(norm(h), mask)                   expert_mask[L] is the mask; routing[L] recorded, then
                                                    expert_scale[L] scales the chosen experts' weights
    f = ffn(norm(h))                                ffn_output[L]
    out = h + f                                     residual[L] replaces out; hidden_states[L] records it

Records are taken after the edits at the same point (the blocks and the stream attended to), except routing, which
is recorded as the router chose it, before `expert_scale`, and without the rows of padding (`Trace.mask`). The fast
paths keep the same hook points (their twins call the same submodules); a forward with a trace never runs compiled or
captured. Generation under interventions (every prefill chunk and decode step edited) is `research.intervened`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from numbers import Real
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..errors import InputError
from ..model.config import check_layer_ids
from ..model.moe import Routing

if TYPE_CHECKING:
    from ..model.decoder import MiniMaxM3

# chunk_elements large enough that attention runs in one query chunk: what a captured core runs with
ONE_CHUNK = 1 << 62

Edit = torch.Tensor | Callable[[torch.Tensor], torch.Tensor]


def _finite_number(x: object) -> bool:
    """A real number (not a bool), or a one-element tensor, that is finite."""
    if isinstance(x, torch.Tensor):
        return x.numel() == 1 and not x.dtype.is_complex and bool(torch.isfinite(x).all())
    return isinstance(x, Real) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class Interventions:
    """Edits a forward applies at its hook points (`model(ids, interventions=...)`, or `Trace(interventions=...)`).

    Hook points, per decoder layer L (`DecoderLayer.forward`; the module docstring lists where each attaches):
      h = x + attn(norm(x))            msa_blocks[L] replaces the MSA block selection inside attn;
                                       attention_residual[L] replaces h ("the residual after attention")
      routing = router(norm(h))        expert_mask[L] removes experts from the choice
      y = moe(norm(h), routing)        expert_scale[L] multiplies chosen experts' outputs
      out = h + y                      residual[L] replaces out ("the residual after the FFN", the layer's output)

    expert_mask[L]: bool [E], False = never routed (the router picks the top k among the kept experts and
        normalises their weights among themselves: what a checkpoint pruned of those experts computes).
    expert_scale[L]: {expert id: factor}; the factor multiplies that expert's fp32 routing weight where it is
        chosen, so its contribution to the sum (0 zeroes it; the other experts' weights are unchanged, unlike
        a mask).
    residual[L], attention_residual[L]: a tensor [B, T, H] used in place of the stream, or a function of the
        stream returning its replacement (same shape).
    msa_blocks[L]: on an MSA layer, the key blocks each query attends to, int [B, kv_heads, T, kb] (-1 = empty
        slot, any kb), in place of the indexer's top-k (`Trace.blocks` has the indexer's, in this form). Each
        query still sees only keys at or before its position; every row needs a block holding one of those.
        Under tensor parallelism, this rank's kv heads (as `Trace.blocks`).
    Nothing else in the forward's arithmetic changes. With none given, the forward runs unchanged.
    In generation (`mr.generate(..., interventions=)`, `research.intervened`) every forward is edited: a residual edit
    must then be a function (it sees each prefill chunk's and decode step's stream), and `msa_blocks` is refused.
    """

    expert_mask: dict[int, torch.Tensor] = field(default_factory=dict)
    expert_scale: dict[int, dict[int, float]] = field(default_factory=dict)
    residual: dict[int, Edit] = field(default_factory=dict)
    attention_residual: dict[int, Edit] = field(default_factory=dict)
    msa_blocks: dict[int, torch.Tensor] = field(default_factory=dict)

    def check(self, model: MiniMaxM3) -> None:
        """Refuse edits naming layers or experts the model does not have, or of the wrong kind (InputError)."""
        n, E = model.text.num_hidden_layers, model.text.num_local_experts
        moe = {i for i in range(n) if model.text.moe_layers[i]}
        for name in ("expert_mask", "expert_scale", "residual", "attention_residual", "msa_blocks"):
            edits = getattr(self, name)
            if not isinstance(edits, Mapping):
                raise InputError(f"interventions.{name}: expected a dict {{layer index: edit}}, got "
                                 f"{type(edits).__name__}")
            for L in edits:
                if isinstance(L, bool) or not isinstance(L, int) or not 0 <= L < n:
                    raise InputError(f"interventions.{name}: layer {L!r} is not a layer index in [0, {n})")
                if name.startswith("expert") and L not in moe:
                    raise InputError(f"interventions.{name}: layer {L} has a dense MLP, not experts "
                                     f"(MoE layers: {sorted(moe)[:8]}{'...' if len(moe) > 8 else ''})")
                if name == "msa_blocks" and not model.text.sparse_layers[L]:
                    raise InputError(f"interventions.msa_blocks: layer {L} has dense attention, no block selection")
        for L, mask in self.expert_mask.items():
            if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != (E,):
                got = (mask.dtype, tuple(mask.shape)) if isinstance(mask, torch.Tensor) else type(mask).__name__
                raise InputError(f"interventions.expert_mask[{L}] must be a bool tensor [{E}], got {got}")
            if int(mask.sum()) < model.text.num_experts_per_tok:
                raise InputError(f"interventions.expert_mask[{L}] keeps {int(mask.sum())} experts; routing "
                                 f"chooses {model.text.num_experts_per_tok} per token")
        for L, scales in self.expert_scale.items():
            if not isinstance(scales, Mapping):
                raise InputError(f"interventions.expert_scale[{L}] must be a dict {{expert id: factor}}, got "
                                 f"{type(scales).__name__}")
            bad = [e for e in scales if isinstance(e, bool) or not isinstance(e, int) or not 0 <= e < E]
            if bad:
                raise InputError(f"interventions.expert_scale[{L}]: expert ids {bad[:5]} are not in [0, {E})")
            for e, factor in scales.items():
                if not _finite_number(factor):
                    raise InputError(f"interventions.expert_scale[{L}][{e}] = {factor!r}: a factor must be a finite "
                                     "number")
        for name in ("residual", "attention_residual"):
            for L, edit in getattr(self, name).items():
                if not (isinstance(edit, torch.Tensor) or callable(edit)):
                    raise InputError(f"interventions.{name}[{L}] must be a tensor [B, T, H] or a function of the "
                                     f"stream, got {type(edit).__name__}")

    def blocks_for(self, layer: int, pos: torch.Tensor, kv_heads: int, block_size: int) -> torch.Tensor:
        """`msa_blocks[layer]` checked against the call (queries at `pos` [B, T], `kv_heads` heads) -> long, on
        pos's device."""
        blocks = self.msa_blocks[layer]
        where = f"interventions.msa_blocks[{layer}]"
        B, T = pos.shape
        if not isinstance(blocks, torch.Tensor) or blocks.dtype.is_floating_point or blocks.dtype == torch.bool \
                or blocks.dim() != 4 or tuple(blocks.shape[:3]) != (B, kv_heads, T):
            got = (blocks.dtype, tuple(blocks.shape)) if isinstance(blocks, torch.Tensor) else type(blocks).__name__
            raise InputError(f"{where} must be an integer tensor [{B}, {kv_heads}, {T}, kb], got {got}")
        blocks = blocks.to(pos.device, torch.long)
        last = (pos // block_size)[:, None, :, None]  # the query's own block: later ones hold only future keys
        if bool(((blocks < -1) | (blocks > last)).any()):
            raise InputError(f"{where}: block ids must be -1 (empty) or a block at or before the query's own "
                             f"(block = position // {block_size})")
        if not bool((blocks >= 0).any(-1).all()):
            raise InputError(f"{where}: every query needs at least one block (its own, position // {block_size}, "
                             "always has a key it may see)")
        return blocks

    @staticmethod
    def apply(edit: Edit, stream: torch.Tensor, where: str) -> torch.Tensor:
        """The stream replaced by `edit` (a tensor of the stream's shape, or a function of the stream)."""
        new = edit(stream) if callable(edit) else edit
        if not isinstance(new, torch.Tensor) or new.shape != stream.shape:
            got = tuple(new.shape) if isinstance(new, torch.Tensor) else type(new).__name__
            raise InputError(f"interventions.{where}: the replacement is {got}, the stream is {tuple(stream.shape)}")
        return new.to(stream.dtype)


@dataclass
class Trace:
    """What a forward pass records, per layer index, for research and kernel tests.

    hidden_states[L]: the residual stream after layer L, [B, T, H] (only layers in `layers`, all when
        `layers` is None; `hidden_states[-1]`-style access is by layer index, not position).
    attention_output[L], ffn_output[L]: with `components`, what layer L's attention and FFN (MLP or MoE)
        add to the stream, [B, T, H] each (same layers as `hidden_states`).
    routing[L]: MoE decision of layer L (`moe.Routing`: expert_ids long [N, k], weights fp32 [N, k] as the router
        chose them, before `expert_scale`, router logits fp32 [N, E]) for the N real tokens, row-major over [B, T]:
        rows of padding (`mask` False) are dropped as they are recorded. `routed(L)` shapes it [B, T, k] (a batch
        without padding) or gives sequence b's rows (`routed(L, b)`); `expert_counts(L)` / `routed_mass(L)` count
        tokens / sum routing weight per expert.
    blocks[L]: MSA block ids of layer L, long [B, kv_heads, T, kb] (-1 = empty slot); under tensor
        parallelism, this rank's kv heads only.
    attention[L]: for the layers in `attention_layers`, the attention core's operands and result as it was called
        (`ATTENTION_FIELDS` lists each field: shape, dtype, before or after RoPE); with `attention_probs` also
        `probs`, fp32 [B, Hq, T, L], the softmax weights of every query over every key (`attention_probabilities`).
        What golden bundles are made of. A captured core runs in one query chunk, or with
        `attention_chunk_elements` in the engine's query chunks of that size (long prompts: linear memory).
    shape: (B, T) of the last forward. mask: [B, T] bool, True at real tokens (None: all real); set by the
        caller before the forward, or by `capture` (and `minimax_ref.research.score`) for its right-padded batches.
    interventions: edits applied during the forward (`Interventions`).

    Each forward records into the trace the layers it runs, replacing what an earlier forward recorded for
    those layers; `reset()` clears every record (the settings stay). `capture(model, sequences, batch_size=)`
    records many sequences a batch at a time and merges the records (padding zeroed, or -1 in block ids).
    """

    layers: set[int] | None = None
    hidden_states: dict[int, torch.Tensor] = field(default_factory=dict)
    routing: dict[int, Routing] = field(default_factory=dict)
    blocks: dict[int, torch.Tensor] = field(default_factory=dict)
    attention_layers: set[int] = field(default_factory=set)
    attention: dict[int, dict] = field(default_factory=dict)
    attention_chunk_elements: int | None = None  # captured cores run in chunks of this size (None: one chunk)
    components: bool = False
    attention_probs: bool = False
    attention_output: dict[int, torch.Tensor] = field(default_factory=dict)
    ffn_output: dict[int, torch.Tensor] = field(default_factory=dict)
    shape: tuple[int, int] | None = None
    mask: torch.Tensor | None = None
    interventions: Interventions | None = None

    def wants(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers

    def reset(self) -> None:
        """Clear every record (hidden states, routing, blocks, attention, components, shape, mask)."""
        for d in (self.hidden_states, self.routing, self.blocks, self.attention, self.attention_output,
                  self.ffn_output):
            d.clear()
        self.shape = self.mask = None

    def begin(self, model: MiniMaxM3, x: torch.Tensor) -> None:
        """Called by the model before its layers run on x [B, T, H]: refuses layer indices the model does not
        have (InputError) and notes the shape."""
        for name in ("layers", "attention_layers"):
            ids = getattr(self, name)
            if ids is not None and not isinstance(ids, (set, frozenset, list, tuple, range)):
                raise InputError(f"Trace({name}={ids!r}): give a set of layer indices, e.g. {{{ids!r}}}"
                                 + (" (None: every layer)" if name == "layers" else ""))
            check_layer_ids(ids or (), model.text.num_hidden_layers, f"Trace({name}=...)")
        if self.interventions is not None and not isinstance(self.interventions, Interventions):
            raise InputError(f"Trace(interventions=...): expected a minimax_ref.Interventions, got "
                             f"{type(self.interventions).__name__}")
        if self.interventions is not None:
            self.interventions.check(model)
        if self.mask is not None and tuple(self.mask.shape) != tuple(x.shape[:2]):
            raise InputError(f"Trace.mask is {tuple(self.mask.shape)}, the batch is {tuple(x.shape[:2])}")
        self.shape = (int(x.shape[0]), int(x.shape[1]))

    def settings(self) -> Trace:
        """A new trace with this one's settings (layers, attention layers and probabilities, chunk size, components,
        interventions) and no records."""
        return Trace(layers=None if self.layers is None else set(self.layers),
                     attention_layers=set(self.attention_layers),
                     attention_chunk_elements=self.attention_chunk_elements, components=self.components,
                     attention_probs=self.attention_probs, interventions=self.interventions)

    def _routing(self, layer: int) -> Routing:
        if layer not in self.routing:
            raise InputError(f"the trace holds no routing for layer {layer} (it has {sorted(self.routing)}; "
                             "dense-MLP layers route nothing)")
        return self.routing[layer]

    def routed(self, layer: int, b: int | None = None) -> Routing:
        """Layer `layer`'s routing of real tokens only: sequence b's [n_b, k] / [n_b, E] (its n_b real tokens in
        order), or without b the whole batch shaped [B, T, k] / [B, T, E], which only a batch without padding has
        (InputError otherwise: ask per sequence, or read the flat `routing[layer]`)."""
        r = self._routing(layer)
        B, T = self.shape
        if b is None:
            if self.mask is not None and not bool(self.mask.all()):
                raise InputError(f"routed({layer}): the batch holds padding ({int((~self.mask).sum())} of {B * T} "
                                 f"positions), which has no routing; take one sequence, routed({layer}, b), or the "
                                 f"real tokens' rows, trace.routing[{layer}]")
            return Routing(r.expert_ids.view(B, T, -1), r.weights.view(B, T, -1), r.logits.view(B, T, -1))
        if not isinstance(b, int) or not 0 <= b < B:
            raise InputError(f"routed({layer}, b={b!r}): b must be a sequence index in [0, {B})")
        lengths = [T] * B if self.mask is None else self.mask.sum(1).tolist()
        start = sum(lengths[:b])
        rows = slice(start, start + lengths[b])
        return Routing(r.expert_ids[rows], r.weights[rows], r.logits[rows])

    def expert_counts(self, layer: int) -> torch.Tensor:
        """long [E]: how many real tokens (padding excluded) chose each expert in `layer`."""
        r = self._routing(layer)
        return torch.bincount(r.expert_ids.reshape(-1), minlength=r.logits.shape[-1])

    def routed_mass(self, layer: int) -> torch.Tensor:
        """float64 [E]: each expert's routing weight in `layer` summed over the real tokens (`routed_mass`)."""
        r = self._routing(layer)
        return routed_mass(r, r.logits.shape[-1])

    @torch.no_grad()
    def capture(self, model: MiniMaxM3, sequences: Sequence[Sequence[int]], *, batch_size: int = 8,
                on_batch: Callable[[range, torch.Tensor], None] | None = None) -> None:
        """Record the plain forward of every token-id sequence into this trace (reset first), `batch_size`
        sequences at a time, each batch right-padded to its longest (exact: MSA blocks are anchored to absolute
        positions). The records are merged over the batches as one batch [N, T] in the given order (T the longest
        sequence; `mask` marks the real tokens): streams and attention records zero at padding, block ids -1 there,
        routing rows of real tokens only. `on_batch(rows, logits)` receives each batch's fp32 logits [b, t, V] and
        the indices of its sequences (the logits are not kept)."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise InputError(f"batch_size={batch_size!r}: must be an integer >= 1")
        if not sequences:
            raise InputError("capture: no sequences")
        lengths = [len(s) for s in sequences]
        if min(lengths) < 1:
            raise InputError(f"capture: sequence {lengths.index(0)} is empty")
        iv = self.interventions
        fixed = [] if iv is None else [f"{name}[{L}]" for name in ("residual", "attention_residual", "msa_blocks")
                                        for L, edit in getattr(iv, name).items() if not callable(edit)]
        if fixed and len(sequences) > batch_size:
            raise InputError(f"interventions.{fixed[0]} is a tensor of one forward's shape, and {len(sequences)} "
                             f"sequences run in batches of {batch_size}: give batch_size={len(sequences)} (one "
                             "batch), or the edit as a function of the stream")
        self.reset()
        device = model.device
        parts = []
        for b0 in range(0, len(sequences), batch_size):
            rows = range(b0, min(len(sequences), b0 + batch_size))
            t = max(lengths[i] for i in rows)
            ids = torch.zeros(len(rows), t, dtype=torch.long, device=device)
            mask = torch.zeros(len(rows), t, dtype=torch.bool, device=device)
            for j, i in enumerate(rows):
                ids[j, : lengths[i]] = torch.tensor(list(sequences[i]), dtype=torch.long, device=device)
                mask[j, : lengths[i]] = True
            part = self.settings()
            part.mask = mask
            logits = model(ids, trace=part)
            if on_batch is not None:
                on_batch(rows, logits)
            del logits
            parts.append(part)
        merge_into(self, parts, max(lengths))

    def logit_lens(self, model: MiniMaxM3, layers: set[int] | None = None) -> dict[int, torch.Tensor]:
        """fp32 logits [B, T, V] of each recorded residual stream (`hidden_states[L]` through the final norm and
        LM head, `MiniMaxM3.logits`): what the model would predict if it stopped after layer L."""
        keys = sorted(self.hidden_states if layers is None else layers)
        missing = [L for L in keys if L not in self.hidden_states]
        if missing:
            raise InputError(f"logit_lens: layers {missing[:5]} were not recorded (Trace(layers=...) decides which)")
        return {L: model.logits(self.hidden_states[L]) for L in keys}

    @contextmanager
    def attached(self, model: MiniMaxM3) -> Iterator[Trace]:
        """This trace's hooks, and its interventions', on `model`'s decoder layers for the length of the block (what
        `MiniMaxM3.hidden` runs its layers inside when given a trace); the layers' chunk sizes are restored after."""
        handles: list = []
        chunks: dict[nn.Module, int] = {}
        try:
            for L, layer in enumerate(model.layers):
                _attach_layer(self, L, layer, handles, chunks)
            yield self
        finally:
            for handle in handles:
                handle.remove()
            for attn, chunk in chunks.items():
                attn.chunk_elements = chunk


def _attach_layer(trace: Trace, L: int, layer: nn.Module, handles: list, chunks: dict) -> None:
    """Layer L's hooks, edits before the records taken at the same point (module docstring)."""
    iv = trace.interventions

    def on(module: nn.Module, fn: Callable) -> None:
        handles.append(module.register_forward_hook(fn))

    def store(records: dict) -> Callable:
        return lambda module, args, out: records.__setitem__(L, out)

    attn = layer.self_attn
    if attn.sparse:
        if iv is not None and L in iv.msa_blocks:
            on(attn.selection, lambda m, args, out: iv.blocks_for(L, args[2], attn.n_kv, attn.geometry.block_size))
        on(attn.selection, store(trace.blocks))
    if L in trace.attention_layers:
        chunks[attn] = attn.chunk_elements
        attn.chunk_elements = trace.attention_chunk_elements or ONE_CHUNK
        _attach_core(trace, L, attn, on)
    components = trace.components and trace.wants(L)
    if components:
        on(attn, store(trace.attention_output))
    if iv is not None and L in iv.attention_residual:
        edit = iv.attention_residual[L]
        on(layer.attention_residual, lambda m, args, out: iv.apply(edit, out, f"attention_residual[{L}]"))
    moe = getattr(layer, "block_sparse_moe", None)
    if moe is not None:
        mask = None if iv is None else iv.expert_mask.get(L)
        if mask is not None:
            handles.append(moe.gate.register_forward_pre_hook(
                lambda m, args, kwargs: (args, {**kwargs, "mask": mask}), with_kwargs=True))
        on(moe.gate, lambda m, args, out: trace.routing.__setitem__(L, real_rows(out, trace.mask)))
        scale = None if iv is None else iv.expert_scale.get(L)
        if scale:
            on(moe.gate, lambda m, args, out: scaled_routing(out, scale, m.weight.shape[0]))
    if components:
        on(layer.ffn, store(trace.ffn_output))
    if iv is not None and L in iv.residual:
        edit = iv.residual[L]
        on(layer, lambda m, args, out: iv.apply(edit, out, f"residual[{L}]"))
    if trace.wants(L):
        on(layer, store(trace.hidden_states))


def _attach_core(trace: Trace, L: int, attn: nn.Module, on: Callable) -> None:
    """Record layer L's attention core as it is called: `trace.attention[L]` (the `Trace.attention` fields)."""
    index: dict[str, torch.Tensor] = {}
    if attn.sparse:
        on(attn.selection, lambda m, args, out: index.update(iq=args[0], ik=args[1]))

    def core(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        q, k, v, q_pos = args[:4]
        rec = {"q": q, "k": k, "v": v, "q_pos": q_pos, "o": out, "scale": module.scale,
               "chunk_elements": attn.chunk_elements}
        if attn.sparse:
            sp = attn.geometry
            rec.update(iq=index["iq"], ik=index["ik"], blocks=args[4], block_size=sp.block_size,
                       topk_blocks=sp.topk_blocks, local_blocks=sp.local_blocks, init_blocks=sp.init_blocks)
        if trace.attention_probs:
            rec["probs"] = attention_probabilities(q, k, q_pos, module.scale, rec.get("blocks"), rec.get("block_size"))
        trace.attention[L] = rec

    on(attn.core, core)


def scaled_routing(routing: Routing, scale: dict[int, float], num_experts: int) -> Routing:
    """`routing` with each chosen expert e's fp32 weight multiplied by `scale[e]` (1 for the others)."""
    ids = routing.expert_ids
    factor = torch.ones(num_experts, dtype=torch.float32, device=ids.device)
    factor[list(scale)] = torch.tensor([float(v) for v in scale.values()], device=ids.device)
    return Routing(ids, routing.weights * factor[ids], routing.logits)


# The fields of `Trace.attention[L]`, as the attention core of layer L was called (`model.attention.Attention.forward`).
# B batch, T queries of this forward, L keys attended (T without a KV cache; with one, the cached slots [0, kv_len):
# slot = absolute position), Hq / Hkv this rank's query / kv heads (query head h reads kv head h // (Hq / Hkv)),
# D head dim, Di index head dim, kb blocks per query. "Compute dtype" is the model's (float32 or bfloat16).
ATTENTION_FIELDS = {
    "q": "queries [B, T, Hq, D], compute dtype, after q_norm and RoPE (the partial NeoX rotation already applied)",
    "k": "keys [B, L, Hkv, D], compute dtype (or the cache's dtype as read back), after k_norm and RoPE",
    "v": "values [B, L, Hkv, D], compute dtype: v_proj's output (no norm, no RoPE)",
    "q_pos": "long [B, T]: the queries' absolute positions (key slot j is position j)",
    "o": "fp32 [B, T, Hq, D]: the core's output, before the cast to the compute dtype and o_proj",
    "scale": "float: the softmax scale, head_dim ** -0.5",
    "chunk_elements": "int: the bound on the core's temporaries it ran with (ONE_CHUNK = 2**62: one query chunk)",
    "iq": "MSA layers: index queries [B, T, Hkv, Di], compute dtype, after index_q_norm and RoPE",
    "ik": "MSA layers: index keys [B, L, Di], after index_k_norm and RoPE",
    "blocks": "MSA layers: long [B, Hkv, T, kb], the key blocks each query of kv head h attends to (-1 = empty slot)",
    "block_size, topk_blocks, local_blocks, init_blocks": "MSA layers: ints, the layer's block geometry",
    "probs": "with Trace(attention_probs=True): fp32 [B, Hq, T, L], `attention_probabilities(q, k, q_pos, scale, "
             "blocks, block_size)`; o == probs @ v (per query head, over its kv head's values)",
}


def real_rows(routing: Routing, mask: torch.Tensor | None) -> Routing:
    """`routing` of B*T tokens (row-major over [B, T]) keeping the rows where `mask` [B, T] is True (all rows when
    mask is None): padding has no routing."""
    if mask is None:
        return routing
    keep = mask.reshape(-1).to(routing.expert_ids.device)
    return Routing(routing.expert_ids[keep], routing.weights[keep], routing.logits[keep])


def routed_mass(routing: Routing, num_experts: int) -> torch.Tensor:
    """float64 [num_experts]: the sum over every row (token) of `routing` of each expert's normalised routing weight
    (`Routing.weights`, summing to 1 per token), so the total is the number of tokens. What `minimax-ref prune
    --method weight` ranks experts by."""
    mass = torch.zeros(num_experts, dtype=torch.float64, device=routing.weights.device)
    mass.index_add_(0, routing.expert_ids.reshape(-1), routing.weights.reshape(-1).double())
    return mass


def attention_probabilities(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, scale: float,
                            blocks: torch.Tensor | None = None, block_size: int | None = None) -> torch.Tensor:
    """The attention weights fp32 [B, Hq, T, L] of queries q [B, T, Hq, D] over keys k [B, L, Hkv, D] (both after
    their norms and RoPE, as `Trace.attention` records them; key slot j is position j): query head h reads kv head
    h // (Hq / Hkv); scores `scale * q . k` in fp32; a query at position p sees the keys at positions <= p and, with
    `blocks` [B, Hkv, T, kb] (MSA layers; -1 = empty slot), only those in one of its kv head's blocks (key j is in
    block j // block_size); softmax over the keys it sees, 0 at the others. Quadratic in memory: for chosen layers."""
    B, T, Hq, D = q.shape
    L, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    qf = q.float().view(B, T, Hkv, G, D)
    s = torch.einsum("bthgd,blhd->bhgtl", qf, k.float()) * scale  # [B, Hkv, G, T, L]
    key_pos = torch.arange(L, device=q.device)
    seen = key_pos[None, None, :] <= q_pos[:, :, None]  # [B, T, L]
    seen = seen[:, None].expand(B, Hkv, T, L)
    if blocks is not None:
        key_block = key_pos // block_size
        in_block = torch.zeros(B, Hkv, T, L, dtype=torch.bool, device=q.device)
        for j in range(blocks.shape[-1]):
            chosen = blocks[..., j:j + 1].to(q.device)  # [B, Hkv, T, 1]
            in_block |= (chosen >= 0) & (key_block[None, None, None, :] == chosen)
        seen = seen & in_block
    p = torch.softmax(s.masked_fill(~seen[:, :, None], float("-inf")), dim=-1)
    return p.reshape(B, Hq, T, L)


def _pad(x: torch.Tensor, dims: dict[int, int], value: float) -> torch.Tensor:
    """x padded at the end of each dim in `dims` to that size, with `value`."""
    pad: list[int] = []
    for d in reversed(range(x.dim())):
        pad += [0, dims.get(d, x.shape[d]) - x.shape[d]]
    return torch.nn.functional.pad(x, pad, value=value) if any(pad) else x


def _at_padding(x: torch.Tensor, mask: torch.Tensor, dim: int, value: float) -> torch.Tensor:
    """x with `value` at the positions of dim `dim` (a [B, .., T, ..] layout, B at dim 0) where mask [B, T] is
    False."""
    shape = [mask.shape[0]] + [1] * (x.dim() - 1)
    shape[dim] = mask.shape[1]
    return x.masked_fill(~mask.view(shape).to(x.device), value)


def merge_into(trace: Trace, parts: Sequence[Trace], T: int) -> None:
    """Merge the records of `parts` (one trace per right-padded batch, each with its `mask`) into `trace` as one
    batch [N, T]: streams and attention operands zero at padding, block ids -1 there, routing rows concatenated
    (real tokens only), attention probabilities zero at padding queries and keys."""
    masks = [_pad(p.mask, {1: T}, False) for p in parts]
    trace.mask = torch.cat(masks)
    trace.shape = (int(trace.mask.shape[0]), T)
    for name in ("hidden_states", "attention_output", "ffn_output"):
        for L in getattr(parts[0], name):
            getattr(trace, name)[L] = torch.cat([_at_padding(_pad(getattr(p, name)[L], {1: T}, 0.0), m, 1, 0.0)
                                                 for p, m in zip(parts, masks)])
    for L in parts[0].routing:
        rs = [p.routing[L] for p in parts]
        trace.routing[L] = Routing(torch.cat([r.expert_ids for r in rs]), torch.cat([r.weights for r in rs]),
                                   torch.cat([r.logits for r in rs]))

    def blocks(xs: list[torch.Tensor]) -> torch.Tensor:
        kb = max(x.shape[3] for x in xs)
        return torch.cat([_at_padding(_pad(x, {2: T, 3: kb}, -1), m, 2, -1) for x, m in zip(xs, masks)])

    for L in parts[0].blocks:
        trace.blocks[L] = blocks([p.blocks[L] for p in parts])
    for L in parts[0].attention:
        recs = [p.attention[L] for p in parts]
        merged = dict(recs[0])
        for key in ("q", "k", "v", "o", "iq", "ik"):
            if key in merged:
                merged[key] = torch.cat([_at_padding(_pad(r[key], {1: T}, 0.0), m, 1, 0.0)
                                         for r, m in zip(recs, masks)])
        merged["q_pos"] = torch.arange(T, device=recs[0]["q_pos"].device).expand(trace.shape[0], T)
        if "blocks" in merged:
            merged["blocks"] = blocks([r["blocks"] for r in recs])
        if "probs" in merged:
            merged["probs"] = torch.cat([_at_padding(_at_padding(_pad(r["probs"], {2: T, 3: T}, 0.0), m, 2, 0.0),
                                                     m, 3, 0.0) for r, m in zip(recs, masks)])
        trace.attention[L] = merged
