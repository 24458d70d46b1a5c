"""The routed experts' products of a decode step of T tokens at the release's shapes, three ways: the grouped kernel
over the chosen experts, each multiplied by all T tokens (`compiled`: `fast.grouped`, flags); `fast.mma_gemv` read in
place by the same flags (every chosen expert times all T rows); and `fast.mma_gemv`'s ranges (`FastPaths.
expert_ranges`): the T x 4 (token, choice) pairs sorted by expert, each expert multiplied by its own rows only.

Each token chooses 4 of the 16 experts at random (seeded), as the release's router spreads a batch's tokens. w1 (gate;
w3, up, is the same product) and w2 (down) each multiply T rows of their K (in the engine w2 multiplies each pair's
activation row: the same bytes and MMAs). Microseconds per product (a CUDA
graph of 10 products, replayed) and the fraction of the copy rate: the chosen experts' packed bytes and scales over
the device-to-device copy bandwidth measured in the same run. Every variant is first checked against
`fast.packed.packed_matmul_reference` on each pair's row. `--launches` adds ranges at other launch shapes
(`mma_gemv.Launch`: row tiles a warp, programs an SM).

    # 1 x H100 or H200, about a minute:
    python benchmarks/expert_ranges.py --tokens 16,32 --launches 1,8 2,8 1,16 --out expert_ranges.jsonl
"""

from __future__ import annotations

import argparse
import sys

import torch
from common import GIB, BenchmarkError, copy_bandwidth, emit, main_guard
from fused_matmul import operands, per_call_s
from profile_decode import batch_sizes

from minimax_ref.fast.packed import packed_matmul_reference

EXPERTS, TOP_K = 16, 4
SHAPES = [("routed w1 (gate; w3 alike)", 3072, 6144), ("routed w2 (down)", 6144, 3072)]


def routing(tokens: int, device: torch.device) -> torch.Tensor:
    """Each token's 4 distinct experts of 16, at random (seeded): [T, 4]."""
    gen = torch.Generator(device="cpu").manual_seed(tokens)
    return torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)]).to(device)


def measure(name: str, n: int, k: int, tokens: int, launches: list, iters: int, bw: float,
            device: torch.device) -> dict:
    from minimax_ref.fast import grouped, mma_gemv

    w, s, g = operands("nvfp4", EXPERTS, n, k, device)
    ids = routing(tokens, device)
    pairs = ids.flatten()
    order = torch.argsort(pairs, stable=True)
    counts = torch.bincount(pairs, minlength=EXPERTS)
    ends = counts.cumsum(0).to(torch.int32)
    active = (counts > 0).to(torch.int32)
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(tokens, k, generator=gen, device=device).to(torch.bfloat16)
    xs = x[order // TOP_K]  # each pair's token row, sorted by expert
    chosen = int(active.sum())
    nbytes = (w[0].numel() * w.element_size() + s[0].numel() * s.element_size()) * chosen
    want = torch.stack([packed_matmul_reference(xs[r:r + 1], "nvfp4", w[e], s[e], g[e], torch.bfloat16)[0]
                        for r, e in enumerate(pairs[order].tolist())]).float()
    sms = grouped.sm_count(device)
    counters = mma_gemv.counters_for(EXPERTS, n, device)
    tiles, split = grouped.launch_for("nvfp4", EXPERTS, n, k, device)
    pick = (pairs[order], order // TOP_K)  # a sorted pair's place in the flags' [16, T, N] output
    variants = {
        "grouped flags (compiled)": (lambda: grouped.packed_matmul_grouped(x, "nvfp4", w, s, g, active=active,
                                                                          tiles=tiles, split=split, table=True), pick),
        "mma flags": (lambda: mma_gemv.packed_product_stored(x, "nvfp4", w, s, g, active=active, busy=chosen,
                                                             sms=sms, counters=counters), pick),
        "mma ranges (expert_ranges)": (lambda: mma_gemv.packed_product_stored(xs, "nvfp4", w, s, g, ends=ends,
                                                                              sms=sms, counters=counters), None),
    }
    for row_tiles, per_sm in launches:
        launch = mma_gemv.Launch(row_tiles, per_sm)
        variants[f"mma ranges rt={row_tiles} per_sm={per_sm}"] = (
            lambda launch=launch: mma_gemv.packed_product_stored(xs, "nvfp4", w, s, g, ends=ends, sms=sms,
                                                                 counters=counters, launch=launch), None)
    case: dict = {"name": name, "N": n, "K": k, "tokens": tokens, "rows_per_expert": counts.tolist(),
                  "chosen": chosen, "packed_bytes": nbytes, "roofline_us": 1e6 * nbytes / bw}
    for vname, (fn, where) in variants.items():
        got = fn().float()
        got = got[where] if where is not None else got
        err = float((got - want).abs().max() / want.abs().max())
        if err > 1e-2:
            raise BenchmarkError(f"{name} {vname}: relative error {err:.3g} against decode-then-matmul")
        t = per_call_s(fn, iters)
        case[vname] = {"us": 1e6 * t, "roofline_fraction": nbytes / bw / t, "rel_err": err}
    print(f"{tokens:3d} tokens  {name:28s} roof {case['roofline_us']:7.1f} us  " + "  ".join(
        f"{v} {case[v]['us']:.1f} us ({100 * case[v]['roofline_fraction']:.0f} %)" for v in variants),
        file=sys.stderr, flush=True)
    return case


def _launch(text: str) -> tuple[int, int]:
    try:
        row_tiles, per_sm = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give ROW_TILES,PER_SM (e.g. 1,8)") from None
    if row_tiles not in (1, 2) or per_sm < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: row tiles 1 or 2, a positive count of programs an SM")
    return row_tiles, per_sm


def run(args: argparse.Namespace) -> None:
    from minimax_ref.fast import mma_gemv

    device = torch.device("cuda")
    if not torch.cuda.is_available() or not mma_gemv.runs_on(device):
        raise BenchmarkError("expert_ranges.py measures fast.mma_gemv on a CUDA GPU of compute capability 8.9 or "
                             "above: run it on such a machine")
    bw = copy_bandwidth(device, 4 * GIB)
    result = {"benchmark": "expert_ranges", "command": " ".join(sys.argv), "device_name":
              torch.cuda.get_device_name(device), "torch": torch.__version__, "copy_bandwidth": bw, "cases": []}
    with torch.no_grad():
        for tokens in args.tokens:
            for name, n, k in SHAPES:
                result["cases"].append(measure(name, n, k, tokens, args.launches, args.iters, bw["bytes_per_s"],
                                               device))
    emit(result, args.out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=batch_sizes, default=[16, 32],
                   help="tokens of the step (one a sequence), comma-separated")
    p.add_argument("--launches", type=_launch, nargs="*", default=[],
                   help="ranges at these launch shapes too: ROW_TILES,PER_SM each (e.g. 1,8 2,8)")
    p.add_argument("--iters", type=int, default=30, help="graph replays timed (default: 30)")
    p.add_argument("--out", default=None, help="also append the JSON line to this file")
    args = p.parse_args(argv)
    return main_guard(lambda: run(args), [])


if __name__ == "__main__":
    sys.exit(main())
