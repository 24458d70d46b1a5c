"""The routed experts' products of a decode step of T tokens at the release's shapes (16 experts, 4 chosen a token),
as the engine runs them: the gate and up stacks (w1, w3) one allocation, as the loader places them, each stack
`fast.mma_gemv` read in place (`gemv-mma`) either in a launch of its own or both as one joint stack
(`fast.joint.JointStack`), beside the grouped kernel `compiled` runs. Each way of choosing the rows:

* ids (fewer pairs than experts: 1 to 3 tokens): each (token, choice) pair's expert by id;
* flags: every chosen expert times all T tokens (`fast.grouped` in `compiled`, `fast.mma_gemv` up to 8 tokens);
* ranges (`FastPaths.expert_ranges`, above 8 tokens; measured at every count, beside the ids and flags below): the
  pairs sorted by expert, each expert times its own rows.

Each token chooses 4 of the 16 experts at random (seeded), as the release's router spreads a batch's tokens. Down (w2)
multiplies each pair's own row (its activation in the engine). Microseconds per product (a CUDA graph of 10, replayed)
and the fraction of the copy rate: the chosen experts' packed bytes and scales over the device-to-device copy
bandwidth measured in the same run; only the products' launches are timed (the joint stack's few index kernels with
them). Every variant is first checked against `fast.packed.packed_matmul_reference` on each pair's row. `--launches`
adds the stacks' ranges at other launch shapes (`mma_gemv.Launch`: row tiles a warp, programs an SM).

    # 1 x H100 or H200, about a minute:
    python benchmarks/routed_products.py --tokens 1,2,16,32 --out routed_products.jsonl
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
# (name, N, K, gate and up: two stacks of one allocation)
SHAPES = [("routed gate and up (w1, w3)", 3072, 6144, True), ("routed down (w2)", 6144, 3072, False)]


def routing(tokens: int, device: torch.device) -> torch.Tensor:
    """Each token's 4 distinct experts of 16, at random (seeded): [T, 4]."""
    gen = torch.Generator(device="cpu").manual_seed(tokens)
    return torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)]).to(device)


def stacks(n: int, k: int, pair: bool, device: torch.device) -> list:
    """The stacks of one case as the engine holds them (`FastPackedWeight`s configured for `gemv-mma`): the gate and
    up stacks as the two halves of one allocation, or one stack."""
    from minimax_ref.fast import FastPaths, apply
    from minimax_ref.weights.packed import PackedWeight

    parts = [operands("nvfp4", EXPERTS, n, k, device) for _ in range(2 if pair else 1)]
    both = [torch.stack(ts) for ts in zip(*parts)]  # [S, E, ...] each
    weights = [PackedWeight("nvfp4", *(t[i] for t in both)) for i in range(len(parts))]
    for w in weights:
        apply(w, FastPaths(gemv="mma"))
        if w.gemv_kernel != "mma-stored":
            raise BenchmarkError(f"a {n} x {k} stack is not read in place by fast.mma_gemv ({w.gemv_kernel})")
    return weights


