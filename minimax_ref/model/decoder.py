"""The MiniMax-M3 text model: embedding, decoder layers, final norm, LM head.

    h  = x + self_attn(input_layernorm(x))
    x' = h + ffn(post_attention_layernorm(h))          ffn = dense MLP or MoE, per layer
    logits = lm_head(norm(x_last))                       fp32

The layer schedule (dense/sparse attention, dense MLP/MoE) comes from the config's per-layer lists.
Module and parameter names follow the release's tensor names (with `language_model.model.`
dropped), so the name table in checkpoint.py is short.

Calling the model on input ids [B, S] runs the plain full forward at positions 0..S-1 and returns
fp32 logits [B, S, V]. Cached prefill/decode pass `cache` and `positions`. A `Trace` (per-layer hidden states,
router decisions, MSA block selections, the attention cores' operands) and `Interventions` (edits at the hook
points) attach to the layers from outside, by forward hooks, for one forward (`research.trace`).

Tensor parallelism: built with a `parallel.World` of N ranks, every rank runs this same code on its
slices (parallel.py lists the splits); the residual stream is replicated, attention and FFN blocks
each end in one all-reduce, the embedding sums the ranks' vocabulary rows and the logits are gathered
so every rank holds the same full fp32 logits.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ConfigError, InputError
from ..research.trace import Interventions, Trace
from .attention import Attention
from .cache import KVCache, LayerCache
from .config import ModelConfig, TextConfig, check_layer_ids
from .finite import finite_logits
from .linear import ACT_QUANT_MODES, set_activation_formats
from .mlp import MLP
from .moe import MoE
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


class StreamPoint(nn.Identity):
    """A named point of the residual stream, the identity: where forward hooks read or replace the stream
    (`research.trace`)."""


class DecoderLayer(nn.Module):
    """One decoder layer: `input_layernorm`, `self_attn`, `post_attention_layernorm`, then `block_sparse_moe` (MoE
    layers) or `mlp` (dense layers), each block added to the residual stream."""

    def __init__(self, cfg: TextConfig, layer: int, world: World, expert_parallel: bool = False,
                 chunk_elements: int = CHUNK_ELEMENTS):
        super().__init__()
        self.layer = layer
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer, world=world, chunk_elements=chunk_elements)
        self.attention_residual = StreamPoint()
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

    @property
    def ffn(self) -> nn.Module:
        """The layer's feed-forward block: `block_sparse_moe` or `mlp`."""
        return self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: LayerCache | None = None, kv_len: int | None = None) -> torch.Tensor:
        """The layer on the residual stream x [B, T, H] (compute dtype) -> [B, T, H].

        pos [B, T]: absolute positions; cos, sin fp32 [B, T, rotary_dim] (`MiniMaxM3.rope`); cache: this layer's
        part of the KV cache (`KVCache.layer`) or None; kv_len: cached slots [0, kv_len) to attend over.
        """
        h = self.attention_residual(x + self.self_attn(self.input_layernorm(x), pos, cos, sin, cache, kv_len))
        return h + self.ffn(self.post_attention_layernorm(h))


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
        if input_ids.numel() and bool(((input_ids < 0) | (input_ids >= V)).any()):
            bad = input_ids[(input_ids < 0) | (input_ids >= V)].unique()[:5].tolist()
            raise InputError(f"token ids {bad} are outside the vocabulary [0, {V})")
        return self.embed_tokens(input_ids)

    def hidden(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache | None = None,
               trace: Trace | None = None) -> torch.Tensor:
        """Run the decoder layers on embeddings x [B, T, H] at positions [B, T]; returns the residual
        stream before the final norm. trace: attached to the layers for this call (`Trace.attached`)."""
        if trace is not None:
            trace.begin(self, x)
        cos, sin = self.rope(positions)
        # cached keys are slots [0, kv_len), read on the host once here rather than in every layer
        kv_len = None if cache is None else int(positions.max()) + 1
        with nullcontext() if trace is None else trace.attached(self):
            for i, layer in enumerate(self.layers):
                x = layer(x, positions, cos, sin, None if cache is None else cache.layer(i), kv_len)
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
        if B == 0 or T == 0:
            raise InputError(f"input_ids is [{B}, {T}]: give at least one sequence of at least one token")
        if positions is None:
            limit = self.max_seq_len
            if T > limit:
                raise InputError(f"input_ids has {T} positions, more than max_seq_len {limit}; shorten the input "
                                 "or load the model with a larger max_seq_len")
            positions = torch.arange(T, device=input_ids.device).expand(B, T)
        elif cache is None and not torch.equal(positions, torch.arange(T, device=positions.device).expand(B, T)):
            raise InputError("positions other than 0..T-1 need a KV cache (keys live at their positions)")
        for name, value, kind in (("trace", trace, Trace), ("interventions", interventions, Interventions)):
            if value is not None and not isinstance(value, kind):
                raise InputError(f"{name}: expected a minimax_ref.{kind.__name__}, got {type(value).__name__}")
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

        def rerun() -> dict[int, torch.Tensor]:
            trace = Trace(layers=None, interventions=interventions)
            self.hidden(x, positions, cache, trace)
            return trace.hidden_states

        return finite_logits(self, logits, x, rerun)

    def new_cache(self, batch_size: int, max_seq_len: int, kv_cache_dtype: str | None = None) -> KVCache:
        """A KV cache for this rank: its kv heads only (all of them with one process); kv_cache_dtype "auto" or
        "fp8" (default: `numerics.kv_cache_dtype`)."""
        return KVCache(self.text, batch_size, max_seq_len, self.embed_tokens.weight.dtype, self.device,
                       kv_cache_dtype or self.numerics.kv_cache_dtype, kv_heads=self.layers[0].self_attn.n_kv)
