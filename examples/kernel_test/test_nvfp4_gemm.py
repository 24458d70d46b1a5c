"""Test an independent NVFP4 GEMM (`nvfp4_gemm.py`) against a minimax-ref golden bundle, through the test API.

    minimax-ref golden --synthetic-weights tiny --ops nvfp4_linear --prompt "..." --out bundle/
    MINIMAX_REF_GOLDEN_BUNDLE=bundle/ python -m pytest examples/kernel_test
"""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest
import torch
from nvfp4_gemm import gemm_bf16, gemm_fp32

from minimax_ref import golden

BUNDLE = os.environ.get("MINIMAX_REF_GOLDEN_BUNDLE")
if BUNDLE is None:
    pytest.skip("set MINIMAX_REF_GOLDEN_BUNDLE to a golden bundle folder", allow_module_level=True)


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """numpy view of a bundle tensor; fp8 block scales as their bytes (the GEMM decodes them)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy()
    return t.numpy()


def as_torch(a: np.ndarray) -> torch.Tensor:
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


@golden.parametrize(BUNDLE, ops=["nvfp4_linear"])
def test_nvfp4_gemm(golden_entry):
    if golden_entry.numerics["act_quant"] != "none":
        pytest.skip("this GEMM does not quantize its activations")
    t = {k: as_numpy(v) for k, v in golden_entry.inputs.items()}
    gemm = gemm_bf16 if golden_entry.numerics["dtype"] == "bfloat16" else gemm_fp32
    out = {"y": gemm(t["x"], t["w1.weight"], t["w1.weight_scale"], float(t["w1.weight_scale_2"])),
           "y2": gemm(t["h"], t["w2.weight"], t["w2.weight_scale"], float(t["w2.weight_scale_2"]))}
    result = golden.compare(golden_entry, {k: as_torch(v) for k, v in out.items()})
    print(result)
    assert result.ok, str(result)
