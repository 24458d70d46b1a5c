"""The grouped dequantize-and-multiply (`fast.grouped.packed_matmul_grouped`, `FastPaths(grouped=True)`) at the
release's shapes and a batch-decode row count, against what it replaces at more than `fused_rows` rows: decoding
the weight to bf16, then cuBLAS (`decode_then_matmul`, `decode_fast` then `torch.matmul`), and cuBLAS on a weight
decoded beforehand (`cublas_bf16`, 3.6x the bytes for NVFP4; no decoding). The grouped kernel runs as `compiled`
runs it (NVFP4 through each block's 8-value table); beside it, NVFP4 by bit operations (`grouped bits`,
`table=False`), the kernel in the other orientation (`x_major`: `grouped.Tiles.x_major` flipped) and, in the
orientation x_major 0, with one product per plane of the packed words flipped on or off (`planes`:
`grouped.Tiles.planes`, which keeps the decoded tile out of shared memory). Each figure is
microseconds per product (a CUDA graph of 10 products, replayed) with the packed bytes read per second and the
fraction of the weight-read roofline (packed bytes and scales over the device-to-device copy bandwidth measured in
the same run). Every product is first checked against `fast.packed.packed_matmul_reference`.

`--sweep` times every launch configuration of `--sweep-tiles` on each shape and prints, per format, the one with the
least total time as an entry for `fast.grouped.TUNED`. `--tiles` times one configuration.

    # 1 x H200 (about a minute; the first launch of each configuration compiles it):
    python benchmarks/grouped_gemm.py --rows 32 --out grouped_gemm.jsonl
    python benchmarks/grouped_gemm.py --rows 32 --sweep --out grouped_sweep.jsonl
    # the tuned tiles against the same tiles by planes (and the planes sweep entries alone)
    python benchmarks/grouped_gemm.py --rows 32 --tiles 64,128,4,4 --out grouped_planes.jsonl
    python benchmarks/grouped_gemm.py --rows 32 --sweep --sweep-tiles "64,128,4,4;64,128,4,4,0,1;128,256,8,3,0,1"
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from dataclasses import replace

import torch
from common import GIB, BenchmarkError, add_kernel_bench_flags, copy_bandwidth, emit, main_guard, tile_configs
from fused_matmul import operands, per_call_s

from minimax_ref.fast.packed import decode_fast, packed_matmul_reference

# (name, format, entries of the stack (0: a linear), N, K): the release's products at TP1, 16 experts a layer (all of
# them chosen at batch 32: 128 (token, slot) pairs)
SHAPES = [("16 routed experts w1", "nvfp4", 16, 3072, 6144), ("16 routed experts w2", "nvfp4", 16, 6144, 3072),
          ("q_proj", "mxfp8", 0, 8192, 6144), ("k_proj", "mxfp8", 0, 512, 6144), ("o_proj", "mxfp8", 0, 6144, 8192),
          ("shared gate_proj", "mxfp8", 0, 3072, 6144), ("shared down_proj", "mxfp8", 0, 6144, 3072),
          ("dense gate_proj", "mxfp8", 0, 12288, 6144), ("dense down_proj", "mxfp8", 0, 6144, 12288)]
# Configurations that compile for sm_90 without register spills at 16 and 32 rows, both formats (ptxas -v; the
# planes ones, "...,0,1", also at 64 rows: benchmarks/kernel_sass.py)
SWEEP = ["128,64,8,4", "128,64,8,3", "128,128,8,3", "128,128,8,4", "64,64,4,4", "128,32,4,4", "64,128,4,4",
         "256,128,8,3", "128,64,8,4,1", "128,128,8,3,1", "64,128,4,4,0,1", "128,128,8,4,0,1", "64,256,4,4,0,1",
         "128,256,8,3,0,1", "128,128,4,4,0,1"]


def measure(shape: tuple, rows: int, iters: int, bw: float, configs: list, device: torch.device,
            baselines: bool) -> dict:
    """One shape (`SHAPES`): microseconds, packed bytes per second and roofline fraction per variant."""
    from minimax_ref.fast.grouped import packed_matmul_grouped, tiles_for

    name, fmt, experts, n, k = shape
    w, s, g = operands(fmt, experts, n, k, device)
    x = torch.randn(rows, k, device=device).to(torch.bfloat16)
    nbytes = w.numel() * w.element_size() + s.numel() * s.element_size()
    want = packed_matmul_reference(x, fmt, w, s, g, torch.bfloat16).float()
    case: dict = {"name": name, "format": fmt, "experts": experts, "N": n, "K": k, "rows": rows,
                  "packed_bytes": nbytes, "roofline_us": 1e6 * nbytes / bw}
    table = fmt == "nvfp4"  # as `compiled` multiplies: NVFP4 through the blocks' tables
    variants = {f"grouped {c.text() if c else 'default'}": (
        lambda c=c: packed_matmul_grouped(x, fmt, w, s, g, tiles=c, table=table)) for c in configs}
    if baselines:
        tiles = configs[0] or tiles_for(fmt, device)
        if table:
            variants["grouped bits"] = lambda: packed_matmul_grouped(x, fmt, w, s, g, tiles=tiles)
        flipped = replace(tiles, x_major=1 - tiles.x_major, planes=0)
        variants[f"grouped x_major={flipped.x_major}"] = (
            lambda: packed_matmul_grouped(x, fmt, w, s, g, tiles=flipped, table=table))
        if not tiles.x_major:  # one product per plane of the words, or the tile interleaved into K order
            other = replace(tiles, planes=1 - tiles.planes)
            variants[f"grouped planes={other.planes}"] = (
                lambda: packed_matmul_grouped(x, fmt, w, s, g, tiles=other, table=table))
        dense = decode_fast(fmt, w, s, g, torch.bfloat16)
        variants["cublas_bf16"] = lambda: torch.matmul(x, dense.transpose(-1, -2))
        variants["decode_then_matmul"] = lambda: torch.matmul(x, decode_fast(fmt, w, s, g, torch.bfloat16)
                                                              .transpose(-1, -2))
    for vname, fn in variants.items():
        err = float((fn().float() - want).abs().max() / want.abs().max())
        if err > 1e-2:
            raise BenchmarkError(f"{name} {vname}: relative error {err:.3g} against decode-then-matmul")
        t = per_call_s(fn, iters)
        case[vname] = {"us": 1e6 * t, "packed_bytes_per_s": nbytes / t, "roofline_fraction": nbytes / bw / t,
                       "rel_err": err}
    print(f"{name:22s} roof {case['roofline_us']:7.1f} us  " + "  ".join(
        f"{v} {case[v]['us']:.1f} us ({100 * case[v]['roofline_fraction']:.0f} %)" for v in variants),
        file=sys.stderr, flush=True)
    return case


def run(args: argparse.Namespace) -> None:
    if not torch.cuda.is_available():
        raise BenchmarkError("grouped_gemm.py measures CUDA kernels: run it on a machine with a GPU")
    from minimax_ref.fast import grouped

    if not grouped.AVAILABLE:
        raise BenchmarkError("grouped_gemm.py needs triton (pip install triton)")
    device = torch.device("cuda")
    bw = copy_bandwidth(device, 2 * GIB)["bytes_per_s"]
    configs = tile_configs(args, grouped.Tiles)
    cases = [measure(shape, args.rows, args.iters, bw, configs, device, not args.sweep) for shape in SHAPES]
    out: dict = {"benchmark": "grouped_gemm", "command": " ".join(sys.argv), "torch": torch.__version__,
                 "triton": grouped.triton.__version__, "device_name": torch.cuda.get_device_name(device),
                 "copy_bandwidth_bytes_per_s": bw, "rows": args.rows, "cases": cases}
    if args.sweep:
        totals: dict[str, dict[str, float]] = defaultdict(dict)
        for case in cases:
            for c in configs:
                v = f"grouped {c.text()}"
                totals[case["format"]][c.text()] = totals[case["format"]].get(c.text(), 0.0) + case[v]["us"]
        best = {fmt: min(t, key=t.get) for fmt, t in totals.items()}
        out["sweep_totals_us"], out["best"] = totals, best
        key = (torch.cuda.get_device_name(device), grouped._major_minor(torch.__version__),
               grouped._major_minor(grouped.triton.__version__))
        entry = ", ".join(f'"{fmt}": Tiles({", ".join(t.split(","))})' for fmt, t in best.items())
        print(f"fast.grouped.TUNED entry:\n    {key!r}: {{{entry}}},", file=sys.stderr, flush=True)
    emit(out, args.out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=32, help="rows of x (tokens of a decode step; default: 32)")
    add_kernel_bench_flags(p, "BN,BK,WARPS,STAGES", "fast.grouped.tiles_for", SWEEP, iters=30)
    args = p.parse_args(argv)
    return main_guard(lambda: run(args), [])


if __name__ == "__main__":
    sys.exit(main())
