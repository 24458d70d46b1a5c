#!/usr/bin/env python
"""A 131,072-token context at TP2 with packed weights: prefill and decode at that length, and the memory it
takes against `minimax-ref plan`'s estimate (KV cache bytes, weights, the activation reserve).

    # 2 x H200 (about 3-5 minutes):
    torchrun --nproc-per-node 2 benchmarks/long_context_tp2.py --out long.jsonl
    # CPU dry run (gloo; the tiny preset holds 4096 positions):
    torchrun --nproc-per-node 2 benchmarks/long_context_tp2.py --device cpu --preset tiny --context 1500 \\
        --prefill-chunk 512 --decode-tokens 4

Each rank materialises its slices of `--preset` (default pruned-80) in device memory, allocates a KV cache
of `--max-model-len` slots (default: context + decode tokens) in `--kv-cache-dtype` (default fp8, as the
seed), prefills `--context` random tokens in `--prefill-chunk` chunks (MSA attends to at most 16 blocks of
128 keys per query, and queries run in chunks, so memory stays linear in the context), then decodes
`--decode-tokens` greedy tokens. Printed (one JSON line): the cache's measured bytes per card next to
plan's KV estimate (`kv_bytes_per_token * max_model_len`), weights per card next to plan's, peak memory
per card split into weights + KV + everything else (to compare with plan's activation reserve), and
whether the peak fits plan's budget (`--gpu-memory-utilization` of the card); prefill and decode tokens/s.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from common import (
    GIB,
    BenchmarkError,
    add_fast_flag,
    barrier,
    decode,
    emit,
    init_world,
    log,
    main_guard,
    memory_now,
    peak_gib,
    reset_peak,
    sync,
)

from minimax_ref.research.plan import DEFAULT_ACTIVATION_RESERVE_GIB, DEFAULT_UTILIZATION, plan_memory
from minimax_ref.weights.loader import load_synthetic
from minimax_ref.weights.synth import PRESETS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="pruned-80", choices=sorted(PRESETS), help="synth preset (default: pruned-80)")
    p.add_argument("--format", default="nvfp4", choices=["nvfp4", "mxfp8", "bf16"], help="default: nvfp4")
    p.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    p.add_argument("--experts", type=int, default=None, help="override the preset's routed experts per layer")
    p.add_argument("--device", default=None, help="default: cuda:LOCAL_RANK when CUDA is available, else cpu")
    add_fast_flag(p, ["on", "compile", "off"], "on")
    p.add_argument("--expert-parallel", action="store_true", help="whole experts per rank instead of TP slices")
    p.add_argument("--kv-cache-dtype", default="fp8", choices=["auto", "fp8"], help="default: fp8")
    p.add_argument("--context", type=int, default=131072, help="prompt tokens (default: 131072)")
    p.add_argument("--decode-tokens", type=int, default=32, help="greedy tokens after the prompt (default: 32)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="KV cache slots (default: context + decode tokens); must hold both")
    p.add_argument("--prefill-chunk", type=int, default=8192, help="tokens per prefill forward (default: 8192)")
    p.add_argument("--attention-chunk-elements", type=int, default=1 << 27,
                   help="largest attention temporary in elements (default: 2^27, 512 MiB in fp32)")
    p.add_argument("--graph", action="store_true", help="also decode through a captured CUDA graph")
    p.add_argument("--gpu-memory", type=float, default=None, help="GiB per card for the plan (default: the card's)")
    p.add_argument("--gpu-memory-utilization", type=float, default=DEFAULT_UTILIZATION,
                   help=f"plan's fraction of the card (default: {DEFAULT_UTILIZATION})")
    p.add_argument("--budget-s", type=float, default=120.0, help="stop decoding early after this (default: 120)")
    p.add_argument("--dist-timeout", type=float, default=1800.0, help="collective timeout in seconds")
    p.add_argument("--out", default=None, help="also append the JSON line to this file")
    return p


def run(args: argparse.Namespace, holder: list) -> None:
    world, device = init_world(args.device, args.dist_timeout)
    holder.append(world)
    need = args.context + args.decode_tokens
    max_len = args.max_model_len or need
    if max_len < need:
        raise BenchmarkError(f"--max-model-len {max_len} cannot hold --context {args.context} + --decode-tokens "
                             f"{args.decode_tokens} = {need} tokens")
    if args.graph and device.type != "cuda":
        raise BenchmarkError("--graph needs CUDA")
    card_gib = (torch.cuda.get_device_properties(device).total_memory / GIB if device.type == "cuda" else 141.0)
    gpu_gib = args.gpu_memory or card_gib

    log(world, f"materialising {args.preset} at TP{world.size}, max_model_len {max_len}")
    t0 = time.perf_counter()
    model = load_synthetic(args.preset, format=args.format, layers=args.layers, experts=args.experts, device=device,
                           tp=world, expert_parallel=args.expert_parallel, fast=args.fast, max_seq_len=max_len,
                           kv_cache_dtype=args.kv_cache_dtype, attention_chunk_elements=args.attention_chunk_elements)
    sync(device)
    load_s = time.perf_counter() - t0
    cfg = model.config
    plan = plan_memory(cfg, tp=world.size, gpu_memory_gib=gpu_gib, max_model_len=max_len,
                       kv_cache_dtype=args.kv_cache_dtype, utilization=args.gpu_memory_utilization,
                       expert_parallel=args.expert_parallel)
    weights = model.load_stats["memory_bytes"]
    allocated0 = torch.cuda.memory_allocated(device) if device.type == "cuda" else weights

    cache = model.new_cache(1, max_len, args.kv_cache_dtype)
    kv_bytes = cache.nbytes()
    log(world, f"KV cache: {kv_bytes / GIB:.3f} GiB measured, plan {plan['kv_gib_for_max_model_len']:.3f} GiB")

    ids = torch.randint(0, min(cfg.text.vocab_size, 100_000), (1, args.context), device=device,
                        generator=torch.Generator(device=device).manual_seed(7))
    reset_peak(device)
    chunks = []
    with torch.no_grad():
        barrier(world)
        sync(device)
        t0 = time.perf_counter()
        h = None
        for s0 in range(0, args.context, args.prefill_chunk):
            s1 = min(args.context, s0 + args.prefill_chunk)
            c0 = time.perf_counter()
            h = model.hidden(model.embed(ids[:, s0:s1]), torch.arange(s0, s1, device=device)[None], cache)
            sync(device)
            chunks.append({"end": s1, "seconds": time.perf_counter() - c0})
            log(world, f"prefill {s1}/{args.context}: chunk at {(s1 - s0) / chunks[-1]['seconds']:.0f} tokens/s")
        last = model.logits(h[:, -1])
        sync(device)
        prefill_s = time.perf_counter() - t0
        peak_prefill = peak_gib(device)
        decodes = {}
        for graph in ([False, True] if args.graph else [False]):
            name = "graph" if graph else "eager"
            reset_peak(device)
            try:
                r = decode(model, cache, last, args.context, args.decode_tokens, graph=graph, budget_s=args.budget_s)
                decodes[name] = {"steps": r.steps, "tokens_per_s": r.tokens_per_s, "step_ms": r.step_ms,
                                 "peak_gib": peak_gib(device)}
                log(world, f"decode {name} at {args.context}: {r.tokens_per_s:.2f} tokens/s")
            except Exception as e:
                if not graph or isinstance(e, torch.OutOfMemoryError):
                    raise
                decodes[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
    peaks = [p for p in [peak_prefill, *(d.get("peak_gib") for d in decodes.values())] if p is not None]
    peak = max(peaks) if peaks else None
    mine = {"rank": world.rank, "weights_gib": weights / GIB, "allocated_after_load_gib": allocated0 / GIB,
            "kv_cache_gib": kv_bytes / GIB, "peak_gib": peak, "after": memory_now(device),
            "activations_gib": None if peak is None else peak - allocated0 / GIB - kv_bytes / GIB,
            "load_seconds": load_s}
    ranks = world.gather_objects(mine)
    if world.rank != 0:
        return
    budget = gpu_gib * args.gpu_memory_utilization
    emit({
        "benchmark": "long_context_tp2", "command": " ".join(sys.argv), "params": vars(args),
        "world_size": world.size, "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "max_model_len": max_len,
        "kv": {"measured_bytes_per_card": kv_bytes, "plan_bytes_per_card": plan["kv_bytes_per_token"] * max_len,
               "plan_kv_bytes_per_token": plan["kv_bytes_per_token"], "measured_equals_plan":
               kv_bytes == plan["kv_bytes_per_token"] * max_len},
        "weights": {"measured_gib_per_card": [r["weights_gib"] for r in ranks],
                    "plan_gib_per_card": plan["weights_gib_per_card"]},
        "memory": {"card_gib": card_gib, "plan_budget_gib": budget, "plan_activation_reserve_gib":
                   DEFAULT_ACTIVATION_RESERVE_GIB, "plan_kv_pool_tokens": plan["kv_pool_tokens"],
                   "plan_max_model_len_fits": plan["max_model_len_fits"],
                   "peak_gib_per_card": [r["peak_gib"] for r in ranks],
                   "activations_gib_per_card": [r["activations_gib"] for r in ranks],
                   "peak_within_plan_budget": None if peak is None else all(r["peak_gib"] <= budget for r in ranks)},
        "prefill": {"tokens": args.context, "seconds": prefill_s, "tokens_per_s": args.context / prefill_s,
                    "chunks": chunks},
        "decode": decodes,
        "ranks": ranks,
    }, args.out)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    holder: list = []
    return main_guard(lambda: run(args, holder), holder)


if __name__ == "__main__":
    sys.exit(main())
