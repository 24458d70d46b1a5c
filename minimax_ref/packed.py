"""Packed weights: NVFP4 / MXFP8 linears kept as stored and decoded at use (`load_model(weights="packed")`).

Decoding everything at load costs 2 bytes per weight in bf16 (544 GB for the 80-expert build); kept packed,
a weight costs what it costs on disk (0.5625 bytes in NVFP4, 1.03125 in MXFP8), and each forward decodes
the layer it is running, or only the routed experts that received tokens.

`PackedWeight` holds one linear's tensors under their checkpoint names (`weight`, `weight_scale`, and for
NVFP4 `weight_scale_2`), or a stack of them for routed experts (a leading expert dimension; one
`weight_scale_2` per expert). Under tensor parallelism they are the rank's slices, cut from the packed
bytes and their block scales together (`read_packed`), exactly as `Checkpoint.read_linear` cuts them.

Contract: `PackedWeight.decode()` returns, bit for bit, what `weights="dequant"` stores:
`quant.dequant_nvfp4/mxfp8(...)` (float32) cast to the compute dtype. Three decoders compute it:

* `decode_reference` (the default): `quant.dequant_nvfp4/mxfp8`'s float32 operations in the same order,
  without their input checks, which synchronise with the host (the loader runs the checks once instead);
* `decode_fast` (`FastPaths(decode="fast")`): two passes instead of about eight, and fewer kernels. A
  byte-to-pair lookup gives both E2M1 values of a byte (exact in bf16 and fp32; E8M0 scales come from a
  256-entry table too), and one multiplication by the fp32 block scale writes the compute dtype.
  PyTorch computes a mixed bf16 x fp32 product in fp32 and rounds it once on store, so the result is the
  reference's fp32 product rounded to the compute dtype;
* `decode_compiled` (`decode="compile"`): `torch.compile` of the reference operations, fused into one
  kernel that reads the packed bytes and writes the compute dtype.

tests/test_packed.py checks all three against `quant.dequant_*` on every code and byte value.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .checkpoint import MXFP8, NVFP4, Checkpoint
from .errors import CheckpointError, QuantFormatError
from .quant import E2M1_MAGNITUDES, MXFP8_BLOCK, NVFP4_BLOCK, _pow2_f32, dequant_mxfp8, dequant_nvfp4, unpack_fp4

# E2M1 value of each 4-bit code (code 8 is -0.0), and of both codes of each byte (low nibble first).
_E2M1_VALUES = torch.cat([E2M1_MAGNITUDES, -E2M1_MAGNITUDES])
_E2M1_PAIRS = torch.stack((_E2M1_VALUES[torch.arange(256) & 0x0F], _E2M1_VALUES[torch.arange(256) >> 4]), dim=-1)

# Lookup tables live on the device they are used on, made once: copying a CPU table at every decode
# would synchronise with the host (and cannot happen inside a CUDA graph).
_TABLES: dict[tuple[str, torch.device, torch.dtype], torch.Tensor] = {}


# E8M0 code -> 2^(code - 127) as float32 (code 255, NaN, is refused at load and never looked up).
_E8M0_VALUES = _pow2_f32(torch.arange(256, dtype=torch.int32) - 127)


def _table(kind: str, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Lookup table `kind` ("values": E2M1 per code, "pairs": E2M1 pair per byte, "e8m0": scale per code) on
    `device` in `dtype` (exact: E2M1 values fit bf16)."""
    key = (kind, torch.device(device), dtype)
    if key not in _TABLES:
        src = {"values": _E2M1_VALUES, "pairs": _E2M1_PAIRS, "e8m0": _E8M0_VALUES}[kind]
        _TABLES[key] = src.to(device=device, dtype=dtype)
    return _TABLES[key]


def _global(scale_2: torch.Tensor, lead: list[int]) -> torch.Tensor:
    """weight_scale_2 shaped to broadcast over `[*L, N, K/16]`: `[1, 1]` for one scalar, `[*L, 1, 1]` for one
    per leading index (as `quant.dequant_nvfp4` shapes it)."""
    return scale_2.reshape(1, 1) if scale_2.dim() == 0 else scale_2.reshape(*lead, 1, 1)


# ---------------------------------------------------------------------------------------------- decoders


