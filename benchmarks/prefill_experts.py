"""One MoE layer's routed-expert products in prefill at release widths, the two ways `FastExperts.grouped` can take
them: today's `compiled` path (the stacks decoded to bf16 by `fast.grouped.decode_grouped`, then
`torch._grouped_mm` for gate, up and down) against `fast.prefill_experts.sorted_packed_matmul` (each tile decoded in
registers, `FastPaths(prefill_experts="triton")`), for each launch configuration of `--tiles` or `--sweep-tiles`.

The rows: `--tokens` tokens routed to `--top-k` of `--experts` experts uniformly at random (every expert chosen at
prefill sizes), sorted by expert. Each figure: milliseconds for the three projections (CUDA events around
`--iters` calls), their FLOPs (2 x rows x 3 x intermediate x hidden) per second, and the fraction of the bf16 matmul
rate measured in the same run. Every kernel result is first checked against the decode-then-grouped-matmul one.

    # 1 x H200 (about a minute): 16 and 128 experts, the default tiles and a few others
    python benchmarks/prefill_experts.py --experts 16,128 --sweep --out prefill_experts.jsonl
"""

from __future__ import annotations

import argparse
import sys

import torch
from common import BenchmarkError, add_kernel_bench_flags, emit, event_ms, main_guard, tile_configs
from fused_matmul import operands
from seed_workload import matmul_rate

HIDDEN, INTERMEDIATE = 6144, 3072  # the release's widths (one routed expert: gate and up 3072 x 6144, down 6144 x 3072)
# configurations that compile for sm_90 without spills (ptxas -v), but 64,128,64,4,3's 8 bytes
SWEEP = ["128,128,64,8,3", "128,128,64,8,4", "128,128,32,8,4", "64,256,64,8,3", "64,128,64,4,3", "64,64,64,4,3"]


def measure(experts: int, args: argparse.Namespace, rate: float, device: torch.device) -> dict:
    from minimax_ref.fast import grouped
    from minimax_ref.fast import prefill_experts as pe
    from minimax_ref.model.mlp import swiglu_oai

    stacks = {leaf: operands("nvfp4", experts, n, k, device)
              for leaf, n, k in (("w1", INTERMEDIATE, HIDDEN), ("w3", INTERMEDIATE, HIDDEN),
                                 ("w2", HIDDEN, INTERMEDIATE))}
    gen = torch.Generator(device=device).manual_seed(0)
    rows = args.tokens * args.top_k
    ids = torch.randint(0, experts, (rows,), generator=gen, device=device).sort().values
    offs = torch.bincount(ids, minlength=experts).cumsum(0).to(torch.int32)
    x = (torch.randn(rows, HIDDEN, generator=gen, device=device) * 0.5).to(torch.bfloat16)

    def today():
        w1, w3, w2 = (grouped.decode_grouped("nvfp4", *stacks[leaf], table=True) for leaf in ("w1", "w3", "w2"))
        gate = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)
        up = torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs)
        return torch._grouped_mm(swiglu_oai(gate, up, 1.702, 7.0), w2.transpose(-2, -1), offs=offs)

    def in_registers(tiles):
        def run():
            gate = pe.sorted_packed_matmul(x, "nvfp4", *stacks["w1"], offs, tiles=tiles, table=True)
            up = pe.sorted_packed_matmul(x, "nvfp4", *stacks["w3"], offs, tiles=tiles, table=True)
            return pe.sorted_packed_matmul(swiglu_oai(gate, up, 1.702, 7.0), "nvfp4", *stacks["w2"], offs,
                                           tiles=tiles, table=True)
        return run

    flops = 2 * rows * 3 * INTERMEDIATE * HIDDEN
    want = today().float()
    case = {"experts": experts, "rows": rows, "tflop": flops / 1e12}
    variants = {"today: decode, then torch._grouped_mm": today}
    for tiles in tile_configs(args, pe.Tiles, pe.tiles_for(device)):
        variants[f"in registers {tiles.text()}"] = in_registers(tiles)
    for name, fn in variants.items():
        err = float((fn().float() - want).abs().max() / want.abs().max())
        if err > 2e-2:
            raise BenchmarkError(f"{experts} experts, {name}: relative error {err:.3g} against today's path")
        ms = event_ms(fn, args.iters, warmup=3)
        case[name] = {"ms": ms, "tflop_per_s": flops / ms / 1e9, "fraction_of_bf16_rate": flops / ms / 1e-3 / rate,
                      "rel_err": err}
        print(f"{experts:4d} experts {rows} rows  {name:40s} {ms:8.3f} ms  {flops / ms / 1e9:6.0f} TFLOP/s",
              file=sys.stderr, flush=True)
    return case


def run(args: argparse.Namespace) -> None:
    if not torch.cuda.is_available():
        raise BenchmarkError("prefill_experts.py measures CUDA kernels: run it on a machine with a GPU")
    device = torch.device("cuda")
    rate = matmul_rate(device)
    cases = [measure(e, args, rate, device) for e in args.experts]
    command = "python benchmarks/prefill_experts.py " + " ".join(sys.argv[1:])
    emit({"benchmark": "prefill_experts", "command": command, "torch": torch.__version__,
          "device_name": torch.cuda.get_device_name(device), "bf16_matmul_tflop_per_s": rate / 1e12,
          "cases": cases}, args.out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--experts", type=lambda t: [int(v) for v in t.split(",")], default=[16, 128],
                   help="routed experts of the layer, comma-separated (default: 16,128)")
    p.add_argument("--tokens", type=int, default=8192, help="prompt tokens of the prefill call (default: 8192)")
    p.add_argument("--top-k", type=int, default=4, help="experts a token chooses (default: 4, the release's)")
    add_kernel_bench_flags(p, "BLOCK_M,BLOCK_N,BLOCK_K,NUM_WARPS[,NUM_STAGES]", "fast.prefill_experts.tiles_for",
                           SWEEP, 10)
    args = p.parse_args()
    return main_guard(lambda: run(args), [])


if __name__ == "__main__":
    sys.exit(main())
