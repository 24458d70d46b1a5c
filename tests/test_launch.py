"""Fixed launch configurations of the compiled layers' large reductions (`launch.py`, issue 9).

On CPU: the configuration's validation and text form, the `FastPaths` switch, which reductions the rule fixes, and
what inductor's hook hands the kernel. On CUDA (marked `gpu`): the Triton kernels inductor generates for a packed
matmul and for release-width compiled layers launch with exactly the fixed configuration, and compute the same
function (the compiled model against the same fast paths run eagerly, to fp32 rounding).
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import sympy
import torch

from minimax_ref.errors import ConfigError
from minimax_ref.fast import FastPaths
from minimax_ref.launch import (
    DECODE_REDUCTIONS,
    MIN_OUTPUTS,
    MIN_REDUCED,
    ReductionConfig,
    ReductionConfigs,
    _choices_class,
    _static,
    compiled_with_fixed_reductions,
    fixes,
)

gpu = pytest.mark.gpu


def test_reduction_config_text_and_validation():
    assert ReductionConfig.parse("2,512,4") == ReductionConfig(2, 512, 4)
    assert ReductionConfig(1, 256, 8).triton() == {"XBLOCK": 1, "R0_BLOCK": 256, "num_warps": 8, "num_stages": 1}
    for text in ("1,256", "a,b,c", "1,256,8,1"):
        with pytest.raises(ConfigError, match="XBLOCK,R0_BLOCK,NUM_WARPS"):
            ReductionConfig.parse(text)
    with pytest.raises(ConfigError, match="r0_block=384: give a power of two"):
        ReductionConfig(1, 384, 8)
    with pytest.raises(ConfigError, match="num_warps=64: at most 32"):
        ReductionConfig(1, 256, 64)
    with pytest.raises(ConfigError, match="xblock=0"):
        ReductionConfig(0, 256, 8)


def test_fast_paths_layer_reductions():
    assert FastPaths.of("compiled").layer_reductions == DECODE_REDUCTIONS
    both = ReductionConfigs(ReductionConfig(1, 512, 4), ReductionConfig(1, 512, 4))
    assert FastPaths.of({"layer_reductions": "1,512,4"}).layer_reductions == both
    assert FastPaths.of({"layer_reductions": ReductionConfig(1, 512, 4)}).layer_reductions == both
    assert FastPaths.of({"layer_reductions": [2, 256, 8]}).layer_reductions == ReductionConfigs(
        ReductionConfig(2, 256, 8), ReductionConfig(2, 256, 8))
    split = FastPaths.of({"layer_reductions": "1,256,8/8,512,1"}).layer_reductions
    assert (split.nvfp4, split.mxfp8) == (ReductionConfig(1, 256, 8), ReductionConfig(8, 512, 1))
    assert split.text() == "1,256,8/8,512,1" and ReductionConfigs.parse(split.text()) == split
    assert FastPaths.of({"layer_reductions": None}).layer_reductions is None
    with pytest.raises(ConfigError, match="layer_reductions=3.5"):
        FastPaths(layer_reductions=3.5)
    with pytest.raises(ConfigError, match="NVFP4's/MXFP8's"):
        ReductionConfigs.parse("1,256,8/8,512,1/2,256,8")


def test_the_rule_fixes_only_large_untiled_reductions_over_packed_weights():
    assert fixes(MIN_OUTPUTS, MIN_REDUCED, tiled=False, packed="nvfp4")
    assert fixes(24576, 1536, tiled=False, packed="nvfp4")  # 4 experts' NVFP4 down projection: 1,536 bytes a row
    assert fixes(8192, 6144, tiled=False, packed="mxfp8")
    assert not fixes(8192, 2048, tiled=False, packed=None)  # MSA's value sum over 2,048 gathered keys
    assert not fixes(MIN_OUTPUTS - 1, 6144, tiled=False, packed="mxfp8")  # kv projections: a few hundred rows
    assert not fixes(8192, MIN_REDUCED - 1, tiled=False, packed="nvfp4")  # short rows
    assert not fixes(8192, 6144, tiled=True, packed="nvfp4")
    assert not fixes(None, 6144, tiled=False, packed="nvfp4")  # a dynamic size


def _features(numel, rnumel, reads=("codes",)):
    node = SimpleNamespace(read_writes=SimpleNamespace(reads=[SimpleNamespace(name=n) for n in reads]))
    return SimpleNamespace(numel=sympy.Integer(numel), reduction_numel=sympy.Integer(rnumel),
                           is_reduction=lambda: rnumel != 1, scheduler_nodes=lambda: [node])


def test_inductor_hook_hands_the_kernel_the_configuration():
    """`FixedReductions.triton_kernel_kwargs` (inductor calls it for every Triton kernel it generates) adds its
    format's fixed configuration to a large untiled reduction that reads a packed weight (NVFP4: uint8 codes outnumber
    the fp8 block scales; MXFP8: fp8 elements outnumber the uint8 scales) and leaves every other kernel's arguments
    as they were."""
    configs = ReductionConfigs(ReductionConfig(1, 256, 8), ReductionConfig(8, 512, 1))
    choices = _choices_class()(configs)
    buffers = {"codes": (torch.uint8, 6144 * 6144), "block_scales": (torch.float8_e4m3fn, 6144 * 768),
               "elements": (torch.float8_e4m3fn, 6144 * 12288), "e8m0": (torch.uint8, 6144 * 384),
               "x": (torch.bfloat16, 12288), "cache": (torch.float8_e4m3fn, 8192 * 512), "p": (torch.float32, 8192)}
    choices.dtype_of = lambda name: buffers[name][0]
    choices.numel_of = lambda name: buffers[name][1]
    assert _static(7) == 7 and _static(sympy.Integer(7)) == 7 and _static(sympy.Symbol("s0")) is None
    big = {"x": sympy.Integer(6144), "r0_": sympy.Integer(12288)}
    for reads, want in ((("x", "codes", "block_scales"), configs.nvfp4), (("x", "elements", "e8m0"), configs.mxfp8),
                        (("block_scales", "x", "codes"), configs.nvfp4), (("e8m0", "elements"), configs.mxfp8)):
        got = choices.triton_kernel_kwargs(None, _features(6144, 12288, reads), [big], {"features": None})
        assert got["fixed_config"].config == want.triton()
    for features, groups, kwargs in (
        (_features(6144, 12288, ("p", "cache")), [big], {}),  # attention over an fp8 cache: no packed weight
        (_features(6144, 64), [{"x": 6144, "r0_": 64}], {}),  # a short reduction
        (_features(6144 * 4096, 1), [{"x": 6144 * 4096, "r0_": 1}], {}),  # pointwise
        (_features(6144, 12288), [{"x": 96, "y": 64, "r0_": 12288}], {}),  # tiled
        (_features(6144, 12288), [big], {"override_persistent_reduction": True}),
        (_features(6144, 12288), [big], {"mix_order_reduction": True}),
    ):
        assert "fixed_config" not in choices.triton_kernel_kwargs(None, features, groups, dict(kwargs))
    other = ReductionConfigs(ReductionConfig(1, 256, 8), ReductionConfig(1, 512, 4))
    assert choices.uuid() != _choices_class()(other).uuid()


# ------------------------------------------------------------------------------------------------------- CUDA


class _Launched:
    """Every inductor Triton kernel launched while inside (its `CachingAutotuner.run`)."""

    def __enter__(self):
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner

        self.kernels, self._run = [], CachingAutotuner.run
        launched, run = self.kernels, self._run

        def recorded(kernel, *args, **kwargs):
            launched.append(kernel)
            return run(kernel, *args, **kwargs)

        CachingAutotuner.run = recorded
        return self

    def __exit__(self, *exc):
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner

        CachingAutotuner.run = self._run

    def configs(self, fixed: bool) -> set:
        from torch._inductor.runtime.hints import HeuristicType

        out = set()
        for k in self.kernels:
            if (k.heuristic_type == HeuristicType.FIXED) == fixed and "R0_BLOCK" in k.launchers[0].config.kwargs:
                c = k.launchers[0].config
                out.add((c.kwargs.get("XBLOCK", 1), c.kwargs["R0_BLOCK"], c.num_warps))
        return out

    def fixed_read_uint8(self) -> bool:
        """Whether every kernel launched with a fixed configuration takes a uint8 pointer (a packed weight)."""
        from torch._inductor.runtime.hints import HeuristicType

        fixed = [k for k in self.kernels if k.heuristic_type == HeuristicType.FIXED]
        return all("*u8" in k.triton_meta["signature"].values() for k in fixed)


def _matvec(x: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    return (x * codes.float()).sum(-1)


@gpu
@pytest.mark.parametrize("config", [ReductionConfig(1, 256, 8), ReductionConfig(2, 512, 4)])
def test_compiled_matvec_launches_with_the_fixed_configuration(config):
    """Three matrix-vector products compiled together: 4,096 x 3,072 uint8 codes (a packed weight, as the rule sees
    it) launches with exactly `config` and no tuning; 2,048 x 3,072 in fp32 (no packed weight; another row count, so
    not fused with the first) and 4,096 x 64 codes (short rows) keep inductor's tuning; all three to fp32 rounding."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch._dynamo.reset()
    g = torch.Generator(device="cuda").manual_seed(0)
    x, xs = torch.randn(3072, device="cuda", generator=g), torch.randn(64, device="cuda", generator=g)
    codes = torch.randint(0, 256, (4096, 3072), dtype=torch.uint8, device="cuda", generator=g)
    dense = torch.randn(2048, 3072, device="cuda", generator=g)
    short = torch.randint(0, 256, (4096, 64), dtype=torch.uint8, device="cuda", generator=g)
    fn = compiled_with_fixed_reductions(lambda a, b, c, d, e: (_matvec(a, b), (a * c).sum(-1), _matvec(d, e)),
                                        ReductionConfigs(config, config), dynamic=False, fullgraph=True,
                                        options={"coordinate_descent_tuning": True})
    with _Launched() as launched:
        packed, plain, small = fn(x, codes, dense, xs, short)
        torch.cuda.synchronize()
    assert launched.configs(fixed=True) == {(config.xblock, config.r0_block, config.num_warps)}
    assert len([k for k in launched.kernels if k.heuristic_type.name == "FIXED"]) == 1
    assert torch.allclose(packed, (codes.double() @ x.double()).float(), rtol=1e-5, atol=1e-1)
    assert torch.allclose(plain, (dense.double() @ x.double()).float(), rtol=1e-5, atol=1e-3)
    assert torch.allclose(small, (short.double() @ xs.double()).float(), rtol=1e-5, atol=1e-2)


