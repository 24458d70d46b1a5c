"""Fixed launch configurations for the long Triton reductions of the compiled decode layers.

At batch 1 every product with a weight is a reduction over the weight's rows: one output per row, the row's K
elements summed. Inductor compiles each into a Triton reduction whose launch configuration (XBLOCK outputs per
program, R0_BLOCK elements per step of the loop over K, warps) coordinate-descent tuning picks by timing the kernel
alone, accepting any move that measures 0.1 % faster. On an H200 (torch 2.11) that search stopped at a different
configuration from one compile to the next, up to 2x slower in the decode step than one row per program, 256
elements a step and 8 warps (BENCHMARKS.md, `benchmarks/launch_configs.py`). `FixedReductions` gives every such
reduction over a packed weight a configuration chosen beforehand for its format (`DECODE_REDUCTIONS`), so a decode
step's matmul kernels are the same in every compile and run, and are not tuned at all (the other kernels, attention
among them, still are).

The configuration changes only the order of the fp32 sums, never what is summed: each output is the same function,
equal to fp32 rounding (`tests/test_fused.py` compares the compiled layers with the reference on CPU and GPU).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .errors import ConfigError


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


@dataclass(frozen=True)
class ReductionConfigs:
    """The fixed launch configurations of the reductions over packed weights, one per format (`FixedReductions` tells
    them apart by the largest packed tensor a kernel reads: NVFP4's uint8 codes or MXFP8's fp8 elements)."""

    nvfp4: ReductionConfig
    mxfp8: ReductionConfig

    @classmethod
    def parse(cls, text: str) -> ReductionConfigs:
        """`"X,R,W"` (both formats) or `"X,R,W/X,R,W"` (NVFP4's, then MXFP8's), e.g. `"1,256,8/8,512,1"`."""
        parts = text.split("/")
        if len(parts) > 2:
            raise ConfigError(f"reduction launch configurations {text!r}: give XBLOCK,R0_BLOCK,NUM_WARPS for both "
                              "formats, or NVFP4's/MXFP8's, e.g. 1,256,8/8,512,1")
        nvfp4 = ReductionConfig.parse(parts[0])
        return cls(nvfp4, ReductionConfig.parse(parts[1]) if len(parts) == 2 else nvfp4)

    @classmethod
    def of(cls, value) -> ReductionConfigs | None:
        """`FastPaths.layer_reductions`' accepted forms: None (tuned), a ReductionConfigs, one ReductionConfig or
        (X, R, W) for both formats, or the `parse` text."""
        if value is None or isinstance(value, ReductionConfigs):
            return value
        if isinstance(value, str):
            return cls.parse(value)
        if isinstance(value, (tuple, list)):
            value = ReductionConfig(*value)
        if isinstance(value, ReductionConfig):
            return cls(value, value)
        raise ConfigError(f"fast paths: layer_reductions={value!r}: give a launch.ReductionConfigs, a "
                          "launch.ReductionConfig, its text \"XBLOCK,R0_BLOCK,NUM_WARPS\" (or NVFP4's/MXFP8's) or None "
                          "(tuned)")

    def text(self) -> str:
        return "/".join(f"{c.xblock},{c.r0_block},{c.num_warps}" for c in (self.nvfp4, self.mxfp8))


# The decode step's reductions over packed weights: one output per program, 256 elements (NVFP4: bytes) a step, 8
# warps, for both formats. Measured on an H200 (BENCHMARKS.md, session 7): the 60-layer batch-1 step took 26.2 ms with
# it. Relaunched in place (`benchmarks/launch_configs.py --what layers`), each NVFP4 kernel has another fastest
# configuration, all within 15 % of this one; MXFP8 kernels that read one weight run 1.1-2x faster with 8 outputs per
# one-warp program and 512 elements a step (8,512,1), but the kernels that read two (the fused gate + up of the
# shared expert and of the dense MLPs) ran 12x and 11x slower with it, so MXFP8 keeps this one until a configuration
# by number of weights read is measured.
DECODE_REDUCTIONS = ReductionConfigs(nvfp4=ReductionConfig(1, 256, 8), mxfp8=ReductionConfig(1, 256, 8))
# Fixed reductions have at least this many outputs and reduced elements (bytes, for NVFP4's packed pairs): the products
# with packed weights (hundreds to thousands of rows of thousands of elements). Smaller ones (the kv and index key
# projections, hundreds of rows) keep inductor's choice: with one row per program they would not fill the GPU.
MIN_OUTPUTS = 1024
MIN_REDUCED = 1024


def fixes(outputs: int | None, reduced: int | None, tiled: bool, packed: str | None) -> bool:
    """Whether a reduction of `outputs` independent results of `reduced` elements each (None: not a static size) gets
    a fixed configuration: it decodes a packed weight (`packed`: "nvfp4" or "mxfp8", the format of the largest packed
    tensor it reads, `FixedReductions.packed_format`), both sizes are static and at least `MIN_OUTPUTS` x
    `MIN_REDUCED`, and it is not tiled over a second output dimension. Attention reductions (the value sums over
    cached keys, which need several outputs per program to read the cache's rows coalesced) keep their tuning."""
    return (packed is not None and not tiled and outputs is not None and reduced is not None
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
            return f"minimax_ref.launch.FixedReductions({self.configs.text()})"

        def dtype_of(self, buffer: str) -> torch.dtype | None:
            """The dtype of a buffer or graph input of the graph being compiled (None: not one)."""
            try:
                return V.graph.get_dtype(buffer)
            except (KeyError, AttributeError):
                return None

        def numel_of(self, buffer: str) -> int:
            try:
                return _static(V.graph.get_numel(buffer)) or 0
            except (KeyError, AttributeError):
                return 0

        def packed_format(self, features) -> str | None:
            """"nvfp4" or "mxfp8" when the kernel reads a packed weight (a uint8 tensor: NVFP4's codes or MXFP8's E8M0
            scales; nothing else in a decode step is uint8), by the dtype of the largest uint8 or fp8 tensor it reads
            (NVFP4's codes outnumber their fp8 block scales 8 to 1, MXFP8's fp8 elements their uint8 scales 32 to 1);
            else None."""
            reads = {dep.name for node in features.scheduler_nodes() for dep in node.read_writes.reads}
            packed = [(self.numel_of(name), dtype) for name in sorted(reads)
                      if (dtype := self.dtype_of(name)) in (torch.uint8, torch.float8_e4m3fn)]
            if not any(dtype == torch.uint8 for _, dtype in packed):
                return None
            return "nvfp4" if max(packed, key=lambda p: p[0])[1] == torch.uint8 else "mxfp8"

        def triton_kernel_kwargs(self, kernel_cls, features, groups, kernel_kwargs):
            kernel_kwargs = super().triton_kernel_kwargs(kernel_cls, features, groups, kernel_kwargs)
            if (not features.is_reduction() or kernel_kwargs.get("fixed_config") is not None
                    or kernel_kwargs.get("override_persistent_reduction")
                    or kernel_kwargs.get("mix_order_reduction") or len(groups) != 1):
                return kernel_kwargs
            tiled = not (isinstance(groups[0], dict) and set(groups[0]) == {"x", "r0_"})
            fmt = self.packed_format(features)
            if fixes(_static(features.numel), _static(features.reduction_numel), tiled, fmt):
                config = getattr(self.configs, fmt)
                kernel_kwargs = {**kernel_kwargs, "fixed_config": FixedTritonConfig(config.triton())}
            return kernel_kwargs

    return FixedReductions


def inductor_options(configs: ReductionConfigs) -> dict:
    """What to add to `torch.compile`'s options so that inductor's caches tell these compiles from others: the
    choices handler itself where this torch keys its caches on it (torch 2.13 lists `inductor_choices_class` among
    the config's factory keys and hashes the handler's uuid), else no graph cache (torch 2.11 has the option but
    would try to pickle the factory into the key; a graph compiled with other choices must not be reused)."""
    from torch._inductor import config as inductor_config

    if "inductor_choices_class" in getattr(inductor_config, "_cache_config_factory_keys", ()):
        handler = _choices_class()(configs)
        return {"inductor_choices_class": lambda: handler}
    return {"fx_graph_cache": False}


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
