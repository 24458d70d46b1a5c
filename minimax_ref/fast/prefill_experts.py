"""The routed experts' products in prefill straight from their packed weights (`FastPaths(prefill_experts="triton")`):
one Triton kernel a projection over the (token, slot) rows sorted by expert, each weight tile decoded in registers
(`fast.grouped`'s tile decoders) and multiplied on the tensor cores, instead of decoding the experts' weights to bf16
in memory and then calling `torch._grouped_mm` on them.

Why: a prefill call decodes every chosen expert's weights, so the decoded copy costs the experts' bf16 bytes written
and read again on top of their packed bytes: for the release's 128 experts (all of them chosen by an 8K prompt) about
as much time as their products. Decoding in registers costs instructions once per tile of `block_m` rows instead.

Grid: (column tiles of N, row tiles). The row tiles are laid out on the device from the groups' ends (`offs`, as
`torch._grouped_mm` takes them): group g's rows `[offs[g-1], offs[g])` are cut into tiles of `block_m` rows, the
tiles of all groups numbered one after another, at most `ceil(R / block_m) + G` of them (a static bound: no host
synchronisation); programs past the last tile, and a group without rows, do nothing.

Numerics contract (`sorted_packed_matmul`): y[r, n] = bf16( sum_k x[r, k] * w_hat[e(r), n, k] ) with w_hat =
`packed.decode_reference(...).to(bfloat16)` bit for bit (the tile decoders of `fast.grouped`, the scales in the
normal range, MXFP8 without an E4M3 NaN byte: the caller checks both once, as `FastPackedWeight.configure` does), e(r)
the entry of r's group (`index[g]`, or g), products exact in fp32 and summed in fp32 on the tensor cores (in K-step
order; within a step in the MMA's order), one rounding to bf16 (nearest, ties to even). `torch._grouped_mm` on the
decoded weights computes the same function with another fp32 summation order. Rows no group holds (past `offs[-1]`)
are left unwritten.

Under `TRITON_INTERPRET=1` the kernel runs on CPU tensors (tests), with `fast.grouped`'s exact fp32 emulation of the
bf16 roundings and of the bf16 dot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError
from ..weights.checkpoint import NVFP4
from . import grouped
from .launch import KernelTiles

if grouped.AVAILABLE:
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton

    # The shared decoders as globals of this module (a kernel resolves its callees by global name).
    _decoded_tile = grouped._decoded_tile
    _step_scales = grouped._step_scales
    _x_operand = grouped._x_operand
    _bf16_storable = grouped._bf16_storable

AVAILABLE = grouped.AVAILABLE


@dataclass(frozen=True)
class Tiles(KernelTiles):
    """One launch configuration: `block_m` sorted rows, `block_n` output columns (weight rows) and `block_k` decoded
    elements of K a program step (powers of two, at least 16, 16 and 32), `num_warps`, `num_stages`; written
    "BLOCK_M,BLOCK_N,BLOCK_K,NUM_WARPS[,NUM_STAGES]"."""

    KIND = "prefill experts"

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3

    def check(self) -> None:
        w = self.num_warps
        if self.block_m < 16 or self.block_n < 16 or self.block_k < 32 or w < 1 or w & (w - 1) or self.num_stages < 1:
            raise ConfigError(f"prefill experts tiles: block_m={self.block_m} (>= 16), block_n={self.block_n} "
                              f"(>= 16), block_k={self.block_k} (>= 32), num_warps={w} (a power of two), "
                              f"num_stages={self.num_stages} (>= 1)")


# Untuned: a GEMM's usual tile for sm_90 (128 x 128 outputs, 64 of K a step, 8 warps); measured entries go to
# `TUNED`, keyed by GPU name, torch and triton versions (as `fast.grouped.TUNED`).
DEFAULT = Tiles()
TUNED: dict[tuple[str, str, str], Tiles] = {}
# `FastPaths(prefill_experts="auto")` (the `compiled` preset) multiplies in registers where a call has fewer sorted
# rows than this a local expert: decoding an expert to bf16 costs its bf16 bytes written and read again whatever its
# rows, so with few rows an expert the decode pass outweighs what cuBLAS's grouped GEMM gains over this kernel's
# tensor-core rate (an 8K prompt: 256 rows an expert for 128 experts, in registers; 2,048 for 16, decoded first).
IN_REGISTERS_BELOW_ROWS_PER_EXPERT = 512


def multiplies_in_registers(mode: str, rows: int, experts: int) -> bool:
    """Whether a prefill call's `rows` sorted (token, slot) rows over `experts` local experts multiply in registers
    under `FastPaths.prefill_experts` = `mode`: always for "triton", for "auto" below
    `IN_REGISTERS_BELOW_ROWS_PER_EXPERT` rows an expert, never for "reference"."""
    if mode == "triton":
        return True
    return mode == "auto" and rows < IN_REGISTERS_BELOW_ROWS_PER_EXPERT * experts


def tiles_for(device: torch.device) -> Tiles:
    """`TUNED`'s entry for this GPU and these torch and triton versions, else `DEFAULT`."""
    if device.type == "cuda" and AVAILABLE:
        key = (torch.cuda.get_device_name(device), grouped._major_minor(torch.__version__),
               grouped._major_minor(triton.__version__))
        return TUNED.get(key, DEFAULT)
    return DEFAULT


