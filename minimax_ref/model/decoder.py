"""The MiniMax-M3 text model: embedding, decoder layers, final norm, LM head.

    h  = x + self_attn(input_layernorm(x))
    x' = h + ffn(post_attention_layernorm(h))          ffn = dense MLP or MoE, per layer
    logits = lm_head(norm(x_last))                       fp32

The layer schedule (dense/sparse attention, dense MLP/MoE) comes from the config's per-layer lists.
Module and parameter names follow the release's tensor names (with `language_model.model.`
dropped), so the name table in checkpoint.py is short.

Calling the model on input ids [B, S] runs the plain full forward at positions 0..S-1 and returns
fp32 logits [B, S, V]. Cached prefill/decode pass `cache` and `positions`; research hooks pass a
`Trace` to receive per-layer hidden states, router decisions, MSA block selections and (for golden
bundles) the attention cores' operands, and `Interventions` to edit the forward at its hook points
(expert masks and scales, MSA block selections, the residual stream after attention and after each layer).

Tensor parallelism: built with a `parallel.World` of N ranks, every rank runs this same code on its
slices (parallel.py lists the splits); the residual stream is replicated, attention and FFN blocks
each end in one all-reduce, the embedding sums the ranks' vocabulary rows and the logits are gathered
so every rank holds the same full fp32 logits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import ConfigError, InputError
from .attention import Attention
from .cache import KVCache, LayerCache
from .config import ModelConfig, TextConfig
from .finite import finite_logits
from .linear import ACT_QUANT_MODES, set_activation_formats
from .mlp import MLP
from .moe import MoE, Routing
from .msa import CHUNK_ELEMENTS
from .norm import RMSNorm
from .parallel import ColumnParallelLinear, VocabParallelEmbedding, World
from .rope import rope_cos_sin, rope_inv_freq

KV_CACHE_DTYPES = ("auto", "fp8")


@dataclass(frozen=True)
class Numerics:
    """How a model computes, fixed when it is built (`MiniMaxM3(..., numerics=)`).

    act_quant: "none" (weight-only: activations stay in the compute dtype) or "emulate" (the inputs of NVFP4 /
        MXFP8 linears fake-quantized as W4A4 / W8A8 kernels see them, `linear.emulate_activation_quant`).
    attention_chunk_elements: bound on the largest attention temporary, in elements (queries run in chunks).
    kv_cache_dtype: `new_cache`'s default storage, "auto" (the compute dtype) or "fp8" (cache.py).
    The compute dtype is the loaded weights' (`MiniMaxM3.dtype`).
    """

    act_quant: str = "none"
    attention_chunk_elements: int = CHUNK_ELEMENTS
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.act_quant not in ACT_QUANT_MODES:
            raise ConfigError(f"act_quant={self.act_quant!r}: choose one of {list(ACT_QUANT_MODES)}")
        if not isinstance(self.attention_chunk_elements, int) or self.attention_chunk_elements < 1:
            raise ConfigError(f"attention_chunk_elements={self.attention_chunk_elements!r}: give a positive count")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype={self.kv_cache_dtype!r}: choose one of {list(KV_CACHE_DTYPES)}")


Edit = torch.Tensor | Callable[[torch.Tensor], torch.Tensor]


@dataclass
class Interventions:
    """Edits a forward applies at its hook points (`model(ids, interventions=...)`, or `Trace(interventions=...)`).

    Hook points, per decoder layer L (`DecoderLayer.forward`):
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
    """

    expert_mask: dict[int, torch.Tensor] = field(default_factory=dict)
    expert_scale: dict[int, dict[int, float]] = field(default_factory=dict)
    residual: dict[int, Edit] = field(default_factory=dict)
    attention_residual: dict[int, Edit] = field(default_factory=dict)
    msa_blocks: dict[int, torch.Tensor] = field(default_factory=dict)

    def check(self, model: MiniMaxM3) -> None:
        """Refuse edits naming layers or experts the model does not have (InputError)."""
        n, E = model.text.num_hidden_layers, model.text.num_local_experts
        moe = {i for i in range(n) if model.text.moe_layers[i]}
        for name in ("expert_mask", "expert_scale", "residual", "attention_residual", "msa_blocks"):
            for L in getattr(self, name):
                if not isinstance(L, int) or not 0 <= L < n:
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
            bad = [e for e in scales if not isinstance(e, int) or not 0 <= e < E]
            if bad:
                raise InputError(f"interventions.expert_scale[{L}]: expert ids {bad[:5]} are not in [0, {E})")

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


def check_layer_ids(layers: Iterable, n: int, what: str) -> None:
    """Refuse (InputError, naming the argument `what`) entries of `layers` that are not layer indices 0..n-1."""
    bad = [L for L in layers if isinstance(L, bool) or not isinstance(L, int) or not 0 <= L < n]
    if bad:
        raise InputError(f"{what}: {bad[:5]} are not layer indices of this model (0..{n - 1})")


@dataclass
class Trace:
    """What a forward pass records, per layer index, for research and kernel tests.

    hidden_states[L]: the residual stream after layer L, [B, T, H] (only layers in `layers`, all when
        `layers` is None; `hidden_states[-1]`-style access is by layer index, not position).
    attention_output[L], ffn_output[L]: with `components`, what layer L's attention and FFN (MLP or MoE)
        add to the stream, [B, T, H] each (same layers as `hidden_states`).
    routing[L]: MoE decision of layer L for the B*T flattened tokens, row-major over [B, T] (`moe.Routing`;
        `routed(L)` gives it shaped [B, T, k], `expert_counts(L)` counts the tokens `mask` keeps).
    blocks[L]: MSA block ids of layer L, [B, kv_heads, T, kb] (-1 = empty slot); under tensor
        parallelism, this rank's kv heads only.
    attention[L]: for the layers in `attention_layers`, the attention core's operands and result as it
        was called (`Attention.record`: q, k, v, q_pos, o, and on MSA layers iq, ik, blocks; the scale,
        geometry and chunk size). What golden bundles are made of. A captured core runs in one query chunk, or
        with `attention_chunk_elements` in the engine's query chunks of that size (long prompts: linear memory).
    shape: (B, T) of the last forward. mask: [B, T] bool, True at real tokens (None: all real); set by the
        caller, or by `minimax_ref.research.score` for its right-padded batch.
    interventions: edits applied during the forward (`Interventions`).

    Each forward records into the trace the layers it runs, replacing what an earlier forward recorded for
    those layers; `reset()` clears every record (the settings stay).
    """

    layers: set[int] | None = None
    hidden_states: dict[int, torch.Tensor] = field(default_factory=dict)
    routing: dict[int, Routing] = field(default_factory=dict)
    blocks: dict[int, torch.Tensor] = field(default_factory=dict)
    attention_layers: set[int] = field(default_factory=set)
    attention: dict[int, dict] = field(default_factory=dict)
    attention_chunk_elements: int | None = None  # captured cores run in chunks of this size (None: one chunk)
    components: bool = False
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
            check_layer_ids(getattr(self, name) or (), model.text.num_hidden_layers, f"Trace({name}=...)")
        if self.interventions is not None:
            self.interventions.check(model)
        if self.mask is not None and tuple(self.mask.shape) != tuple(x.shape[:2]):
            raise InputError(f"Trace.mask is {tuple(self.mask.shape)}, the batch is {tuple(x.shape[:2])}")
        self.shape = (int(x.shape[0]), int(x.shape[1]))

    def routed(self, layer: int) -> Routing:
        """Layer `layer`'s routing shaped [B, T, k] (expert ids, weights) and [B, T, E] (logits)."""
        if layer not in self.routing:
            raise InputError(f"the trace holds no routing for layer {layer} (it has {sorted(self.routing)}; "
                             "dense-MLP layers route nothing)")
        r, (B, T) = self.routing[layer], self.shape
        return Routing(r.expert_ids.view(B, T, -1), r.weights.view(B, T, -1), r.logits.view(B, T, -1))

    def expert_counts(self, layer: int) -> torch.Tensor:
        """long [E]: how many tokens chose each expert in `layer`, over the tokens `mask` keeps (padding excluded)."""
        r = self.routed(layer)
        ids = r.expert_ids if self.mask is None else r.expert_ids[self.mask.to(r.expert_ids.device)]
        return torch.bincount(ids.reshape(-1), minlength=r.logits.shape[-1])

    def logit_lens(self, model: MiniMaxM3, layers: set[int] | None = None) -> dict[int, torch.Tensor]:
        """fp32 logits [B, T, V] of each recorded residual stream (`hidden_states[L]` through the final norm and
        LM head, `MiniMaxM3.logits`): what the model would predict if it stopped after layer L."""
        keys = sorted(self.hidden_states if layers is None else layers)
        missing = [L for L in keys if L not in self.hidden_states]
        if missing:
            raise InputError(f"logit_lens: layers {missing[:5]} were not recorded (Trace(layers=...) decides which)")
        return {L: model.logits(self.hidden_states[L]) for L in keys}


