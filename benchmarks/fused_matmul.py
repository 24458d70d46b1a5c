"""One packed weight at the release's shapes: the fused dequantize-and-multiply (`fast.packed.packed_matmul`, compiled
as the compiled layers compile it) against cuBLAS on the weight already decoded to bf16, and against
decode-then-multiply, at a few rows. Each figure is microseconds per product (a CUDA graph of 10 products, replayed),
with the packed bytes per microsecond beside it; every product is first checked against
`fast.packed.packed_matmul_reference`.

Variants: `planes=reference` (`fast.packed.decoded_planes`), `planes=normal` (`fast.packed.normal_range_planes`, the
same bits in fewer operations; the weights here are in its range), `cublas_bf16` (`x @ w_bf16^T`, the weight decoded
beforehand: 3.6x the bytes for NVFP4, no decoding), `decode_then_matmul` (`decode_fast`, then the matmul: what `--fast
on` does).

    # 1 x H200 (about 2 minutes, most of it compiling):
    python benchmarks/fused_matmul.py --out fused_matmul.jsonl
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from common import BenchmarkError, emit, main_guard

from minimax_ref.fast.compiled import LAYER_INDUCTOR_OPTIONS
from minimax_ref.fast.packed import _select as select_entries
from minimax_ref.fast.packed import decode_fast, packed_matmul, packed_matmul_reference

# (name, format, experts in the stack, N, K, gathered entries or 0): the release's projections at TP1
SHAPES = [("q_proj", "mxfp8", 0, 8192, 6144, 0), ("o_proj", "mxfp8", 0, 6144, 8192, 0),
          ("dense gate_proj", "nvfp4", 0, 12288, 6144, 0), ("dense down_proj", "nvfp4", 0, 6144, 12288, 0),
          ("4 routed experts w1", "nvfp4", 16, 3072, 6144, 4), ("4 routed experts w2", "nvfp4", 16, 6144, 3072, 4)]


def operands(fmt: str, experts: int, n: int, k: int, device: torch.device):
    """Random packed weights with realistic scales (block scales near 1e-3 to 1e-2, as real checkpoints have)."""
    lead = (experts,) if experts else ()
    if fmt == "nvfp4":
        weight = torch.randint(0, 256, (*lead, n, k // 2), dtype=torch.uint8, device=device)
        scale = (torch.rand(*lead, n, k // 16, device=device) * 2 + 0.1).to(torch.float8_e4m3fn)
        g = torch.rand(experts, device=device) * 1e-2 + 1e-3 if experts else torch.tensor(3e-3, device=device)
        return weight, scale, g
    weight = torch.randn(*lead, n, k, device=device).to(torch.float8_e4m3fn)
    return weight, torch.randint(110, 125, (*lead, n, k // 32), dtype=torch.uint8, device=device), None


def per_call_s(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (10 * iters)


def measure(shape: tuple, fused, rows: int, iters: int, device: torch.device) -> dict:
    """Every variant of one weight shape (`SHAPES`): microseconds per product and packed bytes per second."""
    name, fmt, experts, n, k, gathered = shape
    w, s, g = operands(fmt, experts, n, k, device)
    index = torch.arange(gathered, device=device) * 3 % experts if gathered else None
    x = torch.randn(*((gathered,) if gathered else ()), rows, k, device=device).to(torch.bfloat16)
    parts = select_entries(w, s, g, index)
    nbytes = sum(t.numel() * t.element_size() for t in parts[:2])
    want = packed_matmul_reference(x, fmt, w, s, g, torch.bfloat16, index).float()
    dense = decode_fast(fmt, *parts, torch.bfloat16)
    case: dict = {"name": name, "format": fmt, "N": n, "K": k, "gathered": gathered, "packed_bytes": nbytes}
    variants = {
        "planes=reference": lambda: fused(x, fmt, w, s, g, torch.bfloat16, index, False),
        "planes=normal": lambda: fused(x, fmt, w, s, g, torch.bfloat16, index, True),
        "cublas_bf16": lambda: torch.matmul(x, dense.transpose(-1, -2)),
        "decode_then_matmul": lambda: torch.matmul(x, decode_fast(fmt, *parts, torch.bfloat16).transpose(-1, -2)),
    }
    for vname, fn in variants.items():
        err = float((fn().float() - want).abs().max() / want.abs().max())
        if err > 1e-2:
            raise BenchmarkError(f"{name} {vname}: relative error {err:.3g} against decode-then-matmul")
        t = per_call_s(fn, iters)
        case[vname] = {"us": 1e6 * t, "packed_bytes_per_s": nbytes / t, "rel_err": err}
    print(f"{name:22s} " + "  ".join(f"{v} {case[v]['us']:.1f} us" for v in variants), file=sys.stderr, flush=True)
    return case


def run(args: argparse.Namespace) -> None:
    if not torch.cuda.is_available():
        raise BenchmarkError("fused_matmul.py measures CUDA kernels: run it on a machine with a GPU")
    device = torch.device("cuda")
    options = dict(LAYER_INDUCTOR_OPTIONS)
    fused = torch.compile(packed_matmul, dynamic=False, fullgraph=True, options=options)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    out: dict = {"benchmark": "fused_matmul", "command": " ".join(sys.argv), "torch": torch.__version__,
                 "device_name": torch.cuda.get_device_name(device), "rows": args.rows,
                 "cases": [measure(shape, fused, args.rows, args.iters, device) for shape in SHAPES]}
    emit(out, args.out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=1, help="rows of x (tokens; default: 1)")
    p.add_argument("--iters", type=int, default=50, help="graph replays timed (default: 50)")
    p.add_argument("--out", default=None, help="also append the JSON line to this file")
    args = p.parse_args(argv)
    return main_guard(lambda: run(args), [])


if __name__ == "__main__":
    sys.exit(main())
