"""Prefill's fused norms and rotations (`fast.prefill`; `FastPaths(prefill_fusion=True)`, the non-user preset
`fusion`): each compiled function against the reference functions it fuses (`gemma_rms_norm`, `apply_rope`) and a
float64 computation of the same contract, and a model's prefill through them."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from minimax_ref.fast import FastPaths, apply
from minimax_ref.fast import prefill as fp
from minimax_ref.model.norm import gemma_rms_norm
from minimax_ref.model.rope import apply_rope, rope_cos_sin, rope_inv_freq


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of each element of `x` in its dtype (bf16: 8 significant bits)."""
    mant = torch.finfo(x.dtype).eps  # 2^-(significant bits - 1)
    mag = x.float().abs().clamp_min(torch.finfo(x.dtype).tiny)
    return torch.exp2(torch.floor(torch.log2(mag))) * mant


def _norm64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xd = x.double()
    return xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + eps) * (1 + w.double())


def _operands(shape, rot: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3).to(torch.bfloat16)
    w = torch.randn(shape[-1], generator=g) * 0.1
    B, T = shape[0], shape[1]
    pos = torch.arange(T)[None].expand(B, T) + torch.arange(B)[:, None] * 17
    cos, sin = rope_cos_sin(pos, rope_inv_freq(rot, 10000.0))
    return x, w, cos, sin


@pytest.mark.parametrize("shape", [(1, 300, 96), (2, 70, 4, 32), (3, 65, 1, 64)])
def test_fused_norm_within_one_ulp(shape):
    """The compiled norm equals `gemma_rms_norm` except where the fp32 value lies at a bf16 rounding boundary: at
    most one unit in the last place, on few elements; both are the float64 norm rounded once to bf16 (within one
    ulp of it, from the fp32 arithmetic before the rounding)."""
    x, w, *_ = _operands(shape, 16, seed=len(shape))
    want = gemma_rms_norm(x, w, 1e-6)
    got = fp.fused_rms_norm(x, w, 1e-6)
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    diff = (got.float() - want.float()).abs()
    assert (diff <= _ulp(want)).all()
    assert (diff > 0).float().mean() < 0.01
    exact = _norm64(x, w, 1e-6)
    for y in (got, want):
        assert ((y.double() - exact).abs() <= _ulp(y).double() * 1.01).all()


@pytest.mark.parametrize("shape, rot", [((2, 70, 4, 32), 16), ((1, 130, 8, 64), 64), ((2, 66, 1, 32), 32)])
def test_fused_norm_rope_within_one_ulp(shape, rot):
    """The compiled norm + rotation equals `apply_rope(gemma_rms_norm(...))`, the norm's bf16 rounding kept before
    the rotation (which a fused kernel could elide): at most one ulp where the norm's value sits at a boundary, and
    exactly on the channels that do not rotate wherever the norm agrees."""
    x, w, cos, sin = _operands(shape, rot, seed=rot)
    want = apply_rope(gemma_rms_norm(x, w, 1e-6), cos, sin)
    got = fp.fused_norm_rope(x, w, 1e-6, cos, sin)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    normed = gemma_rms_norm(x, w, 1e-6).float()
    # the rotation of an exactly bf16-rounded norm: one ulp of the norm moves a rotated value by at most that much
    bound = _ulp(normed).amax(-1, keepdim=True) + _ulp(want)
    diff = (got.float() - want.float()).abs()
    assert (diff <= bound).all()
    assert (diff > 0).float().mean() < 0.02
    # without the bf16 rounding between norm and rotation the errors would be of the norm's full fp32 precision
    # everywhere; with it, most elements are bit-identical
    assert (diff == 0).float().mean() > 0.98


def test_model_prefill_through_the_fused_kernels(tiny_nvfp4, monkeypatch):
    """A bf16 model prefilling 90 tokens of two sequences with `prefill_fusion`: every decoder layer's two norms and
    every attention's q / k (and, on MSA layers, index q / k) go through the compiled functions, decode-sized calls
    do not, and the logits equal the same fast paths without the fusion up to bf16 rounding."""
    from minimax_ref.weights.loader import load_model

    model = load_model(tiny_nvfp4, dtype=torch.bfloat16, weights="packed")
    ids = torch.randint(0, 1000, (2, 100), generator=torch.Generator().manual_seed(3))
    pos = torch.stack([torch.arange(100), torch.arange(100) + 5])

    def run() -> torch.Tensor:
        with torch.no_grad():
            cache = model.new_cache(2, 128)
            first = model(ids[:, :90], positions=pos[:, :90], cache=cache)
            return torch.cat([first, model(ids[:, 90:], positions=pos[:, 90:], cache=cache)], dim=1)

    apply(model, True)
    want = run()
    calls = {"norm": 0, "norm_rope": 0}
    norm, norm_rope = fp.fused_rms_norm, fp.fused_norm_rope

    def count(name, fn):
        def wrapped(x, *args):
            assert x.shape[1] == 90
            calls[name] += 1
            return fn(x, *args)
        return wrapped

    import minimax_ref.fast.attention as fa
    import minimax_ref.fast.compiled as fc

    monkeypatch.setattr(fc, "fused_rms_norm", count("norm", norm))
    monkeypatch.setattr(fa, "fused_norm_rope", count("norm_rope", norm_rope))
    apply(model, replace(FastPaths.of(True), prefill_fusion=True))
    got = run()
    layers = model.layers
    sparse = sum(layer.self_attn.sparse for layer in layers)
    assert calls == {"norm": 2 * len(layers), "norm_rope": 2 * len(layers) + 2 * sparse}
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.95  # a near tie may flip under one ulp
    # one ulp in an index query can turn a near tie of MSA block scores: that token attends over another block and
    # its logits move; the others stay within bf16 rounding
    per_position = (got.float() - want.float()).abs().amax(-1) / want.float().abs().amax()
    assert per_position.median() < 1e-2 and (per_position < 5e-2).float().mean() > 0.9
    apply(model, FastPaths())
    assert type(model.layers[0].input_layernorm).__name__ == "RMSNorm"


def test_presets():
    assert FastPaths.of("fusion") == replace(FastPaths.of("compiled"), prefill_fusion=True)
    from minimax_ref.fast.paths import PRESETS, USER_PRESETS

    assert "fusion" not in USER_PRESETS
    assert not any(PRESETS[name].paths.prefill_fusion for name in USER_PRESETS)