def row_tiles(offs: torch.Tensor, block_m: int, bound: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The row tiles of groups ending at `offs` (int32 [G], cumulative), numbered group after group: (group int32
    [bound], first row int32 [bound]); a number past the last tile has group -1. `bound` >= the number of tiles."""
    ends = offs.to(torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    tiles = (ends - starts + block_m - 1) // block_m  # [G]
    last = tiles.cumsum(0)  # tile numbers below last[g] belong to groups <= g
    t = torch.arange(bound, device=offs.device)
    group = torch.searchsorted(last, t, right=True)  # the first group whose tiles end after t
    valid = group < offs.numel()
    g = group.clamp(max=offs.numel() - 1)
    first = starts[g] + (t - (last[g] - tiles[g])) * block_m
    return torch.where(valid, g, -1).to(torch.int32), torch.where(valid, first, 0).to(torch.int32)


if AVAILABLE:
    @triton.jit
    def _sorted_kernel(
        x_ptr, w_ptr, s_ptr, g_ptr, index_ptr, offs_ptr, tile_group_ptr, tile_row_ptr, y_ptr,
        N, K_STEPS, stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_ge, stride_ym,
        NVFP4_FMT: tl.constexpr, HAS_INDEX: tl.constexpr, EXACT_FP32: tl.constexpr, TABLE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """y[r, n] for the rows of one row tile (all of one group) and one tile of columns (module docstring)."""
        pid_n = tl.program_id(0)
        t = tl.program_id(1)
        group = tl.load(tile_group_ptr + t)
        if group >= 0:
            row0 = tl.load(tile_row_ptr + t)
            end = tl.load(offs_ptr + group)
            if HAS_INDEX:
                e = tl.load(index_ptr + group).to(tl.int64)
            else:
                e = group.to(tl.int64)
            rows = row0 + tl.arange(0, BLOCK_M)
            m_ok = rows < end
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = offs_n < N
            w_rows = w_ptr + e * stride_we + offs_n[:, None] * stride_wn  # [BLOCK_N, 1]
            s_rows = s_ptr + e * stride_se + offs_n[:, None] * stride_sn
            BLOCKS: tl.constexpr = BLOCK_K // 16 if NVFP4_FMT else BLOCK_K // 32  # block scales a row a step
            g = tl.load(g_ptr + e * stride_ge)  # NVFP4's global (MXFP8: an unread one)
            jk = tl.arange(0, BLOCK_K)
            x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for ks in range(0, K_STEPS):
                sc = _step_scales(s_rows, ks, n_ok, BLOCKS)
                w = _decoded_tile(w_rows, sc, g, ks, n_ok, NVFP4_FMT, TABLE, BLOCK_N, BLOCK_K, EXACT_FP32)
                a = _x_operand(x_rows + ks * BLOCK_K + jk[None, :], m_ok[:, None], EXACT_FP32)  # [BM, BK]
                if EXACT_FP32:
                    acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
                else:
                    acc = tl.dot(a, tl.trans(w), acc)
            y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
            tl.store(y_ptrs, _bf16_storable(acc, EXACT_FP32), mask=m_ok[:, None] & n_ok[None, :])

    @triton_op("minimax_ref::sorted_packed_matmul", mutates_args=())
    def _sorted_op(x: torch.Tensor, words: torch.Tensor, scale: torch.Tensor, g: torch.Tensor,
                   index: torch.Tensor | None, offs: torch.Tensor, nvfp4: bool, block_m: int, block_n: int,
                   block_k: int, num_warps: int, num_stages: int, exact_fp32: bool, table: bool) -> torch.Tensor:
        """The launch (see `sorted_packed_matmul`): x bf16 `[R, K]`, words int32 `[E, N, K/8 or K/4]`, scale uint8,
        g fp32 `[E]` or `[1]`, index int `[G]` or None, offs int32 `[G]`. Returns bf16 `[R, N]`."""
        rows, n = x.shape[0], words.shape[1]
        y = torch.empty((rows, n), dtype=torch.bfloat16, device=x.device)
        bound = -(-rows // block_m) + offs.numel()
        tile_group, tile_row = row_tiles(offs, block_m, bound)
        grid = (triton.cdiv(n, block_n), bound)
        wrap_triton(_sorted_kernel)[grid](
            x, words, scale, g, offs if index is None else index, offs, tile_group, tile_row, y,
            n, x.shape[1] // block_k, x.stride(0), words.stride(0), words.stride(1), scale.stride(0),
            scale.stride(1), 1 if g.numel() > 1 else 0, y.stride(0),
            NVFP4_FMT=nvfp4, HAS_INDEX=index is not None, EXACT_FP32=exact_fp32, TABLE=table and nvfp4,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)
        return y


def sorted_packed_matmul(x: torch.Tensor, fmt: str, weight: torch.Tensor, weight_scale: torch.Tensor,
                         weight_scale_2: torch.Tensor | None, offs: torch.Tensor, index: torch.Tensor | None = None,
                         tiles: Tiles | None = None, table: bool = False) -> torch.Tensor:
    """`torch._grouped_mm(x, w_hat[index].transpose(-2, -1), offs=offs)` for a packed stack, its weights decoded in
    the kernel's registers (module docstring: the contract).

    x: bf16 `[R, K]`, the rows sorted by group; weight, weight_scale, weight_scale_2: a packed stack `[E, N, K]` as
    stored (scales in the normal range, MXFP8 without an E4M3 NaN byte: the caller checks), K a multiple of 32;
    offs: int32 `[G]`, group g's rows end at offs[g] (cumulative; equal ends: an empty group); index: an integer
    tensor `[G]` of stack entries (None: group g is entry g, G <= E); table: NVFP4 through its blocks' tables (the same
    bits). Returns bf16 `[R, N]` (rows past offs[-1] unwritten). Static in the shapes: no host synchronisation."""
    if not AVAILABLE:
        raise RuntimeError("sorted_packed_matmul needs triton")
    tiles = tiles or tiles_for(x.device)
    k = x.shape[-1]
    stored_k = weight.shape[-1] * (2 if fmt == NVFP4 else 1)
    if (x.dim() != 2 or x.dtype != torch.bfloat16 or weight.dim() != 3 or stored_k != k or not grouped.supports(fmt, k)
            or offs.dim() != 1 or (index is not None and index.shape != offs.shape)):
        raise ValueError(f"sorted_packed_matmul: x {list(x.shape)} {x.dtype} against {fmt} stack "
                         f"{list(weight.shape)}, offs {list(offs.shape)}"
                         + ("" if index is None else f", index {list(index.shape)}"))
    block_k = grouped._fit_block_k(tiles, k)
    _, words, scale, g = grouped._packed_operands(fmt, weight, weight_scale, weight_scale_2)
    return torch.ops.minimax_ref.sorted_packed_matmul(
        x.contiguous(), words, scale, g, index, offs.to(torch.int32), fmt == NVFP4, tiles.block_m, tiles.block_n,
        block_k, tiles.num_warps, tiles.num_stages, grouped.interpreting(), table)


__all__ = ["AVAILABLE", "DEFAULT", "IN_REGISTERS_BELOW_ROWS_PER_EXPERT", "TUNED", "Tiles", "multiplies_in_registers",
           "row_tiles", "sorted_packed_matmul", "tiles_for"]
