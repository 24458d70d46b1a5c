"""The MSA block selection of one prefill call at release widths on one GPU: the selection kernel
(`fast.selection_kernel`, `FastPaths(block_selection="triton")`) against the path it replaces
(`fast.attention.select_blocks_chunked`: fp32 index scores [Hi, chunk, L], the future masked, per-block max, top-k).

    # 1 x H200: one 8K prompt (one MSA layer's selection; the prefill runs it on 57 of 60 layers)
    python benchmarks/selection_kernel.py --prompt-len 8192
    # every launch configuration of --sweep-tiles; prints the best as a `TUNED` entry
    python benchmarks/selection_kernel.py --sweep
    # one configuration (QUERIES,KEYS,WARPS,STAGES)
    python benchmarks/selection_kernel.py --tiles 128,128,8,2

Operands: 4 index heads of 128 channels, blocks of 128 slots, top-16, one local block forced; one sequence of
--prompt-len queries at positions --context .. --context + --prompt-len - 1 over that many index keys (random bf16;
the index queries drift from token to token as in benchmarks/attention_kernel.py). The reference path takes its
queries in the chunks `FastAttention` gives it beside the attention kernel (`index_chunk` of `CHUNK_ELEMENTS`);
the kernel path takes them all at once (`FastBlockSelection`: its temporary is nb block scores a query, not L).

Per path: ms a call (a CUDA graph of 10 calls replayed: also a check that the call captures), and for the kernel its
block scores alone, `useful_tflops` (2 Di flops per index head and causal (query, key) pair over the time) and
`executed_tflops` (the products it issues: every query tile times every block up to its last query). Before timing,
the last --check queries' block scores are compared with `msa.block_scores(msa.index_scores(...))` within the
contract's bound (3.1 Di 2^-24 of the block's largest sum |iq_d ik_d|) and their ids with the reference path's up to
ties; the share of identical rows is reported.
"""

from __future__ import annotations

import argparse
import sys

import torch
from common import BenchmarkError, add_attention_workload_flags, add_kernel_bench_flags, emit, main_guard, tile_configs
from fused_matmul import per_call_s

from minimax_ref.model.msa import CHUNK_ELEMENTS, block_scores, index_scores

HI, DI, BLOCK, TOPK, LOCAL = 4, 128, 128, 16, 1
SWEEP = ["128,64,8,2", "128,128,8,2", "128,32,8,2", "128,64,8,3", "128,64,4,2", "64,64,4,2", "64,128,4,3",
         "256,64,8,2"]


def operands(prompt_len: int, context: int, correlation: float, device: torch.device, seed: int = 0) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    L, T = context + prompt_len, prompt_len
    noise = torch.randn(1, T, HI, DI, device=device, generator=g)
    iq = torch.empty_like(noise)
    iq[:, 0] = noise[:, 0]
    fresh = (1 - correlation**2) ** 0.5
    for t in range(1, T):  # index queries drifting from token to token
        iq[:, t] = correlation * iq[:, t - 1] + fresh * noise[:, t]
    ik = torch.randn(1, L, DI, device=device, generator=g)
    pos = torch.arange(context, L, device=device)[None]
    return {"iq": iq.bfloat16(), "ik": ik.bfloat16(), "pos": pos}


def check(ops: dict, ids: torch.Tensor, want_ids: torch.Tensor, scores: torch.Tensor, n: int) -> dict:
    """The last `n` queries: the kernel's block scores against the reference's within the contract's bound, its ids
    against the reference path's up to ties. Raises BenchmarkError where either fails."""
    iq, ik, pos = ops["iq"][:, -n:], ops["ik"], ops["pos"][:, -n:]
    want = block_scores(index_scores(iq, ik, pos), pos, BLOCK, LOCAL)
    bound = 3.1 * DI * 2.0**-24 * block_scores(index_scores(iq.abs(), ik.abs(), pos), pos, BLOCK, 0).clamp(min=0)
    got = scores[:, :, -n:]
    finite = torch.isfinite(want)
    if not torch.equal(got[~finite], want[~finite]) or ((got - want).abs()[finite] > bound[finite]).any():
        raise BenchmarkError("selection kernel: block scores outside the contract's bound of the reference's")
    ids, want_ids = ids[:, :, -n:], want_ids[:, :, -n:]
    kth = want.topk(min(TOPK, want.shape[-1]), dim=-1).values[..., -1:]
    e = bound.amax(-1, keepdim=True)
    valid = ids >= 0
    if not torch.equal(valid, want_ids >= 0) or (valid & (want.gather(-1, ids.clamp(min=0)) < kth - 2 * e)).any():
        raise BenchmarkError("selection kernel: a selected block is not among the reference's top-k up to ties")
    err = (got - want).abs()[finite]
    return {"max_abs_err": float(err.max()), "max_err_over_bound": float((err / bound[finite].clamp(min=1e-30)).max()),
            "rows_identical": float((ids == want_ids).all(-1).float().mean())}


