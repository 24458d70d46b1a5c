"""`minimax-ref golden --replay BUNDLE --impl impl:nvfp4_linear --ops nvfp4_linear` runs this kernel (from
examples/kernel_test, or with it on PYTHONPATH) on every NVFP4 linear of a bundle and prints the error sizes."""

from __future__ import annotations

import numpy as np
import torch
from nvfp4_gemm import gemm_fp32


def nvfp4_linear(entry) -> dict[str, torch.Tensor] | None:
    """The numpy GEMM on a golden entry's first GEMM (x, w1.*) -> {"y": ...}; fp32 bundles only."""
    if entry.numerics["dtype"] != "float32" or entry.numerics["act_quant"] != "none":
        return None
    t = {k: v.cpu() for k, v in entry.inputs.items()}
    y = gemm_fp32(t["x"].numpy(), t["w1.weight"].numpy(), t["w1.weight_scale"].view(torch.uint8).numpy(),
                  float(t["w1.weight_scale_2"]))
    return {"y": torch.from_numpy(np.ascontiguousarray(y))}
