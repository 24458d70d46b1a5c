"""The attention kernel alone (`fast.attention_kernel.block_attention`) at release widths on one GPU: milliseconds a
call and the tensor cores' share, MSA and dense layers, bf16 and fp8 caches.

    # 1 x H200: one 8K prompt (the prefill figure's attention: 60 layers x this call)
    python benchmarks/attention_kernel.py --prompt-len 8192
    # every launch configuration of --sweep-tiles on each case; prints the best per layer kind and cache storage as
    # a `TUNED` entry
    python benchmarks/attention_kernel.py --prompt-len 8192 --sweep
    # one configuration (ROWS,KEYS,WARPS,STAGES); 16,128,4,2 is one token a program reading whole blocks
    python benchmarks/attention_kernel.py --tiles 16,128,4,2
    # the value sum's probabilities as two bf16 parts (the contract) and as one (`attention_probabilities="bf16"`)
    python benchmarks/attention_kernel.py --prompt-len 8192 --probabilities split,bf16

Operands: 64 query heads over 4 kv heads of 128 channels, queries at positions --context .. --context +
--prompt-len - 1 over a cache of that many keys (random, stored bf16 or fp8), one sequence. MSA: blocks of 128
slots, top-16 selected by msa.py's rule (`fast.attention.select_blocks_chunked`) from random index keys and index
queries that drift from token to token (each the previous times --correlation plus fresh noise for the rest of
its variance: 1 gives every token of a tile the same blocks but its local one, 0 independent choices).

Per case: ms a call (a CUDA graph of 10 calls replayed, so also a check that the call captures: static shapes, no
host read), including the tiles' block unions (`tile_blocks`, also timed alone); the mean union of a tile (blocks
it reads); `useful_tflops`: 4 * D flops per (query head, key it reads) over the time (what the reference computes);
`executed_tflops`: the tensor cores' work the kernel issues (three products a key tile: scores and the two
halves of the probabilities times the values, for every row of a tile and every key tile it reads) over the time:
against the bf16 dense peak (~790 TFLOP/s measured on an H200) it is the kernel's tensor-core efficiency. Before
timing, the last --check queries are compared with the reference cores (`msa.gather_block_attention`,
`attention.causal_attention`): the error must stay within the tests' 2e-5 of max |v| (an output row is a convex
combination of the values it reads).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict

import torch
from common import BenchmarkError, add_attention_workload_flags, add_kernel_bench_flags, emit, main_guard, tile_configs
from fused_matmul import per_call_s

from minimax_ref.model.attention import causal_attention
from minimax_ref.model.msa import gather_block_attention

HQ, HKV, D, BLOCK, TOPK = 64, 4, 128, 128, 16
# Configurations to sweep: the default, key tiles of 32 and 128, pipelining depths 1 and 3, 64 rows, and one token a
# program reading whole blocks (no union). All compile for sm_90 without register spills at release widths (ptxas -v,
# triton 3.6; 256 rows and 128 rows on 4 warps spill).
SWEEP = ["128,64,8,2", "128,128,8,2", "128,32,8,2", "128,64,8,3", "128,64,8,1", "64,64,4,2", "64,64,4,3", "64,128,4,2",
         "16,128,4,2"]


def operands(prompt_len: int, context: int, correlation: float, device: torch.device, seed: int = 0) -> dict:
    """Queries, a cache (bf16 and its fp8 form) and the indexer's selection for one sequence."""
    from minimax_ref.fast.attention import index_chunk, select_blocks_chunked
    from minimax_ref.model.cache import store_kv

    g = torch.Generator(device=device).manual_seed(seed)
    L, T = context + prompt_len, prompt_len
    q = torch.randn(1, T, HQ, D, device=device, generator=g).bfloat16()
    k = torch.randn(1, L, HKV, D, device=device, generator=g).bfloat16()
    v = torch.randn(1, L, HKV, D, device=device, generator=g).bfloat16()
    pos = torch.arange(context, L, device=device)[None]
    noise = torch.randn(1, T, HKV, D, device=device, generator=g)
    iq = torch.empty_like(noise)
    iq[:, 0] = noise[:, 0]
    fresh = (1 - correlation**2) ** 0.5
    for t in range(1, T):  # index queries drifting from token to token
        iq[:, t] = correlation * iq[:, t - 1] + fresh * noise[:, t]
    ik = torch.randn(1, L, D, device=device, generator=g)
    blocks = select_blocks_chunked(iq, ik, pos, BLOCK, TOPK, 1, 0, index_chunk(iq, ik, 1 << 26))
    fp8 = torch.float8_e4m3fn
    return {"q": q, "k": k, "v": v, "pos": pos, "blocks": blocks, "k8": store_kv(k, fp8, 1.0),
            "v8": store_kv(v, fp8, 1.0)}


