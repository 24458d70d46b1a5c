"""Test the numpy implementation of every op (`numpy_ops.py`) and an NVFP4 GEMM (`nvfp4_gemm.py`) against a minimax-ref
golden bundle, through the test API:

    minimax-ref golden --op msa_decode --context 4173 --batch 3 --out bundle/      # or any bundle
    MINIMAX_REF_GOLDEN_BUNDLE=bundle/ python -m pytest examples/kernel_test

MINIMAX_REF_GOLDEN_BUNDLE may name several bundles, separated by the path separator (`:`).
"""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import numpy_ops
import pytest
import torch
from nvfp4_gemm import gemm_bf16, gemm_fp32

from minimax_ref import golden

BUNDLE = os.environ.get("MINIMAX_REF_GOLDEN_BUNDLE")
if BUNDLE is None:
    pytest.skip("set MINIMAX_REF_GOLDEN_BUNDLE to a golden bundle folder", allow_module_level=True)

ENTRIES = [e for path in BUNDLE.split(os.pathsep) if path for e in golden.load(path)]
GEMMS = [e for e in ENTRIES if e.op == "nvfp4_linear"]


@pytest.mark.parametrize("golden_entry", ENTRIES, ids=[f"{i}:{e.id}" for i, e in enumerate(ENTRIES)])
def test_every_output(golden_entry):
    """Every output of every entry, each op computed in numpy from the entry's inputs."""
    result = golden.compare(golden_entry, numpy_ops.run(golden_entry))
    print(result)
    assert result.ok, str(result)


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


@pytest.mark.skipif(not GEMMS, reason="the bundle has no nvfp4_linear entry")
@pytest.mark.parametrize("golden_entry", GEMMS, ids=[f"{i}:{e.id}" for i, e in enumerate(GEMMS)])
def test_nvfp4_gemm(golden_entry):
    """The GEMM a kernel team writes first: y (and y2 where the entry has it) only, other outputs named as left out;
    in bf16 bundles the bf16 tensor-core recipe (weight_scale_2 on the accumulator)."""
    if golden_entry.numerics["act_quant"] != "none":
        pytest.skip("this GEMM does not quantize its activations")
    t = {k: as_numpy(v) for k, v in golden_entry.inputs.items()}
    gemm = gemm_bf16 if golden_entry.numerics["dtype"] == "bfloat16" else gemm_fp32
    out = {"y": gemm(t["x"], t["w1.weight"], t["w1.weight_scale"], float(t["w1.weight_scale_2"]))}
    if "h" in t:
        out["y2"] = gemm(t["h"], t["w2.weight"], t["w2.weight_scale"], float(t["w2.weight_scale_2"]))
    result = golden.compare(golden_entry, {k: as_torch(v) for k, v in out.items()})
    print(result)
    assert result.ok, str(result)