class DecoderLayer(nn.Module):
    """One decoder layer: `input_layernorm`, `self_attn`, `post_attention_layernorm`, then `block_sparse_moe` (MoE
    layers) or `mlp` (dense layers), each block added to the residual stream."""

    def __init__(self, cfg: TextConfig, layer: int, world: World, expert_parallel: bool = False,
                 chunk_elements: int = CHUNK_ELEMENTS):
        super().__init__()
        self.layer = layer
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer, world=world, chunk_elements=chunk_elements)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.moe_layers[layer]:
            self.block_sparse_moe = MoE(
                cfg.hidden_size, cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size,
                cfg.shared_intermediate_size, cfg.n_shared_experts, cfg.routed_scaling_factor,
                cfg.use_routing_bias, cfg.swiglu_alpha, cfg.swiglu_limit, world, expert_parallel,
            )
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.dense_intermediate_size, cfg.swiglu_alpha, cfg.swiglu_limit,
                           world)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: LayerCache | None, trace: Trace | None, kv_len: int | None = None) -> torch.Tensor:
        """The layer on the residual stream x [B, T, H] (compute dtype) -> [B, T, H].

        pos [B, T]: absolute positions; cos, sin fp32 [B, T, rotary_dim] (`MiniMaxM3.rope`); cache: this layer's
        part of the KV cache (`KVCache.layer`) or None; kv_len: cached slots [0, kv_len) to attend over. trace:
        receives this layer's records and supplies its interventions (`Trace`, `Interventions`: the hook points).
        """
        rec = None if trace is None else {"capture": self.layer in trace.attention_layers,
                                          "capture_chunk": trace.attention_chunk_elements}
        iv = None if trace is None else trace.interventions
        if iv is not None and self.layer in iv.msa_blocks:
            rec["force_blocks"] = iv.blocks_for(self.layer, pos, self.self_attn.n_kv,
                                                self.self_attn.geometry.block_size)
        a = self.self_attn(self.input_layernorm(x), pos, cos, sin, cache, rec, kv_len)
        h = x + a
        if iv is not None and self.layer in iv.attention_residual:
            h = iv.apply(iv.attention_residual[self.layer], h, f"attention_residual[{self.layer}]")
        if hasattr(self, "block_sparse_moe"):
            routing: list | None = [] if trace is not None else None
            mask = scale = None
            if iv is not None:
                mask, scale = iv.expert_mask.get(self.layer), iv.expert_scale.get(self.layer)
            f = self.block_sparse_moe(self.post_attention_layernorm(h), routing, mask, scale)
            if routing:
                trace.routing[self.layer] = routing[0]
        else:
            f = self.mlp(self.post_attention_layernorm(h))
        out = h + f
        if iv is not None and self.layer in iv.residual:
            out = iv.apply(iv.residual[self.layer], out, f"residual[{self.layer}]")
        if trace is not None:
            if "blocks" in rec:
                trace.blocks[self.layer] = rec["blocks"]
            if "core" in rec:
                trace.attention[self.layer] = rec["core"]
            if trace.wants(self.layer):
                trace.hidden_states[self.layer] = out
                if trace.components:
                    trace.attention_output[self.layer] = a
                    trace.ffn_output[self.layer] = f
        return out


