#!/usr/bin/env python
"""The 80-expert build at its real shapes, tensor-parallel, packed weights, synthetic values: prefill and
decode speed, memory per card, and the HBM roofline of the decode step, in one run.

    # 2 x H200, the fast paths a GPU user gets (`--fast compiled`, decode steps replayed from CUDA graphs; about
    # 8-12 minutes with the defaults, see --decode-tokens / --budget-s to shorten):
    torchrun --nproc-per-node 2 benchmarks/tp2_packed.py --out tp2.jsonl
    # CPU dry run (gloo):
    torchrun --nproc-per-node 2 benchmarks/tp2_packed.py --device cpu --preset tiny --prompt-len 200 \\
        --decode-tokens 8 --batches 1,4 --bw-gib 0.125

What it does, on every rank (only rank 0 prints):
1. measures the card's copy bandwidth (the roofline's ceiling);
2. materialises `--preset` (default pruned-80: 80 experts, 60 layers, release widths) with random
   values in the release's NVFP4 + MXFP8 formats directly in device memory (loader.load_synthetic),
   each rank only its slices, packed (`--weights packed`): weights per card = the packed size;
3. prefills one `--prompt-len`-token prompt (default 8192) in `--prefill-chunk` chunks: tokens/s;
4. decodes `--decode-tokens` (default 512) greedy tokens at each batch of `--batches` (default 1,32)
   from the prefilled cache (batch B copies the prompt's cache into B rows), for each `--variants`
   entry: `eager` (the `--fast` paths, launched from Python), `graph` (the same step captured in a CUDA
   graph and replayed), `compile-graph` (the graph with torch.compile'd packed decoding: one fused kernel
   per weight; compiling takes a few minutes), `fused` / `fused-graph` (eager / graph with the fused
   dequantize-and-multiply of packed weights, `fast="fused"`, whatever `--fast` says), `compiled` /
   `compiled-graph` (the same with every decoder layer of a decode step compiled, `fast="compiled"`), `reference` (the
   fast paths off);
5. prints one JSON line: parameters, per-rank memory (weights, peaks), bandwidth, prefill and decode
   tokens/s, and per batch the bytes a decode step must read (benchmarks/common.py) with the roofline
   tokens/s and the fraction of it reached, and the estimated bytes the packed weights cost a step
   unfused and fused (`packed_traffic`).

With the fused matmul (`--fast fused` or a `fused*` variant) the run first compiles it and checks it on the
model's own weights (`fused_check`: exact weight bits, agreement with decode-then-matmul); a failure ends the
run before anything is timed. Compiling happens there and in each variant's untimed warm-up steps, before a
CUDA graph is captured.

    # 2 x H200, the fused matmul beside the current graph (about 4-6 minutes):
    torchrun --nproc-per-node 2 benchmarks/tp2_packed.py --decode-tokens 64 --budget-s 20 \\
        --variants graph,fused-graph --out tp2_fused.jsonl
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, replace

import torch
from common import (
    FUSED_ROWS_HELP,
    GIB,
    BenchmarkError,
    active_linear_elements_per_token,
    add_fast_flag,
    barrier,
    check_fused_matmul,
    copy_bandwidth,
    decode,
    decode_step_bytes,
    emit,
    fused_rows_arg,
    init_world,
    log,
    main_guard,
    memory_now,
    packed_weight_traffic,
    peak_gib,
    prefill,
    replicate_cache,
    reset_peak,
    sync,
    with_fused_rows,
)

from minimax_ref.fast import FUSED_ROWS, FastPaths, apply
from minimax_ref.research.plan import plan_memory
from minimax_ref.weights.loader import load_synthetic
from minimax_ref.weights.packed import packed_weights
from minimax_ref.weights.synth import PRESETS

VARIANTS = ("eager", "graph", "compile-graph", "fused", "fused-graph", "compiled", "compiled-graph", "reference")


def variant_fast(variant: str, fast: FastPaths, fused_rows: int | None) -> FastPaths:
    """The fast paths a variant runs with: `--fast` for eager/graph, else the variant's own."""
    own = {"reference": "off", "compile-graph": "compile", "fused": "fused", "fused-graph": "fused",
           "compiled": "compiled", "compiled-graph": "compiled"}
    if variant not in own:
        return fast
    return with_fused_rows(FastPaths.of(own[variant]), fused_rows)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="pruned-80", choices=sorted(PRESETS), help="synth preset (default: pruned-80)")
    p.add_argument("--format", default="nvfp4", choices=["nvfp4", "mxfp8", "bf16"], help="default: nvfp4")
    p.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    p.add_argument("--experts", type=int, default=None, help="override the preset's routed experts per layer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="default: cuda:LOCAL_RANK when CUDA is available, else cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--weights", default="packed", choices=["packed", "dequant"], help="default: packed")
    add_fast_flag(p, ["on", "compile", "fused", "compiled"], "auto",
                  auto="compiled on CUDA with packed NVFP4/MXFP8 weights, else on (the prefill's and the eager/graph "
                       "variants' paths)")
    p.add_argument("--fused-rows", type=fused_rows_arg, default=None, help=FUSED_ROWS_HELP)
    p.add_argument("--expert-parallel", action="store_true", help="whole experts per rank instead of TP slices")
    p.add_argument("--kv-cache-dtype", default="fp8", choices=["auto", "fp8"], help="default: fp8 (as the seed)")
    p.add_argument("--prompt-len", type=int, default=8192, help="prefill length (default: 8192)")
    p.add_argument("--decode-tokens", type=int, default=512, help="greedy tokens per decode run (default: 512)")
    p.add_argument("--batches", default="1,32", help="decode batch sizes (default: 1,32)")
    p.add_argument("--variants", default=None,
                   help=f"comma list of {','.join(VARIANTS)} (default: graph on CUDA, eager on CPU)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="KV cache length (default: prompt-len + decode-tokens); must hold both")
    p.add_argument("--prefill-chunk", type=int, default=8192, help="tokens per prefill forward (default: 8192)")
    p.add_argument("--prefill-repeats", type=int, default=2, help="timed prefills (default: 2; best is reported)")
    p.add_argument("--attention-chunk-elements", type=int, default=1 << 26,
                   help="largest attention temporary in elements (default: 2^26)")
    p.add_argument("--budget-s", type=float, default=75.0,
                   help="stop a decode run early after this many seconds (default: 75); steps done are reported")
    p.add_argument("--bw-gib", type=float, default=4.0, help="size of the bandwidth copy in GiB (default: 4)")
    p.add_argument("--dist-timeout", type=float, default=900.0, help="collective timeout in seconds (default: 900)")
    p.add_argument("--out", default=None, help="also append the JSON line to this file")
    return p


def run(args: argparse.Namespace, holder: list) -> None:
    world, device = init_world(args.device, args.dist_timeout)
    holder.append(world)
    batches = [int(b) for b in args.batches.split(",") if b]
    variants = (args.variants or ("graph" if device.type == "cuda" else "eager")).split(",")
    for v in variants:
        if v not in VARIANTS:
            raise BenchmarkError(f"--variants {v!r}: choose from {list(VARIANTS)}")
    if any(v.endswith("graph") for v in variants) and device.type != "cuda":
        raise BenchmarkError("--variants graph / compile-graph need CUDA")
    need = args.prompt_len + args.decode_tokens
    max_len = args.max_model_len or need
    if max_len < need:
        raise BenchmarkError(f"--max-model-len {max_len} cannot hold --prompt-len {args.prompt_len} + "
                             f"--decode-tokens {args.decode_tokens} = {need} tokens: raise it or shorten the run")
    if min(batches) < 1 or args.prompt_len < 1 or args.decode_tokens < 1:
        raise BenchmarkError("--batches, --prompt-len and --decode-tokens must be >= 1")
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    if args.fast == "auto":
        packed = args.weights == "packed" and args.format != "bf16"
        args.fast = "compiled" if device.type == "cuda" and packed else "on"
    fast = with_fused_rows(FastPaths.of(args.fast), args.fused_rows)
    fused_rows = args.fused_rows or FUSED_ROWS  # the `fused` preset's passes: its check and traffic estimate
    fused = [v for v in variants if variant_fast(v, fast, args.fused_rows).matmul == "fused"]
    if fused and (args.weights != "packed" or args.format == "bf16"):
        raise BenchmarkError(f"variants {fused} use the fused packed matmul: it needs --weights packed and an "
                             "nvfp4 or mxfp8 --format")
    result: dict = {"benchmark": "tp2_packed", "command": " ".join(sys.argv), "params": vars(args),
                    "world_size": world.size, "device": str(device), "torch": torch.__version__,
                    "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}

    log(world, f"copy bandwidth ({args.bw_gib} GiB)")
    bw = copy_bandwidth(device, int(args.bw_gib * GIB))

    log(world, f"materialising {args.preset} ({args.format}, {args.weights}) at TP{world.size} on {device}")
    reset_peak(device)
    t0 = time.perf_counter()
    model = load_synthetic(args.preset, format=args.format, layers=args.layers, experts=args.experts, seed=args.seed,
                           device=device, dtype=dtype, weights=args.weights, tp=world,
                           expert_parallel=args.expert_parallel, fast=fast, max_seq_len=max_len,
                           kv_cache_dtype=args.kv_cache_dtype, attention_chunk_elements=args.attention_chunk_elements)
    sync(device)
    load_s = time.perf_counter() - t0
    mine = {"rank": world.rank, "copy_bandwidth": bw, "load_seconds": load_s,
            "weights_bytes": model.load_stats["memory_bytes"], "after_load": memory_now(device)}
    cfg = model.config
    plan = plan_memory(cfg, tp=world.size, gpu_memory_gib=(torch.cuda.get_device_properties(device).total_memory / GIB
                                                            if device.type == "cuda" else 141.0),
                       max_model_len=max_len, kv_cache_dtype=args.kv_cache_dtype,
                       dtype_bytes=2 if dtype == torch.bfloat16 else 4, expert_parallel=args.expert_parallel)
    result["plan"] = {k: plan[k] for k in ("weights_gib_per_card", "kv_bytes_per_token", "kv_gib_for_max_model_len")}
    result["model"] = {"layers": cfg.text.num_hidden_layers, "experts": cfg.text.num_local_experts,
                       "hidden": cfg.text.hidden_size, "fast_paths": asdict(model.fast)}
    log(world, f"loaded in {load_s:.1f} s: {mine['weights_bytes'] / GIB:.2f} GiB of weights on rank 0")
    if fused:
        if not any(True for _ in packed_weights(model)):
            raise BenchmarkError("the fused matmul was asked for but the model holds no packed weights")
        log(world, "compiling and checking the fused packed matmul")
        apply(model, replace(FastPaths.of("fused"), fused_rows=fused_rows))
        error = None
        try:
            with torch.no_grad():
                result["fused_check"] = check_fused_matmul(model, batches, fused_rows)
        except Exception as e:  # every rank must learn of a failure, or the others would wait in a collective
            error = e
        world.agree(error, "checking the fused packed matmul")
        apply(model, fast)
        log(world, f"fused matmul checked in {result['fused_check']['seconds']:.1f} s")

    # ---- prefill (batch 1)
    gen = torch.Generator(device=device).manual_seed(1234)
    V = min(cfg.text.vocab_size, 100_000)
    ids = torch.randint(0, V, (1, args.prompt_len), device=device, generator=gen)
    cache = model.new_cache(1, max_len, args.kv_cache_dtype)
    warm = min(512, args.prompt_len)
    with torch.no_grad():
        log(world, f"prefill warm-up ({warm} tokens)")
        prefill(model, cache, ids[:, :warm], args.prefill_chunk)
        reset_peak(device)
        times = []
        for r in range(args.prefill_repeats):
            sync(device)
            barrier(world)
            t0 = time.perf_counter()
            last = prefill(model, cache, ids, args.prefill_chunk)
            sync(device)
            times.append(time.perf_counter() - t0)
            log(world, f"prefill {r + 1}/{args.prefill_repeats}: {args.prompt_len / times[-1]:.1f} tokens/s")
    mine["peak_prefill_gib"] = peak_gib(device)
    best = min(times)
    flops = 2 * active_linear_elements_per_token(model) * args.prompt_len
    result["prefill"] = {"tokens": args.prompt_len, "chunk": args.prefill_chunk, "seconds": times,
                         "tokens_per_s": args.prompt_len / best,
                         "linear_tflop_per_s_per_rank": flops / best / 1e12}

    # ---- decode
    kv_elem = 1 if args.kv_cache_dtype == "fp8" else (2 if dtype == torch.bfloat16 else 4)
    context = args.prompt_len + args.decode_tokens // 2
    mine["roofline_bytes"] = {str(B): decode_step_bytes(model, B, context, kv_elem) for B in batches}
    decode_out: dict = {}
    peaks: dict = {}
    with torch.no_grad():
        for variant in variants:
            apply(model, variant_fast(variant, fast, args.fused_rows))
            decode_out[variant] = {}
            for B in batches:
                key = f"{variant}/{B}"
                log(world, f"decode {key}: {args.decode_tokens} tokens")
                reset_peak(device)
                c = cache if B == 1 else replicate_cache(model, cache, B, args.kv_cache_dtype)
                try:
                    r = decode(model, c, last.expand(B, -1), args.prompt_len, args.decode_tokens,
                               graph=variant.endswith("graph"), budget_s=args.budget_s)
                    decode_out[variant][str(B)] = {"steps": r.steps, "seconds": r.seconds,
                                                   "tokens_per_s": r.tokens_per_s, "step_ms": r.step_ms}
                    log(world, f"decode {key}: {r.tokens_per_s:.2f} tokens/s ({r.step_ms:.1f} ms/step)")
                except Exception as e:  # a variant that fails (e.g. graph capture) must not lose the others
                    if isinstance(e, torch.OutOfMemoryError) or not variant.endswith("graph"):
                        raise
                    decode_out[variant][str(B)] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
                    log(world, f"decode {key} failed: {decode_out[variant][str(B)]['error']}")
                peaks[key] = peak_gib(device)
                del c
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    mine["peak_decode_gib"] = peaks
    apply(model, fast)

    ranks = world.gather_objects(mine)
    if world.rank != 0:
        return
    result["ranks"] = ranks
    result["decode"] = decode_out
    roof = {}
    for B in batches:
        # the step is as slow as the slowest rank: each rank's bytes over its own measured bandwidth
        step_s = max(r["roofline_bytes"][str(B)]["bytes"] / r["copy_bandwidth"]["bytes_per_s"] for r in ranks)
        roof[str(B)] = {"bytes_per_step_rank0": ranks[0]["roofline_bytes"][str(B)]["bytes"],
                        "by_family_rank0": ranks[0]["roofline_bytes"][str(B)]["by_family"],
                        "context": context, "roofline_step_ms": 1e3 * step_s, "roofline_tokens_per_s": B / step_s}
        for variant, by_batch in decode_out.items():
            got = by_batch.get(str(B), {})
            if "tokens_per_s" in got:
                roof[str(B)][f"fraction_{variant}"] = got["tokens_per_s"] * step_s / B
    result["roofline"] = roof
    result["packed_traffic"] = {str(B): packed_weight_traffic(model, B, fused_rows) for B in batches}
    result["summary"] = {
        "weights_gib_per_card": [r["weights_bytes"] / GIB for r in ranks],
        "plan_weights_gib_per_card": plan["weights_gib_per_card"],
        "copy_tb_per_s": [r["copy_bandwidth"]["bytes_per_s"] / 1e12 for r in ranks],
        "prefill_tokens_per_s": result["prefill"]["tokens_per_s"],
        **{f"decode_{v}_b{b}_tokens_per_s": by.get(b, {}).get("tokens_per_s") for v, by in decode_out.items()
           for b in map(str, batches)},
        **{f"roofline_b{b}_tokens_per_s": roof[b]["roofline_tokens_per_s"] for b in map(str, batches)},
        "peak_gib_per_card": [max([r["peak_prefill_gib"] or 0, *[p or 0 for p in r["peak_decode_gib"].values()]])
                              for r in ranks],
    }
    emit(result, args.out)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    holder: list = []
    return main_guard(lambda: run(args, holder), holder)


if __name__ == "__main__":
    sys.exit(main())
