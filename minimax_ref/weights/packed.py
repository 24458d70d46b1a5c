"""Packed weights: NVFP4 / MXFP8 linears kept as stored and decoded at use (`load_model(weights="packed")`).

Decoding everything at load costs 2 bytes per weight in bf16; kept packed, a weight costs what it costs on
disk (0.5625 bytes in NVFP4, 1.03125 in MXFP8), and each forward decodes the layer it is running, or only the
routed experts that received tokens.

`PackedWeight` holds one linear's tensors under their checkpoint names (`weight`, `weight_scale`, and for
NVFP4 `weight_scale_2`), or a stack of them for routed experts (a leading expert dimension; one
`weight_scale_2` per expert). Under tensor parallelism they are the rank's slices, cut from the packed
bytes and their block scales together (`read_packed`), exactly as `Checkpoint.read_linear` cuts them.

Contract: `PackedWeight.decode()` returns, bit for bit, what `weights="dequant"` stores:
`quant.dequant_nvfp4/mxfp8(...)` (float32) cast to the compute dtype. It decodes through
`quant.decode_nvfp4/mxfp8`, the same operations without the input checks (which read the tensors on the
host); the loader runs the checks once (`check_packed`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import CheckpointError
from .checkpoint import MXFP8, NVFP4, Checkpoint
from .quant import MXFP8_BLOCK, NVFP4_BLOCK, decode_mxfp8, decode_nvfp4, dequant_mxfp8, dequant_nvfp4


def decode_reference(fmt: str, weight: torch.Tensor, weight_scale: torch.Tensor,
                     weight_scale_2: torch.Tensor | None = None) -> torch.Tensor:
    """Decode packed tensors to float32: `quant.decode_nvfp4` / `quant.decode_mxfp8`.

    NVFP4: weight uint8 `[*L, N, K/2]`, weight_scale float8_e4m3fn `[*L, N, K/16]`, weight_scale_2 float32 `()`
    or `[*L]`. MXFP8: weight float8_e4m3fn `[*L, N, K]`, weight_scale uint8 `[*L, N, K/32]`. Returns float32
    `[*L, N, K]`. No input checks: the loader checks every tensor once.
    """
    if fmt == NVFP4:
        return decode_nvfp4(weight, weight_scale, weight_scale_2)
    return decode_mxfp8(weight, weight_scale)


class PackedWeight(nn.Module):
    """One NVFP4 or MXFP8 weight (or a stack of routed experts' weights) kept as stored.

    Buffers, named as in the checkpoint: `weight` (NVFP4: uint8 `[*L, N, K/2]`; MXFP8: float8_e4m3fn
    `[*L, N, K]`), `weight_scale` (NVFP4: float8_e4m3fn `[*L, N, K/16]`; MXFP8: uint8 E8M0 `[*L, N, K/32]`),
    `weight_scale_2` (NVFP4 only: float32 `()`, or `[E]` for an expert stack). `L` is empty for a linear
    and `[E_local]` for the experts of a layer.

    `decode(index)` returns the weight in the compute dtype `dtype`: all of it, one expert (`index` an int)
    or a batch of experts (`index` a LongTensor, repeats allowed). Indexing (`w[e]`) and `.shape` behave like
    the decoded stack, so code written for decoded weights reads packed ones too.
    """

    def __init__(self, fmt: str, weight: torch.Tensor, weight_scale: torch.Tensor,
                 weight_scale_2: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        if fmt not in (NVFP4, MXFP8):
            raise ValueError(f"PackedWeight: format {fmt!r} is not packed (nvfp4 or mxfp8)")
        if (fmt == NVFP4) != (weight_scale_2 is not None):
            raise ValueError("PackedWeight: weight_scale_2 is given for NVFP4 and only for NVFP4")
        self.fmt, self.dtype = fmt, dtype
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("weight_scale_2", weight_scale_2)

    @property
    def shape(self) -> torch.Size:
        """The decoded weight's shape `[*L, N, K]`."""
        s = self.weight.shape
        return torch.Size((*s[:-1], 2 * s[-1] if self.fmt == NVFP4 else s[-1]))

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def parts(self, index: int | torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """(weight, weight_scale, weight_scale_2) of the selected experts (all with index None), packed."""
        g = self.weight_scale_2
        if index is None:
            return self.weight, self.weight_scale, g
        # a scalar global (one linear) is shared; a per-expert global is selected with its expert
        return self.weight[index], self.weight_scale[index], None if g is None else (g if g.dim() == 0 else g[index])

    def decode(self, index: int | torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The decoded weight in `dtype` (default `self.dtype`, the compute dtype): `[*L, N, K]`, `[N, K]` (an
        int index) or `[P, N, K]` (a LongTensor of P expert indices)."""
        return decode_reference(self.fmt, *self.parts(index)).to(dtype or self.dtype)

    def __getitem__(self, index: int | torch.Tensor) -> torch.Tensor:
        return self.decode(index)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """`F.linear(x, self.decode())`: one linear, x [..., K] -> [..., N] in the compute dtype."""
        return F.linear(x, self.decode())

    def matmul(self, x: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
        """`torch.matmul(x, self.decode(index).transpose(-1, -2))`: x `[*B, M, K]` against the whole stack (index
        None) or the entries `index` (a LongTensor of any shape)."""
        return torch.matmul(x, self.decode(index).transpose(-1, -2))

    def extra_repr(self) -> str:
        return f"{self.fmt}, shape={list(self.shape)}, dtype={self.dtype}"


def read_packed(ck: Checkpoint, prefix: str, rows: slice | None = None,
                cols: slice | None = None) -> tuple[str, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The packed tensors of linear `prefix` (or of the [rows, cols] part of its [out, in] weight), as
    `(fmt, weight, weight_scale, weight_scale_2)`, sliced exactly as `Checkpoint.read_linear` slices them
    (NVFP4 K-slices move K/2 bytes and K/16 scales, MXFP8 K-slices K/32 scales; `cols` must keep whole
    groups). The compressed-tensors global `weight_global_scale` is turned into `weight_scale_2 = 1 / it`
    in fp32, as `read_linear` does. Not decoded and not checked (`check_packed` checks)."""
    f = ck.formats[prefix]
    if f.fmt not in (NVFP4, MXFP8):
        raise CheckpointError(f"{prefix}: stored {f.fmt}, not packed")
    group = NVFP4_BLOCK if f.fmt == NVFP4 else MXFP8_BLOCK
    start = stop = None
    if cols is not None:
        start, stop = cols.start or 0, cols.stop
        if start % group or (stop is not None and stop % group):
            raise CheckpointError(f"{prefix}: column slice {start}:{stop} is not aligned to the {f.fmt} group "
                                  f"of {group}")

    def per(n: int) -> slice | None:  # the column slice of a tensor holding one entry per n elements
        return None if cols is None else slice(start // n, None if stop is None else stop // n)

    if f.fmt == NVFP4:
        weight = ck.read(f.weight, rows, per(2))
        scale = ck.read(f.scale, rows, per(NVFP4_BLOCK))
        g = ck.read_scalar(f.scale_2)
        if f.compressed_tensors:
            g = 1.0 / g
        return NVFP4, weight, scale, g
    return MXFP8, ck.read(f.weight, rows, cols), ck.read(f.scale, rows, per(MXFP8_BLOCK)), None


def check_packed(fmt: str, weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor | None,
                 name: str) -> None:
    """Run `quant.dequant_nvfp4/mxfp8`'s checks (NaN scales, E8M0 code 255, bad globals, overflow) on packed
    tensors, raising `QuantFormatError` naming `name`. The decoded result is dropped."""
    if fmt == NVFP4:
        dequant_nvfp4(weight, weight_scale, weight_scale_2, name=name)
    else:
        dequant_mxfp8(weight, weight_scale, name=name)


def packed_weights(model: nn.Module) -> Iterator[tuple[str, PackedWeight]]:
    for name, m in model.named_modules():
        if isinstance(m, PackedWeight):
            yield name, m


def model_nbytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer of `model`: its weight memory. The bytes of contiguous tensors are counted
    once (tied tensors; views into one storage, such as the parts of a joint copy, `fast.joint`); a strided view (a
    tensor-parallel column slice) counts its elements, not the storage around them."""
    spans: dict[int, list[tuple[int, int]]] = {}
    strided, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        nbytes = t.numel() * t.element_size()
        if nbytes and t.is_contiguous():
            start = t.storage_offset() * t.element_size()
            spans.setdefault(t.untyped_storage().data_ptr(), []).append((start, start + nbytes))
        elif nbytes and (t.data_ptr(), t.shape, t.stride()) not in strided:
            strided.add((t.data_ptr(), t.shape, t.stride()))
            total += nbytes
    for ranges in spans.values():
        end = 0
        for lo, hi in sorted(ranges):  # the union of a storage's byte ranges
            total += max(0, hi - max(lo, end))
            end = max(end, hi)
    return total


def dequantize(model: nn.Module) -> nn.Module:
    """Replace every `PackedWeight` of `model` by its decoded weight, in place (as `weights="dequant"` would
    have loaded it): each module holding one decodes it through its `unpack` (`linear.Linear`, `moe.Experts`).
    For tools that need plain weights (the transformers oracle in benchmarks)."""
    for m in list(model.modules()):
        for name, child in list(m.named_children()):
            if isinstance(child, PackedWeight):
                m.unpack(name)
    return model