@gpu
def test_release_width_compiled_layers_with_fixed_reductions():
    """Release-like widths (hidden 2,048, 3 dense layers and an MSA + MoE layer, NVFP4 + MXFP8 packed, fp32): the
    compiled decode steps launch their matmuls with `DECODE_REDUCTIONS` and equal the same fast paths run eagerly
    to fp32 rounding."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from minimax_ref.loader import load_synthetic

    torch._dynamo.reset()
    overrides = {"vocab_size": 8192, "hidden_size": 2048, "num_attention_heads": 16, "dense_intermediate_size": 4096,
                 "intermediate_size": 2048, "shared_intermediate_size": 2048}
    model = load_synthetic("release", layers=4, experts=8, overrides=overrides, device="cuda", dtype=torch.float32,
                           fast=replace(FastPaths.of("compiled"), compile_layers=False), max_seq_len=512)
    ids = torch.randint(0, 8192, (1, 300), generator=torch.Generator().manual_seed(1)).cuda()

    def steps() -> torch.Tensor:
        with torch.no_grad():
            cache = model.new_cache(1, 512)
            out = [model(ids[:, :296], positions=torch.arange(296, device="cuda")[None], cache=cache)]
            for t in range(296, 300):
                out.append(model(ids[:, t:t + 1], positions=torch.tensor([[t]], device="cuda"), cache=cache))
        return torch.cat(out, dim=1)

    want = steps()
    model.set_fast("compiled")
    with _Launched() as launched:
        got = steps()
    assert launched.configs(fixed=True) == {(c.xblock, c.r0_block, c.num_warps)
                                            for c in (DECODE_REDUCTIONS.nvfp4, DECODE_REDUCTIONS.mxfp8)}
    assert launched.fixed_read_uint8()  # the attention reductions kept their tuning
    assert torch.equal(got[:, :296], want[:, :296])
    rel = float((got - want).abs().max() / want.abs().max())
    assert rel < 1e-5, rel
