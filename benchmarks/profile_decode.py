"""Where a decode step's time goes on a GPU: the kernels of one CUDA-graph decode step, by name, with their
count and device time per step, beside the step's wall time and its HBM roofline, measured in one run.

A synthetic model (`--preset`, `--layers`, `--experts`, NVFP4+MXFP8 packed weights by default) prefills a
`--prompt-len` prompt once, then for each batch size of `--batch` (comma-separated: the prompt's cache replicated,
each row of a batch feeding a random token of its own, so that the rows route to different experts as distinct
requests do) one decode step of that many sequences with the fast paths `--fast` is captured in a CUDA graph
(`fast.graph.GraphStep`);
`--steps` replays are timed (wall clock, synchronised), then profiled with `torch.profiler` (CUPTI records the kernels
a graph launches). One JSON line per batch size and configuration gives:

* `step_ms` (timed replays), `kernel_ms` (sum of kernel time per step), `kernels_per_step`;
* `roofline`: the bytes a step must read (`common.decode_step_bytes`) over the device-to-device copy bandwidth
  measured in the same run, and the measured step as a fraction of it;
* `top`: the `--top` kernels by device time, each with calls and microseconds per step;
* `by_kind`: the same summed over coarse kinds of kernel (Triton reductions and pointwise kernels, GEMMs,
  attention, copies, others), from the kernel names.

    # 1 x H200, the scaled model of vs_transformers.py, compiled layers (about 2 minutes with the compile):
    python benchmarks/profile_decode.py --preset release --layers 6 --experts 16 --fast compiled --out prof.jsonl
    # two launch configurations of the reductions on the same weights (one compile and capture each):
    python benchmarks/profile_decode.py --layers 60 --reduction-config 1,256,8 --reduction-config tuned --out prof.jsonl
    # batch 1 and 32 at 60 layers, the grouped kernel of batch > fused_rows off then on:
    python benchmarks/profile_decode.py --layers 60 --batch 1,32 --grouped both --steps 10 --out prof.jsonl
    # batch 32 with the routed experts' gate, up and SwiGLU as one launch, off then on; top-k by sort, off then on:
    python benchmarks/profile_decode.py --layers 60 --fast gemv-mma --batch 32 --grouped-swiglu both --out prof.jsonl
    python benchmarks/profile_decode.py --layers 60 --fast gemv-mma --batch 1,32 --sort-topk both --out prof.jsonl
    python benchmarks/profile_decode.py --layers 60 --fast gemv-mma --batch 16,32 --expert-ranges both --out prof.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections import defaultdict
from dataclasses import asdict, replace

import torch
from common import (
    FUSED_ROWS_HELP,
    GIB,
    MXFP8_WORDS_CHOICES,
    REDUCTION_CONFIG_HELP,
    WORDS_CHOICES,
    BenchmarkError,
    add_fast_flag,
    copy_bandwidth,
    decode_step_bytes,
    emit,
    fused_rows_arg,
    init_world,
    log,
    main_guard,
    prefill,
    reduction_config,
    replicate_cache,
    sync,
    with_fused_rows,
    words_choice,
    words_settings,
)

from minimax_ref.fast import FastPaths, apply
from minimax_ref.fast.graph import GraphStep
from minimax_ref.weights.loader import load_synthetic
from minimax_ref.weights.synth import PRESETS

GROUPED = {"default": None, "on": [True], "off": [False], "both": [False, True]}
# The on / off switches of FastPaths a run can set or compare (`GROUPED`'s choices), and what each does
SWITCHES = {"grouped": "products of more than --fused-rows rows by the grouped Triton kernel (compiled: on)",
            "grouped_swiglu": "the routed experts' gate, up and SwiGLU as one grouped launch",
            "sort_topk": "the compiled step's top-k of short rows by a stable sort",
            "expert_ranges": "each chosen routed expert times its own tokens only (with gemv-mma)"}
DECODE_ATTENTION = {"default": None, "reference": ["reference"], "triton": ["triton"], "both": ["reference", "triton"]}


def batch_sizes(text: str) -> list[int]:
    """A `--batch` argument: comma-separated positive batch sizes."""
    try:
        sizes = [int(v) for v in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive batch sizes, comma-separated (e.g. 1,32)")
    return sizes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="release", choices=sorted(PRESETS))
    p.add_argument("--format", default="nvfp4", choices=["nvfp4", "mxfp8", "bf16"])
    p.add_argument("--layers", type=int, default=6, help="layers (0 = the preset's)")
    p.add_argument("--experts", type=int, default=16, help="routed experts per layer (0 = the preset's)")
    add_fast_flag(p, ["on", "fused", "compiled", "gemv", "gemv-mma", "gemv-mma-stored",
                      "grouped-rows", "grouped-swiglu"], "compiled")
    p.add_argument("--fused-rows", type=fused_rows_arg, default=None, help=FUSED_ROWS_HELP)
    p.add_argument("--batch", type=batch_sizes, default=[1],
                   help="sequences a step, comma-separated to profile several sizes on one prefill (default: 1)")
    p.add_argument("--prompt-len", type=int, default=8192)
    p.add_argument("--prefill-chunk", type=int, default=4096)
    p.add_argument("--kv-cache-dtype", default="fp8", choices=["fp8", "auto"])
    p.add_argument("--steps", type=int, default=20, help="timed and profiled graph replays (default: 20)")
    p.add_argument("--top", type=int, default=25, help="kernels listed (default: 25)")
    p.add_argument("--bw-gib", type=float, default=4.0, help="bytes of the bandwidth copy, GiB (default: 4)")
    p.add_argument("--reduction-config", action="append", default=None,
                   metavar="X,R,W[/X,R,W][/KIND=X,R,W...]|tuned",
                   help=REDUCTION_CONFIG_HELP + "; repeat it to profile several in one run, on the same weights and "
                   "prefilled cache (one JSON line each)")
    p.add_argument("--nvfp4-words", default="default", type=words_choice(WORDS_CHOICES),
                   help="FastPaths.nvfp4_words: the fused NVFP4 products read the packed bytes as int32 words; both: "
                   "each configuration with and without (default: as --fast sets it; compiled: on)")
    p.add_argument("--mxfp8-words", default="default", type=words_choice(MXFP8_WORDS_CHOICES),
                   help="FastPaths.mxfp8_words: the same for MXFP8's E4M3 bytes; gate_up: only the gate and up "
                   "projections; several, comma-separated: each in turn (default: as --fast sets it)")
    for switch, what in SWITCHES.items():
        p.add_argument(f"--{switch.replace('_', '-')}", default="default", choices=sorted(GROUPED),
                       help=f"FastPaths.{switch}: {what}; both: each configuration without, then with (default: as "
                       "--fast sets it)")
    p.add_argument("--decode-attention", default="default", choices=sorted(DECODE_ATTENTION),
                   help="FastPaths.decode_attention: the decode step's attention by the Triton kernel or the compiled\n"
                   "gathering path; both: each in turn (default: as --fast sets it; compiled: triton)")
    p.add_argument("--out", default=None, help="also append the JSON line to this file")
    return p


def kernel_kind(name: str) -> str:
    """A coarse kind of a kernel from its name (inductor's Triton kernels are named for what they fuse)."""
    n = name.lower()
    if n.startswith("triton_red") or n.startswith("triton_per"):
        return "triton reduction"
    if n.startswith("triton_poi"):
        return "triton pointwise"
    if n.startswith("triton"):
        return "triton other"
    if any(s in n for s in ("gemm", "gemv", "cutlass", "sm90_xmma", "nvjet", "cublas")):
        return "gemm"
    if any(s in n for s in ("fmha", "attention", "flash")):
        return "attention"
    if "nccl" in n:
        return "collective"
    if any(s in n for s in ("copy", "memcpy", "memset")):
        return "copy"
    return "other"


def profile_replays(runner: GraphStep, ids: torch.Tensor, pos: torch.Tensor, steps: int) -> dict:
    """Kernel names, calls and device microseconds per step over `steps` replays of `runner`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            runner.step(ids, pos)
        sync(ids.device)
    calls: dict[str, int] = defaultdict(int)
    micros: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        calls[e.name] += 1
        micros[e.name] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    return {"calls": {k: v / steps for k, v in calls.items()}, "micros": {k: v / steps for k, v in micros.items()}}


def run(args: argparse.Namespace, holder: list) -> None:
    world, device = init_world(None, 600)
    holder.append(world)
    if device.type != "cuda" or world.size != 1:
        raise BenchmarkError("profile_decode.py profiles CUDA-graph replays on one GPU: run it with python on a "
                             "machine with CUDA")
    configs = [reduction_config(text) for text in args.reduction_config or [None]]
    fast = replace(with_fused_rows(FastPaths.of(args.fast), args.fused_rows), layer_reductions=configs[0])
    max_len = args.prompt_len + 8
    bw = copy_bandwidth(device, int(args.bw_gib * GIB))
    log(world, f"materialising {args.preset} layers={args.layers} experts={args.experts} ({args.format})")
    model = load_synthetic(args.preset, format=args.format, layers=args.layers or None, experts=args.experts or None,
                           device=device, weights="packed" if args.format != "bf16" else "dequant",
                           dtype=torch.bfloat16, fast=fast, max_seq_len=max_len, kv_cache_dtype=args.kv_cache_dtype)
    ids = torch.randint(0, 100_000, (1, args.prompt_len), generator=torch.Generator(device=device).manual_seed(3),
                        device=device)
    with torch.no_grad():
        prompt_cache = model.new_cache(1, max_len, args.kv_cache_dtype)
        last = prefill(model, prompt_cache, ids, args.prefill_chunk)
        # each step writes the same cache slot, so every configuration sees the same state
        switches = [[(name, on) for on in GROUPED[getattr(args, name)] or [getattr(fast, name)]]
                    for name in SWITCHES]
        for reductions, nvfp4_words, mxfp8_words, attention, *settings in itertools.product(
                configs, words_settings(args.nvfp4_words, fast.nvfp4_words),
                words_settings(args.mxfp8_words, fast.mxfp8_words),
                DECODE_ATTENTION[args.decode_attention] or [fast.decode_attention], *switches):
            torch._dynamo.reset()
            apply(model, replace(fast, layer_reductions=reductions, nvfp4_words=nvfp4_words,
                                   mxfp8_words=mxfp8_words, decode_attention=attention, **dict(settings)))
            for batch in args.batch:  # one compile of each layer kind per batch size, kept across the sizes
                cache = prompt_cache
                if batch > 1:
                    cache = replicate_cache(model, prompt_cache, batch, args.kv_cache_dtype)
                tok = last.argmax(-1, keepdim=True)
                if batch > 1:
                    # a token of its own per row, so that the rows route to different experts as distinct requests
                    # do (the roofline counts the experts `batch` rows choose at random)
                    tok = torch.randint(0, model.config.text.vocab_size, (batch, 1), device=device,
                                        generator=torch.Generator(device=device).manual_seed(5))
                pos = torch.full((batch, 1), args.prompt_len, dtype=torch.long, device=device)
                result = profile_step(args, world, model, cache, tok, pos, bw)
                emit(result, args.out)
                del cache
                torch.cuda.empty_cache()


def profile_step(args: argparse.Namespace, world, model, cache, tok: torch.Tensor, pos: torch.Tensor,
                 bw: dict) -> dict:
    """Capture `model`'s decode step (its fast paths as set) in a CUDA graph, time and profile its replays."""
    device = tok.device
    batch = tok.shape[0]
    result: dict = {"benchmark": "profile_decode", "command": " ".join(sys.argv), "params": vars(args), "batch": batch,
                    "torch": torch.__version__, "device_name": torch.cuda.get_device_name(device),
                    "copy_bandwidth": bw, "fast_paths": asdict(model.fast)}
    t0 = time.perf_counter()
    runner = GraphStep(model, cache, tok, pos)  # the warm-up steps compile what the fast paths compile
    result["capture_s"] = time.perf_counter() - t0
    log(world, f"captured in {result['capture_s']:.1f} s")
    for _ in range(3):
        runner.step(tok, pos)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        runner.step(tok, pos)
    sync(device)
    step_s = (time.perf_counter() - t0) / args.steps
    prof = profile_replays(runner, tok, pos, args.steps)
    del runner
    need = decode_step_bytes(model, batch, args.prompt_len, 1 if args.kv_cache_dtype == "fp8" else 2)
    roof_s = need["bytes"] / bw["bytes_per_s"]
    kernel_us = sum(prof["micros"].values())
    kinds: dict[str, dict[str, float]] = defaultdict(lambda: {"calls": 0.0, "us": 0.0})
    for name, us in prof["micros"].items():
        k = kinds[kernel_kind(name)]
        k["calls"] += prof["calls"][name]
        k["us"] += us
    top = sorted(prof["micros"], key=prof["micros"].get, reverse=True)[: args.top]
    reductions = model.compiled.reductions if model.compiled is not None else None  # the launch configurations in force
    result.update({
        "reduction_config": None if reductions is None else reductions.text(),
        "model": {"layers": model.text.num_hidden_layers, "experts": model.text.num_local_experts,
                  "hidden": model.text.hidden_size},
        "step_ms": 1e3 * step_s, "tokens_per_s": batch / step_s,
        "kernel_ms": kernel_us / 1e3, "kernels_per_step": sum(prof["calls"].values()),
        "roofline": {"bytes_per_step": need["bytes"], "by_family": need["by_family"], "step_ms": 1e3 * roof_s,
                     "tokens_per_s": batch / roof_s, "fraction": roof_s / step_s},
        "by_kind": {k: {"calls": v["calls"], "us": v["us"]}
                    for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]["us"])},
        "top": [{"name": n[:160], "calls": prof["calls"][n], "us": prof["micros"][n]} for n in top],
    })
    words = "".join(f" {fmt} words" + ("" if on is True else f" ({on})")
                    for fmt in ("nvfp4", "mxfp8") if (on := getattr(model.fast, f"{fmt}_words")))
    words += " grouped" if model.fast.grouped else ""
    words += " swiglu-pair" if model.fast.grouped_swiglu else ""
    words += " sort-topk" if model.fast.sort_topk else ""
    words += " expert-ranges" if model.fast.expert_ranges else ""
    words += f" attention={model.fast.decode_attention}"
    log(world, f"[{result['reduction_config']}{words}] batch {batch}: step {1e3 * step_s:.2f} ms "
               f"({batch / step_s:.1f} tok/s), "
               f"kernels {kernel_us / 1e3:.2f} ms in {result['kernels_per_step']:.0f} launches; roofline "
               f"{1e3 * roof_s:.2f} ms ({100 * roof_s / step_s:.1f} %)")
    return result


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    holder: list = []
    return main_guard(lambda: run(args, holder), holder)


if __name__ == "__main__":
    sys.exit(main())
