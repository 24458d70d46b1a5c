"""`FastPaths`: which fast paths are on. All off (`FastPaths()`) is the reference engine; each switch replaces
one reference computation by a twin that computes the same function (tests/test_packed.py, test_fused.py,
test_launch.py, test_grouped.py, test_gemv.py and test_attention_kernel.py compare each with the reference).
`PRESETS` names the sets users choose (`minimax-ref --fast off|on|compiled|gemv-mma`) and the finer ones benchmarks
and tests take.

* `decode="fast"`: packed-weight decoding by a two-pass decoder (`fast.packed.decode_fast`). Bit-identical.
* `decode="compile"`: the reference decoder through `torch.compile` (one fused kernel). Bit-identical.
* `decode="triton"` (the `compiled` preset): on CUDA with triton, bf16 weights whose scales are in the normal range
  are decoded by one Triton kernel that reads the packed bytes once and writes the bf16 weight once
  (`fast.grouped.decode_grouped`, the grouped kernel's tile decoding); elsewhere as "fast". Bit-identical. What
  prefill's products with packed weights decode.
* `moe=True`: the routed experts of small batches (up to `sync_free_tokens` tokens) by batched matmuls over the
  chosen experts, with no host synchronisation and static shapes (`fast.moe.FastExperts`); of larger calls (prefill)
  sorted by expert, each projection one grouped matmul over the chosen experts (`torch._grouped_mm`, where it runs:
  CPUs, bf16 on CUDA 9.0+; without expert parallelism and with the stacks decodable at once, over every local expert
  with the groups' offsets on the device, so the host does not wait for the GPU). Equal to fp32 rounding.
* `static_kv=True`: in decode steps (up to `sync_free_tokens` tokens per sequence), attention over the whole
  cache (static shapes, no host synchronisation; later slots are masked as future keys). Equal to fp32 rounding.
* `sdpa=True`: the fp32 attention core through `F.scaled_dot_product_attention`, and MSA gathers its selected key
  blocks from the cache's storage before converting them (`fast.attention`). Equal to fp32 rounding.
* `matmul="fused"`: products with packed weights in calls of up to `fused_tokens` = min(`sync_free_tokens`,
  `fused_rows`) tokens by a compiled dequantize-and-multiply that reads the packed bytes and scales and never
  writes the decoded weight (`fast.packed.Kernels.matmul`; compiled on first use: warm up before capturing a
  CUDA graph). The same decoded bits; the sum is fp32 in another order. `nvfp4_words` / `mxfp8_words`: the fused
  products read the packed bytes as int32 words (`mxfp8_words="gate_up"`: only the gate and up projections).
* `prefill_attention="triton"` (every preset): calls of more than `sync_free_tokens` tokens (prefill) of a bf16
  model on CUDA attend through one Triton kernel (`fast.attention_kernel`): block-sparse flash attention on the tensor
  cores that reads each query's selected key blocks (dense layers: its causal keys) from the cache (an fp8 cache's
  keys and values widened to bf16 once a call where the query tiles would convert more keys than it holds;
  decode steps read them as stored). Scores
  exact products summed in fp32; probabilities split into two bf16 parts for the value sum (2^-18 relative; the
  `compiled` preset rounds them once to bf16, `attention_probabilities`). Equal to fp32 rounding plus that split
  (tests/test_attention_kernel.py). Elsewhere (fp32 models, CPU) the gathering path.
* `block_selection="triton"` (every preset but "off"): the MSA block selection of prefill calls (more than
  `sync_free_tokens` tokens) and of calls of few query rows (decode steps and speculative verification: queries x
  index heads <= `selection_kernel.DECODE_ROWS`, an fp8 cache's index keys read as stored) of a bf16 model on CUDA
  by one Triton kernel (`fast.selection_kernel`) that computes each block's max index score straight from the index
  queries and keys (tensor-core dot of the bf16 values, fp32 sums; future keys excluded, forced blocks +inf), never
  the [T, L] index scores, then the same top-k. The same block scores up to the order of the fp32 sums, so the same
  ids except at ties within that rounding (tests/test_selection_kernel.py).
  Elsewhere (fp32 models, CPU, other decode-sized calls) `fast.attention.select_blocks`.
* `prefill_fusion=True` (the `compiled` preset): in prefill calls (more than `sync_free_tokens` tokens) each
  decoder layer's input and post-attention RMSNorm, and each q / k / index-q / index-k norm with the RoPE rotation
  after it, run as one kernel compiled by torch.compile with dynamic shapes (`fast.prefill`), instead of a chain of
  fp32 elementwise kernels; so does each SwiGLU activation (MLPs, shared and routed experts); the routed experts'
  weighted combine reads each expert row once (no [pairs, H] fp32 buffer) and, on one rank, adds the block's scaling
  and shared expert and rounds to the compute dtype in the same kernel (`fast.moe.FastMoE`). The same operations and
  roundings; the norm's fp32 mean and the combine's slot sum in another order, so a norm's element differs by at
  most one unit in the last place, the combine by fp32 rounding (tests/test_prefill_fusion.py).
* `attention_probabilities="bf16"` (the `compiled` preset): the attention kernel multiplies the values by each
  softmax probability rounded once to bf16 (2^-9 relative, flash attention's rule) instead of its two bf16 parts
  (2^-18, "split", the other presets and the non-user preset `split-probabilities`): one tensor-core product a key
  tile instead of two, about a quarter off an 8K prefill's attention.
* `decode_attention="triton"` (the `compiled` preset): decode steps (up to `sync_free_tokens` tokens a sequence) attend
  through the same kernel, inside compiled layers and CUDA graphs, each program's keys split over the GPU and the
  splits merged by their softmax denominators (fp32, one kernel). The same contract.
* `grouped=True`: on CUDA with triton, products with packed weights of more rows than `fused_tokens`, up to
  `sync_free_tokens` (batch > 1 decode steps), by one Triton kernel that decodes each weight tile once in registers
  (the same bf16 bits) and multiplies it by all the rows on the tensor cores, fp32 sums (`fast.grouped`); the routed
  experts read only the experts some token chose (`fast.moe.FastExperts.forward_grouped`). Equal to fp32 rounding.
  For weights whose scales are in the normal range (`fast.packed.scales_in_normal_range`: real checkpoints) and a
  bf16 compute dtype; elsewhere, and without triton, the other paths.
* `grouped_swiglu=True` (the non-user preset `grouped-swiglu`: `compiled` with it; a 32-row step of `gemv-mma` was
  slower with it on an H100, BENCHMARKS.md): where the routed experts' gate and up stacks multiply a batch's shared
  rows through the grouped kernel at one K split, both products and their SwiGLU in one launch
  (`fast.grouped.swiglu_pair_grouped`: x's step tile loaded once for the two tiles, the activation stored, not the
  products; the SwiGLU of the bf16 products in fp32, rounded once, as the compiled step's fused SwiGLU).
* `sort_topk=True` (the `compiled` preset): in compiled regions the routing's and the MSA block selection's top-k of
  rows up to `compiled.SORT_ROWS` by a stable descending sort cut at k, which inductor compiles into one Triton kernel
  with the producer's elementwise ops fused (`compiled.top_k`); the same values, ties to the lower index.
* `gemv="triton"` (the non-user preset `gemv`: `compiled` with it; to be measured before a user preset takes it): on
  CUDA with triton, products with packed weights of 1 to `sync_free_tokens` rows (decode steps) by `fast.gemv`: the
  weight reordered once at configuration into the kernel's tile order (beside the stored planes: the packed bytes
  once more), decoded in registers to the same bf16 bits, a split-K GEMV on the CUDA cores up to `fast.gemv.GEMV_ROWS`
  rows and the tensor cores' dot above, fp32 sums; the routed experts read only the chosen experts. Takes precedence
  over `matmul="fused"` and `grouped` where it applies (as `grouped`: scales in the normal range, bf16). Equal to fp32
  rounding.
* `gemv="mma"` (the preset `gemv-mma`): as "triton", except that on CUDA products with packed weights of
  few rows go through `fast.mma_gemv`: each lane of a warp loads the 8 elements it holds in a tensor-core MMA,
  decoded to the reference's bf16 bits in its registers, fp32 sums on the tensor cores. Expert stacks (most of the
  bytes) are read where they are stored, up to `fast.mma_gemv.STORED_STACK_ROWS` (8) rows; linears (and stacks whose
  rows are not aligned to a lane's loads) from a copy reordered once at configuration (beside the stored planes),
  up to `fast.mma_gemv.MAX_ROWS` (32) rows; the linears that read one input (an attention's q, k, v and indexer
  projections, an MLP's gate and up) hold their copies as one weight and multiply it in one launch
  (`fast.joint`), as a routed layer's gate and up stacks are read as one stack where the loader placed them in one
  allocation. More rows take the grouped and fused paths. A Gluon kernel; where it
  does not run (CPU tensors, the interpreter, GPUs before sm_89) no weight takes a one-to-few-row kernel: the
  products are those of `gemv="reference"`. Equal to fp32 rounding.
* `expert_ranges=True` (in the preset `gemv-mma`; a 32-row step is faster with it, BENCHMARKS.md): with
  `gemv="mma"` or "mma-stored", decode
  steps of more than 8 tokens (one MMA row group) multiply each chosen routed expert by its own tokens only: the
  (token, choice) pairs sorted by expert on the device, each projection one `fast.mma_gemv` launch over the experts'
  ranges of rows (an expert's ranges of up to 8 rows in one row group, more in passes of 16; experts no pair chose
  read nothing), where the grouped kernel and the flags multiply every chosen expert by all the tokens
  (`fast.moe.FastExperts.forward_ranges`). Equal to fp32 rounding.
* `gemv="mma-stored"` (the non-user preset `gemv-mma-stored`: its one-row step is between `compiled`'s and
  `gemv-mma`'s on an H100, BENCHMARKS.md; `auto` takes it once its captured step is tested on a GPU and timed beside
  `compiled` in one run): as "mma", with every weight read where it is stored (linears too: no reordered copy, so no
  memory beyond the weights), up to `fast.mma_gemv.STORED_STACK_ROWS` (8) rows; more rows take the grouped and fused
  paths, and a weight the kernel cannot read in place takes no one-to-few-row kernel.
* `nvfp4_table=True` (the `compiled` preset): the grouped kernel (and the GEMV of `gemv="triton"`) decodes NVFP4
  through each block's table: with A = bf16(S) and B = bf16(fp32(1.5 S)) for the block scale S, every decoded element
  is one of {0, A/2, A, B, 2A, 2B, 4A, 4B} with its sign, looked up by byte permutes (`fast.grouped._TABLE_ASM`: no
  multiply or conversion an element). The same bits as the reference decoder for every weight the kernels take (tests:
  the assembly text run through a model of each instruction, the kernels under the interpreter, the grouped kernel on
  a GPU).
* `prefill_experts="triton"` (the non-user preset `prefill-experts`): on CUDA with triton, prefill's routed experts
  with packed stacks (the sorted path of `moe`) by one Triton kernel a projection over the rows sorted by expert that
  decodes each weight tile in registers (the same bf16 bits) and multiplies on the tensor cores, fp32 sums
  (`fast.prefill_experts`), instead of decoding the chosen experts to bf16 in memory before `torch._grouped_mm`;
  every local expert in one call with the groups' ends on the device (no host synchronisation, no
  `SORTED_DECODED_BYTES` groups). As `grouped`: scales in the normal range, bf16. Equal to fp32 rounding.
  `prefill_experts="auto"` (the `compiled` preset): the kernel for calls with fewer than
  `fast.prefill_experts.IN_REGISTERS_BELOW_ROWS_PER_EXPERT` sorted rows a local expert (the release's 128 experts
  at an 8K prompt), decode-then-grouped-GEMM for more (cuBLAS's higher tensor-core rate then outweighs the decode).
* The non-user preset `grouped-rows` (`compiled` with `matmul="reference"`): one-row products with packed weights by
  the grouped kernel too (its decoded tile padded to the tensor cores' 16 rows); slower than the fused product at one
  row, so no user preset takes it.
* `overlap_steps=True` (the `compiled` preset): `generate_ids` runs jobs whose requests are all greedy through
  `fast.overlap.OverlapScheduler`, which launches each decode step on the previous step's argmax on the device and
  reads the tokens one step behind (pinned copies and events on CUDA), so the GPU does not wait for the host between
  steps. The same tokens as the plain loop; a request that stops has one more step computed and dropped.
* `compile_layers=True`: in decode steps (one token per sequence, and the speculative loop's verify steps of k+1
  tokens, `MiniMaxM3.step_with_hidden`; with a cache and no trace), each decoder layer runs through `torch.compile`
  (`fast.compiled.CompiledLayers`), one graph per kind of layer and step shape, in which inductor fuses the norms,
  RoPE, cache writes, routing and activations around the matmuls. Needs `moe` and `static_kv`. `layer_reductions`:
  the launch configurations of its large reductions (`fast.launch`).

* `graph=True`: decode steps on CUDA (`MiniMaxM3.step`, which `generate` calls, and `step_with_hidden`, the
  speculative loop's verify steps) are captured in a CUDA graph per KV cache and step shape and replayed
  (`fast.graph.CapturedSteps`): with `moe` and `static_kv` (and no trace, no activation emulation, no expert mask,
  at most `sync_free_tokens` tokens in all) a decode step has no host synchronisation and fixed shapes. The replay
  computes what the same fast paths compute eagerly. The DSpark drafter's greedy passes are captured too
  (`fast.drafter`: each row's context window gathered with a static shape).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import NamedTuple

from ..errors import ConfigError
from .launch import ReductionConfigs

# Rows of x per pass of the fused matmul over a weight (`fast.packed`): each pass decodes every weight element once
# and feeds one fp32 accumulator per row, so more rows mean fewer passes (less weight traffic) but more registers.
FUSED_ROWS = 8
DECODE_MODES = ("reference", "fast", "compile", "triton")
ATTENTION_MODES = ("reference", "triton")
MATMUL_MODES = ("reference", "fused")
GEMV_MODES = ("reference", "triton", "mma", "mma-stored")
SELECTION_MODES = ("reference", "triton")
PREFILL_EXPERT_MODES = ("reference", "triton", "auto")
PROBABILITY_MODES = ("split", "bf16")
# The switches that take one of a few values, and those values
CHOICES = {"decode": DECODE_MODES, "matmul": MATMUL_MODES, "prefill_attention": ATTENTION_MODES,
           "decode_attention": ATTENTION_MODES, "block_selection": SELECTION_MODES, "gemv": GEMV_MODES,
           "attention_probabilities": PROBABILITY_MODES, "prefill_experts": PREFILL_EXPERT_MODES}
# Token count up to which `moe=True` uses the synchronisation-free expert path, and `static_kv` the whole
# cache (decode steps); larger calls (prefill) group tokens by expert (`FastExperts.forward_sorted`) and attend over
# the filled slots only.
SYNC_FREE_TOKENS = 64
# With compiled layers, `FastMiniMaxM3.new_cache` sizes the KV cache in multiples of this many slots: each cache
# length is a compiled graph of its own (static shapes), so prompts of different lengths would otherwise each compile
# anew; the extra slots are future keys, masked.
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
    # rows of the input per pass of the fused matmul over a weight (`fast.packed.Kernels.matmul`)
    fused_rows: int = FUSED_ROWS
    # the fused products read the packed bytes as int32 words (`fast.packed.nvfp4_word_planes`, `mxfp8_word_planes`)
    nvfp4_words: bool = False
    mxfp8_words: bool | str = False  # or "gate_up": only the gate and up projections (`reads_words`)
    compile_layers: bool = False
    # launch configurations of the compiled layers' large reductions over packed weights: "auto" (the table's
    # entry for the model's GPU and this torch, `launch.tuned_for`), None (tuned per compile) or fixed ones
    layer_reductions: ReductionConfigs | str | None = "auto"
    # "triton": prefill calls through the block-sparse attention kernel (`fast.attention_kernel`)
    prefill_attention: str = "reference"
    # "triton": decode-sized calls (up to `sync_free_tokens` tokens) through the attention kernel too, its keys split
    # over the GPU (`fast.attention_kernel`)
    decode_attention: str = "reference"
    # "triton": the MSA block scores of prefill calls by the selection kernel (`fast.selection_kernel`)
    block_selection: str = "reference"
    # prefill calls' RMSNorms, q / k / index norms with their RoPE rotation, SwiGLU activations and the experts'
    # combine, as one compiled kernel each (`fast.prefill`)
    prefill_fusion: bool = False
    # products of more than `fused_tokens` and up to `sync_free_tokens` rows through the grouped Triton kernel
    grouped: bool = False
    # the routed experts' gate and up products of the grouped kernel and their SwiGLU as one launch
    # (`fast.grouped.swiglu_pair_grouped`; the non-user preset `grouped-swiglu`)
    grouped_swiglu: bool = False
    # decode steps of more than 8 tokens: each chosen routed expert multiplies its own tokens only, the (token,
    # choice) pairs sorted by expert, by `fast.mma_gemv`'s ranges (with `gemv` "mma" or "mma-stored")
    expert_ranges: bool = False
    # in compiled regions, the routing's and the block selection's top-k of short rows by a stable sort, which
    # inductor compiles into one Triton kernel with the producer fused (`compiled.top_k`; the `compiled` preset)
    sort_topk: bool = False
    # the grouped and GEMV kernels decode NVFP4 through each block's 8-value table (`fast.grouped._TABLE_ASM`)
    nvfp4_table: bool = False
    # "triton": products of up to `sync_free_tokens` rows through `fast.gemv` (weights reordered at configuration)
    gemv: str = "reference"
    # "triton": prefill's routed experts with packed stacks through `fast.prefill_experts` (decoded in registers);
    # "auto": where a call has few rows an expert (`prefill_experts.multiplies_in_registers`)
    prefill_experts: str = "reference"
    # the attention kernel's value sum: the probabilities as two bf16 parts ("split", 2^-18) or one ("bf16", 2^-9)
    attention_probabilities: str = "split"
    # decode steps (`MiniMaxM3.step`) on CUDA captured in a CUDA graph per KV cache and shape, then replayed
    # (`fast.graph.CapturedSteps`); needs `moe` and `static_kv` (no host synchronisation, static shapes)
    graph: bool = False
    # greedy decode steps launched on the previous step's tokens on the device, before the host reads them
    # (`fast.overlap.OverlapScheduler`)
    overlap_steps: bool = False

    def __post_init__(self) -> None:
        if self.layer_reductions != "auto":
            object.__setattr__(self, "layer_reductions", ReductionConfigs.of(self.layer_reductions))
        for name, modes in CHOICES.items():
            if getattr(self, name) not in modes:
                raise ConfigError(f"fast paths: {name}={getattr(self, name)!r}: choose one of {list(modes)}")
        if self.fused_rows < 1:
            raise ConfigError(f"fast paths: fused_rows={self.fused_rows}: give a positive row count")
        if self.compile_layers and not (self.moe and self.static_kv):
            raise ConfigError("fast paths: compile_layers needs moe=True and static_kv=True (a compiled decode step "
                              "must have static shapes and no host synchronisation)")
        if self.graph and not (self.moe and self.static_kv):
            raise ConfigError("fast paths: graph needs moe=True and static_kv=True (a captured step must have static "
                              "shapes and no host synchronisation)")
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
        """`load_model`'s `fast` argument: a preset's name (`PRESETS`: "off", "on", "compiled", and the finer
        "compile" and "fused"), False/None ("off"), True ("on"), a dict of switches, or a FastPaths."""
        if isinstance(fast, FastPaths):
            return fast
        if fast is None or isinstance(fast, bool):
            fast = "on" if fast else "off"
        if isinstance(fast, str):
            if fast not in PRESETS:
                raise ConfigError(f"fast={fast!r}: choose a preset, one of {list(PRESETS)}")
            return PRESETS[fast].paths
        if isinstance(fast, dict):
            names = {f.name for f in fields(cls)}
            unknown = sorted(set(fast) - names)
            if unknown:
                raise ConfigError(f"fast paths: unknown switches {unknown}; known: {sorted(names)}")
            return cls(**fast)
        raise ConfigError(f"fast={fast!r}: give True, False, a preset's name ({', '.join(PRESETS)}), a dict of "
                          "switches or a FastPaths")

    @property
    def any(self) -> bool:
        return self != FastPaths()

    @property
    def fused_tokens(self) -> int:
        """Calls with up to this many tokens multiply packed weights fused (`PackedWeight.fused_tokens`; 0: none)."""
        return min(self.sync_free_tokens, self.fused_rows) if self.matmul == "fused" else 0

    @property
    def grouped_tokens(self) -> int:
        """Calls with more rows than `fused_tokens` and up to this many go through the grouped kernel (0: none)."""
        return self.sync_free_tokens if self.grouped else 0

    @property
    def gemv_tokens(self) -> int:
        """Calls with up to this many rows go through `fast.gemv` (0: none)."""
        return self.sync_free_tokens if self.gemv != "reference" else 0


REFERENCE = FastPaths()


class Preset(NamedTuple):
    """A named set of fast paths (`PRESETS`): its switches, one line saying what it does (the `--fast` help is made of
    these), and whether users choose it (`minimax-ref --fast`) or only benchmarks and tests do."""

    paths: FastPaths
    description: str
    user: bool = True


_ON = FastPaths(decode="fast", moe=True, static_kv=True, sdpa=True, prefill_attention="triton",
                block_selection="triton", graph=True)

# The presets, by name: `FastPaths.of(name)`, `load_model(fast=name)`, `minimax-ref --fast name` (the user ones) and
# the benchmarks' `--fast`. Every preset but "off" prefills with the Triton attention and selection kernels where they
# run (`prefill_attention="triton"`, `block_selection="triton"`) and replays decode steps from CUDA graphs on a GPU
# (`graph`).
PRESETS: dict[str, Preset] = {
    "off": Preset(REFERENCE, "the reference: no fast path"),
    "on": Preset(_ON, "batched experts without host synchronisation, static-shape cached attention, the SDPA "
                      "attention core, two-pass packed decoding, a bf16 prefill on CUDA through the Triton attention "
                      "and block-selection kernels, decode steps replayed from CUDA graphs on a GPU"),
    "compile": Preset(replace(_ON, decode="compile"), "on, with the packed-weight decoder compiled by torch.compile",
                      user=False),
    "fused": Preset(replace(_ON, matmul="fused"),
                    f"on, plus products with packed weights of up to {FUSED_ROWS} rows by a compiled "
                    "dequantize-and-multiply (with --weights packed)", user=False),
    # sdpa off: the fp32 SDPA kernel does not split the keys of a one-query step over the GPU; the compiled einsum
    # core does. fused_rows=1: the fused matmul reads a weight once per row (the routed experts once per token and
    # choice) on the CUDA cores; from two rows on (batches, verify steps) the grouped kernel reads each chosen tile
    # once for all rows and multiplies on the tensor cores
    "compiled": Preset(
        FastPaths(decode="triton", moe=True, static_kv=True, sdpa=False, matmul="fused", fused_rows=1,
                  compile_layers=True, nvfp4_words=True, mxfp8_words="gate_up", grouped=True, nvfp4_table=True,
                  prefill_attention="triton", block_selection="triton", decode_attention="triton",
                  prefill_fusion=True, prefill_experts="auto", attention_probabilities="bf16", graph=True,
                  overlap_steps=True, sort_topk=True),
        "on without SDPA, plus each decoder layer of a decode step compiled by torch.compile (on first use: "
        "minutes on a GPU), one-row products with packed weights by a compiled dequantize-and-multiply and, on CUDA "
        f"with triton, products of 2 to {SYNC_FREE_TOKENS} rows (batches, verify steps) by a grouped Triton kernel, "
        "decode steps attending through the Triton attention kernel, packed weights decoded for prefill by one "
        "Triton kernel (prefill's routed experts with few rows an expert multiplied from their packed weights, "
        "decoded in registers), prefill's norms, rotations, activations and expert combine as compiled kernels, the "
        "attention kernel's softmax probabilities rounded once to bf16 for the value sum (flash attention's rule), "
        "the compiled step's routing and block-selection top-k as one sort kernel with its producer fused, "
        "and greedy decode steps launched on the previous step's tokens on the device before the host reads them"),
}
# `compiled` with the reordered-weight products of `fast.gemv` for every decode row count (benchmarks measure it
# against `compiled` before a user preset takes it)
PRESETS["gemv"] = Preset(replace(PRESETS["compiled"].paths, gemv="triton"),
                         "compiled, with products of 1 to 64 rows by the split-K GEMV / dot kernel of fast.gemv on "
                         "weights reordered at load (beside the stored planes)", user=False)
# `compiled` with the routed experts' gate, up and SwiGLU as one grouped launch (non-user: a 32-row step was slower
# with it on an H100, BENCHMARKS.md)
PRESETS["grouped-swiglu"] = Preset(replace(PRESETS["compiled"].paths, grouped_swiglu=True),
                                   "compiled, with the routed experts' gate and up products of 2 to 64 rows and their "
                                   "SwiGLU in one grouped-kernel launch (fast.grouped.swiglu_pair_grouped)",
                                   user=False)
# `compiled` with `fast.mma_gemv`'s decode products of up to 8 rows, every weight read where it is stored: no copy,
# so the memory of `compiled` (non-user until its captured step is tested on a GPU and timed beside `compiled`)
PRESETS["gemv-mma-stored"] = Preset(replace(PRESETS["compiled"].paths, gemv="mma-stored"),
                                    "compiled, with decode steps' products with packed weights of up to 8 rows on the "
                                    "tensor cores, every weight read where it is stored (fast.mma_gemv; no copy)",
                                    user=False)
# `compiled` with `fast.mma_gemv`'s decode products: a user's choice, not `auto`'s: the linears' reordered copies take
# memory a full batch needs (the seed's 32 requests at 16 experts fit 30 rows on one H100, and the run was slower)
PRESETS["gemv-mma"] = Preset(replace(PRESETS["compiled"].paths, gemv="mma", expert_ranges=True),
                             "compiled, with decode steps' products with packed weights (up to 32 rows; routed "
                             "experts read where they are stored, each chosen expert times its own tokens) on the "
                             "tensor cores, each lane decoding its MMA fragments (fast.mma_gemv; CUDA, compute "
                             "capability 8.9 and above): the linears' packed bytes kept once more, reordered")
# `compiled` with one-row products too by the grouped kernel (its loop issues fewer instructions an NVFP4 element than
# the GEMV's: benchmarks/kernel_sass.py); slower than the fused product at one row on a GPU (BENCHMARKS.md)
PRESETS["grouped-rows"] = Preset(replace(PRESETS["compiled"].paths, matmul="reference"),
                                 "compiled, with products of 1 to 64 rows (one-row decode steps included) by the "
                                 "grouped Triton kernel instead of the fused dequantize-and-multiply", user=False)
# `compiled` with prefill's routed experts multiplied straight from their packed stacks (`fast.prefill_experts`)
# at any rows an expert (`compiled` chooses by rows an expert: benchmarks measure both sides of its rule)
PRESETS["prefill-experts"] = Preset(replace(PRESETS["compiled"].paths, prefill_experts="triton"),
                                    "compiled, with prefill's routed experts multiplied from their packed weights by "
                                    "one Triton kernel a projection (decoded in registers) instead of decoded to bf16 "
                                    "first, at any rows an expert", user=False)
# `compiled` with the attention kernel's probabilities as two bf16 parts, the other presets' tighter value sum (what
# `compiled` gives up for speed, measured against it)
PRESETS["split-probabilities"] = Preset(replace(PRESETS["compiled"].paths, attention_probabilities="split"),
                                        "compiled, with the attention kernel's softmax probabilities split in two bf16 "
                                        "parts for the value sum (2^-18 relative) instead of rounded once to bf16 "
                                        "(2^-9)", user=False)
USER_PRESETS = tuple(name for name, preset in PRESETS.items() if preset.user)  # what `minimax-ref --fast` offers

# Compiling a decode step takes tens of seconds on the first run of a shape (seconds from the compile cache after);
# below this many bytes of weights on the device a step is so short that CUDA graphs alone ("on") keep the GPU busy
# and compiling does not pay back over a reply.
AUTO_COMPILE_MIN_BYTES = 1 << 30


def auto_preset(device, weight_bytes: int) -> str:
    """`--fast auto` (`load_model(fast="auto")`) for a model of `weight_bytes` on `device`: "compiled" on CUDA from
    `AUTO_COMPILE_MIN_BYTES` on, "on" below, "off" (the reference) on a CPU."""
    import torch

    if torch.device(device).type != "cuda":
        return "off"
    return "compiled" if weight_bytes >= AUTO_COMPILE_MIN_BYTES else "on"


def describe_presets(names) -> str:
    """The presets `names` as "name = description; ...": the `--fast` help of the CLI and the benchmarks."""
    return "; ".join(f"{name} = {PRESETS[name].description}" for name in names)
