"""`apply(model, paths)`: install the fast twins on a built model, or restore the reference.

Each twin is a subclass of its reference module that overrides only how it computes (forward or a helper), so
parameter and buffer names, `state_dict` and the loaded tensors are unchanged; `apply` swaps the module's class in
place and gives it the `FastPaths` it reads (`paths`). `apply(model, FastPaths())` swaps every module back to its
reference class and removes what the twins were given.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from ..generation.drafter import DSparkDrafter
from ..model.attention import Attention
from ..model.cache import KVCache
from ..model.config import check_layer_ids
from ..model.decoder import DecoderLayer, MiniMaxM3
from ..model.mlp import MLP
from ..model.moe import Experts, MoE, Router
from ..model.msa import BlockSelection
from ..model.norm import RMSNorm
from ..research.trace import Interventions, Trace
from ..weights.packed import PackedWeight
from .attention import FastAttention, FastBlockSelection
from .compiled import CompiledLayers, StoredNorm, run_layer, use_compile_cache
from .drafter import FastDSparkDrafter
from .graph import CapturedSteps
from .grouped import sm_count
from .launch import tuned_for
from .moe import FastExperts, FastMLP, FastMoE, FastRouter
from .packed import GEMV_BUFFERS, FastPackedWeight, Kernels
from .paths import CACHE_BUCKET, REFERENCE, FastPaths


class FastMiniMaxM3(MiniMaxM3):
    """`MiniMaxM3` with the fast paths `fast` (a `FastPaths`): attention over the whole cache in decode steps
    (`static_kv`), the decoder layers compiled in decode steps (`compile_layers`), and, with compiled layers, KV
    caches sized in multiples of `CACHE_BUCKET` slots (each cache length is a compiled graph of its own)."""

    fast: FastPaths
    compiled: CompiledLayers | None
    captured: CapturedSteps | None  # the CUDA graphs of the current cache's decode steps (`graph`)
    captured_shapes: set  # the step shapes compiled so far (their first capture is announced)

    def hidden(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache | None = None,
               trace: Trace | None = None, kept: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """`MiniMaxM3.hidden`; `kept` (a dict whose keys are layer indices) receives the residual stream after each
        of those layers without a trace, so the call stays compiled and capturable."""
        if trace is not None:
            trace.begin(self, x)
        cos, sin = self.rope(positions)
        kv_len = None
        if cache is not None:
            # static_kv (decode steps only; a prefill chunk attends over what it needs): the whole cache
            static = self.fast.static_kv and positions.shape[1] <= self.fast.sync_free_tokens
            kv_len = cache.max_seq_len if static else int(positions.max()) + 1
        run = self.compiled if self.compiles_step(positions, cache, trace, step=kept is not None) else run_layer
        with nullcontext() if trace is None else trace.attached(self):
            for i, layer in enumerate(self.layers):
                x = run(layer, x, positions, cos, sin, None if cache is None else cache.layer(i), kv_len)
                if kept is not None and i in kept:
                    kept[i] = x
        return x

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # the range check reads the ids on the host: skipped while a CUDA graph is captured (the ids of a captured
        # step are the model's own samples)
        if input_ids.is_cuda and torch.cuda.is_current_stream_capturing():
            return self.embed_tokens(input_ids)
        return super().embed(input_ids)

    def compiles_step(self, positions: torch.Tensor, cache: KVCache | None, trace: Trace | None,
                      step: bool = False) -> bool:
        """Whether this call runs its layers compiled: a decode step (each shape is a graph of its own, so prompts are
        not compiled: one token per sequence, or any `step` call, `sync_free_step`, which a verify step of k+1 tokens
        is) with a cache and no trace (so no interventions), no activation emulation and no expert mask (those
        synchronise with the host)."""
        if self.compiled is None or (positions.shape[1] != 1 and not step):
            return False
        return self.sync_free(positions, cache, trace)

    def sync_free(self, positions: torch.Tensor, cache: KVCache | None, trace: Trace | None) -> bool:
        """Whether a call with a cache runs without host synchronisation and with static shapes (what a CUDA graph
        can capture): at most `sync_free_tokens` tokens in all (batch x tokens per sequence), no trace
        (interventions), no activation emulation and no expert mask."""
        # the routed experts take their synchronisation-free path for up to `sync_free_tokens` tokens in all
        if cache is None or trace is not None or positions.numel() > self.fast.sync_free_tokens:
            return False
        for layer in self.layers:
            if layer.self_attn.q_proj.emulate_act_quant:
                return False
            moe = getattr(layer, "block_sparse_moe", None)
            if moe is not None and (moe.gate.expert_mask is not None or moe.experts.emulate_act_quant):
                return False
        return True

    @property
    def decode_scheduler(self):
        """The loop `generate_ids` runs requests with: `fast.overlap.OverlapScheduler` with `overlap_steps`, else
        the plain `Scheduler`."""
        from ..generation.decoding import Scheduler
        from .overlap import OverlapScheduler

        return OverlapScheduler if self.fast.overlap_steps else Scheduler

    def step(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """`MiniMaxM3.step`; with `graph` on CUDA, replayed from the step's CUDA graph (`CapturedSteps`, captured on
        the first step of each shape on each cache). The logits are the graph's output buffer: read them before the
        next step."""
        if not self.replays(ids, positions, cache):
            return super().step(ids, positions, cache)
        return self.captured_for(cache).step(self, ids, positions, ())[0]

    def step_with_hidden(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                         layers) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """`MiniMaxM3.step_with_hidden`; a synchronisation-free step keeps the layers' residual streams without a
        trace (`sync_free_step`), and with `graph` on CUDA replays from a CUDA graph whose outputs include them."""
        layers = list(layers)
        check_layer_ids(layers, self.text.num_hidden_layers, "step_with_hidden(layers=...)")
        layers = tuple(sorted(set(layers)))
        if self.replays(ids, positions, cache):
            return self.captured_for(cache).step(self, ids, positions, layers)
        if self.sync_free(positions, cache, None):
            return self.sync_free_step(ids, positions, cache, layers)
        return super().step_with_hidden(ids, positions, cache, layers)

    def sync_free_step(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                       layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """A step with no host synchronisation (what `CapturedSteps` records; `sync_free` must hold): logits fp32
        [B, T, V] and the residual stream after each of `layers`, without `forward`'s argument checks."""
        kept = dict.fromkeys(layers)
        h = self.hidden(self.embed(ids), positions, cache, kept=kept)
        return self.logits(h), kept

    def replays(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> bool:
        """Whether a step is replayed from a CUDA graph: `graph` on, on CUDA, and `sync_free`."""
        return self.fast.graph and ids.is_cuda and self.sync_free(positions, cache, None)

    def captured_for(self, cache: KVCache) -> CapturedSteps:
        """The captured steps of `cache`; a new cache drops the previous one's graphs (and the memory they hold)."""
        if self.captured is None or not self.captured.holds(cache):
            self.captured = CapturedSteps(cache, self.captured_shapes)
        return self.captured

    def batch_slots(self, requests: int, limit: int) -> int:
        """The slots of a call of `requests` (at most `limit`) sequences: with compiled layers (a compile of a minute
        or more for each batch size, here and in the cache a later process reads) the next power of two within
        `limit`, so few batch sizes ever compile; otherwise `requests` (an empty slot still costs its share of a
        step), and so for an offloaded model too (an empty slot's experts would be copied to the GPU every step)."""
        if self.compiled is None or getattr(self, "offload", None) is not None:
            return requests
        return min(limit, 1 << max(0, requests - 1).bit_length())

    def release_captured_steps(self) -> None:
        """Drop the captured steps (their graphs, memory pool and the KV cache they keep): a call about to size its
        batch from free memory counts what the previous call's cache held (each call builds a cache of its own)."""
        self.captured = None

    def share_paths(self, module: nn.Module) -> None:
        apply(module, self.fast)

    def checked(self, logits: torch.Tensor, x: torch.Tensor, positions: torch.Tensor,
                cache: KVCache | None, interventions: Interventions | None = None) -> torch.Tensor:
        # sync-free decode steps read nothing back to the host; the non-finite check is a host read
        if positions.shape[1] <= self.fast.sync_free_tokens:
            return logits
        return super().checked(logits, x, positions, cache, interventions)

    def new_cache(self, batch_size: int, max_seq_len: int, kv_cache_dtype: str | None = None) -> KVCache:
        # the captured steps keep the previous cache alive: free both before allocating the next one
        self.release_captured_steps()
        if self.compiled is not None:
            rounded = -(-max_seq_len // CACHE_BUCKET) * CACHE_BUCKET
            runtime = getattr(self, "runtime", None)
            limit = max(max_seq_len, runtime.max_seq_len if runtime is not None else self.text.max_position_embeddings)
            max_seq_len = min(rounded, limit)
        return super().new_cache(batch_size, max_seq_len, kv_cache_dtype)


# reference class -> its twin; swapped only on modules of exactly the reference class
TWINS: dict[type, type] = {Attention: FastAttention, BlockSelection: FastBlockSelection, Experts: FastExperts,
                           Router: FastRouter, MLP: FastMLP, MoE: FastMoE,
                           PackedWeight: FastPackedWeight, MiniMaxM3: FastMiniMaxM3, DSparkDrafter: FastDSparkDrafter}
REFERENCES = {twin: ref for ref, twin in TWINS.items()} | {StoredNorm: RMSNorm}
# what `apply` gives the twins, removed when the reference is restored
_GIVEN = ("paths", "fast", "compiled", "kernels", "mode", "fused_tokens", "fused_rows",
          "normal_range", "words", "grouped_tokens", "grouped_launch", "decode_tiles", "gemv_tokens", "gemv_kernel",
          "gemv_sms", "table", "sorted_tiles", "captured", "captured_shapes", "sm_count")


def paths_of(model: nn.Module) -> FastPaths:
    """The fast paths in force on `model` (`REFERENCE` when none are installed)."""
    return getattr(model, "fast", REFERENCE)


def apply(model: nn.Module, paths: bool | str | dict | FastPaths | None = True) -> FastPaths:
    """Install the fast paths `paths` (`FastPaths.of`: True = every eager fast path, "compiled", a dict, a
    FastPaths...) on `model` (a `MiniMaxM3`, a `DSparkDrafter`, or any module holding reference modules: an
    `Experts`, a `PackedWeight`), in place; `FastPaths()` (or False) restores the reference modules. Returns the
    paths in force. Reads each packed weight's scales on the host once (`FastPackedWeight.configure`)."""
    paths = FastPaths.of(paths)
    if paths.compile_layers or paths.matmul == "fused" or paths.decode in ("compile", "triton") or paths.grouped \
            or paths.gemv != "reference" or paths.prefill_experts != "reference" \
            or paths.prefill_fusion \
            or "triton" in (paths.prefill_attention, paths.decode_attention, paths.block_selection):
        use_compile_cache()  # before the first compile or Triton launch reads where its cache is
    kernels = getattr(model, "kernels", None) or Kernels()  # kept across re-applies: its compiled functions
    _restore(model)
    if not paths.any:
        return paths
    stored = {id(norm) for m in model.modules() if isinstance(m, DecoderLayer)
              for norm in (m.input_layernorm, m.post_attention_layernorm)}
    for name, m in model.named_modules():
        twin = TWINS.get(type(m))
        if type(m) is RMSNorm and id(m) in stored:
            m.__class__ = StoredNorm
            m.paths = paths
        elif twin is not None:
            m.__class__ = twin
            m.paths = paths
            if twin is FastAttention:
                m.sm_count = sm_count(m.q_norm.weight.device)
                if isinstance(getattr(m, "selection", None), BlockSelection):
                    m.selection.sm_count = m.sm_count
        if isinstance(m, FastPackedWeight):
            m.configure(kernels, paths.decode, paths.fused_tokens, paths.fused_rows, paths.reads_words(name, m.fmt),
                        paths.grouped_tokens, paths.gemv_tokens, paths.nvfp4_table,
                        paths.prefill_experts != "reference", paths.gemv)
    # after every packed weight has its copy: the linears (and expert stacks) that read one input as one product
    for m in [m for m in model.modules() if isinstance(m, (FastAttention, FastMLP, FastExperts))]:
        m.join_projections()
    if isinstance(model, FastMiniMaxM3):
        model.fast, model.kernels = paths, kernels
        reductions = tuned_for(model.device) if paths.layer_reductions == "auto" else paths.layer_reductions
        model.compiled = (CompiledLayers(reductions, use_compile_cache() / "layers", paths) if paths.compile_layers
                          else None)
        model.captured, model.captured_shapes = None, set()
    return paths


def _restore(model: nn.Module) -> None:
    for m in list(model.modules()):
        ref = REFERENCES.get(type(m))
        if ref is None:
            continue
        m.__class__ = ref
        m._modules.pop("joint", None)  # `fast.joint`'s product (its parts' copies are the buffers below)
        for attr in _GIVEN:
            m.__dict__.pop(attr, None)
        for buffer in GEMV_BUFFERS:  # `fast.gemv`'s reordered copy of a packed weight
            m._buffers.pop(buffer, None)
