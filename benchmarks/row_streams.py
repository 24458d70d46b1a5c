"""What the routed experts' row reads stream at with nothing else in the loop. Each program reads its rows W bytes at a
time a row (one load of each of its rows an iteration, the next iteration's loads issued before this one's bytes are
used), placed as the one-token gate and up launch of `fast.mma_gemv` places its programs: 4 of 16 experts in each
half of a joint stack of 3072 rows of 3072 bytes (the release's routed w1 and w3 in NVFP4), 64 rows a program, the
rows' bytes in 3 K splits, 64 bytes a row an iteration (a pair step). Then the same bytes at other widths, splits,
rows a program and warps. The bytes are only xor-folded into one word a row (nothing decoded or multiplied), so each
time is the access pattern's own: the fraction is the chosen rows' bytes at the device-to-device copy rate measured
in the same run (a CUDA graph of 10 launches, replayed), and each fold is checked against torch's.

    # 1 x H100 or H200, under a minute:
    python benchmarks/row_streams.py --out row_streams.jsonl
"""

from __future__ import annotations

import argparse
import sys

import torch
from common import GIB, BenchmarkError, copy_bandwidth, emit, main_guard
from fused_matmul import per_call_s

from minimax_ref.fast import grouped

EXPERTS, CHOSEN, ROWS, ROW_BYTES = 16, (3, 7, 11, 14), 3072, 3072
# (what it is, rows a program, bytes a row an iteration, K splits, warps a program)
CASES = [("as the 1-token gate and up launch", 64, 64, 3, 4),
         ("128 bytes a row an iteration", 64, 128, 3, 4),
         ("256 bytes a row an iteration", 64, 256, 3, 4),
         ("64 bytes, 1 split", 64, 64, 1, 4),
         ("64 bytes, 6 splits", 64, 64, 6, 4),
         ("128 bytes, 32 rows a program", 32, 128, 3, 4),
         ("256 bytes, 16 rows a program", 16, 256, 3, 4),
         ("256 bytes, 1 split", 64, 256, 1, 4),
         ("64 bytes, 8 warps", 64, 64, 3, 8),
         ("64 bytes, 128 rows a program, 8 warps", 128, 64, 3, 8)]

if grouped.AVAILABLE:
    import triton
    import triton.language as tl

    @triton.jit
    def _fold_rows(w_ptr, ids_ptr, out_ptr, stride_e, stride_n, STEPS, Q, E_COPY, ROWS: tl.constexpr,
                   W: tl.constexpr):
        """Program (row block, output entry p, split): entry ids[p % Q] of stack half p // Q, its ROWS rows' STEPS x W
        int64 of the split, xor-folded to one int64 a row at out[p, split, row]."""
        pid_n = tl.program_id(0)
        p = tl.program_id(1)
        sid = tl.program_id(2)
        e = tl.load(ids_ptr + p % Q) + (p // Q) * E_COPY
        rows = pid_n * ROWS + tl.arange(0, ROWS)
        base = w_ptr + e * stride_e + rows[:, None] * stride_n + sid * STEPS * W + tl.arange(0, W)[None, :]
        acc = tl.zeros([ROWS, W], tl.int64)
        nxt = tl.load(base)
        for s in range(1, STEPS):
            cur = nxt
            nxt = tl.load(base + s * W)
            acc ^= cur
        acc ^= nxt
        tl.store(out_ptr + (p * tl.num_programs(2) + sid) * tl.num_programs(0) * ROWS + rows, tl.xor_sum(acc, 1))


def folded(w: torch.Tensor, ids: torch.Tensor, split: int) -> torch.Tensor:
    """torch's fold of what `_fold_rows` reads: [2 Q, split, N] int64."""
    entries = torch.cat([ids, ids + EXPERTS])
    parts = w[entries].view(len(entries), ROWS, split, -1)
    out = parts[..., 0].clone()
    for i in range(1, parts.shape[-1]):
        out ^= parts[..., i]
    return out.transpose(1, 2)


def run(args: argparse.Namespace) -> None:
    if not torch.cuda.is_available() or not grouped.runs_on(torch.device("cuda")):
        raise BenchmarkError("row_streams.py times a Triton kernel on a CUDA GPU: run it on such a machine")
    device = torch.device("cuda")
    bw = copy_bandwidth(device, 4 * GIB)
    gen = torch.Generator(device=device).manual_seed(0)
    w = torch.randint(-2**62, 2**62, (2 * EXPERTS, ROWS, ROW_BYTES // 8), device=device, dtype=torch.int64,
                      generator=gen)
    ids = torch.tensor(CHOSEN, device=device)
    nbytes = 2 * len(CHOSEN) * ROWS * ROW_BYTES
    result = {"benchmark": "row_streams", "command": " ".join(sys.argv), "device_name":
              torch.cuda.get_device_name(device), "torch": torch.__version__, "copy_bandwidth": bw,
              "read_bytes": nbytes, "roofline_us": 1e6 * nbytes / bw["bytes_per_s"], "cases": []}
    for name, rows, width, split, warps in CASES:
        steps = ROW_BYTES // width // split
        grid = (ROWS // rows, 2 * len(CHOSEN), split)
        out = torch.empty(grid[1] * split * ROWS, device=device, dtype=torch.int64)

        def launch(grid=grid, out=out, steps=steps, rows=rows, width=width, warps=warps):
            _fold_rows[grid](w, ids, out, w.stride(0), w.stride(1), steps, len(CHOSEN), EXPERTS, ROWS=rows,
                             W=width // 8, num_warps=warps)

        launch()
        if not torch.equal(out.view(grid[1], split, ROWS), folded(w, ids, split)):
            raise BenchmarkError(f"{name}: the kernel's fold differs from torch's")
        t = per_call_s(launch, args.iters)
        case = {"name": name, "rows_per_program": rows, "bytes_per_row_iteration": width, "splits": split,
                "warps": warps, "programs": grid[0] * grid[1] * grid[2], "us": 1e6 * t,
                "copy_fraction": nbytes / bw["bytes_per_s"] / t}
        result["cases"].append(case)
        print(f"{name:40s} {case['programs']:5d} programs {case['us']:6.1f} us "
              f"({100 * case['copy_fraction']:5.1f} % of the copy rate)", file=sys.stderr, flush=True)
    emit(result, args.out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=50, help="graph replays timed (default: 50)")
    p.add_argument("--out", default=None, help="also append the JSON line to this file")
    args = p.parse_args(argv)
    return main_guard(lambda: run(args), [])


if __name__ == "__main__":
    sys.exit(main())
