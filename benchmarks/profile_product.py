"""One packed product of a decode step at release shapes, called a few times and nothing else, for a kernel profiler
to read (the operands of `packed_gemv.py`). Nsight Compute, the last call of the product's kernel, on 1 x H100
(BENCHMARKS.md, "What the products stall on"):

    ncu --clock-control none -k regex:_gemv_kernel --launch-skip 3 --launch-count 1 --section WarpStateStats \
        --section Occupancy --section MemoryWorkloadAnalysis \
        --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio' \
        python3 benchmarks/profile_product.py gemv-table w1 1
    # the grouped kernel: -k regex:_packed_matmul_kernel ... profile_product.py grouped-table w1 32

Kernels: `gemv` (`fast.gemv`, split K as `gemv.splits` chooses for the chosen experts), `grouped` (`fast.grouped`,
the launch `grouped.launch_for` chooses), each with `-table` for NVFP4 through the blocks' tables. Products: routed
`w1` and `w2` (NVFP4, 16 experts: at one row the 4 a token chose, else all), `q` and `o` (MXFP8 q_proj, o_proj).
"""

from __future__ import annotations

import argparse
import sys

import torch
from common import BenchmarkError, main_guard
from fused_matmul import operands

# name -> (format, experts in the stack (0: a linear), N, K)
PRODUCTS = {"w1": ("nvfp4", 16, 3072, 6144), "w2": ("nvfp4", 16, 6144, 3072),
            "q": ("mxfp8", 0, 8192, 6144), "o": ("mxfp8", 0, 6144, 8192)}
CHOSEN_AT_ONE_ROW = 4


def run(args: argparse.Namespace) -> None:
    if not torch.cuda.is_available():
        raise BenchmarkError("profile_product.py launches CUDA kernels: run it on a machine with a GPU")
    from minimax_ref.fast import gemv, grouped

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    fmt, experts, n, k = PRODUCTS[args.product]
    w, s, g = operands(fmt, experts, n, k, device)
    x = torch.randn(args.rows, k, generator=gen, device=device).to(torch.bfloat16)
    chosen = CHOSEN_AT_ONE_ROW if args.rows == 1 else experts
    active = None
    if experts:
        ids = torch.randperm(experts, generator=gen, device=device)[:chosen]
        active = torch.zeros(experts, dtype=torch.int32, device=device).index_fill_(0, ids, 1)
    table = args.kernel.endswith("-table")
    if args.kernel.startswith("gemv"):
        reordered = gemv.reorder(fmt, w, s, g)
        programs = max(chosen, 1) * -(-n // gemv.TILE_N)
        split = gemv.splits(programs, reordered[0].shape[2], grouped.sm_count(device))
        print(f"{args.kernel} {args.product} rows {args.rows}: split {split}, {programs * split} programs",
              file=sys.stderr)

        def product():
            return gemv.packed_product(x, fmt, n, *reordered, active=active, split=split, table=table)
    else:
        tiles, split = grouped.launch_for(fmt, max(experts, 1), n, k, device)
        print(f"{args.kernel} {args.product} rows {args.rows}: tiles {tiles.text()}, split {split}", file=sys.stderr)

        def product():
            return grouped.packed_matmul_grouped(x, fmt, w, s, g, active=active, tiles=tiles, split=split,
                                                 table=table)
    for _ in range(args.calls):
        product()
    torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("kernel", choices=["gemv", "gemv-table", "grouped", "grouped-table"])
    p.add_argument("product", choices=sorted(PRODUCTS))
    p.add_argument("rows", type=int, help="rows of x (1 to 64)")
    p.add_argument("--calls", type=int, default=4, help="calls of the product (default: 4)")
    args = p.parse_args(argv)
    if not 1 <= args.rows <= 64:
        p.error(f"rows {args.rows}: give 1 to 64 (a decode step's rows)")
    return main_guard(lambda: run(args), [])


if __name__ == "__main__":
    sys.exit(main())
