"""Activation emulation against an independent fake-quant written here, and linear memory growth."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from memory import PeakMemory

from minimax_ref.model.msa import msa_attention
from minimax_ref.weights.loader import load_model


def ref_fake_nvfp4(x: torch.Tensor, input_scale: float) -> torch.Tensor:
    """NVFP4 activation fake-quant from checkpoint.md, with ml_dtypes doing the E4M3/E2M1 rounding."""
    a = x.float().numpy().reshape(-1, 16)
    g = np.float32(1.0) / np.float32(input_scale)
    amax = np.abs(a).max(-1, keepdims=True)
    s = (g * (amax * (np.float32(1) / np.float32(6)))).astype(np.float32)
    s = np.clip(s, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.float32(1) / (s / g)
        q = np.clip(a * inv, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    out = np.where(s == 0, np.float32(0), q * (s / g)).astype(np.float32)
    return torch.from_numpy(out.reshape(x.shape)).to(x.dtype)


def ref_fake_mxfp8(x: torch.Tensor) -> torch.Tensor:
    a = x.float().numpy().reshape(-1, 32).astype(np.float64)
    amax = np.abs(a).max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        e = np.ceil(np.log2(amax / 448.0))
    X = np.where(amax == 0, 1.0, np.exp2(np.nan_to_num(e)))
    q = np.clip(a / X, -448, 448).astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return torch.from_numpy((q * X).astype(np.float32).reshape(x.shape)).to(x.dtype)


def test_reference_fake_quant_agrees_with_the_shared_vectors():
    import json
    from pathlib import Path

    found = [p / "shared/testdata/quant_vectors.json" for p in Path(__file__).resolve().parents
             if (p / "shared/testdata/quant_vectors.json").is_file()]
    if not found:
        pytest.skip("shared/testdata/quant_vectors.json not found")
    data = json.loads(found[0].read_text())
    for case in data["nvfp4_activations"]:
        x = torch.tensor(case["x"], dtype=torch.float32).reshape(case["shape"])
        want = torch.tensor(case["x_hat"], dtype=torch.float32).reshape(case["shape"])
        assert torch.equal(ref_fake_nvfp4(x, case["input_scale"]), want)


def test_act_quant_emulate_equals_reference_fake_quant(tiny_nvfp4):
    emulate = load_model(tiny_nvfp4, dtype=torch.float32, act_quant="emulate")
    plain = load_model(tiny_nvfp4, dtype=torch.float32)
    # the reference: the weight-only model with the test's fake-quant applied to each quantized input
    hooked = 0
    for module in plain.modules():
        fmt = getattr(module, "act_format", None)
        if fmt is None:
            continue
        if hasattr(module, "w1"):  # stacked routed experts: one input scale per expert and leaf
            def act(x, leaf, e, m=module):
                return ref_fake_nvfp4(x, float(getattr(m, f"{leaf}_input_scale")[e]))
            module._act = act
        elif fmt == "nvfp4":
            module.register_forward_pre_hook(lambda m, a: (ref_fake_nvfp4(a[0], float(m.input_scale)),))
        else:
            module.register_forward_pre_hook(lambda m, a: (ref_fake_mxfp8(a[0]),))
        hooked += 1
    assert hooked > 20
    ids = torch.randint(0, 1000, (2, 90), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b, c = emulate(ids), plain(ids), load_model(tiny_nvfp4, dtype=torch.float32)(ids)
    assert torch.allclose(a, b, rtol=0, atol=1e-5)
    assert (a - c).abs().max() > 1e-3, "emulation changes the logits"
    assert emulate.lm_head.act_format is None  # the bf16 LM head is never fake-quantized


@pytest.mark.parametrize("seq", [1024])
def test_msa_prefill_memory_grows_linearly(seq):
    def peak(S: int) -> int:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, S, h, 32, generator=g) for h in (8, 2, 2))
        iq, ik = torch.randn(1, S, 2, 32, generator=g), torch.randn(1, S, 32, generator=g)
        with PeakMemory() as m:
            msa_attention(q, k, v, iq, ik, torch.arange(S)[None], 32**-0.5, 16, 4, 1, 0, chunk_elements=1 << 18)
        return m.peak

    one, two = peak(seq), peak(2 * seq)
    assert two < 2.5 * one, (one, two)
    assert two < 0.1 * (2 * seq) ** 2 * 8 * 4, "far below a dense S x S score matrix"


def test_model_prefill_memory_grows_linearly(tiny_bf16):
    # a small chunk budget makes the chunking engage at test-sized contexts
    model = load_model(tiny_bf16, dtype=torch.float32, attention_chunk_elements=1 << 16)

    def peak(S: int) -> int:
        ids = torch.randint(0, 1000, (1, S), generator=torch.Generator().manual_seed(0))
        with torch.no_grad(), PeakMemory() as m:
            model(ids)
        return m.peak

    one, two = peak(512), peak(1024)
    assert two < 2.5 * one, (one, two)
