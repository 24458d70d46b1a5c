"""The MiniMax-M3 text model: embedding, decoder layers, final norm, LM head.

    h  = x + self_attn(input_layernorm(x))
    x' = h + ffn(post_attention_layernorm(h))          ffn = dense MLP or MoE, per layer
    logits = lm_head(norm(x_last))                       fp32

The layer schedule (dense/sparse attention, dense MLP/MoE) comes from the config's per-layer lists.
Module and parameter names follow the release's tensor names (with `language_model.model.`
dropped), so the name table in checkpoint.py is short.

Calling the model on input ids [B, S] runs the plain full forward at positions 0..S-1 and returns
fp32 logits [B, S, V]. Cached prefill/decode pass `cache` and `positions`; research hooks pass a
`Trace` to receive per-layer hidden states, router decisions and MSA block selections.

Tensor parallelism: built with a `parallel.World` of N ranks, every rank runs this same code on its
slices (parallel.py lists the splits); the residual stream is replicated, attention and FFN blocks
each end in one all-reduce, the embedding sums the ranks' vocabulary rows and the logits are gathered
so every rank holds the same full fp32 logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .attention import Attention
from .cache import KVCache, LayerCache
from .config import ModelConfig, TextConfig
from .errors import InputError
from .fast import REFERENCE, FastPaths, materialize, register_materialize_lowering
from .launch import DECODE_REDUCTIONS, ReductionConfigs, compiled_with_fixed_reductions
from .mlp import MLP
from .moe import Experts, MoE, Routing
from .norm import RMSNorm
from .packed import FUSED_INDUCTOR_OPTIONS, PackedWeight
from .parallel import ColumnParallelLinear, VocabParallelEmbedding, World
from .rope import rope_cos_sin, rope_inv_freq


@dataclass
class Trace:
    """What a forward pass records, per layer index, for research and kernel tests.

    hidden_states[L]: the residual stream after layer L, [B, T, H] (only layers in `layers`, all when
        `layers` is None; `hidden_states[-1]`-style access is by layer index, not position).
    routing[L]: MoE decision of layer L for the B*T flattened tokens (`moe.Routing`).
    blocks[L]: MSA block ids of layer L, [B, kv_heads, T, kb] (-1 = empty slot); under tensor
        parallelism, this rank's kv heads only.
    """

    layers: set[int] | None = None
    hidden_states: dict[int, torch.Tensor] = field(default_factory=dict)
    routing: dict[int, Routing] = field(default_factory=dict)
    blocks: dict[int, torch.Tensor] = field(default_factory=dict)

    def wants(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer: int, world: World, expert_parallel: bool = False):
        super().__init__()
        self.layer = layer
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer, world=world)
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
        """The layer on x [B, T, H]; `cache` is this layer's part of the KV cache (`KVCache.layer`)."""
        rec: dict = {} if trace is not None else None
        # compiled, each norm is computed once and stored (fast.materialize), not once per row of every weight
        # that multiplies it: fused into a matmul with one row per program, the norm's mean over the hidden size
        # was recomputed for every output row
        h = x + self.self_attn(materialize(self.input_layernorm(x)), pos, cos, sin, cache, rec, kv_len)
        if hasattr(self, "block_sparse_moe"):
            routing: list | None = [] if trace is not None else None
            out = h + self.block_sparse_moe(materialize(self.post_attention_layernorm(h)), routing)
            if routing:
                trace.routing[self.layer] = routing[0]
        else:
            out = h + self.mlp(materialize(self.post_attention_layernorm(h)))
        if trace is not None:
            if "blocks" in rec:
                trace.blocks[self.layer] = rec["blocks"]
            if trace.wants(self.layer):
                trace.hidden_states[self.layer] = out
        return out


def _run_layer(layer: DecoderLayer, x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               cache: LayerCache | None, trace: Trace | None, kv_len: int | None) -> torch.Tensor:
    return layer(x, pos, cos, sin, cache, trace, kv_len)


# The compiled layers' inductor options: the fused matmul's (`packed.FUSED_INDUCTOR_OPTIONS`: a packed weight's
# decoding stays inside the matmul that reads it, and the bfloat16 roundings are kept), with coordinate-descent tuning
# of each Triton kernel's block sizes and warps (measured on an H200, scaled model at batch 1: 5.9 -> 4.7 ms per step,
# for a few minutes more compiling; no effect on a CPU). Descent along one axis at a time: with every diagonal move
# tried too (`coordinate_descent_check_all_directions`) the compile of a 4-layer model did not finish in 5 minutes.
LAYER_INDUCTOR_OPTIONS = {**FUSED_INDUCTOR_OPTIONS, "coordinate_descent_tuning": True}


