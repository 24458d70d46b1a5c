"""The seed's throughput protocol through `generate`: N requests of ~L tokens in, M out, one call.

A synthetic model (`--preset`, `--layers`, `--experts`, NVFP4+MXFP8 packed, fp8 KV, `--fast`) decodes `--requests`
random prompts of `--prompt-len` tokens, `--new-tokens` each (no stop token), through `decoding.generate_ids`, the
loop `minimax-ref generate` runs for `--prompt`s and `--input-file` lines (continuous batching, `--max-batch-size`
at once, prompts prefilled in chunks of `--prefill-chunk`; both by default chosen from free memory as the CLI
chooses them, `generation.sizing`). The call runs twice in one process: the first includes compiling and capturing
the step, the second is warm. Each reports output tokens/s end to end, prefill and decode tokens/s, the sizes
used, and the GPU memory allocated before it and at its peak (what the chosen batch and prefill chunk really take,
against `generation.sizing`'s estimate). Measured in the same run: one prompt prefilled alone into a fresh one-row
cache in the same chunks (the prefill benchmark's rate for the same tokens per call), and the workload's roofline:
the prefill's matmul FLOPs over the measured bf16 matmul rate, plus every decode step's bytes
(`common.decode_step_bytes`, at the step's mean context) over the measured device-to-device copy bandwidth.

    # 1 x H200, release widths, 60 layers, 16 experts, 32 x 8K in / 512 out (BENCHMARKS.md):
    python benchmarks/seed_workload.py --layers 60 --experts 16 --requests 32 --prompt-len 8192 --new-tokens 512
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from common import (
    BenchmarkError,
    active_linear_elements_per_token,
    add_fast_flag,
    copy_bandwidth,
    decode_step_bytes,
    emit,
    main_guard,
    memory_now,
    peak_gib,
    reset_peak,
    sync,
)

from minimax_ref.generation.decoding import generate_ids, prefill
from minimax_ref.generation.sampling import SamplingParams
from minimax_ref.weights.loader import load_synthetic
from minimax_ref.weights.synth import PRESETS


def matmul_rate(device: torch.device, n: int = 8192, iters: int = 10) -> float:
    """Measured bf16 matmul FLOP/s: the median of `iters` [n, n] x [n, n] products of random data."""
    a, b = torch.randn(n, n, device=device, dtype=torch.bfloat16), torch.randn(n, n, device=device,
                                                                                dtype=torch.bfloat16)
    times = []
    for i in range(iters + 3):
        sync(device)
        t0 = time.perf_counter()
        a @ b
        sync(device)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    times.sort()
    return 2 * n**3 / times[len(times) // 2]


def roofline(model, requests: int, prompt_len: int, new_tokens: int, batch: int, flops_per_s: float,
             bytes_per_s: float) -> dict:
    """Seconds the workload needs at least: prefill matmuls at `flops_per_s` and decode steps' bytes at
    `bytes_per_s` (batches of `batch` requests, each step at its mean context)."""
    # each prompt's last position only goes through the LM head (its first token), the rest are decode steps' logits
    prefill_s = 2 * (active_linear_elements_per_token(model, lm_head=False) * prompt_len
                     + model.lm_head.in_features * model.lm_head.out_features) * requests / flops_per_s
    decode_s = 0.0
    for start in range(0, requests, batch):
        rows = min(batch, requests - start)
        step = decode_step_bytes(model, rows, prompt_len + new_tokens // 2, kv_elem_bytes=1)["bytes"]
        decode_s += (new_tokens - 1) * step / bytes_per_s
    return {"prefill_s": prefill_s, "decode_s": decode_s, "seconds": prefill_s + decode_s,
            "output_tokens_per_s": requests * new_tokens / (prefill_s + decode_s)}


def run_once(model, prompts: list[list[int]], args) -> dict:
    before = memory_now(model.device).get("allocated_gib")  # the weights, and what earlier calls still hold
    reset_peak(model.device)
    t0 = time.perf_counter()
    seqs, stats = generate_ids(model, prompts, max_new_tokens=args.new_tokens, sampling=SamplingParams(temperature=0),
                               stop_ids=[], max_batch_size=args.max_batch_size, prefill_chunk=args.prefill_chunk)
    seconds = time.perf_counter() - t0
    out = sum(len(s.generated) for s in seqs)
    return {"seconds": seconds, "output_tokens": out, "output_tokens_per_s": out / seconds,
            "output_tokens_per_s_excluding_warmup": out / (seconds - stats.warmup_seconds),
            "prefill_tokens_per_s": stats.prefill_tokens_per_s, "decode_tokens_per_s": stats.decode_tokens_per_s,
            "warmup_seconds": stats.warmup_seconds, "prefill_seconds": stats.prefill_seconds,
            "decode_seconds": stats.decode_seconds, "time_to_first_token_seconds": stats.first_token_seconds,
            "decode_steps": stats.decode_steps, "max_batch_size": stats.max_batch_size,
            "prefill_chunk": stats.prefill_chunk, "allocated_gib_before": before, "peak_gib": peak_gib(model.device)}


def prefill_alone(model, prompt: list[int], chunk: int, repeats: int = 2) -> float:
    """Prompt tokens/s of one prompt prefilled alone into a fresh one-row cache in chunks of `chunk` (the best of
    `repeats`), as `decoding.prefill` runs it."""
    ids = torch.tensor([prompt], device=model.device)
    best = float("inf")
    for _ in range(repeats):
        cache = model.new_cache(1, len(prompt) + 1, "fp8")
        sync(model.device)
        t0 = time.perf_counter()
        with torch.no_grad():
            prefill(lambda x, pos, e, index, cache=cache: model(x, positions=pos, cache=cache, logit_index=index),
                    ids, [len(prompt)], None, chunk)
        sync(model.device)
        best = min(best, time.perf_counter() - t0)
    return len(prompt) / best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="release", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, default=60)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=8192)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--max-batch-size", type=int, default=None,
                   help="requests decoded together (default: chosen from free memory, as the CLI)")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="prompt tokens per prefill forward (default: chosen from free memory, as the CLI)")
    p.add_argument("--device", default="cuda")
    add_fast_flag(p, ["off", "on", "compiled", "gemv-mma", "gemv-mma-stored", "grouped-swiglu", "prefill-experts",
                      "split-probabilities"], "auto",
                  auto="compiled on CUDA, off elsewhere")
    p.add_argument("--out", default=None, help="append the JSON result to this file")
    args = p.parse_args()
    if min(args.requests, args.prompt_len, args.new_tokens) < 1:
        raise BenchmarkError("--requests, --prompt-len and --new-tokens must be >= 1")
    device = torch.device(args.device)
    fast = args.fast if args.fast != "auto" else ("compiled" if device.type == "cuda" else "off")
    model = load_synthetic(args.preset, format="nvfp4", device=device, layers=args.layers, experts=args.experts,
                           weights="packed", fast=fast, kv_cache_dtype="fp8",
                           max_seq_len=args.prompt_len + args.new_tokens)
    g = torch.Generator().manual_seed(0)
    vocab = model.text.vocab_size
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.requests)]
    first = run_once(model, prompts, args)
    print(json.dumps({"bench": "seed_workload_first_call", **first}), file=sys.stderr, flush=True)
    warm = run_once(model, prompts, args)
    alone = prefill_alone(model, prompts[0], warm["prefill_chunk"])
    flops = matmul_rate(device) if device.type == "cuda" else float("nan")
    bandwidth = copy_bandwidth(device, 1 << 30)["bytes_per_s"] if device.type == "cuda" else float("nan")
    floor = roofline(model, args.requests, args.prompt_len, args.new_tokens, warm["max_batch_size"], flops,
                     bandwidth)
    result = {"bench": "seed_workload", "preset": args.preset, "layers": args.layers, "experts": args.experts,
              "requests": args.requests, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "max_batch_size": warm["max_batch_size"], "prefill_chunk": warm["prefill_chunk"], "fast": fast,
              "prefill_alone_tokens_per_s": alone,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "first_call": first, "warm_call": warm, "bf16_matmul_tflop_per_s": flops / 1e12,
              "copy_tb_per_s": bandwidth / 1e12, "roofline": floor,
              "warm_fraction_of_roofline": warm["output_tokens_per_s"] / floor["output_tokens_per_s"]}
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main_guard(main, []))
