"""Switchable fast paths. All off (the default) is the reference engine; each switch replaces one readable
reference computation by a faster one that computes the same function.

* `decode="fast"`: packed-weight decoding (`packed.decode_reference`) by a two-pass decoder.
  Bit-identical.
* `decode="compile"`: the same through `torch.compile` of the reference decoder (one fused kernel).
  Bit-identical.
* `moe=True`: the routed experts of small batches (up to `sync_free_tokens` tokens, default 64) by batched matmuls
  over the chosen experts, with no host synchronisation and static shapes. Equal to fp32 rounding.
* `static_kv=True`: in decode steps (up to `sync_free_tokens` tokens per sequence), cached attention over
  slots [0, max(pos) + 1) by attention over the whole cache (static shapes, no host synchronisation;
  later slots are masked as future keys). Equal to fp32 rounding.
* `sdpa=True`: the fp32 attention core (scores, softmax, value sum) by
  `F.scaled_dot_product_attention` in fp32, and MSA gathers its selected key blocks from the cache's
  storage before converting them (an fp8 cache is never converted whole). Equal to fp32 rounding.
* `matmul="fused"`: products with packed weights (linears, and the routed experts of `moe=True`) in calls of
  up to `fused_tokens` = min(`sync_free_tokens`, `fused_rows`) tokens (one pass over the weight; larger calls
  decode then multiply: on an H200 the fused kernels made batch-1 decode 2.4x faster and batch-32 decode,
  in 4 passes, 2.1x slower, BENCHMARKS.md) by `packed.packed_matmul_fused`, a `torch.compile`d dequantize-and-multiply
  that reads the packed bytes and scales and never writes the decoded weight (compiled on first use: warm up
  before capturing a CUDA graph). The decoded weight has the same bits; the sum is fp32 in another order, so
  equal to fp32 rounding. Not part of `fast=True`; `fast="fused"` is every fast path with it. `fused_rows`
  sets how many rows of the input each pass over the weight takes (more rows: fewer passes, more registers).
  `nvfp4_words=True`: the fused NVFP4 products (bf16, scales in the normal range) read the packed bytes as int32
  words, eight elements per load (`packed.nvfp4_word_planes`); the same decoded bits, the sum in another order.
  `mxfp8_words=True`: the same for MXFP8's E4M3 bytes (`packed.mxfp8_word_planes`, bits placed by integer
  operations instead of the E4M3 conversion; a weight holding an E4M3 NaN byte keeps the byte planes);
  `mxfp8_words="gate_up"`: only for the gate and up projections (`reads_words`). `fast="compiled"` takes
  `nvfp4_words=True, mxfp8_words="gate_up"`: on an H200 (60 compiled layers, batch 1, one run) NVFP4's words took
  the routed experts' products from 108.4 to 97.5 and 49.0 to 42.5 us a layer, MXFP8's the shared expert's gate + up
  from 29.2 to 21.3 us, while MXFP8's single products (q_proj, o_proj, the down projections) were 1.1-1.5x slower
  as words, with any of the three launch configurations tried; 20.41 -> 19.86 ms a step for the gate + up
  (BENCHMARKS.md). The compiled word planes are checked bit for bit on the CPU and the H200 (`tests/test_fused.py`).

* `compile_layers=True`: in decode steps (one token per sequence, with a cache and no trace), each decoder layer
  runs through `torch.compile` (`model.compiled_layer`): one compiled graph per
  kind of layer (dense attention + MLP, MSA + MoE) and batch size, shared by every layer of that kind, in which
  inductor fuses the norms, RoPE, cache writes, routing and activations into the few kernels around the
  matmuls (and, with `matmul="fused"`, the packed weights' decoding into the matmuls). It needs `moe` and
  `static_kv` (static shapes, no host synchronisation). Same function; fp32 sums in another order, so equal to
  fp32 rounding. Compiled on first use (tens of seconds per kind of layer): warm up before capturing a CUDA
  graph. Steps with NVFP4/MXFP8 activation emulation or an expert mask run the layers eagerly.
  `layer_reductions`: the launch configurations of the compiled layers' large Triton reductions
  (`launch.FixedReductions`), one per kind (`launch.KINDS`: products over one or two packed weights of each format,
  read as bytes or as words, and reductions over no packed weight, attention's value sums), default
  `launch.DECODE_REDUCTIONS`; None, for all or for a kind: tuned by inductor's coordinate descent like the other
  kernels (a different configuration from one compile to the next). A `launch.ReductionConfigs`, one
  `launch.ReductionConfig` for every product over packed weights, or the text of `ReductionConfigs.parse`
  (`"X,R,W"`, `"X,R,W/X,R,W"`: NVFP4's/MXFP8's, `KIND=X,R,W` parts). Same function either way.

With `moe` and `static_kv` (and no trace, no activation emulation) a decode step has no host synchronisation
and fixed shapes, so it can be captured in a CUDA graph (`benchmarks/common.py`); so can it with `matmul="fused"`
once the warm-up steps have compiled it. tests/test_packed.py and tests/test_fused.py compare every switch with
the reference on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from .errors import ConfigError
from .launch import DECODE_REDUCTIONS, ReductionConfigs

DECODE_MODES = ("reference", "fast", "compile")
MATMUL_MODES = ("reference", "fused")
# Token count up to which `moe=True` uses the synchronisation-free expert path, and `static_kv` the whole
# cache (decode steps); larger calls (prefill) group tokens by expert, which needs the per-expert counts
# on the host, and attend over the filled slots only.
SYNC_FREE_TOKENS = 64
# Rows of x per pass of the fused matmul over a weight: each pass decodes every weight element once and feeds
# one fp32 accumulator per row, so more rows mean fewer passes (less weight traffic) but more registers.
FUSED_ROWS = 8
# With compiled layers, generation sizes its KV cache in multiples of this many slots: each cache length is a
# compiled graph of its own (static shapes), so prompts of different lengths would otherwise each compile anew;
# the extra slots are future keys, masked.
CACHE_BUCKET = 1024


# The projections that `mxfp8_words="gate_up"` reads as words: the two whose products a compiled layer fuses into
# one kernel (the dense MLPs' and the shared expert's; the routed experts' are NVFP4).
GATE_UP = frozenset({"gate_proj", "up_proj"})


@dataclass(frozen=True)
class FastPaths:
    """Which fast paths are on (see the module docstring). `FastPaths()` is the reference."""

    decode: str = "reference"
    moe: bool = False
    static_kv: bool = False
    sdpa: bool = False
    # calls of up to this many tokens take the `moe` / `static_kv` / `matmul` paths; training raises it so that
    # every expert runs densely on every token (a few large matmuls instead of a loop over experts)
    sync_free_tokens: int = SYNC_FREE_TOKENS
    matmul: str = "reference"
    # rows of the input per pass of the fused matmul over a weight (`packed.packed_matmul_fused`)
    fused_rows: int = FUSED_ROWS
    # the fused products read the packed bytes as int32 words (`packed.nvfp4_word_planes`, `mxfp8_word_planes`)
    nvfp4_words: bool = False
    mxfp8_words: bool | str = False  # or "gate_up": only the gate and up projections (`reads_words`)
    compile_layers: bool = False
    # launch configurations of the compiled layers' large reductions over packed weights (None: tuned per compile)
    layer_reductions: ReductionConfigs | None = DECODE_REDUCTIONS

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_reductions", ReductionConfigs.of(self.layer_reductions))
        if self.decode not in DECODE_MODES:
            raise ConfigError(f"fast paths: decode={self.decode!r}: choose one of {list(DECODE_MODES)}")
        if self.matmul not in MATMUL_MODES:
            raise ConfigError(f"fast paths: matmul={self.matmul!r}: choose one of {list(MATMUL_MODES)}")
        if self.fused_rows < 1:
            raise ConfigError(f"fast paths: fused_rows={self.fused_rows}: give a positive row count")
        if self.compile_layers and not (self.moe and self.static_kv):
            raise ConfigError("fast paths: compile_layers needs moe=True and static_kv=True (a compiled decode step "
                              "must have static shapes and no host synchronisation)")
        if self.sync_free_tokens < 1:
            raise ConfigError(f"fast paths: sync_free_tokens={self.sync_free_tokens}: give a positive token count")
        if self.mxfp8_words not in (False, True, "gate_up"):
            raise ConfigError(f"fast paths: mxfp8_words={self.mxfp8_words!r}: give True, False or \"gate_up\" (only "
                              "the gate and up projections)")

    def reads_words(self, name: str, fmt: str) -> bool:
        """Whether the packed weight `name` (a module path, e.g. `layers.3.mlp.gate_proj.packed`) of format `fmt`
        is read as int32 words (`nvfp4_words`, `mxfp8_words`)."""
        if fmt == "nvfp4":
            return self.nvfp4_words
        if self.mxfp8_words == "gate_up":
            return not GATE_UP.isdisjoint(name.split("."))
        return self.mxfp8_words

    @classmethod
    def of(cls, fast: bool | str | dict | FastPaths | None) -> FastPaths:
        """`load_model`'s `fast` argument: False/None (reference), True (every fast path, eager decode),
        "compile" (every fast path, compiled decode), "fused" (every fast path, eager decode, and the fused
        packed matmul for a few tokens), "compiled" ("fused" with compiled decoder layers in decode steps, the
        einsum attention core, which compiles better than fp32 SDPA), a dict of switches, or a FastPaths."""
        if isinstance(fast, FastPaths):
            return fast
        if fast is None or fast is False:
            return cls()
        if fast is True:
            return cls(decode="fast", moe=True, static_kv=True, sdpa=True)
        if fast == "compile":
            return cls(decode="compile", moe=True, static_kv=True, sdpa=True)
        if fast == "fused":
            return cls(decode="fast", moe=True, static_kv=True, sdpa=True, matmul="fused")
        if fast == "compiled":
            # sdpa off: its fp32 kernel (memory-efficient attention) does not split the keys of a one-query step
            # over the GPU (measured: 0.5 ms per layer at 8K keys on an H200), while the compiled einsum core does
            return cls(decode="fast", moe=True, static_kv=True, sdpa=False, matmul="fused", compile_layers=True,
                       nvfp4_words=True, mxfp8_words="gate_up")
        if isinstance(fast, dict):
            names = {f.name for f in fields(cls)}
            unknown = sorted(set(fast) - names)
            if unknown:
                raise ConfigError(f"fast paths: unknown switches {unknown}; known: {sorted(names)}")
            return cls(**fast)
        raise ConfigError(f"fast={fast!r}: give True, False, 'compile', 'fused', 'compiled', a dict of switches or "
                          "a FastPaths")

    @property
    def any(self) -> bool:
        return self != FastPaths()

    @property
    def fused_tokens(self) -> int:
        """Calls with up to this many tokens multiply packed weights fused (`PackedWeight.fused_tokens`; 0: none)."""
        return min(self.sync_free_tokens, self.fused_rows) if self.matmul == "fused" else 0


REFERENCE = FastPaths()


@torch.library.custom_op("minimax_ref::materialize", mutates_args=())
def _materialize(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_materialize.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def materialize(x: torch.Tensor) -> torch.Tensor:
    """`x`. Inside a compiled region (`compile_layers`), x computed once and stored: inductor fuses an elementwise
    chain into every consumer and recomputes it there, which for the queries after norm and RoPE, the softmax
    probabilities or the SwiGLU output means once per key or per weight row (measured on an H200: 110 us instead of a
    few for the scores of one layer at 8K keys). The packed matmuls need that inlining (their decoded weight must never
    be stored), so it is bounded here, where it costs. Traced as an opaque operator, which inductor lowers to storing
    x (`register_materialize_lowering`; without the lowering, the operator's copy of x)."""
    return _materialize(x) if torch.compiler.is_compiling() else x


def register_materialize_lowering() -> None:
    """Have inductor lower `materialize` to x's buffer itself: the producer's kernel stores x and the consumers read
    it, instead of storing it and then copying it through the operator (a device-to-device copy of about 1 us, seven
    per decoder layer: 0.43 ms of a 60-layer step on an H200). Same values. Registered once per process, in inductor's
    table of lowerings (the compiled layers call it before compiling)."""
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
