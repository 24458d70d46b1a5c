#!/usr/bin/env python
"""Offloaded decode: the 60-layer 80-expert build at release widths on one GPU that cannot hold it,
packed weights streamed from pinned host memory (`load_synthetic(..., offload="cpu")`), against the PCIe roofline
measured in the same run.

    # one H200 (139 GiB; the build is 151.7 GiB in GPU memory), about 3 minutes a budget: the engine's defaults
    # (`--fast auto`: compiled segments replayed from CUDA graphs; prefetch of the predicted experts' rows)
    PYTHONPATH=$PWD python3 benchmarks/offload.py --device cuda --gpu-memory 100 --out offload.jsonl
    # the reference paths, nothing copied ahead (each chosen expert's weights decoded at every step: at batch 32 that
    # compute, not the copies, sets the pace):
    PYTHONPATH=$PWD python3 benchmarks/offload.py --device cuda --gpu-memory 100 --fast off --prefetch off
    # CPU dry run (the compute device is the CPU, the store separate host tensors):
    PYTHONPATH=$PWD python3 benchmarks/offload.py --device cpu --preset tiny

What it does:
1. measures the host-to-device copy rate from pinned memory (`h2d_gbps`: `--h2d-mib` MiB copied `--h2d-repeats`
   times after a warm-up, timed with a synchronisation before and after);
2. builds `--preset` (default pruned-80: 60 layers, 80 routed experts, release widths, NVFP4 experts + MXFP8
   elsewhere) with random values, offloaded within `--gpu-memory` GiB (offload.py: the device map, resident parts
   generated on the GPU, streamed parts moved to pinned host memory). Synthetic weights share host storage: every
   streamed expert stack reads the host stacks of the first streamed one (`share_streamed_experts`), so the run fits
   a host with less memory than the build (the H200 machine has 128 GiB of RAM and 64 GiB of disk); each step still
   moves the chosen experts' rows of every streamed layer, the same bytes as distinct stacks would;
3. for each batch of `--batches` (default 1,32): prefills a `--prompt-len`-token random prompt per sequence, then
   runs `--warmup` + `--steps` greedy decode steps, timing each (synchronised) and reading the bytes the streamer
   moved and its expert rows (`model.offload.stats`: chosen rows, hits among them copied ahead on the prediction
   with `--prefetch on`, misses copied after the router, rows copied ahead);
4. prints and writes one JSON line: parameters, the device map (resident and streamed layers), peak GPU memory
   (`torch.cuda.max_memory_allocated`) against `--gpu-memory`, and per batch: tok/s, bytes moved per step (measured,
   and planned from top-k routing: `device_map.DeviceMap.bytes_per_step`), the prediction's hit rate (hits / chosen
   rows), the PCIe roofline `tok/s = B / (bytes needed per step / h2d rate)` (needed: the layer parts and the chosen
   rows, not the rows copied ahead that were not chosen) and the fraction of it reached.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minimax_ref.errors import MiniMaxRefError  # noqa: E402
from minimax_ref.fast.paths import describe_presets  # noqa: E402
from minimax_ref.weights.device_map import GIB  # noqa: E402
from minimax_ref.weights.footprint import offload_units  # noqa: E402
from minimax_ref.weights.loader import load_synthetic, resolve_dtype  # noqa: E402
from minimax_ref.weights.offload import OffloadConfig  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def h2d_rate(device: torch.device, mib: int, repeats: int) -> float:
    """Bytes per second of a copy from pinned host memory to `device` (on a CPU: host memory to host memory)."""
    n = mib << 20
    src = torch.empty(n, dtype=torch.uint8)
    if device.type == "cuda":
        src = src.pin_memory()
    src.fill_(1)
    dst = torch.empty(n, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)  # warm-up
    sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src, non_blocking=True)
    sync(device)
    return n * repeats / (time.perf_counter() - t0)


def default_budget(cfg, dtype_bytes: int, reserve_bytes: int) -> float:
    """A budget (GiB) under which about half of the expert stacks stream (one more with prefetch, whose second
    staging stack takes a resident stack's room): everything else resident."""
    always, units = offload_units(cfg, dtype_bytes=dtype_bytes)
    layers = sum(u.nbytes for u in units if u.kind == "layer")
    stacks = [u.nbytes for u in units if u.kind == "experts"]
    return (always + reserve_bytes + layers + max(stacks) * (1 + len(stacks) // 2) + 1) / GIB


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--preset", default="pruned-80", help="synth preset (default: pruned-80)")
    p.add_argument("--format", default="nvfp4", choices=["nvfp4", "mxfp8"])
    p.add_argument("--layers", type=int, default=None, help="layers (default: the preset's)")
    p.add_argument("--experts", type=int, default=None, help="routed experts per layer (default: the preset's)")
    p.add_argument("--offload", default="cpu", choices=["cpu", "disk"],
                   help="where the streamed weights stay: pinned host memory (default) or --offload-folder")
    p.add_argument("--offload-folder", type=Path, default=None,
                   help="with --offload disk (default: a new folder under the cache folder, removed at exit)")
    p.add_argument("--gpu-memory", type=float, default=None,
                   help="GiB the model may take on the device (default: half the expert stacks streamed)")
    p.add_argument("--reserve", type=float, default=None,
                   help="GiB reserved for activations beyond the KV cache (default: 5 on a GPU, 0.01 on a CPU)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    fast_presets = ["off", "on", "compile", "fused", "compiled"]
    p.add_argument("--fast", default="auto", choices=["auto", *fast_presets],
                   help=f"fast paths: auto = the engine's choice (compiled on CUDA); {describe_presets(fast_presets)} "
                        "(default: auto; on decodes every expert of a batch-32 step)")
    p.add_argument("--prefetch", default="auto", choices=["auto", "on", "off"],
                   help="copy the next streamed stack's predicted experts' rows ahead, on a side stream (default: "
                        "auto, the engine's default: on for --offload cpu on CUDA)")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--h2d-mib", type=int, default=1024)
    p.add_argument("--h2d-repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="append the JSON line to this file")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    batches = [int(b) for b in args.batches.split(",")]
    reserve = args.reserve if args.reserve is not None else (5.0 if device.type == "cuda" else 0.01)
    max_len = args.prompt_len + args.warmup + args.steps + 1

    def log(msg: str) -> None:
        print(f"[offload] {msg}", file=sys.stderr, flush=True)

    rate = h2d_rate(device, args.h2d_mib if device.type == "cuda" else min(args.h2d_mib, 64), args.h2d_repeats)
    log(f"host-to-device copy rate {rate / 1e9:.2f} GB/s")
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    from minimax_ref.model.cache import kv_bytes_per_token
    from minimax_ref.model.config import parse_model_config
    from minimax_ref.weights.synth import build_config

    cfg = parse_model_config(build_config(args.preset, args.format, args.experts, args.layers))
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    kv = kv_bytes_per_token(cfg, 1, "auto", dtype_bytes) * max_len * max(batches)
    gpu_memory = args.gpu_memory or default_budget(cfg, dtype_bytes, int(reserve * GIB) + kv)
    t0 = time.perf_counter()
    log(f"building {args.preset} ({cfg.text.num_hidden_layers} layers, {cfg.text.num_local_experts} experts) "
        f"offloaded within {gpu_memory:.4g} GiB on {device}")
    model = load_synthetic(args.preset, format=args.format, layers=args.layers, experts=args.experts, seed=args.seed,
                           device=device, dtype=dtype, weights="packed", fast=args.fast,
                           offload=OffloadConfig(args.offload, gpu_memory, folder=args.offload_folder,
                                                 reserve_gib=reserve, share_streamed_experts=True,
                                                 prefetch=None if args.prefetch == "auto" else args.prefetch == "on"),
                           max_seq_len=max_len, max_batch_size=max(batches))
    load_s = time.perf_counter() - t0
    streamer = model.offload
    dm = streamer.device_map
    units = {u.name: u for u in dm.units}
    log(f"loaded in {load_s:.1f} s: {len(dm.resident)} units resident, {len(dm.streamed)} streamed "
        f"({sum(units[n].nbytes for n in dm.streamed) / GIB:.2f} GiB, sharing host storage)")
    k = cfg.text.num_experts_per_tok
    results = []
    gen = torch.Generator().manual_seed(args.seed)
    for B in batches:
        ids = torch.randint(0, cfg.text.vocab_size, (B, args.prompt_len), generator=gen).to(device)
        cache = model.new_cache(B, max_len)
        pos = torch.arange(args.prompt_len, device=device).expand(B, -1)
        with torch.inference_mode():
            tok = model(ids, positions=pos, cache=cache)[:, -1].argmax(-1, keepdim=True)
            times, moved, needed = [], [], []
            rows = dict.fromkeys(("chosen_rows", "hit_rows", "miss_rows", "prefetched_rows"), 0)
            for step in range(args.warmup + args.steps):
                here = torch.full((B, 1), args.prompt_len + step, device=device)
                sync(device)
                before, s0 = dataclasses.replace(streamer.stats), time.perf_counter()
                tok = model(tok, positions=here, cache=cache)[:, -1].argmax(-1, keepdim=True)
                sync(device)
                if step >= args.warmup:
                    times.append(time.perf_counter() - s0)
                    st = streamer.stats
                    moved.append(st.bytes_moved - before.bytes_moved)
                    copied = st.expert_rows - before.expert_rows
                    step_rows = {key: getattr(st, key) - getattr(before, key) for key in rows}
                    wasted = step_rows["prefetched_rows"] - step_rows["hit_rows"]
                    row_bytes = (st.expert_bytes - before.expert_bytes) / copied if copied else 0
                    needed.append(moved[-1] - wasted * row_bytes)
                    for key, v in step_rows.items():
                        rows[key] += v
        step_s = sum(times) / len(times)
        step_bytes = sum(moved) / len(moved)
        need_bytes = sum(needed) / len(needed)
        roofline = B / (need_bytes / rate) if need_bytes else None
        tok_s = B / step_s
        row = {"batch": B, "step_ms": 1e3 * step_s, "tok_s": tok_s, "bytes_moved_per_step": step_bytes,
               "bytes_needed_per_step": need_bytes, "bytes_moved_per_token": step_bytes / B,
               "planned_bytes_per_step": dm.bytes_per_step(B, k),
               **{f"{key}_per_step": v / len(times) for key, v in rows.items()},
               "hit_rate": rows["hit_rows"] / rows["chosen_rows"] if rows["chosen_rows"] else None,
               "roofline_tok_s": roofline, "fraction_of_roofline": (tok_s / roofline) if roofline else None}
        results.append(row)
        log(f"batch {B}: {row['step_ms']:.1f} ms/step, {tok_s:.2f} tok/s; {step_bytes / 1e9:.3f} GB moved per step, "
            f"{need_bytes / 1e9:.3f} needed (planned {row['planned_bytes_per_step'] / 1e9:.3f}); expert rows per step: "
            f"{row['chosen_rows_per_step']:.1f} chosen, {row['hit_rows_per_step']:.1f} hits "
            + (f"({100 * row['hit_rate']:.1f} %)" if row["hit_rate"] is not None else "")
            + f", {row['prefetched_rows_per_step']:.1f} copied ahead; PCIe roofline "
            + (f"{roofline:.2f} tok/s, {100 * tok_s / roofline:.1f} %" if roofline else "none (nothing streamed)"))
        del cache
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    out = {"benchmark": "offload", "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "preset": args.preset, "format": args.format,
           "layers": cfg.text.num_hidden_layers, "experts": cfg.text.num_local_experts, "top_k": k,
           "dtype": str(dtype).removeprefix("torch."), "fast": model.fast_preset, "offload": args.offload,
           "prefetch": "on" if streamer.prefetch else "off",
           "gpu_memory_gib": gpu_memory, "reserve_gib": reserve, "prompt_len": args.prompt_len,
           "steps": args.steps, "warmup": args.warmup, "load_s": load_s, "h2d_gbps": rate / 1e9,
           "weights_gib": (model.load_stats["memory_bytes"]) / GIB,
           "model_gib_if_resident": (dm.resident_bytes + sum(units[n].nbytes for n in dm.streamed)) / GIB,
           "resident_units": list(dm.resident), "streamed_units": list(dm.streamed),
           "planned_gpu_gib": dm.gpu_bytes / GIB,
           "peak_gpu_gib": None if peak is None else peak / GIB,
           "peak_within_budget": None if peak is None else peak <= gpu_memory * GIB,
           "host_storage": "synthetic: every streamed expert stack shares the first streamed stack's host tensors "
                           "(pinned, or mapped from disk; bytes moved per step as with distinct stacks)",
           "roofline": "tok/s = B / (bytes needed per step / h2d bytes/s), bytes and rate measured in this run "
                       "(needed: moved less the rows copied ahead that were not chosen)",
           "results": results}
    if peak is not None:
        log(f"peak GPU memory {peak / GIB:.2f} GiB of --gpu-memory {gpu_memory:g} GiB "
            f"({'within' if out['peak_within_budget'] else 'OVER'})")
    line = json.dumps(out)
    print(line)
    if args.out is not None:
        with args.out.open("a") as f:
            f.write(line + "\n")
    return out


if __name__ == "__main__":
    try:
        main()
    except MiniMaxRefError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
