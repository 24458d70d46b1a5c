"""The MSA block selection's scores in one Triton kernel (`FastPaths(block_selection="triton")`, preset `selection`):
the lightning indexer's block scores of prefill calls computed straight from the index queries and keys, never the
[T, L] index scores.

The reference (`msa.index_scores`, `msa.block_scores`) scores every query against every cached index key (an fp32
[B, Hi, T, L] tensor: 1 GiB a layer for an 8K prompt at release widths), masks the future keys, pads it to whole
blocks and takes each block's max; at 8K tokens on 60 layers that is an fp32 GEMM on the CUDA cores plus three
passes over those scores. Here one program takes a tile of `Tiles.queries` consecutive query tokens of one sequence
and one index head, keeps their index queries in registers and streams the index keys block by block (in key tiles of
`Tiles.keys`), each block's max kept per query in registers and stored once: the only tensor written is the block
scores.

Contract (`block_scores`; the tests check it against the reference, `msa.block_scores(msa.index_scores(...))`):
* operands: index queries iq [B, T, Hi, Di] bf16 (a model's `index_qk`), index keys ik [B, L, Di] bf16 (what
  `LayerCache.index_keys` gives a bf16 model: an fp8 cache's keys already loaded) or float8_e4m3fn as an fp8 cache
  stores them, read as `LayerCache.load` reads them: bf16(fp32(e4m3) * ik_scale), in registers; q_pos [B, T] the
  queries' positions (key slot k is position k);
* scores: s[b, h, t, k] = iq . ik over Di channels, the products of two bf16 values (exact in fp32) summed in fp32 by
  the tensor cores (`tl.dot` with an fp32 accumulator), no scale. The reference computes the same products in fp32
  (`.float()` of the same bf16 values) and sums them in fp32 too: only the order of the sums differs (and tensor
  cores may align a group's addends by truncation), so each score is the reference's within
  gamma_Di(u) + gamma_Di(2u) <= 3.1 Di u of sum_d |iq_d ik_d| (u = 2^-24, gamma_n(u) = n u / (1 - n u): the
  bounds of fp32 summation, the tensor cores' with twice the unit roundoff; 2.4e-5 of it at Di = 128);
* block scores fp32 [B, Hi, T, nb], nb = ceil(L / block_size): block j's max of s over its keys at or before the
  query's position (slots past L do not exist); -inf for a block with no such key; +inf for the forced blocks
  (`msa.block_scores`' rule: the `local_blocks` blocks ending at pos // block_size, and the first `init_blocks`
  blocks at or before it). A max of values each within e of the reference's is within e of the reference's max, so
  each finite block score is the reference's within the bound above taken over the block's keys; -inf and +inf are
  exactly the reference's (they depend on positions only).
* the selection (`fast.attention.select_blocks_kernel`): torch's top-k of these scores as msa.select_blocks does it
  (ids of -inf scores -> -1, left-packed, descending). The ids can differ from the reference's only where two block
  scores lie within the sums' rounding of each other (ties): a selected block's reference score is at least the
  k-th largest reference score minus twice the bound; the count of valid ids and the empty slots are the same.

Two launch shapes of the same contract. Prefill calls: a program a tile of queries and index head (above). Few query
rows (queries x index heads <= `DECODE_ROWS`: decode steps, speculative verification): a program a sequence and a run
of consecutive blocks (`_decode_block_scores_kernel`), every query row of the sequence (t, h) against each key tile
loaded once, the runs sized so the programs fill the GPU; blocks after every row's position are written -inf unread.
A decode step's query tile would be mostly padding and its few programs would each stream a whole cache.

`block_scores` launches the kernel through `torch.library.triton_op` (`minimax_ref::selection_block_scores`), so a
compiled region and a CUDA graph take it as it is (static shapes, no host read). `handles` says where it runs: CUDA
with triton, bf16 index queries, index keys bf16 or fp8, index heads of at most 256 channels; under
`TRITON_INTERPRET=1` (the tests on a CPU) CPU tensors outside compiled regions, with `fast.grouped`'s exact-fp32
forms of the bf16 loads and dots. Memory: the output only (B x Hi x T x nb fp32); callers chunk the queries to bound
it (`fast.attention.FastBlockSelection`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError
from . import attention_kernel
from .grouped import AVAILABLE, interpreting
from .launch import KernelTiles

if AVAILABLE:
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton

# tl.dot's smallest side: query tiles, key tiles and the channels are at least this.
MIN_TILE = 16
# Index heads wider than this are left to the reference (the query tile stays in registers).
MAX_INDEX_DIM = 256
# Query rows (queries x index heads) up to which a call takes the decode grid: the rows are one dot operand.
DECODE_ROWS = 64
# The decode grid's key tile and warps: a program loads 128 keys at once (16 KB of fp8 keys in flight), and 4 warps
# suffice for its dot of 16 to 64 query rows.
DECODE_KEYS = 128
DECODE_WARPS = 4
# Programs an SM the decode grid's runs of blocks aim at (loads in flight over the GPU).
DECODE_PER_SM = 4


@dataclass(frozen=True)
class Tiles(KernelTiles):
    """One launch configuration of the selection kernel: `queries` query tokens a program (the dot's M), `keys` key
    slots a key tile (a block of more slots is read as several tiles), `num_warps`, `num_stages` (software pipelining
    of the key loads). Powers of two, queries and keys at least 16."""

    KIND = "selection"

    queries: int = 128
    keys: int = 64
    num_warps: int = 8
    num_stages: int = 2

    def check(self) -> None:
        if self.queries < MIN_TILE or self.keys < MIN_TILE or self.num_stages < 1:
            raise ConfigError(f"selection tiles: queries={self.queries}, keys={self.keys} (>= {MIN_TILE}), "
                              f"num_stages={self.num_stages} (>= 1)")


# Where `TUNED` has no entry: 128 queries of one index head against key tiles of 64 slots, 8 warps, the
# attention kernel's shape for 128-channel operands.
DEFAULT = Tiles()
# Measured configurations (benchmarks/selection_kernel.py --sweep prints an entry in this form):
# torch.cuda.get_device_properties().name -> Tiles.
TUNED: dict[str, Tiles] = {
    "NVIDIA H200": Tiles(128, 128, 8, 2),
}


def tiles_for(device: torch.device) -> Tiles:
    """`TUNED`'s entry for this GPU, else `DEFAULT` (the device is queried only when `TUNED` has entries)."""
    if device.type == "cuda" and TUNED:
        return TUNED.get(torch.cuda.get_device_properties(device).name, DEFAULT)
    return DEFAULT


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


if AVAILABLE:
    # the callees as globals of this module: inductor's compile worker resolves a kernel's callees by global name
    _x_operand = attention_kernel._x_operand
    _kv_tile = attention_kernel._kv_tile
    _dot = attention_kernel._dot

    @triton.jit
    def _block_max(q, k_base, stride_kl, j, qpos, L, d, d_ok, ik_scale, BS: tl.constexpr, QUERIES: tl.constexpr,
                   KEYS: tl.constexpr, MASKED: tl.constexpr, IK_FP8: tl.constexpr, EXACT_FP32: tl.constexpr):
        """Max over block j's keys of q . k per query row [QUERIES] (fp32 sums). MASKED: only keys at or before
        the row's position `qpos` and before L count (-inf if none); else every key of the block exists and
        precedes every row."""
        n = tl.arange(0, KEYS)
        m = tl.full((QUERIES,), float("-inf"), dtype=tl.float32)
        for c in tl.static_range(0, BS, KEYS):
            kpos = j * BS + c + n
            k_ok = (c + n < BS) & (kpos < L)
            kt = _kv_tile(k_base + kpos[:, None] * stride_kl + d[None, :], k_ok[:, None] & d_ok[None, :], ik_scale,
                          IK_FP8, EXACT_FP32)
            s = _dot(q, tl.trans(kt), tl.zeros((QUERIES, KEYS), dtype=tl.float32), EXACT_FP32)
            if MASKED:
                s = tl.where(k_ok[None, :] & (kpos[None, :] <= qpos[:, None]), s, float("-inf"))
            elif BS % KEYS != 0:  # the block's last key tile runs past it
                s = tl.where(k_ok[None, :], s, float("-inf"))
            m = tl.maximum(m, tl.max(s, 1))
        return m

    @triton.jit
    def _block_bounds(qpos, ok, L, BS: tl.constexpr):
        """(full, read) of a program's rows at positions `qpos` (where `ok`): blocks before `full` lie wholly before L
        and at or before every row's position (no causal mask); blocks from `read` on hold no key of any row (-inf,
        unread)."""
        last = tl.minimum(tl.max(qpos, 0), L - 1)
        first = tl.minimum(tl.min(tl.where(ok, qpos, L - 1), 0), L - 1)
        return tl.minimum((first + 1) // BS, L // BS), last // BS + 1

    @triton.jit
    def _store_block(out_rows, j, m, qblk, LOCAL, INIT, t_ok):
        """Block j's scores `m` of the rows, +inf where the block is forced (msa.block_scores' rule)."""
        forced = ((j <= qblk) & (j > qblk - LOCAL)) | ((j < INIT) & (j <= qblk))
        tl.store(out_rows + j, tl.where(forced, float("inf"), m), mask=t_ok)

    @triton.jit
    def _block_scores_kernel(
        iq_ptr, ik_ptr, pos_ptr, out_ptr, T, L, NB, LOCAL, INIT, ik_scale,
        stride_qb, stride_qt, stride_qh, stride_kb, stride_kl, stride_pb, stride_pt, stride_ob, stride_oh, stride_ot,
        DI: tl.constexpr, DP: tl.constexpr, BS: tl.constexpr, QUERIES: tl.constexpr, KEYS: tl.constexpr,
        IK_FP8: tl.constexpr, EXACT_FP32: tl.constexpr,
    ):
        """out[b, h, t, j] for the QUERIES tokens t of one tile, index head h, sequence b, every block j (see
        `block_scores`). Grid: (query tiles, index heads, sequences); tiles run last first (the longest first)."""
        pid_t = tl.cdiv(T, QUERIES) - 1 - tl.program_id(0)
        h = tl.program_id(1)
        b = tl.program_id(2).to(tl.int64)  # a batch of long caches passes 2^31 elements
        t = pid_t * QUERIES + tl.arange(0, QUERIES)
        t_ok = t < T
        d = tl.arange(0, DP)
        d_ok = d < DI
        qpos = tl.load(pos_ptr + b * stride_pb + t * stride_pt, mask=t_ok, other=-1)
        q = _x_operand(iq_ptr + b * stride_qb + t[:, None] * stride_qt + h * stride_qh + d[None, :],
                       t_ok[:, None] & d_ok[None, :], EXACT_FP32)
        k_base = ik_ptr + b * stride_kb
        out_rows = out_ptr + b * stride_ob + h * stride_oh + t * stride_ot
        qblk = qpos // BS
        full, read = _block_bounds(qpos, t_ok, L, BS)
        for j in range(0, full):
            m = _block_max(q, k_base, stride_kl, j, qpos, L, d, d_ok, ik_scale, BS, QUERIES, KEYS, False, IK_FP8,
                           EXACT_FP32)
            _store_block(out_rows, j, m, qblk, LOCAL, INIT, t_ok)
        for j in range(full, read):
            m = _block_max(q, k_base, stride_kl, j, qpos, L, d, d_ok, ik_scale, BS, QUERIES, KEYS, True, IK_FP8,
                           EXACT_FP32)
            _store_block(out_rows, j, m, qblk, LOCAL, INIT, t_ok)
        none = tl.full((QUERIES,), float("-inf"), dtype=tl.float32)
        for j in range(read, NB):
            tl.store(out_rows + j, none, mask=t_ok)

    @triton.jit
    def _decode_block_scores_kernel(
        iq_ptr, ik_ptr, pos_ptr, out_ptr, T, L, NB, LOCAL, INIT, ik_scale, PER,
        stride_qb, stride_qt, stride_qh, stride_kb, stride_kl, stride_pb, stride_pt, stride_ob, stride_oh, stride_ot,
        HI: tl.constexpr, DI: tl.constexpr, DP: tl.constexpr, BS: tl.constexpr, ROWS: tl.constexpr,
        KEYS: tl.constexpr, IK_FP8: tl.constexpr, EXACT_FP32: tl.constexpr,
    ):
        """out[b, h, t, j] for every query t and index head h of sequence b (row t * HI + h of ROWS) and the PER
        blocks j of this program's run (see `block_scores`). Grid: (runs of PER blocks, sequences)."""
        b = tl.program_id(1).to(tl.int64)
        r = tl.arange(0, ROWS)
        t = r // HI
        h = r % HI
        r_ok = t < T
        d = tl.arange(0, DP)
        d_ok = d < DI
        qpos = tl.load(pos_ptr + b * stride_pb + t * stride_pt, mask=r_ok, other=-1)
        q = _x_operand(iq_ptr + b * stride_qb + t[:, None] * stride_qt + h[:, None] * stride_qh + d[None, :],
                       r_ok[:, None] & d_ok[None, :], EXACT_FP32)
        k_base = ik_ptr + b * stride_kb
        out_rows = out_ptr + b * stride_ob + h * stride_oh + t * stride_ot
        qblk = qpos // BS
        full, read = _block_bounds(qpos, r_ok, L, BS)  # blocks from `read` on: -inf, never forced
        j0 = tl.program_id(0) * PER
        for j in range(j0, tl.minimum(j0 + PER, NB)):
            if j < full:
                m = _block_max(q, k_base, stride_kl, j, qpos, L, d, d_ok, ik_scale, BS, ROWS, KEYS, False, IK_FP8,
                               EXACT_FP32)
            elif j < read:
                m = _block_max(q, k_base, stride_kl, j, qpos, L, d, d_ok, ik_scale, BS, ROWS, KEYS, True, IK_FP8,
                               EXACT_FP32)
            else:
                m = tl.full((ROWS,), float("-inf"), dtype=tl.float32)
            _store_block(out_rows, j, m, qblk, LOCAL, INIT, r_ok)

    @triton_op("minimax_ref::selection_block_scores", mutates_args=())
    def _block_scores_op(iq: torch.Tensor, ik: torch.Tensor, q_pos: torch.Tensor, block_size: int,
                         local_blocks: int, init_blocks: int, ik_scale: float, queries: int, keys: int,
                         num_warps: int, num_stages: int, exact_fp32: bool, sms: int) -> torch.Tensor:
        """The launch (see `block_scores`): iq bf16 [B, T, Hi, Di], ik bf16 or uint8 (fp8's bytes) [B, L, Di], both
        with unit channel stride; returns fp32 [B, Hi, T, nb]. T * Hi <= DECODE_ROWS: the decode grid, its runs of
        blocks sized for `sms` SMs."""
        B, T, Hi, Di = iq.shape
        L = ik.shape[1]
        nb = triton.cdiv(L, block_size)
        out = torch.empty(B, Hi, T, nb, dtype=torch.float32, device=iq.device)
        fp8 = attention_kernel.fp8_mode(ik.dtype, ik_scale)
        if T * Hi <= DECODE_ROWS:
            per = max(1, nb * B // (DECODE_PER_SM * sms))
            wrap_triton(_decode_block_scores_kernel)[(triton.cdiv(nb, per), B)](
                iq, ik, q_pos, out, T, L, nb, local_blocks, init_blocks, ik_scale, per,
                iq.stride(0), iq.stride(1), iq.stride(2), ik.stride(0), ik.stride(1), *q_pos.stride(),
                out.stride(0), out.stride(1), out.stride(2),
                HI=Hi, DI=Di, DP=max(MIN_TILE, _pow2(Di)), BS=block_size, ROWS=max(MIN_TILE, _pow2(T * Hi)),
                KEYS=min(DECODE_KEYS, max(MIN_TILE, _pow2(block_size))), IK_FP8=fp8, EXACT_FP32=exact_fp32,
                num_warps=DECODE_WARPS, num_stages=1)
            return out
        grid = (triton.cdiv(T, queries), Hi, B)
        wrap_triton(_block_scores_kernel)[grid](
            iq, ik, q_pos, out, T, L, nb, local_blocks, init_blocks, ik_scale,
            iq.stride(0), iq.stride(1), iq.stride(2), ik.stride(0), ik.stride(1), *q_pos.stride(),
            out.stride(0), out.stride(1), out.stride(2),
            DI=Di, DP=max(MIN_TILE, _pow2(Di)), BS=block_size, QUERIES=queries,
            KEYS=min(keys, max(MIN_TILE, _pow2(block_size))), IK_FP8=fp8,
            EXACT_FP32=exact_fp32,
            num_warps=num_warps, num_stages=num_stages)
        return out


def block_scores(iq: torch.Tensor, ik: torch.Tensor, q_pos: torch.Tensor, block_size: int, local_blocks: int = 1,
                 init_blocks: int = 0, ik_scale: float = 1.0, tiles: Tiles | None = None,
                 sms: int = 1) -> torch.Tensor:
    """`msa.block_scores(msa.index_scores(iq, ik, q_pos), q_pos, block_size, local_blocks, init_blocks)` without the
    index scores: fp32 [B, Hi, T, ceil(L / block_size)] of bf16 index queries iq [B, T, Hi, Di] at positions q_pos
    [B, T] over index keys ik [B, L, Di] (bf16, or float8_e4m3fn read as bf16(fp32(x) * ik_scale)). Equal to the
    reference within the order of the fp32 sums (the module docstring's contract). tiles: the prefill grid's launch
    configuration (default `tiles_for` this device); sms: the GPU's SMs, which the decode grid (T * Hi <=
    `DECODE_ROWS`) spreads its programs over. Static in the shapes, no host read."""
    if not AVAILABLE:
        raise RuntimeError("selection_kernel.block_scores needs triton")
    B, T, Hi, Di = iq.shape
    if iq.dtype != torch.bfloat16 or ik.dtype not in (torch.bfloat16, torch.float8_e4m3fn) or ik.shape[0] != B \
            or ik.shape[2] != Di or Di > MAX_INDEX_DIM or tuple(q_pos.shape) != (B, T):
        raise ValueError(f"selection_kernel.block_scores: iq {list(iq.shape)} {iq.dtype}, ik {list(ik.shape)} "
                         f"{ik.dtype}, q_pos {list(q_pos.shape)}")
    if tiles is None:
        tiles = tiles_for(iq.device)
    if iq.stride(-1) != 1:
        iq = iq.contiguous()
    if ik.stride(-1) != 1:
        ik = ik.contiguous()
    if ik.dtype == torch.float8_e4m3fn:
        ik = ik.view(torch.uint8)
    return torch.ops.minimax_ref.selection_block_scores(iq, ik, q_pos, block_size, local_blocks, init_blocks,
                                                        float(ik_scale), tiles.queries, tiles.keys, tiles.num_warps,
                                                        tiles.num_stages, interpreting(), max(1, sms))


def handles(device: torch.device, dtype: torch.dtype, ik_dtype: torch.dtype, index_dim: int) -> bool:
    """Whether `block_scores` runs here: bf16 index queries (`dtype`), index keys `ik_dtype` bf16 or fp8, at most
    `MAX_INDEX_DIM` channels, on CUDA with triton (or CPU tensors under the interpreter, outside compiled regions:
    those cannot trace an interpreted kernel)."""
    if not AVAILABLE or dtype != torch.bfloat16 or ik_dtype not in (torch.bfloat16, torch.float8_e4m3fn):
        return False
    if index_dim > MAX_INDEX_DIM:
        return False
    if interpreting():
        return device.type == "cpu" and not torch.compiler.is_compiling()
    return device.type == "cuda"
