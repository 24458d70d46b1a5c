"""Entry points for `minimax-ref golden --replay BUNDLE --impl impl:FUNCTION` (from examples/kernel_test, or with it on
PYTHONPATH):

- `run`: every op of any bundle, in plain numpy (`numpy_ops.run`): every output of every entry.
- `nvfp4_linear`: only the first GEMM of an NVFP4 linear entry (`nvfp4_gemm.gemm_fp32`), y; run it with
  `--ops nvfp4_linear --skip-outputs y2,x_hat` where the bundle's entries also have those outputs.
"""

from __future__ import annotations

import numpy as np
import numpy_ops
import torch
from nvfp4_gemm import gemm_fp32


def run(entry) -> dict[str, torch.Tensor]:
    """Every output of the entry, computed in numpy."""
    return numpy_ops.run(entry)


def nvfp4_linear(entry) -> dict[str, torch.Tensor] | None:
    """The numpy GEMM on a golden entry's first GEMM (x, w1.*) -> {"y": ...}; bundles without activation
    quantization only (None otherwise: this GEMM does not decode activation codes)."""
    if entry.numerics["act_quant"] != "none":
        return None
    t = {k: v.cpu() for k, v in entry.inputs.items()}
    y = gemm_fp32(t["x"].float().numpy(), t["w1.weight"].numpy(), t["w1.weight_scale"].view(torch.uint8).numpy(),
                  float(t["w1.weight_scale_2"]))
    return {"y": torch.from_numpy(np.ascontiguousarray(y))}