def decode_reference(fmt: str, weight: torch.Tensor, weight_scale: torch.Tensor,
                     weight_scale_2: torch.Tensor | None = None) -> torch.Tensor:
    """Decode to float32, with `quant.dequant_nvfp4` / `quant.dequant_mxfp8`'s operations in their order.

    NVFP4: weight uint8 `[*L, N, K/2]`, weight_scale float8_e4m3fn `[*L, N, K/16]`, weight_scale_2 float32 `()`
    or `[*L]`. MXFP8: weight float8_e4m3fn `[*L, N, K]`, weight_scale uint8 `[*L, N, K/32]`. Returns float32
    `[*L, N, K]`. No input checks (they synchronise with the host): the loader checks every tensor once.
    """
    if fmt == NVFP4:
        *lead, n, half_k = weight.shape
        k = 2 * half_k
        block = weight_scale.to(torch.float32) * _global(weight_scale_2, lead)  # [*L, N, K/16]
        codes = unpack_fp4(weight).to(torch.int32)
        values = _table("values", weight.device)[codes].reshape(*lead, n, k // NVFP4_BLOCK, NVFP4_BLOCK)
        return (values * block.unsqueeze(-1)).reshape(*lead, n, k)
    k = weight.shape[-1]
    x = _pow2_f32(weight_scale.to(torch.int32) - 127)  # E8M0: 2^(code - 127), exact
    values = weight.to(torch.float32)
    blocks = (*weight.shape[:-1], k // MXFP8_BLOCK, MXFP8_BLOCK)
    return (values.reshape(blocks) * x.unsqueeze(-1)).reshape(weight.shape)


def decode_fast(fmt: str, weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor | None,
                dtype: torch.dtype) -> torch.Tensor:
    """`decode_reference(...).to(dtype)`, bit for bit, in two passes over the weight.

    The element values (E2M1 pairs from a 256-entry table, or E4M3 cast to `dtype`) are exact in bf16 and
    fp32; `torch.mul(values, fp32 block scale, out=<dtype>)` computes each product in fp32 and rounds it once
    to `dtype`, which is what the reference's fp32 product followed by `.to(dtype)` does.
    """
    if fmt == NVFP4:
        *lead, n, half_k = weight.shape
        k = 2 * half_k
        pairs = F.embedding(weight.to(torch.int32), _table("pairs", weight.device, dtype))  # [*L, N, K/2, 2]
        values = pairs.view(*lead, n, k // NVFP4_BLOCK, NVFP4_BLOCK)
        block = weight_scale.to(torch.float32) * _global(weight_scale_2, lead)
    else:
        k = weight.shape[-1]
        values = weight.to(dtype).view(*weight.shape[:-1], k // MXFP8_BLOCK, MXFP8_BLOCK)
        block = _table("e8m0", weight.device)[weight_scale.to(torch.int32)]  # = _pow2_f32(code - 127)
    out = torch.empty(values.shape, dtype=dtype, device=weight.device)
    torch.mul(values, block.unsqueeze(-1), out=out)
    return out.view(*values.shape[:-2], k)


def _reference_cast(fmt: str, weight, weight_scale, weight_scale_2, dtype: torch.dtype) -> torch.Tensor:
    return decode_reference(fmt, weight, weight_scale, weight_scale_2).to(dtype)


_compiled = None


def decode_compiled(fmt: str, weight: torch.Tensor, weight_scale: torch.Tensor,
                    weight_scale_2: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """`decode_reference(...).to(dtype)` through `torch.compile` (compiled on first use, dynamic shapes)."""
    global _compiled
    if _compiled is None:
        # one compiled graph per (format, dtype, rank of the weight, kind of global scale): room for all of them
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 32)
        _compiled = torch.compile(_reference_cast, dynamic=True)
    _table("values", weight.device)  # made outside the compiled region
    return _compiled(fmt, weight, weight_scale, weight_scale_2, dtype)


# ---------------------------------------------------------------------------------------------- the module


class PackedWeight(nn.Module):
    """One NVFP4 or MXFP8 weight (or a stack of routed experts' weights) kept as stored.

    Buffers, named as in the checkpoint: `weight` (NVFP4: uint8 `[*L, N, K/2]`; MXFP8: float8_e4m3fn
    `[*L, N, K]`), `weight_scale` (NVFP4: float8_e4m3fn `[*L, N, K/16]`; MXFP8: uint8 E8M0 `[*L, N, K/32]`),
    `weight_scale_2` (NVFP4 only: float32 `()`, or `[E]` for an expert stack). `L` is empty for a linear
    and `[E_local]` for the experts of a layer.

    `decode(index)` returns the weight in the compute dtype `dtype`: all of it, one expert (`index` an int)
    or a batch of experts (`index` a LongTensor, repeats allowed). `mode` picks the decoder ("reference",
    "fast", "compile"); every mode returns the same bits. Indexing (`w[e]`) and `.shape` behave like the
    decoded stack, so code written for decoded weights reads packed ones too.
    """

    def __init__(self, fmt: str, weight: torch.Tensor, weight_scale: torch.Tensor,
                 weight_scale_2: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        if fmt not in (NVFP4, MXFP8):
            raise ValueError(f"PackedWeight: format {fmt!r} is not packed (nvfp4 or mxfp8)")
        if (fmt == NVFP4) != (weight_scale_2 is not None):
            raise ValueError("PackedWeight: weight_scale_2 is given for NVFP4 and only for NVFP4")
        self.fmt, self.dtype, self.mode = fmt, dtype, "reference"
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
        w, s, g = self.parts(index)
        dtype = dtype or self.dtype
        if self.mode == "fast":
            return decode_fast(self.fmt, w, s, g, dtype)
        if self.mode == "compile":
            return decode_compiled(self.fmt, w, s, g, dtype)
        return decode_reference(self.fmt, w, s, g).to(dtype)

    def __getitem__(self, index: int | torch.Tensor) -> torch.Tensor:
        return self.decode(index)

    def extra_repr(self) -> str:
        return f"{self.fmt}, shape={list(self.shape)}, dtype={self.dtype}, decode={self.mode}"


# ---------------------------------------------------------------------------------------------- loading


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
    """Bytes of every parameter and buffer of `model` (tied tensors counted once): its weight memory."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def dequantize(model: nn.Module) -> nn.Module:
    """Replace every `PackedWeight` of `model` by its decoded weight, in place (as `weights="dequant"` would
    have loaded it). For tools that need plain weights (the transformers oracle in benchmarks)."""
    from .linear import Linear
    from .moe import Experts

    for m in list(model.modules()):
        if isinstance(m, Linear) and m.packed is not None:
            m.unpack()
        elif isinstance(m, Experts):
            for leaf in ("w1", "w2", "w3"):
                if isinstance(getattr(m, leaf), PackedWeight):
                    m.unpack(leaf)
    return model


__all__ = ["PackedWeight", "decode_reference", "decode_fast", "decode_compiled", "read_packed", "check_packed",
           "packed_weights", "model_nbytes", "dequantize", "QuantFormatError"]
