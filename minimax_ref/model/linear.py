"""The linear layer every projection of the text model uses.

With `weights="dequant"` (default) the weight is decoded once at load into the compute dtype, so the
forward is a plain `x @ W^T` (no biases in the text model). With `weights="packed"` an NVFP4/MXFP8
weight stays packed (`packed.PackedWeight`) and is decoded at each use, to the same bits. What a linear
remembers of its on-disk format for activation emulation:

* `act_format = "nvfp4"`: with `act_quant="emulate"` the input is fake-quantized to NVFP4 (blocks
  of 16 along K, the checkpoint's `input_scale`) before the matmul, as Blackwell W4A4 kernels do;
* `act_format = "mxfp8"`: the input is fake-quantized to MXFP8 (blocks of 32, E8M0 scale).

Both are fixed when the module is built: `Linear(..., act_format=, emulate=)`, or, for a whole model
under construction, `set_activation_formats` (the tensor-parallel linears' constructors take no format).

With `act_quant="none"` (default) activations stay in the compute dtype: weight-only decoding, as
vLLM runs on Hopper. The fake-quant contract is in `quant.fake_quant_nvfp4/mxfp8`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ..weights.quant import fake_quant_mxfp8, fake_quant_nvfp4

ACT_QUANT_MODES = ("none", "emulate")


def emulate_activation_quant(x: torch.Tensor, act_format: str | None, input_scale: torch.Tensor | None) -> torch.Tensor:
    """Fake-quantize `x` [..., K] the way a W4A4 / W8A8 kernel would see it; identity for None."""
    if act_format == "nvfp4":
        return fake_quant_nvfp4(x, input_scale)
    if act_format == "mxfp8":
        return fake_quant_mxfp8(x)
    return x


def set_activation_formats(root: nn.Module, formats: Mapping[str, str | None], emulate: bool) -> None:
    """For a module under construction: give every module below `root` that holds a weight with emulable inputs
    (a `Linear`, an expert stack: the modules with an `act_format`) the on-disk format of its weight, `formats[path]`
    for its path under `root` ("nvfp4", "mxfp8"; anything else or absent: none), and turn the emulation on where
    `emulate` and the format is packed."""
    for name, m in root.named_modules():
        if hasattr(m, "act_format"):
            fmt = formats.get(name)
            m.act_format = fmt if fmt in ("nvfp4", "mxfp8") else None
            m.emulate_act_quant = emulate and m.act_format is not None


class Linear(nn.Module):
    """`y = x @ W^T` with W [out, in] in the compute dtype: the parameter `weight` (decoded at load), or,
    for a packed linear, `packed.decode()` (then `weight` is None). act_format / emulate: see the module
    docstring."""

    def __init__(self, in_features: int, out_features: int, act_format: str | None = None, emulate: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        # The part of the checkpoint's [out, in] weight this module holds (None = all of it): set by
        # the tensor-parallel layers (parallel.py); the loader reads only that part of the shards.
        self.rows: slice | None = None
        self.cols: slice | None = None
        self.act_format = act_format  # the on-disk format of the weight
        self.emulate_act_quant = emulate and act_format is not None
        self.register_buffer("input_scale", None, persistent=False)
        self.packed = None  # a packed.PackedWeight when loaded with weights="packed"

    def dense_weight(self) -> torch.Tensor:
        """W [out, in] in the compute dtype (decoded now when the linear is packed)."""
        return self.weight if self.packed is None else self.packed.decode()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.emulate_act_quant:
            x = emulate_activation_quant(x, self.act_format, self.input_scale)
        if self.packed is not None:
            return self.packed.linear(x)  # decode, then F.linear
        return F.linear(x, self.weight)

    def set_packed(self, packed: nn.Module) -> None:
        """Hold `packed` (a `PackedWeight` [out, in]) instead of a decoded weight."""
        self._parameters["weight"] = None
        self.packed = packed

    def unpack(self, name: str = "packed") -> None:
        """Decode the packed weight (the child `name`) once and keep the result (what weights="dequant" loads)."""
        w = self.packed.decode()
        self.packed = None
        self.weight = nn.Parameter(w, requires_grad=False)

    def extra_repr(self) -> str:
        fmt = f", act={self.act_format}" if self.emulate_act_quant else ""
        return f"in={self.in_features}, out={self.out_features}{fmt}"
