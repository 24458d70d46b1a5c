"""Launch configurations of the compiled decode layers' long Triton reductions, as data.

At batch 1 every product with a weight is a reduction over the weight's rows: one output per row, the row's K
elements summed. Inductor compiles each into a Triton reduction whose launch configuration (XBLOCK outputs per
program, R0_BLOCK elements per step of the loop over K, warps) coordinate-descent tuning picks by timing the kernel
alone; that search can stop at a different configuration from one compile to the next. `FixedReductions` gives every
such reduction a configuration chosen beforehand for its kind (`KINDS`: over one or over two packed weights, of either
format, read as bytes or as int32 words, or over no packed weight, as attention's value sums are), so a decode step's
matmul kernels are the same in every compile and run.

The configurations are a table keyed by GPU name and torch version (`TUNED`, `tuned_for`); on any other GPU or torch
version the kernels keep inductor's own tuning. The configuration changes only the order of the fp32 sums, never what
is summed (`tests/test_launch.py`, `tests/test_fused.py`).

`KernelTiles` is the common form of the engine's own Triton kernels' launch configurations (`grouped.Tiles`,
`attention_kernel.Tiles`, `selection_kernel.Tiles`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import ClassVar

import torch

from ..errors import ConfigError


@dataclass(frozen=True)
class KernelTiles:
    """A Triton kernel's launch configuration: ints, first two tile sides (powers of two), `num_warps` (a power of
    two) and `num_stages`, then any further choices of the kernel's own, written "SIDE,SIDE,NUM_WARPS,NUM_STAGES[,...]"
    as the benchmarks take them (`parse`, `text`; trailing fields left out keep their defaults). A subclass declares
    the fields with their defaults, `KIND` (the kernel's name in errors) and its further bounds (`check`)."""

    KIND: ClassVar[str] = "kernel"

    def __post_init__(self) -> None:
        for f in fields(self)[:3]:
            v = getattr(self, f.name)
            if v < 1 or v & (v - 1):
                raise ConfigError(f"{self.KIND} tiles: {f.name}={v}: give a power of two")
        self.check()

    def check(self) -> None:
        """The subclass's bounds beyond powers of two (raises ConfigError)."""

    @classmethod
    def parse(cls, text: str) -> KernelTiles:
        """The configuration written as "SIDE,SIDE,NUM_WARPS,NUM_STAGES" (the field names upper-cased)."""
        names = [f.name for f in fields(cls)]
        try:
            values = [int(v) for v in text.split(",")]
        except ValueError:
            values = []
        if not 4 <= len(values) <= len(names):
            raise ConfigError(f"{cls.KIND} tiles {text!r}: give {','.join(n.upper() for n in names)} (from the fifth "
                              f"on optional), e.g. "
                              f"{cls().text()}")
        return cls(*values)

    def text(self) -> str:
        values = [getattr(self, f.name) for f in fields(self)]
        while len(values) > 4 and values[-1] == fields(self)[len(values) - 1].default:
            values.pop()  # trailing defaults left out, as `parse` takes them
        return ",".join(str(v) for v in values)


@dataclass(frozen=True)
class ReductionConfig:
    """One launch configuration of a Triton reduction: `xblock` outputs per program, `r0_block` reduced elements
    per loop step, `num_warps` warps per program (all powers of two); `num_stages` software-pipelining stages."""

    xblock: int = 1
    r0_block: int = 256
    num_warps: int = 8
    num_stages: int = 1

    def __post_init__(self) -> None:
        for name in ("xblock", "r0_block", "num_warps"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1 or v & (v - 1):
                raise ConfigError(f"reduction launch configuration: {name}={v!r}: give a power of two")
        if self.num_warps > 32:
            raise ConfigError(f"reduction launch configuration: num_warps={self.num_warps}: at most 32 (1,024 threads)")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ConfigError(f"reduction launch configuration: num_stages={self.num_stages!r}: give a positive count")

    @classmethod
    def parse(cls, text: str) -> ReductionConfig:
        """`"XBLOCK,R0_BLOCK,NUM_WARPS"` (the command lines' form), e.g. `"1,256,8"`."""
        try:
            xblock, r0_block, num_warps = (int(v) for v in text.split(","))
        except ValueError:
            raise ConfigError(f"reduction launch configuration {text!r}: give three integers "
                              "XBLOCK,R0_BLOCK,NUM_WARPS, "
                              "e.g. 1,256,8") from None
        return cls(xblock, r0_block, num_warps)

    def triton(self) -> dict[str, int]:
        """The configuration as inductor's `FixedTritonConfig` takes it."""
        return {"XBLOCK": self.xblock, "R0_BLOCK": self.r0_block, "num_warps": self.num_warps,
                "num_stages": self.num_stages}


# The kinds of reduction `FixedReductions` tells apart, in the order of `ReductionConfigs`' fields: products over one
# packed weight of each format, over two or more (the fused gate + up projections: two accumulators per output), the
# same four reading the packed bytes as int32 words (`FastPaths.nvfp4_words`, `mxfp8_words`: a reduced index then
# holds four bytes, so the best step differs),
# and the large reductions that read no packed weight (in a decode step: attention's sums of cached values).
PRODUCT_KINDS = ("nvfp4", "mxfp8", "nvfp4_pair", "mxfp8_pair")
KINDS = (*PRODUCT_KINDS, *(f"{kind}_words" for kind in PRODUCT_KINDS), "other")


@dataclass(frozen=True)
class ReductionConfigs:
    """The fixed launch configuration of each kind of large reduction (`KINDS`; None: that kind keeps inductor's
    tuning). `FixedReductions` tells the kinds apart by what a kernel reads: NVFP4's uint8 codes or MXFP8's fp8
    elements as its largest packed tensor, one packed weight or several."""

    nvfp4: ReductionConfig | None = None  # the routed experts' down projection
    mxfp8: ReductionConfig | None = None  # q_proj, o_proj, the shared expert's and dense MLPs' down projections
    nvfp4_pair: ReductionConfig | None = None  # the routed experts' gate + up
    mxfp8_pair: ReductionConfig | None = None  # gate + up of the shared expert and of the dense MLPs
    nvfp4_words: ReductionConfig | None = None  # the same four, the packed bytes read as int32 words
    mxfp8_words: ReductionConfig | None = None
    nvfp4_pair_words: ReductionConfig | None = None
    mxfp8_pair_words: ReductionConfig | None = None
    other: ReductionConfig | None = None  # attention's value sums; every product, with weights decoded at load

    @classmethod
    def uniform(cls, config: ReductionConfig) -> ReductionConfigs:
        """`config` for every product over packed weights (bytes or words); the reductions over none (`other`) as
        `DECODE_REDUCTIONS` has them."""
        return cls(**{**dict.fromkeys(KINDS, config), "other": DECODE_REDUCTIONS.other})

    @classmethod
    def parse(cls, text: str) -> ReductionConfigs:
        """The command lines' form: parts separated by `/`. Up to two bare `X,R,W` parts come first: NVFP4's
        products (one weight and two, bytes and words), then MXFP8's (one bare part: both formats). `KIND=X,R,W` or
        `KIND=tuned` parts (a kind of `KINDS`) then set one kind. Kinds that no part names keep `DECODE_REDUCTIONS`'
        configuration. E.g. `"1,256,8"`, `"1,256,8/8,512,1"`, `"mxfp8=8,512,1/mxfp8_words=8,128,1/other=8,256,4"`."""
        values = {kind: getattr(DECODE_REDUCTIONS, kind) for kind in KINDS}
        bare: list[ReductionConfig] = []
        keyed: dict[str, ReductionConfig | None] = {}
        for part in text.split("/"):
            kind, eq, value = part.rpartition("=")
            if not eq:
                if keyed or len(bare) == 2:
                    raise ConfigError(f"reduction launch configurations {text!r}: at most two bare X,R,W parts "
                                      "(NVFP4's, then MXFP8's), before any KIND=X,R,W part")
                bare.append(ReductionConfig.parse(part))
            elif kind not in KINDS:
                raise ConfigError(f"reduction launch configurations {text!r}: unknown kind {kind!r}; the kinds are "
                                  f"{', '.join(KINDS)}")
            else:
                keyed[kind] = None if value == "tuned" else ReductionConfig.parse(value)
        if bare:
            values.update((kind, bare[0] if kind.startswith("nvfp4") else bare[-1])
                          for kind in KINDS if kind != "other")
        values.update(keyed)
        return cls(**values)

    @classmethod
    def of(cls, value) -> ReductionConfigs | None:
        """`FastPaths.layer_reductions`' accepted forms: None (all tuned), a ReductionConfigs, one ReductionConfig or
        (X, R, W) for every product over packed weights, or the `parse` text."""
        if value is None or isinstance(value, ReductionConfigs):
            return value
        if isinstance(value, str):
            return cls.parse(value)
        if isinstance(value, (tuple, list)):
            value = ReductionConfig(*value)
        if isinstance(value, ReductionConfig):
            return cls.uniform(value)
        raise ConfigError(f"fast paths: layer_reductions={value!r}: give a launch.ReductionConfigs, a "
                          "launch.ReductionConfig, its text \"XBLOCK,R0_BLOCK,NUM_WARPS\" (or the per-kind form of "
                          "ReductionConfigs.parse) or None (tuned)")

    def text(self) -> str:
        """The `parse` form that names every kind."""
        def one(c: ReductionConfig | None) -> str:
            return "tuned" if c is None else f"{c.xblock},{c.r0_block},{c.num_warps}"
        return "/".join(f"{kind}={one(getattr(self, kind))}" for kind in KINDS)


# The tuned configurations of an H200 with torch 2.11, one per kind (`benchmarks/launch_configs.py --what layers`
# relaunches each kernel of a release-width decode step with each candidate; `benchmarks/profile_decode.py` times whole
# steps). NVFP4: one output row per program; MXFP8 over one weight: 8 rows per one-warp program, 512 elements a step
# (the fused gate + up, two accumulators per row, keeps 1,256,8: it would spill registers); attention's value sums:
# 8 outputs per program, whose cached rows are read coalesced across the outputs.
DECODE_REDUCTIONS = ReductionConfigs(nvfp4=ReductionConfig(1, 128, 4), mxfp8=ReductionConfig(8, 512, 1),
                                     nvfp4_pair=ReductionConfig(1, 256, 2), mxfp8_pair=ReductionConfig(1, 256, 8),
                                     nvfp4_words=ReductionConfig(1, 128, 4), mxfp8_words=ReductionConfig(1, 256, 4),
                                     nvfp4_pair_words=ReductionConfig(1, 256, 2),
                                     mxfp8_pair_words=ReductionConfig(1, 256, 8),
                                     other=ReductionConfig(8, 256, 4))
# GPU name (`torch.cuda.get_device_name`) and torch major.minor -> the tuned configurations.
TUNED: dict[tuple[str, str], ReductionConfigs] = {("NVIDIA H200", "2.11"): DECODE_REDUCTIONS}


def tuned_for(device: torch.device | str) -> ReductionConfigs | None:
    """The `TUNED` configurations of `device`'s GPU and this torch, or None (inductor's own tuning: other GPUs, other
    torch versions, CPUs)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    version = ".".join(torch.__version__.split(".")[:2])
    return TUNED.get((torch.cuda.get_device_name(device), version))


# Fixed reductions have at least this many outputs and reduced elements (bytes of the packed weight's row, for NVFP4's
# packed pairs and for rows read as int32 words alike): the products with packed weights (hundreds to thousands of
# rows of thousands of elements) and attention's value sums (thousands of outputs over thousands of keys). Smaller ones
# (the kv and index key projections, hundreds of rows; the norms, the router) keep inductor's choice: with one row per
# program they would not fill the GPU.
MIN_OUTPUTS = 1024
MIN_REDUCED = 1024


def kind_of(packed: str | None, weights: int, width: int = 1) -> str:
    """The `KINDS` entry of a reduction reading `weights` packed weights whose largest packed tensor is of format
    `packed` ("nvfp4", "mxfp8"; None when it reads none) and is loaded `width` bytes at a time (4: int32 words)."""
    if packed is None:
        return "other"
    return packed + ("_pair" if weights >= 2 else "") + ("_words" if width == 4 else "")


def fixes(outputs: int | None, reduced: int | None, tiled: bool) -> bool:
    """Whether a reduction of `outputs` independent results of `reduced` elements each (None: not a static size) is
    large enough to get its kind's fixed configuration: both sizes static and at least `MIN_OUTPUTS` x `MIN_REDUCED`,
    and not tiled over a second output dimension."""
    return (not tiled and outputs is not None and reduced is not None
            and outputs >= MIN_OUTPUTS and reduced >= MIN_REDUCED)


def _static(expr) -> int | None:
    """A size inductor hands over (an int or a sympy expression) as an int, or None when it is symbolic."""
    if isinstance(expr, int):
        return expr
    return int(expr) if getattr(expr, "is_number", False) else None


def _choices_class():
    from torch._inductor.choices import InductorChoices
    from torch._inductor.codegen.triton import FixedTritonConfig
    from torch._inductor.virtualized import V

    class FixedReductions(InductorChoices):
        """Inductor's default choices, except that the large looped reductions over packed weights (`fixes`) are
        generated with the fixed launch configuration of their format (`triton_kernel_kwargs`, inductor's hook for
        that) instead of a tuned one."""

        def __init__(self, configs: ReductionConfigs):
            super().__init__()
            self.configs = configs

        def uuid(self) -> str:  # part of inductor's cache key
            return f"minimax_ref.fast.launch.FixedReductions({self.configs.text()})"

        def dtype_of(self, buffer: str) -> torch.dtype | None:
            """The dtype of a buffer or graph input of the graph being compiled (None: not one); for an alias that
            reinterprets a tensor's bytes (`aten.view.dtype`: NVFP4's codes or MXFP8's elements read as int32
            words, `fast.packed.nvfp4_word_planes`, `fast.packed.mxfp8_word_planes`), the dtype of that tensor."""
            try:
                dtype = V.graph.get_dtype(buffer)
                origins = list(getattr(V.graph.get_buffer(buffer), "origins", None) or ())
            except (KeyError, AttributeError, NotImplementedError):
                return None
            if len(origins) == 1 and origins[0].target is torch.ops.aten.view.dtype:
                source = getattr(origins[0].args[0], "meta", {}).get("val")
                if isinstance(source, torch.Tensor):
                    return source.dtype
            return dtype

        def numel_of(self, buffer: str) -> int:
            try:
                return _static(V.graph.get_numel(buffer)) or 0
            except (KeyError, AttributeError):
                return 0

        def packed_reads(self, features) -> tuple[str | None, int, int]:
            """The format of the packed weights a kernel reads, how many it reads, and the bytes of that format's
            largest tensor one reduced index loads. A packed weight is a uint8 tensor (NVFP4's codes, also when read as
            int32 words, or MXFP8's E8M0 scales, one per weight; nothing else in a decode step is uint8); the format is
            the dtype of the largest uint8 or fp8 tensor read, in elements (NVFP4's codes outnumber their fp8 block
            scales 8 to 1, 2 to 1 as words; MXFP8's fp8 elements their uint8 scales 32 to 1, 8 to 1 as words):
            "nvfp4" or "mxfp8", None with no uint8 read (then 0 weights and 1 byte). The bytes are 4 for a weight
            read as int32 words, else 1."""
            reads = {dep.name for node in features.scheduler_nodes() for dep in node.read_writes.reads}
            packed = [(self.numel_of(name), dtype, name) for name in sorted(reads)
                      if (dtype := self.dtype_of(name)) in (torch.uint8, torch.float8_e4m3fn)]
            weights = sum(dtype == torch.uint8 for _, dtype, _ in packed)
            if not weights:
                return None, 0, 1
            _, dtype, name = max(packed, key=lambda p: p[0])
            return ("nvfp4" if dtype == torch.uint8 else "mxfp8"), weights, self.width_of(name)

        def width_of(self, buffer: str) -> int:
            """The bytes of one element of a buffer as the kernel loads it (4 for a packed weight read as int32 words,
            where `dtype_of` names the dtype they alias); 1 when the graph does not know the buffer."""
            try:
                return V.graph.get_dtype(buffer).itemsize
            except (KeyError, AttributeError, NotImplementedError):
                return 1

        def triton_kernel_kwargs(self, kernel_cls, features, groups, kernel_kwargs):
            kernel_kwargs = super().triton_kernel_kwargs(kernel_cls, features, groups, kernel_kwargs)
            if (not features.is_reduction() or kernel_kwargs.get("fixed_config") is not None
                    or kernel_kwargs.get("override_persistent_reduction")
                    or kernel_kwargs.get("mix_order_reduction") or len(groups) != 1):
                return kernel_kwargs
            tiled = not (isinstance(groups[0], dict) and set(groups[0]) == {"x", "r0_"})
            packed, weights, width = self.packed_reads(features)
            config = getattr(self.configs, kind_of(packed, weights, width))
            reduced = _static(features.reduction_numel)
            if config is not None and fixes(_static(features.numel), reduced and reduced * width, tiled):
                # looped, as the configuration assumes: inductor would make a reduction of at most 1,024 indices
                # (NVFP4's or MXFP8's rows read as words) persistent, a kernel without the R0_BLOCK it sets
                kernel_kwargs = {**kernel_kwargs, "fixed_config": FixedTritonConfig(config.triton()),
                                 "override_persistent_reduction": False}
            return kernel_kwargs

    return FixedReductions


class ChoicesFactory:
    """What `inductor_choices_class` holds: a callable making the `FixedReductions` handler of `configs`. A plain
    class, so that inductor's caches can take it into their keys either way a torch does: by the handler's uuid
    (torch 2.13 lists the option among the config's factory keys) or by pickling the config (torch 2.11 pickles
    every option; this pickles as its class and `configs`)."""

    def __init__(self, configs: ReductionConfigs):
        self.configs = configs

    def __call__(self):
        return _choices_class()(self.configs)


def inductor_options(configs: ReductionConfigs) -> dict:
    """What to add to `torch.compile`'s options so that inductor's caches tell these compiles from others (a graph
    compiled with other choices must not be reused) and still keep them across processes: the choices handler's
    factory (`ChoicesFactory`)."""
    return {"inductor_choices_class": ChoicesFactory(configs)}


@contextlib.contextmanager
def fixed_reductions(configs: ReductionConfigs) -> Iterator[None]:
    """Inside: inductor compiles (on this thread) give the large reductions over packed weights `configs`
    (`FixedReductions`)."""
    from torch._inductor.virtualized import V

    with V.set_choices_handler(_choices_class()(configs)):
        yield


def compiled_with_fixed_reductions(fn, configs: ReductionConfigs | None, **compile_kwargs):
    """`torch.compile(fn, **compile_kwargs)`, whose compiles (on first use, and any recompile) run inside
    `fixed_reductions(configs)`; `configs=None`: plain `torch.compile`, every kernel tuned as the options say."""
    if configs is None:
        return torch.compile(fn, **compile_kwargs)
    options = {**compile_kwargs.pop("options", {}), **inductor_options(configs)}
    compiled = torch.compile(fn, options=options, **compile_kwargs)

    def run(*args, **kwargs):
        with fixed_reductions(configs):
            return compiled(*args, **kwargs)

    return run
