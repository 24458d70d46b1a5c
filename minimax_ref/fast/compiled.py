"""The compiled decoder layer of decode steps (`FastPaths.compile_layers`) and what it needs: `materialize`, the
operator that bounds inductor's recomputation, and the norm twin that uses it.

Inductor fuses an elementwise chain into every consumer and recomputes it there; for the queries after norm and
RoPE, the softmax probabilities, the SwiGLU output or a norm that multiplies every weight row, that means once per
key or per weight row. The packed matmuls need that inlining (their decoded weight must never be stored), so it is
bounded where it costs: the fast twins pass those values through `materialize`, which stores them once in a
compiled region and is the identity elsewhere.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..model.norm import RMSNorm
from .launch import ReductionConfigs, compiled_with_fixed_reductions
from .packed import FUSED_INDUCTOR_OPTIONS
from .prefill import fused_rms_norm

# The fused matmul's options (a packed weight's decoding stays inside the matmul that reads it, the bf16 roundings
# kept), with coordinate-descent tuning of each Triton kernel's block sizes and warps (along one axis at a time:
# trying every diagonal move too makes a compile take many minutes).
# Inductor's static launcher is off: a kernel it launches comes back from the graph cache without the mark that its
# launch configuration was found by coordinate descent, so a new process would tune it again (seconds per kernel);
# launched by Triton's own launcher, a cached kernel reads its tuned configuration from the autotuning cache. The
# launcher's cost does not matter here: a decode step replays from a CUDA graph.
LAYER_INDUCTOR_OPTIONS = {**FUSED_INDUCTOR_OPTIONS, "coordinate_descent_tuning": True,
                          "use_static_cuda_launcher": False}


@torch.library.custom_op("minimax_ref::materialize", mutates_args=())
def _materialize(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_materialize.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def materialize(x: torch.Tensor) -> torch.Tensor:
    """`x`. Inside a compiled region, x computed once and stored (an opaque operator, which inductor lowers to
    storing x: `register_materialize_lowering`), so its consumers read it instead of recomputing it."""
    return _materialize(x) if torch.compiler.is_compiling() else x


def register_materialize_lowering() -> None:
    """Have inductor lower `materialize` to x's buffer itself: the producer's kernel stores x and the consumers read
    it, instead of storing it and then copying it through the operator (a device-to-device copy per use). Same
    values. Registered once per process, in inductor's table of lowerings."""
    from torch._inductor.lowering import lowerings, register_lowering

    op = torch.ops.minimax_ref.materialize.default
    if getattr(lowerings.get(op), "stores_once", False):
        return

    def store_once(x):
        x.realize()
        return x

    # replaces the fallback (the operator's own copy) inductor records for the operator when it first meets it
    register_lowering(op, type_promotion_kind=None)(store_once)
    lowerings[op].stores_once = True


class StoredNorm(RMSNorm):
    """A decoder layer's input or post-attention norm whose output is stored once when compiled (`materialize`):
    fused into a matmul with one row per program, its mean over the hidden size was recomputed for every output
    row. Same function as `RMSNorm`. In prefill calls with `prefill_fusion`, one compiled kernel (`fast.prefill`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.paths.prefill_fusion and x.shape[1] > self.paths.sync_free_tokens:
            return fused_rms_norm(x, self.weight, self.eps)
        return materialize(super().forward(x))


def use_compile_cache() -> Path:
    """Keep what compiling produces across processes, in the cache folder (`embedded.cache_dir()`/compile) unless
    TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR name another: inductor's graph, AOT and autotuning caches and Triton's
    kernels. Inductor keys each entry by the traced graph (the model's shapes), the compile options (the preset),
    torch's version and the GPU, so a later process with the same model and preset loads its compiled steps instead
    of compiling them. Returns the folder."""
    from ..weights.embedded import cache_dir

    folder = Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or cache_dir() / "compile")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(folder))
    os.environ.setdefault("TRITON_CACHE_DIR", str(folder / "triton"))
    return folder


def run_layer(layer, x, pos, cos, sin, cache, kv_len):
    """One decoder layer's forward (what `CompiledLayers` compiles)."""
    return layer(x, pos, cos, sin, cache, kv_len)


class CompiledLayers:
    """`run_layer` through `torch.compile`, for decode steps.

    The layer is an argument and reads no per-layer constant on this path (its cache part comes in as tensors,
    `KVCache.layer`), so every layer of a kind passes the same guards and shares one compiled graph: one per (kind
    of layer, batch size, cache length, dtype). Static shapes (`dynamic=False`) and `fullgraph`: no graph break, so
    no host synchronisation hides in the step. The large reductions launch with their kind's configuration in
    `reductions` (`launch.FixedReductions`; None: tuned like the other kernels). Compiled on first use."""

    def __init__(self, reductions: ReductionConfigs | None):
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        register_materialize_lowering()
        self.reductions = reductions
        self.run = compiled_with_fixed_reductions(run_layer, reductions, dynamic=False, fullgraph=True,
                                                  options=dict(LAYER_INDUCTOR_OPTIONS))

    def __call__(self, *args):
        return self.run(*args)