def compiled_layer(reductions: ReductionConfigs | None = DECODE_REDUCTIONS):
    """`_run_layer` through `torch.compile`, for decode steps (`FastPaths.compile_layers`).

    The layer is an argument and reads no per-layer constant on this path (its cache part comes in as tensors,
    `KVCache.layer`), so every layer of a kind passes the same guards and shares one compiled graph: one per
    (kind of layer, batch size, cache length, dtype). Static shapes (`dynamic=False`: a decode step's shapes are
    fixed) and `fullgraph`: no graph break, so no host synchronisation hides in the step. Inductor options:
    `LAYER_INDUCTOR_OPTIONS`, and the large reductions (the matmuls, attention's value sums) launched with their
    kind's configuration in `reductions` (`launch.FixedReductions`; None: tuned like the other kernels)."""
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    register_materialize_lowering()
    return compiled_with_fixed_reductions(_run_layer, reductions, dynamic=False, fullgraph=True,
                                          options=dict(LAYER_INDUCTOR_OPTIONS))


class MiniMaxM3(nn.Module):
    """The language model (and, when the checkpoint has one, the vision tower and projector).

    world: the tensor-parallel group (default: one process). expert_parallel: with more than one
    rank, hold whole routed experts (E / TP per rank) instead of a slice of every expert.
    `set_fast` switches the fast paths of fast.py (default: the reference).
    """

    fast = REFERENCE
    _compiled_layer = None

    def __init__(self, config: ModelConfig, world: World | None = None, expert_parallel: bool = False):
        super().__init__()
        self.config = config
        self.world = world = world or World.single()
        self.expert_parallel = expert_parallel
        cfg = self.text = config.text
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, world)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, world, expert_parallel)
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

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def set_fast(self, fast: bool | str | dict | FastPaths = True) -> FastPaths:
        """Switch fast paths (`FastPaths.of(fast)`: True = all, False = the reference) on every module."""
        self.fast = FastPaths.of(fast)
        for name, m in self.named_modules():
            if isinstance(m, (Attention, Experts)):
                m.fast = self.fast
            elif isinstance(m, PackedWeight):
                m.mode = self.fast.decode
                m.fused_tokens, m.fused_rows = self.fast.fused_tokens, self.fast.fused_rows
                m.set_words(self.fast.reads_words(name, m.fmt))
        self._compiled_layer = compiled_layer(self.fast.layer_reductions) if self.fast.compile_layers else None
        return self.fast

    def _compiles_step(self, positions: torch.Tensor, cache: KVCache | None, trace: Trace | None) -> bool:
        """Whether this call runs its layers compiled (`FastPaths.compile_layers`): a decode step (one token per
        sequence: each shape is a graph of its own, so short prompts are not compiled) with a cache and no trace,
        no activation emulation and no expert mask (those synchronise with the host)."""
        if self._compiled_layer is None or cache is None or trace is not None or positions.shape[1] != 1:
            return False
        for layer in self.layers:
            if layer.self_attn.q_proj.emulate_act_quant:
                return False
            moe = getattr(layer, "block_sparse_moe", None)
            if moe is not None and (moe.gate.expert_mask is not None or moe.experts.emulate_act_quant):
                return False
        return True

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
        inv_freq = rope_inv_freq(self.text.rotary_dim, self.text.rope_theta, x.device)
        cos, sin = rope_cos_sin(positions, inv_freq)
        kv_len = None  # cached keys are slots [0, kv_len), read once here rather than in every layer
        if cache is not None:
            # static_kv (decode steps only; a prefill chunk attends over what it needs): the whole cache
            static = self.fast.static_kv and positions.shape[1] <= self.fast.sync_free_tokens
            kv_len = cache.max_seq_len if static else int(positions.max()) + 1
        run = self._compiled_layer if self._compiles_step(positions, cache, trace) else _run_layer
        for i, layer in enumerate(self.layers):
            x = run(layer, x, positions, cos, sin, None if cache is None else cache.layer(i), trace, kv_len)
        return x

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits [.., V] of the residual stream h. Each rank computes its vocabulary slice; the
        slices are gathered so every rank holds the same full logits (and samples the same token)."""
        return self.world.all_gather(self.lm_head(self.norm(h)).float(), dim=-1)

    def forward(self, input_ids: torch.Tensor, *, positions: torch.Tensor | None = None,
                cache: KVCache | None = None, trace: Trace | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Logits fp32 [B, T, V] for `input_ids` [B, T].

        positions: [B, T] absolute positions (default 0..T-1); with `cache`, K/V are written there.
        inputs_embeds: replaces the embedding lookup (used for images).
        """
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise InputError(f"input_ids must be a [batch, seq] LongTensor, got {shape}")
        if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise InputError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
        B, T = input_ids.shape
        if positions is None:
            positions = torch.arange(T, device=input_ids.device).expand(B, T)
        elif cache is None and not torch.equal(positions, torch.arange(T, device=positions.device).expand(B, T)):
            raise InputError("positions other than 0..T-1 need a KV cache (keys live at their positions)")
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        return self.logits(self.hidden(x, positions, cache, trace))

    def new_cache(self, batch_size: int, max_seq_len: int, kv_cache_dtype: str = "auto") -> KVCache:
        """A KV cache for this rank: its kv heads only (all of them with one process)."""
        return KVCache(self.text, batch_size, max_seq_len, self.embed_tokens.weight.dtype, self.device,
                       kv_cache_dtype, kv_heads=self.layers[0].self_attn.n_kv)
