"""Decode-step products with packed weights at the release's shapes: `fast.gemv` (weights reordered at load, split-K
GEMV at one row, tensor-core dot above; `FastPaths(gemv="triton")`) beside the kernels the `compiled` preset uses
today for the same product: the compiled fused dequantize-and-multiply at one row (`fast.packed.Kernels.matmul`, one
row a pass, the NVFP4 and gate/up bytes read as words) and the grouped Triton kernel from two rows
(`fast.grouped.packed_matmul_grouped`). Each figure is microseconds per product (a CUDA graph of 10 products,
replayed), and the fraction of the copy rate: the packed bytes and scales the product must read (the chosen experts'
only) over the device-to-device copy bandwidth measured in the same run. Every product is first checked against
`fast.packed.packed_matmul_reference`.

Routed experts as the engine multiplies them: 16 experts a layer, at one row the 4 a token chose (flags over the stack:
what `FastExperts.forward_grouped` passes), at 32 rows all 16; w1 (gate; w3, up, is the same product) with the tokens'
rows shared, w2 (down) with each expert's own rows. `--per-sm` times the GEMV's K splits for several targets of
programs an SM (`fast.gemv.splits`). Products of up to 32 rows also through `fast.mma_gemv` (the `gemv-mma` preset's
kernel: tensor-core MMAs on fragments each lane decodes from its own words), on GPUs it runs on: from its reordered
copy ("mma default") and read where the weight is stored, its K splits added in the kernel ("mma stored", what
`gemv-mma` runs: at one row the routed experts by their ids, "mma stored flags" by flags over the stack;
`--mma-ahead 2` also with loads two K steps ahead).

    # 1 x H200 (about a minute; the first launch of each kernel compiles it):
    python benchmarks/packed_gemv.py --rows 1,32 --per-sm 2,4,8 --out packed_gemv.jsonl
    # one row on the tensor cores too (the grouped kernel, x padded to 16 rows), for some launch configurations:
    python benchmarks/packed_gemv.py --rows 1 --per-sm 8,16 --dot-tiles "64,128,4,4 32,256,4,3 128,128,8,3"
"""

from __future__ import annotations

import argparse
import sys

import torch
from common import GIB, BenchmarkError, copy_bandwidth, emit, main_guard
from fused_matmul import operands, per_call_s

from minimax_ref.fast.packed import Kernels, packed_matmul_reference

# (name, format, experts in the stack (0: a linear), N, K, one x per expert): the release's products at TP1
SHAPES = [("routed w1 (gate; w3 alike)", "nvfp4", 16, 3072, 6144, False),
          ("routed w2 (down)", "nvfp4", 16, 6144, 3072, True),
          ("q_proj", "mxfp8", 0, 8192, 6144, False), ("k_proj", "mxfp8", 0, 512, 6144, False),
          ("o_proj", "mxfp8", 0, 6144, 8192, False),
          ("shared gate_proj (up alike)", "mxfp8", 0, 3072, 6144, False),
          ("shared down_proj", "mxfp8", 0, 6144, 3072, False),
          ("dense gate_proj (up alike)", "mxfp8", 0, 12288, 6144, False),
          ("dense down_proj", "mxfp8", 0, 6144, 12288, False)]
CHOSEN_AT_ONE_ROW = 4  # top-k of the release's router