def measure(name: str, n: int, k: int, pair: bool, tokens: int, launches: list, iters: int, bw: float,
            device: torch.device) -> dict:
    from minimax_ref.fast import grouped, mma_gemv
    from minimax_ref.fast.joint import JointStack

    weights = stacks(n, k, pair, device)
    joint = JointStack.of(*weights) if pair else None
    ids = routing(tokens, device)
    pairs = ids.flatten()
    P = pairs.numel()
    order = torch.argsort(pairs, stable=True)
    counts = torch.bincount(pairs, minlength=EXPERTS)
    ends = counts.cumsum(0).to(torch.int32)
    active = (counts > 0).to(torch.int32)
    chosen = int(active.sum())
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(tokens, k, generator=gen, device=device).to(torch.bfloat16)
    xs = x[order // TOP_K]  # each pair's token row, sorted by expert
    per_expert = sum(t[0].numel() * t.element_size() for t in weights[0].parts()[:2])
    nbytes = per_expert * chosen * len(weights)
    want = torch.stack([torch.stack([packed_matmul_reference(xs[r:r + 1], "nvfp4", *w.parts(e), torch.bfloat16)[0]
                                     for r, e in enumerate(pairs[order].tolist())]) for w in weights]).float()
    sms = grouped.sm_count(device)
    tiles, split = grouped.launch_for("nvfp4", EXPERTS, n, k, device)
    pick = (pairs[order], order // TOP_K)  # a sorted pair's place in the flags' [16, T, N] output

    # each variant: (the launches timed, their outputs arranged as `want` [S, P, N] outside the timing)
    def each(product, arrange):  # each stack in a launch of its own
        return (lambda: [product(w) for w in weights]), lambda ys: torch.stack([arrange(y) for y in ys])

    def together(product, arrange):  # gate and up in one launch over the joint stack
        return product, lambda ys: torch.stack([arrange(y) for y in ys])

    by_flags = lambda y: y[pick]  # noqa: E731
    by_ids = lambda y: y.reshape(P, n)[order]  # noqa: E731
    variants = {"grouped flags (compiled)": each(lambda w: grouped.packed_matmul_grouped(
        x, "nvfp4", *w.parts(), active=active, tiles=tiles, split=split, table=True), by_flags)}
    if P < EXPERTS:  # what `FastExperts` runs for so few pairs
        variants["mma ids"] = each(lambda w: w.matmul(x[:, None, None], ids), by_ids)
        if joint:
            variants["mma ids, joint"] = together(lambda: joint.by_ids(x, ids), by_ids)
    if tokens <= mma_gemv.STORED_STACK_ROWS:
        variants["mma flags"] = each(lambda w: w.gemv_product(x, active=active, busy=chosen), by_flags)
        if joint:
            variants["mma flags, joint"] = together(lambda: joint.by_flags(x, active, chosen), by_flags)
    # ranges at every count: above 8 tokens what the engine runs, below beside its ids and flags
    variants["mma ranges"] = each(lambda w: w.ranged_product(xs, ends), lambda y: y)
    if joint:
        variants["mma ranges, joint"] = together(lambda: joint.by_ranges(xs, ends), lambda y: y)
    for row_tiles, per_sm in launches:
        launch = mma_gemv.Launch(row_tiles, per_sm)
        variants[f"mma ranges rt={row_tiles} per_sm={per_sm}"] = each(
            lambda w, launch=launch: mma_gemv.packed_product_stored(xs, "nvfp4", *w.parts(), ends=ends, sms=sms,
                                                                    counters=w.gemv_counters, launch=launch),
            lambda y: y)
    case: dict = {"name": name, "N": n, "K": k, "stacks": len(weights), "tokens": tokens,
                  "rows_per_expert": counts.tolist(), "chosen": chosen, "packed_bytes": nbytes,
                  "roofline_us": 1e6 * nbytes / bw}
    for vname, (fn, arrange) in variants.items():
        got = arrange(fn()).float()
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
        raise BenchmarkError("routed_products.py measures fast.mma_gemv on a CUDA GPU of compute capability 8.9 or "
                             "above: run it on such a machine")
    bw = copy_bandwidth(device, 4 * GIB)
    result = {"benchmark": "routed_products", "command": " ".join(sys.argv), "device_name":
              torch.cuda.get_device_name(device), "torch": torch.__version__, "copy_bandwidth": bw, "cases": []}
    with torch.no_grad():
        for tokens in args.tokens:
            for name, n, k, pair in SHAPES:
                result["cases"].append(measure(name, n, k, pair, tokens, args.launches, args.iters,
                                               bw["bytes_per_s"], device))
    emit(result, args.out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=batch_sizes, default=[1, 2, 16, 32],
                   help="tokens of the step (one a sequence), comma-separated")
    p.add_argument("--launches", type=_launch, nargs="*", default=[],
                   help="the stacks' ranges at these launch shapes too: ROW_TILES,PER_SM each (e.g. 1,8 2,8)")
    p.add_argument("--iters", type=int, default=30, help="graph replays timed (default: 30)")
    p.add_argument("--out", default=None, help="also append the JSON line to this file")
    args = p.parse_args(argv)
    return main_guard(lambda: run(args), [])


if __name__ == "__main__":
    sys.exit(main())