class MiniMaxM3(nn.Module):
    """The language model (and, when the checkpoint has one, the vision tower and projector).

    world: the tensor-parallel group (default: one process). expert_parallel: with more than one
    rank, hold whole routed experts (E / TP per rank) instead of a slice of every expert.
    numerics: how it computes (`Numerics`). formats: the on-disk format of each linear's and expert
    stack's weight by module path ("nvfp4", "mxfp8", else dense), for activation emulation (the
    loader passes the checkpoint's).
    """

    def __init__(self, config: ModelConfig, world: World | None = None, expert_parallel: bool = False,
                 numerics: Numerics | None = None, formats: Mapping[str, str] | None = None):
        super().__init__()
        self.config = config
        self.world = world = world or World.single()
        self.expert_parallel = expert_parallel
        self.numerics = numerics = numerics or Numerics()
        cfg = self.text = config.text
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, world)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, world, expert_parallel, numerics.attention_chunk_elements)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # column-parallel over the vocabulary, the same rows as embed_tokens (so tying shares them)
        self.lm_head = ColumnParallelLinear(cfg.hidden_size, world.split(cfg.vocab_size, "vocab_size"))
        self.vision_tower = None
        self.projector = None
        if config.vision is not None:
            from .vision import Projector, VisionTower

            self.vision_tower = VisionTower(config.vision)
            self.projector = Projector(config.vision.hidden_size, cfg.hidden_size, config.vision.spatial_merge_size,
                                       projector_hidden=config.projector_hidden_size)
        # the tensor-parallel linears' constructors take no format: it is set here, as the model is built
        set_activation_formats(self, formats or {}, numerics.act_quant == "emulate")

    @property
    def act_quant(self) -> str:
        return self.numerics.act_quant

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        V = self.text.vocab_size
        # The range check reads the ids on the host: skipped while a CUDA graph is captured (the ids of a
        # captured decode step are the model's own samples).
        capturing = input_ids.is_cuda and torch.cuda.is_current_stream_capturing()
        if input_ids.numel() and not capturing and bool(((input_ids < 0) | (input_ids >= V)).any()):
            bad = input_ids[(input_ids < 0) | (input_ids >= V)].unique()[:5].tolist()
            raise InputError(f"token ids {bad} are outside the vocabulary [0, {V})")
        return self.embed_tokens(input_ids)

    def hidden(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache | None = None,
               trace: Trace | None = None) -> torch.Tensor:
        """Run the decoder layers on embeddings x [B, T, H] at positions [B, T]; returns the residual
        stream before the final norm."""
        if trace is not None:
            trace.begin(self, x)
        cos, sin = self.rope(positions)
        # cached keys are slots [0, kv_len), read on the host once here rather than in every layer
        kv_len = None if cache is None else int(positions.max()) + 1
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, cos, sin, None if cache is None else cache.layer(i), trace, kv_len)
        return x

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin fp32 [B, T, rotary_dim] of `positions` [B, T] (`rope.rope_cos_sin`)."""
        return rope_cos_sin(positions, rope_inv_freq(self.text.rotary_dim, self.text.rope_theta, positions.device))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits [.., V] of the residual stream h. Each rank computes its vocabulary slice; the
        slices are gathered so every rank holds the same full logits (and samples the same token)."""
        return self.world.all_gather(self.lm_head(self.norm(h)).float(), dim=-1)

    def forward(self, input_ids: torch.Tensor, *, positions: torch.Tensor | None = None,
                cache: KVCache | None = None, trace: Trace | None = None,
                inputs_embeds: torch.Tensor | None = None,
                interventions: Interventions | None = None,
                logit_index: torch.Tensor | None = None) -> torch.Tensor:
        """Logits fp32 [B, T, V] for `input_ids` [B, T].

        positions: [B, T] absolute positions (default 0..T-1, then T may not exceed `max_seq_len`: the runtime's
            when loaded with one, else the config's max_position_embeddings); with `cache`, K/V are written there.
        trace: receives per-layer records (`Trace`). interventions: edits at the hook points (`Interventions`;
            the same as `trace.interventions`, give one or the other).
        inputs_embeds: replaces the embedding lookup (used for images).
        logit_index: LongTensor [B] of one position per row (0..T-1): only those positions go through the final norm
            and the LM head, and the logits are [B, 1, V] (a prefill needs each row's last prompt token only; the
            LM head over every position of a long prompt costs as much as several layers).
        """
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise InputError(f"input_ids must be a [batch, seq] LongTensor, got {shape}")
        if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise InputError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
        B, T = input_ids.shape
        if positions is None:
            limit = self.max_seq_len
            if T > limit:
                raise InputError(f"input_ids has {T} positions, more than max_seq_len {limit}; shorten the input "
                                 "or load the model with a larger max_seq_len")
            positions = torch.arange(T, device=input_ids.device).expand(B, T)
        elif cache is None and not torch.equal(positions, torch.arange(T, device=positions.device).expand(B, T)):
            raise InputError("positions other than 0..T-1 need a KV cache (keys live at their positions)")
        if interventions is not None:
            if trace is not None and trace.interventions is not None and trace.interventions is not interventions:
                raise InputError("interventions given both as an argument and on the trace: give one")
            trace = trace or Trace(layers=set())
            trace.interventions = interventions
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        h = self.hidden(x, positions, cache, trace)
        if logit_index is not None:
            if not isinstance(logit_index, torch.Tensor) or tuple(logit_index.shape) != (B,) or not (
                    0 <= int(logit_index.min()) and int(logit_index.max()) < T):
                raise InputError(f"logit_index must be a LongTensor [{B}] of positions in 0..{T - 1}")
            h = h.gather(1, logit_index.to(h.device).view(B, 1, 1).expand(B, 1, h.shape[-1]))
        logits = self.logits(h)
        return self.checked(logits, x, positions, cache, None if trace is None else trace.interventions)

    def step(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One decode step: logits fp32 [B, T, V] of `ids` [B, T] at `positions` [B, T], their K/V written to
        `cache`. The same as `forward` with a cache; the decode loops call this so that the fast model can replay
        the step from a CUDA graph (its logits are then valid until the next step)."""
        return self(ids, positions=positions, cache=cache)

    def step_with_hidden(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                         layers: Iterable[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """`step`, also returning the residual stream after each layer in `layers`: (logits fp32 [B, T, V],
        {layer: [B, T, H]}), the same tensors as `Trace(layers=layers).hidden_states`. What speculative
        verification calls (the drafter reads those layers); the fast model replays it from a CUDA graph, whose
        outputs are valid until the next step."""
        layers = list(layers)
        check_layer_ids(layers, self.text.num_hidden_layers, "step_with_hidden(layers=...)")
        trace = Trace(layers=set(layers))
        logits = self(ids, positions=positions, cache=cache, trace=trace)
        return logits, {layer: trace.hidden_states[layer] for layer in sorted(trace.layers)}

    def share_paths(self, module: nn.Module) -> None:
        """Give `module`, which runs beside this model (the DSpark drafter, `drafter.load_drafter`), the way this
        model computes: the reference has nothing to give; the fast model installs its fast paths on it."""

    @property
    def max_seq_len(self) -> int:
        """Longest sequence a forward accepts: the runtime's `max_seq_len` when loaded with one, else the config's
        `max_position_embeddings`."""
        runtime = getattr(self, "runtime", None)
        return runtime.max_seq_len if runtime is not None else self.text.max_position_embeddings

    def checked(self, logits: torch.Tensor, x: torch.Tensor, positions: torch.Tensor,
                cache: KVCache | None, interventions: Interventions | None = None) -> torch.Tensor:
        """`logits`, refused with a `NumericsError` naming the layer where NaN / Inf first appear (finite.py).
        x, positions, cache, interventions: the forward's embeddings and arguments, to re-run it on failure."""

        def rerun(tr: Trace) -> torch.Tensor:
            tr.interventions = interventions
            return self.hidden(x, positions, cache, tr)

        return finite_logits(self, logits, x, rerun, Trace)

    def new_cache(self, batch_size: int, max_seq_len: int, kv_cache_dtype: str | None = None) -> KVCache:
        """A KV cache for this rank: its kv heads only (all of them with one process); kv_cache_dtype "auto" or
        "fp8" (default: `numerics.kv_cache_dtype`)."""
        return KVCache(self.text, batch_size, max_seq_len, self.embed_tokens.weight.dtype, self.device,
                       kv_cache_dtype or self.numerics.kv_cache_dtype, kv_heads=self.layers[0].self_attn.n_kv)