def measure(shape: tuple, rows: int, per_sm: list[int], iters: int, bw: float, kernels: Kernels,
            device: torch.device, dot_tiles: list | None = None, mma_ahead: list[int] | None = None) -> dict:
    """One shape at `rows` rows: microseconds and copy-rate fraction of gemv (one entry per `per_sm`) and of today's
    kernel; at one row also the grouped kernel's tensor-core product (x's row padded to the MMA's 16) for each of
    `dot_tiles` (`grouped.Tiles`), its K split filling the GPU twice over with the chosen entries' tiles."""
    from minimax_ref.fast import gemv, grouped, mma_gemv

    name, fmt, experts, n, k, per_expert = shape
    w, s, g = operands(fmt, experts, n, k, device)
    gen = torch.Generator(device=device).manual_seed(0)
    chosen = experts if rows > 1 else CHOSEN_AT_ONE_ROW
    if experts:
        ids = torch.randperm(experts, generator=gen, device=device)[:chosen].sort().values
        active = torch.zeros(experts, dtype=torch.int32, device=device).index_fill_(0, ids, 1)
        x = torch.randn(experts if per_expert else 1, rows, k, generator=gen, device=device).to(torch.bfloat16)
        x = x if per_expert else x[0]
    else:
        ids, active = None, None
        x = torch.randn(rows, k, generator=gen, device=device).to(torch.bfloat16)
    entry_bytes = (w.numel() * w.element_size() + s.numel() * s.element_size()) // max(experts, 1)
    nbytes = entry_bytes * (chosen if experts else 1)
    want = packed_matmul_reference(x, fmt, w, s, g, torch.bfloat16).float()
    if experts:
        want = want[ids]
    reordered = gemv.reorder(fmt, w, s, g)
    mma_reordered = mma_gemv.reorder(fmt, w, s, g)
    chosen_or_one = chosen if experts else 1
    k_tiles, programs = reordered[0].shape[2], (chosen if experts else 1) * -(-n // gemv.TILE_N)
    sms = grouped.sm_count(device)
    variants = {}
    in_id_order = set()  # variants whose outputs are the chosen experts' alone, in `ids`' order
    for target in per_sm:
        split = gemv.splits(programs, k_tiles, sms, target)
        variants[f"gemv per_sm={target} split={split}"] = (
            lambda split=split: gemv.packed_product(x, fmt, n, *reordered, active=active, split=split))
        if fmt == "nvfp4" and rows == 1:  # the `gemv` preset's decode: each block's table of its 8 values
            variants[f"gemv table per_sm={target} split={split}"] = (
                lambda split=split: gemv.packed_product(x, fmt, n, *reordered, active=active, split=split,
                                                        table=True))
        if rows <= mma_gemv.MAX_ROWS and mma_gemv.runs_on(device):  # `gemv-mma`'s kernel
            mma_split = mma_gemv.splits(mma_gemv.programs(fmt, chosen_or_one, mma_reordered[0].shape[1], rows),
                                        mma_reordered[0].shape[2], sms, target)
            variants[f"mma per_sm={target} split={mma_split}"] = (
                lambda split=mma_split: mma_gemv.packed_product(x, n, *mma_reordered, active=active, split=split))
    if rows <= mma_gemv.MAX_ROWS and mma_gemv.runs_on(device):  # the launches `gemv-mma` makes (`mma_gemv.LAUNCH`)
        busy = chosen if experts else None
        variants["mma default"] = lambda: mma_gemv.packed_product(x, n, *mma_reordered, active=active, sms=sms,
                                                                  busy=busy)
        counters = mma_gemv.counters_for(max(experts, 1), n, device)
        if experts and rows == 1:  # a token's chosen experts by id, as `FastExperts` passes them (fewer pairs)
            xs, sel = (x[ids] if per_expert else x), {"index": ids}
            in_id_order.update({"mma stored", *(f"mma stored ahead={a}" for a in mma_ahead or [])})
            variants["mma stored flags"] = lambda: mma_gemv.packed_product_stored(
                x, fmt, w, s, g, active=active, sms=sms, busy=busy, counters=counters)
        else:
            xs, sel = x, {"active": active, "busy": busy}
        variants["mma stored"] = lambda: mma_gemv.packed_product_stored(xs, fmt, w, s, g, sms=sms,
                                                                        counters=counters, **sel)
        default = mma_gemv.launch_for(fmt, rows)[1]
        for ahead in mma_ahead or []:  # the same launch with another depth of loads in flight
            if ahead != default.ahead:
                launch = default._replace(ahead=ahead)
                variants[f"mma stored ahead={ahead}"] = (
                    lambda launch=launch: mma_gemv.packed_product_stored(xs, fmt, w, s, g, sms=sms, counters=counters,
                                                                         launch=launch, **sel))
    if rows == 1:
        words = fmt == "nvfp4" or "gate_proj" in name  # the compiled preset: nvfp4_words, mxfp8_words="gate_up"
        if experts:  # the gathered experts, each token's row broadcast against them (`FastExperts.forward_sync_free`)
            xg = x[ids] if per_expert else x.unsqueeze(0)
            today = lambda: kernels.matmul(xg, fmt, w, s, g, torch.bfloat16, ids, 1, True, words)  # noqa: E731
        else:
            today = lambda: kernels.matmul(x, fmt, w, s, g, torch.bfloat16, None, 1, True, words)  # noqa: E731
        variants["today: fused (compiled)"] = today
        for tiles in dot_tiles or []:
            steps = k // tiles.block_k
            split = grouped.split_for((chosen if experts else 1) * -(-n // tiles.block_n), steps, sms)
            variants[f"dot {tiles.text()} split={split}"] = (
                lambda tiles=tiles, split=split: grouped.packed_matmul_grouped(x, fmt, w, s, g, active=active,
                                                                               tiles=tiles, split=split, table=True))
    else:
        tile_cfg, split = grouped.launch_for(fmt, max(experts, 1), n, k, device)
        variants["today: grouped"] = lambda: grouped.packed_matmul_grouped(x, fmt, w, s, g, active=active,
                                                                          tiles=tile_cfg, split=split)
    case: dict = {"name": name, "format": fmt, "experts": experts, "chosen": chosen if experts else 0, "N": n, "K": k,
                  "rows": rows, "packed_bytes": nbytes, "roofline_us": 1e6 * nbytes / bw}
    for vname, fn in variants.items():
        got = fn().float()
        if experts and not vname.startswith("today: fused") and vname not in in_id_order:
            got = got[ids]
        err = float((got.reshape(want.shape) - want).abs().max() / want.abs().max())
        if err > 1e-2:
            raise BenchmarkError(f"{name} {vname}: relative error {err:.3g} against decode-then-matmul")
        t = per_call_s(fn, iters)
        case[vname] = {"us": 1e6 * t, "packed_bytes_per_s": nbytes / t, "roofline_fraction": nbytes / bw / t,
                       "rel_err": err}
    print(f"{rows:3d} rows  {name:28s} roof {case['roofline_us']:7.1f} us  " + "  ".join(
        f"{v} {case[v]['us']:.1f} us ({100 * case[v]['roofline_fraction']:.0f} %)" for v in variants),
        file=sys.stderr, flush=True)
    return case


def run(args: argparse.Namespace) -> None:
    if not torch.cuda.is_available():
        raise BenchmarkError("packed_gemv.py measures CUDA kernels: run it on a machine with a GPU")
    from minimax_ref.fast import gemv

    if not gemv.AVAILABLE:
        raise BenchmarkError("packed_gemv.py needs triton (pip install triton)")
    device = torch.device("cuda")
    bw = copy_bandwidth(device, 2 * GIB)["bytes_per_s"]
    kernels = Kernels()
    cases = [measure(shape, rows, args.per_sm, args.iters, bw, kernels, device, args.dot_tiles, args.mma_ahead)
             for rows in args.rows for shape in SHAPES]
    command = "python benchmarks/packed_gemv.py " + " ".join(sys.argv[1:])
    print(f"command (BENCHMARKS.md): {command}", file=sys.stderr, flush=True)
    emit({"benchmark": "packed_gemv", "command": command, "torch": torch.__version__,
          "triton": gemv.triton.__version__, "device_name": torch.cuda.get_device_name(device),
          "copy_bandwidth_bytes_per_s": bw, "cases": cases}, args.out)


def _positive_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",")]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers, comma-separated")
    return values


def _tiles_list(text: str) -> list:
    from minimax_ref.errors import ConfigError
    from minimax_ref.fast.grouped import Tiles

    try:
        return [Tiles.parse(t) for t in text.split()]
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=_positive_list, default=[1, 32],
                   help="rows of x (tokens of a decode step), comma-separated, each at most 64 (default: 1,32)")
    p.add_argument("--per-sm", type=_positive_list, default=None,
                   help="GEMV programs an SM that the K splits aim for, comma-separated (default: "
                        "fast.gemv.PROGRAMS_PER_SM)")
    p.add_argument("--dot-tiles", type=_tiles_list, default=[],
                   help="at one row, also the grouped kernel's tensor-core product with these launch configurations "
                        "(BLOCK_N,BLOCK_K,NUM_WARPS,NUM_STAGES, space-separated), e.g. '64,128,4,4 32,256,4,3'")
    p.add_argument("--mma-ahead", type=_positive_list, default=[],
                   help="also fast.mma_gemv read in place with these K steps of loads in flight (1 or 2), "
                        "comma-separated")
    p.add_argument("--iters", type=int, default=30, help="graph replays timed (default: 30)")
    p.add_argument("--out", default=None, help="also append the JSON line to this file")
    args = p.parse_args(argv)
    if args.per_sm is None:
        from minimax_ref.fast.gemv import PROGRAMS_PER_SM

        args.per_sm = [PROGRAMS_PER_SM]
    if max(args.rows) > 64:
        p.error(f"--rows {args.rows}: at most 64 rows (a decode step's)")
    if not set(args.mma_ahead) <= {1, 2}:
        p.error(f"--mma-ahead {args.mma_ahead}: 1 or 2")
    return main_guard(lambda: run(args), [])


if __name__ == "__main__":
    sys.exit(main())