def executed_flops(kind: str, tiles, ops: dict, tokens: int, context: int) -> tuple[float, float, float]:
    """(useful flops, executed tensor-core flops, mean union) of one call: 2 * D flops a multiply-add."""
    from minimax_ref.fast.attention_kernel import tile_blocks

    T = ops["q"].shape[1]
    L = ops["k"].shape[1]
    tiles_n = -(-T // tokens)
    rows = tokens * (HQ // HKV)
    pos = ops["pos"][0].double()
    if kind == "dense":
        useful = 4 * D * HQ * float((pos + 1).sum())
        keys = tiles.keys
        last = pos[(torch.arange(tiles_n, device=pos.device) * tokens + tokens - 1).clamp(max=T - 1)]  # ascending
        key_tiles = float((torch.div(last, keys, rounding_mode="floor") + 1).sum())
        return useful, 3 * 2 * D * rows * keys * key_tiles * HKV, 0.0
    blocks = ops["blocks"]
    keys_read = ((blocks[..., None] * BLOCK + torch.arange(BLOCK, device=blocks.device) <= ops["pos"][:, None, :, None,
                  None]) & (blocks[..., None] >= 0)).sum()
    useful = 4 * D * (HQ // HKV) * float(keys_read)
    if tokens > 1:
        union = tile_blocks(blocks, tokens, -(-L // BLOCK))
        read = float((union >= 0).sum())
    else:
        read = float((blocks >= 0).sum())
    key_tiles = read * -(-BLOCK // min(tiles.keys, BLOCK))
    return useful, 3 * 2 * D * rows * min(tiles.keys, BLOCK) * key_tiles, read / (HKV * tiles_n)


def measure(ops: dict, kind: str, cache: str, configs: list, iters: int, check: int, sms: int, context: int,
            split: bool = True) -> dict:
    from minimax_ref.fast import attention_kernel as pa

    q, pos = ops["q"], ops["pos"]
    k, v = (ops["k8"], ops["v8"]) if cache == "fp8" else (ops["k"], ops["v"])
    sel = (ops["blocks"], BLOCK) if kind == "sparse" else ()
    case: dict = {"kind": kind, "cache": cache, "queries": q.shape[1], "keys": k.shape[1],
                  "probabilities": "split" if split else "bf16"}
    scale = D**-0.5
    cached_blocks = -(-k.shape[1] // BLOCK)
    if check:
        kf, vf = (k.float().bfloat16(), v.float().bfloat16())
        got = pa.block_attention(q, k, v, pos, scale, *sel, sms=sms, split_probabilities=split)[:, -check:]
        if kind == "sparse":
            want = gather_block_attention(q[:, -check:], kf, vf, ops["blocks"][:, :, -check:], pos[:, -check:], BLOCK,
                                          scale)
        else:
            want = causal_attention(q[:, -check:], kf, vf, pos[:, -check:], scale)
        err = float((got - want).abs().max() / vf.abs().max())
        case["err_over_max_v_last_queries"] = err
        bound = 2e-5 if split else 4e-3  # one bf16 part: 2^-9 a probability
        if err > bound:
            raise BenchmarkError(f"{kind} {cache}: error {err:.3g} of max |v| against the reference core "
                                 f"(> {bound:g})")
    for tiles in configs:
        cfg = tiles or pa.tiles_for(kind, q.device, cache)
        tokens = pa.tile_tokens(cfg.rows, HQ // HKV, q.shape[1])
        t = per_call_s(lambda cfg=cfg: pa.block_attention(q, k, v, pos, scale, *sel, sms=sms, tiles=cfg,
                                                          split_probabilities=split), iters)
        useful, executed, union = executed_flops(kind, cfg, ops, tokens, context)
        entry = {"ms": 1e3 * t, "useful_tflops": useful / t / 1e12, "executed_tflops": executed / t / 1e12,
                 "tokens_a_tile": tokens}
        if kind == "sparse":
            entry["mean_union_blocks"] = union
            if tokens > 1:
                entry["tile_blocks_ms"] = 1e3 * per_call_s(
                    lambda tokens=tokens: pa.tile_blocks(ops["blocks"], tokens, cached_blocks), iters)
        case[cfg.text()] = entry
        print(f"{kind:6s} {cache:4s} tiles {cfg.text():12s} {entry['ms']:8.3f} ms  useful "
              f"{entry['useful_tflops']:6.1f} TFLOP/s  executed {entry['executed_tflops']:6.1f} TFLOP/s"
              + (f"  union {union:.1f} blocks" if kind == "sparse" else ""), file=sys.stderr, flush=True)
    return case


def run(args: argparse.Namespace) -> None:
    if not torch.cuda.is_available():
        raise BenchmarkError("attention_kernel.py measures a CUDA kernel: run it on a machine with a GPU")
    from minimax_ref.fast import attention_kernel as pa

    if not pa.AVAILABLE:
        raise BenchmarkError("attention_kernel.py needs triton (pip install triton)")
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    configs = tile_configs(args, pa.Tiles)
    ops = operands(args.prompt_len, args.context, args.correlation, device)
    cases = [measure(ops, kind, cache, configs, args.iters, args.check, sms, args.context, mode == "split")
             for mode in args.probabilities.split(",")
             for kind in args.kinds.split(",") for cache in args.caches.split(",")]
    out: dict = {"benchmark": "attention_kernel", "command": " ".join(sys.argv), "torch": torch.__version__,
                 "triton": pa.triton.__version__, "device_name": torch.cuda.get_device_name(device),
                 "prompt_len": args.prompt_len, "context": args.context, "correlation": args.correlation,
                 "cases": cases}
    if args.sweep:
        totals: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
        for case in cases:
            if case["probabilities"] != "split":  # TUNED is for the default contract
                continue
            for c in configs:
                key = case["kind"], case["cache"]
                totals[key][c.text()] = totals[key].get(c.text(), 0.0) + case[c.text()]["ms"]
        best = {key: min(t, key=t.get) for key, t in totals.items()}
        out["sweep_totals_ms"] = {" ".join(key): t for key, t in totals.items()}
        out["best"] = {" ".join(key): t for key, t in best.items()}
        entry = ", ".join(f'{key!r}: Tiles({", ".join(t.split(","))})' for key, t in best.items())
        name = torch.cuda.get_device_properties(device).name
        print(f"fast.attention_kernel.TUNED entry:\n    {name!r}: {{{entry}}},", file=sys.stderr, flush=True)
    emit(out, args.out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    add_attention_workload_flags(p)
    p.add_argument("--kinds", default="sparse,dense", help="layers: sparse (MSA), dense (default: both)")
    p.add_argument("--caches", default="bf16,fp8", help="cache storage (default: bf16,fp8)")
    p.add_argument("--probabilities", default="split",
                   help="the value sum's probabilities: split (two bf16 parts, the default), bf16 (one part: "
                        "FastPaths(attention_probabilities='bf16')), or both, comma-separated")
    add_kernel_bench_flags(p, "ROWS,KEYS,WARPS,STAGES", "fast.attention_kernel.tiles_for", SWEEP, iters=5)
    args = p.parse_args(argv)
    return main_guard(lambda: run(args), [])


if __name__ == "__main__":
    sys.exit(main())