def peak_mib(fn) -> float:
    """MiB that one call of `fn` allocates at its peak beyond what was allocated before it."""
    fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def executed_flops(tiles, pos: torch.Tensor) -> tuple[float, float]:
    """(useful, executed) flops of one call: 2 Di a multiply-add, per index head."""
    p = pos[0].double()
    T = p.numel()
    useful = 2 * DI * HI * float((p + 1).sum())
    q = tiles.queries
    last = p[(torch.arange(-(-T // q), device=p.device) * q + q - 1).clamp(max=T - 1)]  # each tile's last position
    blocks_read = float((torch.div(last, BLOCK, rounding_mode="floor") + 1).sum())
    return useful, 2 * DI * HI * q * BLOCK * blocks_read


def run(args: argparse.Namespace) -> None:
    if not torch.cuda.is_available():
        raise BenchmarkError("selection_kernel.py measures a CUDA kernel: run it on a machine with a GPU")
    from minimax_ref.fast import selection_kernel as sk
    from minimax_ref.fast.attention import index_chunk, select_blocks_chunked, select_blocks_kernel

    if not sk.AVAILABLE:
        raise BenchmarkError("selection_kernel.py needs triton (pip install triton)")
    device = torch.device("cuda")
    ops = operands(args.prompt_len, args.context, args.correlation, device)
    iq, ik, pos = ops["iq"], ops["ik"], ops["pos"]
    T = iq.shape[1]
    chunk = index_chunk(iq, ik, CHUNK_ELEMENTS)
    configs = tile_configs(args, sk.Tiles, sk.tiles_for(device))

    def reference():
        return select_blocks_chunked(iq, ik, pos, BLOCK, TOPK, LOCAL, 0, chunk)

    out: dict = {"benchmark": "selection_kernel", "command": " ".join(sys.argv), "torch": torch.__version__,
                 "triton": sk.triton.__version__, "device_name": torch.cuda.get_device_name(device),
                 "prompt_len": args.prompt_len, "context": args.context, "index_heads": HI, "index_dim": DI,
                 "block_size": BLOCK, "topk": TOPK, "reference_chunk_queries": chunk}
    want_ids = reference()
    ref_ms = 1e3 * per_call_s(reference, args.iters)
    out["reference"] = {"ms": ref_ms, "peak_mib": peak_mib(reference)}
    print(f"reference (select_blocks_chunked, {chunk} queries a chunk) {ref_ms:8.3f} ms", file=sys.stderr, flush=True)
    kernel: dict = {}
    for tiles in configs:
        def call(tiles=tiles) -> torch.Tensor:
            return select_blocks_kernel(iq, ik, pos, BLOCK, TOPK, LOCAL, 0, T, tiles=tiles)

        def scores(tiles=tiles) -> torch.Tensor:
            return sk.block_scores(iq, ik, pos, BLOCK, LOCAL, 0, tiles=tiles)

        entry = check(ops, call(), want_ids, scores(), min(args.check, T)) if args.check else {}
        entry["peak_mib"] = peak_mib(call)
        t, t_scores = per_call_s(call, args.iters), per_call_s(scores, args.iters)
        useful, executed = executed_flops(tiles, pos)
        entry.update({"ms": 1e3 * t, "block_scores_ms": 1e3 * t_scores, "speedup": ref_ms / (1e3 * t),
                      "useful_tflops": useful / t_scores / 1e12, "executed_tflops": executed / t_scores / 1e12})
        kernel[tiles.text()] = entry
        print(f"kernel tiles {tiles.text():12s} {entry['ms']:8.3f} ms (block scores {entry['block_scores_ms']:.3f} "
              f"ms, executed {entry['executed_tflops']:.1f} TFLOP/s) x{entry['speedup']:.1f}",
              file=sys.stderr, flush=True)
    out["kernel"] = kernel
    if args.sweep:
        best = min(kernel, key=lambda k: kernel[k]["ms"])
        out["best"] = best
        name = torch.cuda.get_device_properties(device).name
        print(f"fast.selection_kernel.TUNED entry:\n    {name!r}: Tiles({', '.join(best.split(','))}),",
              file=sys.stderr, flush=True)
    emit(out, args.out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    add_attention_workload_flags(p)
    add_kernel_bench_flags(p, "QUERIES,KEYS,WARPS,STAGES", "fast.selection_kernel.tiles_for", SWEEP, iters=5)
    args = p.parse_args(argv)
    return main_guard(lambda: run(args), [])


if __name__ == "__main__":
    sys.exit(main())
