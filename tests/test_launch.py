"""Fixed launch configurations of the compiled layers' large reductions (`fast/launch.py`).

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
from minimax_ref.fast import FastPaths, apply
from minimax_ref.fast.launch import (
    DECODE_REDUCTIONS,
    MIN_OUTPUTS,
    MIN_REDUCED,
    PRODUCT_KINDS,
    TUNED,
    ReductionConfig,
    ReductionConfigs,
    _choices_class,
    _static,
    compiled_with_fixed_reductions,
    fixes,
    kind_of,
    tuned_for,
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
    assert FastPaths.of("compiled").layer_reductions == "auto"  # the table's entry for the model's GPU and torch
    c1, c2 = ReductionConfig(1, 512, 4), ReductionConfig(8, 512, 1)
    everywhere = ReductionConfigs(nvfp4=c1, mxfp8=c1, nvfp4_pair=c1, mxfp8_pair=c1, nvfp4_words=c1, mxfp8_words=c1,
                                  nvfp4_pair_words=c1, mxfp8_pair_words=c1, other=DECODE_REDUCTIONS.other)
    assert FastPaths.of({"layer_reductions": "1,512,4"}).layer_reductions == everywhere
    assert FastPaths.of({"layer_reductions": c1}).layer_reductions == everywhere
    assert FastPaths.of({"layer_reductions": [1, 512, 4]}).layer_reductions == everywhere
    split = FastPaths.of({"layer_reductions": "1,512,4/8,512,1"}).layer_reductions
    assert split == ReductionConfigs(nvfp4=c1, nvfp4_pair=c1, mxfp8=c2, mxfp8_pair=c2, nvfp4_words=c1,
                                     nvfp4_pair_words=c1, mxfp8_words=c2, mxfp8_pair_words=c2,
                                     other=DECODE_REDUCTIONS.other)
    assert FastPaths.of({"layer_reductions": None}).layer_reductions is None
    with pytest.raises(ConfigError, match="layer_reductions=3.5"):
        FastPaths(layer_reductions=3.5)


def test_launch_configurations_are_a_table_with_an_untuned_fallback(monkeypatch):
    """The fixed configurations are data keyed by GPU name and torch version; any other GPU, torch version or a CPU
    gets None (inductor's own tuning), and "auto" resolves to the table's entry when the paths are applied."""
    assert TUNED[("NVIDIA H200", "2.11")] == DECODE_REDUCTIONS
    assert tuned_for("cpu") is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    assert tuned_for("cuda:0") == DECODE_REDUCTIONS
    monkeypatch.setattr(torch, "__version__", "2.12.0")
    assert tuned_for("cuda:0") is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA B200")
    monkeypatch.setattr(torch, "__version__", "2.11.0")
    assert tuned_for("cuda:0") is None


def test_reduction_configs_text_per_kind():
    """Bare parts set NVFP4's and MXFP8's products; `KIND=` parts one kind each (`tuned`: no fixed configuration);
    kinds no part names keep the engine's default; `text()` names every kind and parses back to the same."""
    c1, c2, c3 = ReductionConfig(1, 128, 4), ReductionConfig(8, 512, 1), ReductionConfig(8, 256, 4)
    got = ReductionConfigs.parse("1,128,4/mxfp8=8,512,1/mxfp8_words=8,256,4/other=8,256,4")
    assert got == ReductionConfigs(nvfp4=c1, nvfp4_pair=c1, mxfp8=c2, mxfp8_pair=c1, nvfp4_words=c1,
                                   nvfp4_pair_words=c1, mxfp8_words=c3, mxfp8_pair_words=c1, other=c3)
    assert ReductionConfigs.parse("nvfp4_pair=tuned") == replace(DECODE_REDUCTIONS, nvfp4_pair=None)
    assert ReductionConfigs.parse("mxfp8_pair=1,128,4") == replace(DECODE_REDUCTIONS, mxfp8_pair=c1)
    assert ReductionConfigs.parse("nvfp4_pair_words=1,128,4") == replace(DECODE_REDUCTIONS, nvfp4_pair_words=c1)
    for configs in (got, DECODE_REDUCTIONS, ReductionConfigs()):
        assert ReductionConfigs.parse(configs.text()) == configs
    assert got.text() == ("nvfp4=1,128,4/mxfp8=8,512,1/nvfp4_pair=1,128,4/mxfp8_pair=1,128,4/nvfp4_words=1,128,4/"
                          "mxfp8_words=8,256,4/nvfp4_pair_words=1,128,4/mxfp8_pair_words=1,128,4/other=8,256,4")
    for text, message in (("1,256,8/8,512,1/2,256,8", "at most two bare"),
                          ("other=8,256,4/1,256,8", "before any KIND=X,R,W part"),
                          ("attention=8,256,4", "unknown kind 'attention'; the kinds are nvfp4, mxfp8"),
                          ("mxfp8=8,512", "XBLOCK,R0_BLOCK,NUM_WARPS")):
        with pytest.raises(ConfigError, match=message):
            ReductionConfigs.parse(text)


def test_the_rule_fixes_only_large_untiled_reductions():
    assert fixes(MIN_OUTPUTS, MIN_REDUCED, tiled=False)
    assert fixes(24576, 1536, tiled=False)  # 4 experts' NVFP4 down projection: 1,536 bytes a row
    assert fixes(8192, 2048, tiled=False)  # MSA's value sum over 2,048 gathered keys
    assert not fixes(MIN_OUTPUTS - 1, 6144, tiled=False)  # kv projections: a few hundred rows
    assert not fixes(8192, MIN_REDUCED - 1, tiled=False)  # short rows
    assert not fixes(8192, 6144, tiled=True)
    assert not fixes(None, 6144, tiled=False)  # a dynamic size
    assert [kind_of(f, n) for f, n in ((None, 0), ("nvfp4", 1), ("nvfp4", 2), ("mxfp8", 1), ("mxfp8", 3))] == [
        "other", "nvfp4", "nvfp4_pair", "mxfp8", "mxfp8_pair"]
    assert [kind_of(f, n, 4) for f, n in (("nvfp4", 1), ("nvfp4", 2), ("mxfp8", 1), ("mxfp8", 2))] == [
        "nvfp4_words", "nvfp4_pair_words", "mxfp8_words", "mxfp8_pair_words"]


def _features(numel, rnumel, reads=("codes",)):
    node = SimpleNamespace(read_writes=SimpleNamespace(reads=[SimpleNamespace(name=n) for n in reads]))
    return SimpleNamespace(numel=sympy.Integer(numel), reduction_numel=sympy.Integer(rnumel),
                           is_reduction=lambda: rnumel != 1, scheduler_nodes=lambda: [node])


def test_inductor_hook_hands_the_kernel_its_kinds_configuration():
    """`FixedReductions.triton_kernel_kwargs` (inductor calls it for every Triton kernel it generates) adds the fixed
    configuration of a large untiled reduction's kind: its format (NVFP4: uint8 codes outnumber the fp8 block scales;
    MXFP8: fp8 elements outnumber the uint8 scales), one packed weight or two, or none; and leaves every other
    kernel's arguments, and those of a kind configured None, as they were."""
    c = [ReductionConfig(1, 256, 8), ReductionConfig(8, 512, 1), ReductionConfig(1, 256, 2), ReductionConfig(1, 128, 8),
         ReductionConfig(8, 256, 4), ReductionConfig(1, 64, 4)]
    configs = ReductionConfigs(nvfp4=c[0], mxfp8=c[1], nvfp4_pair=c[2], mxfp8_pair=c[3], other=c[4], nvfp4_words=c[5])
    choices = _choices_class()(configs)
    buffers = {"codes": (torch.uint8, 6144 * 6144), "block_scales": (torch.float8_e4m3fn, 6144 * 768),
               "up_codes": (torch.uint8, 6144 * 6144), "up_block_scales": (torch.float8_e4m3fn, 6144 * 768),
               "elements": (torch.float8_e4m3fn, 6144 * 12288), "e8m0": (torch.uint8, 6144 * 384),
               "up_elements": (torch.float8_e4m3fn, 6144 * 12288), "up_e8m0": (torch.uint8, 6144 * 384),
               "words": (torch.uint8, 6144 * 1536),  # NVFP4's codes of a 12,288-element row as int32 words
               "up_words": (torch.uint8, 6144 * 1536),
               "x": (torch.bfloat16, 12288), "cache": (torch.float8_e4m3fn, 8192 * 512), "p": (torch.float32, 8192)}
    choices.dtype_of = lambda name: buffers[name][0]
    choices.numel_of = lambda name: buffers[name][1]
    choices.width_of = lambda name: 4 if name.endswith("words") else 1
    assert _static(7) == 7 and _static(sympy.Integer(7)) == 7 and _static(sympy.Symbol("s0")) is None
    big = {"x": sympy.Integer(6144), "r0_": sympy.Integer(12288)}
    for reads, want in ((("x", "codes", "block_scales"), c[0]), (("x", "elements", "e8m0"), c[1]),
                        (("block_scales", "x", "codes"), c[0]), (("e8m0", "elements"), c[1]),
                        (("x", "codes", "block_scales", "up_codes", "up_block_scales"), c[2]),
                        (("x", "elements", "e8m0", "up_elements", "up_e8m0"), c[3]),
                        (("p", "cache"), c[4])):  # attention over an fp8 cache: no packed weight
        got = choices.triton_kernel_kwargs(None, _features(6144, 12288, reads), [big], {"features": None})
        assert got["fixed_config"].config == want.triton(), reads
        assert got["override_persistent_reduction"] is False  # looped, as the configuration's R0_BLOCK assumes
    # Words are their own kind, counted in the bytes of the row they hold: 256 words = 1,024 bytes are fixed, 255 are
    # not.
    for n_words, fixed in ((1536, True), (MIN_REDUCED // 4, True), (MIN_REDUCED // 4 - 1, False)):
        got = choices.triton_kernel_kwargs(None, _features(6144, n_words, ("x", "words", "block_scales")),
                                           [{"x": 6144, "r0_": n_words}], {})
        assert ("fixed_config" in got) == fixed and (not fixed or got["fixed_config"].config == c[5].triton())
    pair_of_words = _features(6144, 1536, ("x", "words", "block_scales", "up_words", "up_block_scales"))
    assert "fixed_config" not in choices.triton_kernel_kwargs(None, pair_of_words, [{"x": 6144, "r0_": 1536}], {})
    for features, groups, kwargs in (
        (_features(6144, 64), [{"x": 6144, "r0_": 64}], {}),  # a short reduction
        (_features(6144 * 4096, 1), [{"x": 6144 * 4096, "r0_": 1}], {}),  # pointwise
        (_features(6144, 12288), [{"x": 96, "y": 64, "r0_": 12288}], {}),  # tiled
        (_features(6144, 12288), [big], {"override_persistent_reduction": True}),
        (_features(6144, 12288), [big], {"mix_order_reduction": True}),
    ):
        assert "fixed_config" not in choices.triton_kernel_kwargs(None, features, groups, dict(kwargs))
    tuned_attention = _choices_class()(replace(configs, other=None))
    got = tuned_attention.triton_kernel_kwargs(None, _features(6144, 12288, ("p", "cache")), [big], {})
    assert "fixed_config" not in got
    assert choices.uuid() != tuned_attention.uuid()


def test_kinds_read_from_inductor_graphs():
    """`FixedReductions.packed_reads` on the kernels inductor actually schedules (CPU compiles, inspected after
    fusion): an NVFP4 product read as bytes or as int32 words (`words=True`, an alias of the stored bytes), two NVFP4
    products fused into one kernel (gate and up), an MXFP8 product read as bytes or words, and a plain fp32
    reduction."""

    from minimax_ref.fast.packed import FUSED_INDUCTOR_OPTIONS, packed_matmul
    from minimax_ref.weights.quant import quantize_mxfp8, quantize_nvfp4

    choices = _choices_class()(DECODE_REDUCTIONS)
    g = torch.Generator().manual_seed(0)
    nv = [quantize_nvfp4(torch.randn(4, 64, 256, generator=g)) for _ in range(2)]
    mx = quantize_mxfp8(torch.randn(64, 256, generator=g))
    x = torch.randn(4, 1, 256, generator=g).to(torch.bfloat16)
    ids = torch.tensor([3, 0, 3, 1])

    def kinds(fn, *args) -> list:
        seen = []

        def inspect(nodes):
            for node in nodes:
                if node.is_reduction():
                    seen.append(choices.packed_reads(SimpleNamespace(scheduler_nodes=node.get_nodes)))
            return nodes

        torch._dynamo.reset()
        with torch._inductor.config.patch(force_disable_caches=True, _post_fusion_custom_pass=inspect):
            torch.compile(fn, fullgraph=True, dynamic=False, options=FUSED_INDUCTOR_OPTIONS)(*args)
        return seen

    def nvfp4(words: bool):
        return lambda x, i: packed_matmul(x, "nvfp4", *nv[0], torch.bfloat16, i, True, words=words)

    def gate_up(x, i):
        a, b = (packed_matmul(x, "nvfp4", *w, torch.bfloat16, i, True, words=True) for w in nv)
        return a * b

    assert kinds(nvfp4(False), x, ids) == [("nvfp4", 1, 1)]
    assert kinds(nvfp4(True), x, ids) == [("nvfp4", 1, 4)]  # int32 words: 4 bytes of the row per reduced index
    assert kinds(gate_up, x, ids) == [("nvfp4", 2, 4)]
    assert kinds(lambda x: packed_matmul(x, "mxfp8", *mx, None, torch.bfloat16, None, True), x[0]) == [("mxfp8", 1, 1)]
    mx_words = lambda x: packed_matmul(x, "mxfp8", *mx, None, torch.bfloat16, None, True, words=True)  # noqa: E731
    assert kinds(mx_words, x[0]) == [("mxfp8", 1, 4)]
    assert kinds(lambda a, b: (a * b).sum(-1), torch.randn(64, 256), torch.randn(256)) == [(None, 0, 1)]


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
@pytest.mark.parametrize("other", [None, ReductionConfig(8, 256, 4)], ids=["other-tuned", "other-fixed"])
def test_compiled_matvec_launches_with_the_fixed_configuration(config, other):
    """Three matrix-vector products compiled together: 4,096 x 3,072 uint8 codes (a packed weight, as the rule sees
    it) launches with exactly `config` and no tuning; 2,048 x 3,072 in fp32 (no packed weight; another row count, so
    not fused with the first) with `other` (None: tuned); 4,096 x 64 codes (short rows) keep inductor's tuning; all
    three to fp32 rounding."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch._dynamo.reset()
    g = torch.Generator(device="cuda").manual_seed(0)
    x, xs = torch.randn(3072, device="cuda", generator=g), torch.randn(64, device="cuda", generator=g)
    codes = torch.randint(0, 256, (4096, 3072), dtype=torch.uint8, device="cuda", generator=g)
    dense = torch.randn(2048, 3072, device="cuda", generator=g)
    short = torch.randint(0, 256, (4096, 64), dtype=torch.uint8, device="cuda", generator=g)
    fn = compiled_with_fixed_reductions(lambda a, b, c, d, e: (_matvec(a, b), (a * c).sum(-1), _matvec(d, e)),
                                        replace(ReductionConfigs.uniform(config), other=other), dynamic=False,
                                        fullgraph=True, options={"coordinate_descent_tuning": True})
    with _Launched() as launched:
        packed, plain, small = fn(x, codes, dense, xs, short)
        torch.cuda.synchronize()
    want = {(c.xblock, c.r0_block, c.num_warps) for c in (config, other) if c is not None}
    assert launched.configs(fixed=True) == want
    assert len([k for k in launched.kernels if k.heuristic_type.name == "FIXED"]) == len(want)
    assert torch.allclose(packed, (codes.double() @ x.double()).float(), rtol=1e-5, atol=1e-1)
    assert torch.allclose(plain, (dense.double() @ x.double()).float(), rtol=1e-5, atol=1e-3)
    assert torch.allclose(small, (short.double() @ xs.double()).float(), rtol=1e-5, atol=1e-2)


def _release_width_model(dtype: torch.dtype, fast: FastPaths):
    """Release-like widths at test size on the GPU: hidden 2,048, 3 dense layers and an MSA + MoE layer of 8 experts,
    NVFP4 + MXFP8 packed."""
    from minimax_ref.weights.loader import load_synthetic

    overrides = {"vocab_size": 8192, "hidden_size": 2048, "num_attention_heads": 16, "dense_intermediate_size": 4096,
                 "intermediate_size": 2048, "shared_intermediate_size": 2048}
    return load_synthetic("release", layers=4, experts=8, overrides=overrides, device="cuda", dtype=dtype, fast=fast,
                          max_seq_len=512)


def _prefill_and_decode(model) -> torch.Tensor:
    """The logits of a 296-token prefill and of 4 decode steps after it, float32 `[1, 300, V]`."""
    ids = torch.randint(0, 8192, (1, 300), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.no_grad():
        cache = model.new_cache(1, 512)
        out = [model(ids[:, :296], positions=torch.arange(296, device="cuda")[None], cache=cache)]
        for t in range(296, 300):
            out.append(model(ids[:, t:t + 1], positions=torch.tensor([[t]], device="cuda"), cache=cache))
    return torch.cat(out, dim=1).float()


@gpu
def test_release_width_compiled_layers_with_fixed_reductions():
    """Release-like widths (`_release_width_model`, fp32), each
    kind of product over packed weights given a configuration of its own: the compiled decode steps launch every
    kind's matmuls with it (a kernel with a pair's configuration reads two packed weights, one with a single weight's
    reads one), attention keeps its tuning, and the steps equal the same fast paths run eagerly to fp32 rounding."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from torch._inductor.runtime.hints import HeuristicType

    torch._dynamo.reset()
    bytes_ = replace(FastPaths.of("compiled"), nvfp4_words=False, mxfp8_words=False)  # the bytes kinds only
    model = _release_width_model(torch.float32, replace(bytes_, compile_layers=False))
    want = _prefill_and_decode(model)
    single, pair = ReductionConfig(1, 128, 4), ReductionConfig(1, 256, 2)
    mx_single, mx_pair = ReductionConfig(2, 512, 4), ReductionConfig(1, 256, 8)
    configs = ReductionConfigs(nvfp4=single, mxfp8=mx_single, nvfp4_pair=pair, mxfp8_pair=mx_pair, other=None)
    apply(model, replace(bytes_, layer_reductions=configs))
    with _Launched() as launched:
        got = _prefill_and_decode(model)

    def key(c: ReductionConfig) -> tuple[int, int, int]:
        return c.xblock, c.r0_block, c.num_warps

    assert launched.configs(fixed=True) == {key(c) for c in (single, pair, mx_single, mx_pair)}
    assert launched.fixed_read_uint8()  # the attention reductions kept their tuning
    for k in launched.kernels:
        if k.heuristic_type == HeuristicType.FIXED:
            c = k.launchers[0].config
            weights = list(k.triton_meta["signature"].values()).count("*u8")
            pairs = {key(pair), key(mx_pair)}
            assert ((c.kwargs.get("XBLOCK", 1), c.kwargs["R0_BLOCK"], c.num_warps) in pairs) == (weights >= 2), k
    assert torch.equal(got[:, :296], want[:, :296])
    rel = float((got - want).abs().max() / want.abs().max())
    assert rel < 1e-5, rel


@gpu
def test_release_width_compiled_layers_read_packed_words():
    """bf16 at release-like widths (as above): `fast="compiled"` reading NVFP4's and MXFP8's packed bytes as int32
    words (`nvfp4_words`, `mxfp8_words`), every product, its row counted in bytes (`FixedReductions.packed_reads`),
    launches with its words kind's fixed configuration (none with the bytes kinds'); the decode steps equal
    those of the same model reading bytes up to the bf16 rounding of fp32 sums taken in another order, and the
    prefill (not compiled) is the same."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch._dynamo.reset()
    # told apart from one another and from the bytes kinds'
    words = {"nvfp4_words": (1, 64, 4), "mxfp8_words": (2, 128, 4), "nvfp4_pair_words": (1, 64, 2),
             "mxfp8_pair_words": (1, 128, 8)}
    configs = ReductionConfigs(**dict.fromkeys(PRODUCT_KINDS, ReductionConfig(1, 512, 8)),
                               **{kind: ReductionConfig(*c) for kind, c in words.items()},
                               other=ReductionConfig(8, 256, 4))
    fast = replace(FastPaths.of("compiled"), layer_reductions=configs, nvfp4_words=True, mxfp8_words=True)
    model = _release_width_model(torch.bfloat16, fast)
    with _Launched() as launched:
        by_words = _prefill_and_decode(model)
    got = launched.configs(fixed=True)
    assert set(words.values()) <= got and (1, 512, 8) not in got, got  # every product read as words, with its kind's
    torch._dynamo.reset()
    apply(model, replace(fast, nvfp4_words=False, mxfp8_words=False))
    by_bytes = _prefill_and_decode(model)
    assert torch.equal(by_words[:, :296], by_bytes[:, :296])
    rel = float((by_words[:, 296:] - by_bytes[:, 296:]).abs().max() / by_bytes[:, 296:].abs().max())
    assert rel < 3e-2, rel
