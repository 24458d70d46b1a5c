"""The user's decode loop against the graph step it replays, measured in one run.

A synthetic model (`--preset`, `--layers`, `--experts`, NVFP4+MXFP8 packed, `--fast`, fp8 KV) generates `--new-tokens`
tokens for a `--prompt-len` prompt through `decoding.generate_ids`, the function `minimax-ref generate` calls (the
first decode step compiles and captures the step in a CUDA graph; the stats time it apart). Then the graph that
generate captured (`model.captured`) is replayed `--steps` times alone, timed with CUDA events: the benchmark's step.
Then, for `--batch` sequences (the prompt's cache replicated, each row feeding a token of its own), the model's step
(`MiniMaxM3.step`: captured on its first call) is replayed the same way. Each step is set against its HBM
roofline: the bytes it must read (`common.decode_step_bytes`) over the device-to-device copy bandwidth measured in
the same run.
Two JSON lines: generate's ms per decode step (its wall time: replay, sampling, the token read back, bookkeeping),
the bare replay's, their ratio, the batch's step and tokens/s, each with its roofline fraction, and the stats
generate reports (prefill and decode tokens/s, time to first token, compile-and-capture time).

    # 1 x H200, release widths, 60 layers, 16 experts, an 8K prompt (BENCHMARKS.md's decode setup):
    python benchmarks/generate_decode.py --layers 60 --experts 16 --prompt-len 8192 --out gen.jsonl
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from common import (
    GIB,
    BenchmarkError,
    add_fast_flag,
    copy_bandwidth,
    decode_step_bytes,
    emit,
    event_ms,
    main_guard,
    replicate_cache,
)

from minimax_ref.generation.decoding import generate_ids
from minimax_ref.generation.sampling import SamplingParams
from minimax_ref.weights.loader import load_synthetic
from minimax_ref.weights.synth import PRESETS


def add_model_args(p: argparse.ArgumentParser, prompt_len: int) -> None:
    """The synthetic model's arguments (shared with speculative_decode.py)."""
    p.add_argument("--preset", default="release", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--experts", type=int, default=16)
    add_fast_flag(p, ["on", "fused", "compiled", "gemv", "gemv-mma", "gemv-mma-stored",
                      "grouped-rows", "grouped-swiglu"], "compiled")
    p.add_argument("--prompt-len", type=int, default=prompt_len)


def load_model(args: argparse.Namespace, max_seq_len: int):
    """The synthetic model of `add_model_args`' arguments on a CUDA `--device`: NVFP4+MXFP8 packed, bf16, fp8 KV."""
    if not args.device.startswith("cuda") or not torch.cuda.is_available():
        raise BenchmarkError(f"{Path(sys.argv[0]).name} measures CUDA-graph replays: give a CUDA --device on a GPU "
                             "machine")
    return load_synthetic(args.preset, format="nvfp4", layers=args.layers or None, experts=args.experts or None,
                          device=torch.device(args.device), dtype=torch.bfloat16, weights="packed",
                          kv_cache_dtype="fp8", max_seq_len=max_seq_len, fast=args.fast)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p, 8192)
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generate makes (default: 64)")
    p.add_argument("--steps", type=int, default=50, help="bare replays timed (default: 50)")
    p.add_argument("--batch", type=int, default=32, help="sequences of the batched step (0: skip; default: 32)")
    p.add_argument("--bw-gib", type=float, default=4.0, help="bytes of the bandwidth copy, GiB (default: 4)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=None, help="also append the JSON line to this file")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> None:
    model = load_model(args, args.prompt_len + args.new_tokens + 1)
    device = model.device
    seeded = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.text.vocab_size, (args.prompt_len,), generator=seeded)
    print(f"generating {args.new_tokens} tokens after a {args.prompt_len}-token prompt", file=sys.stderr, flush=True)
    _, stats = generate_ids(model, [prompt.tolist()], max_new_tokens=args.new_tokens,
                            sampling=SamplingParams(temperature=0.0))
    if stats.decode_tokens == 0:
        raise BenchmarkError("generate stopped before a timed decode step: raise --new-tokens")
    captured = getattr(model, "captured", None)
    if captured is None or not captured.graphs:
        raise BenchmarkError(f"--fast {args.fast}: generate replayed no CUDA graph")
    graph = next(iter(captured.graphs.values()))
    replay_ms = replay_time(graph, args.steps)
    generate_ms = 1e3 * stats.decode_seconds / (stats.decode_steps - 1)
    bandwidth = copy_bandwidth(device, int(args.bw_gib * GIB))["bytes_per_s"]
    context = args.prompt_len + args.new_tokens // 2
    kv_bytes = 1  # fp8 cache

    def roofline_ms(batch: int) -> float:
        return 1e3 * decode_step_bytes(model, batch, context, kv_bytes)["bytes"] / bandwidth

    result = {"bench": "generate_decode", "preset": args.preset, "layers": len(model.layers), "experts": args.experts,
              "fast": args.fast, "prompt_len": args.prompt_len, "device": torch.cuda.get_device_name(device),
              "torch": torch.__version__, "copy_bandwidth_tb_s": round(bandwidth / 1e12, 3),
              "generate_ms_per_step": round(generate_ms, 3), "replay_ms_per_step": round(replay_ms, 3),
              "generate_over_replay": round(generate_ms / replay_ms, 4),
              "roofline_ms": round(roofline_ms(1), 3),
              "generate_roofline_fraction": round(roofline_ms(1) / generate_ms, 4),
              "stats": stats.as_dict(), "capture_seconds": round(captured.capture_seconds, 3)}
    emit(result, args.out)
    if args.batch:
        B = args.batch
        cache = replicate_cache(model, graph.cache, B, "fp8")
        # a token of its own per row, so that the rows route to different experts as distinct requests do (the
        # roofline counts the experts B rows choose at random, `common.expected_distinct_experts`)
        ids = torch.randint(0, model.config.text.vocab_size, (B, 1), generator=seeded).to(device)
        pos = graph.pos.expand(B, -1).contiguous()
        print(f"capturing the step of {B} sequences", file=sys.stderr, flush=True)
        with torch.no_grad():
            model.step(ids, pos, cache)
        batched = model.captured.graphs[(B, 1)]
        step_ms = replay_time(batched, args.steps)
        result = {"bench": "generate_decode_batch", "layers": len(model.layers), "experts": args.experts,
                  "fast": args.fast, "prompt_len": args.prompt_len, "copy_bandwidth_tb_s": round(bandwidth / 1e12, 3),
                  "batch": B, "batch_ms_per_step": round(step_ms, 3), "batch_tokens_per_s": round(1e3 * B / step_ms, 1),
                  "batch_roofline_ms": round(roofline_ms(B), 3),
                  "batch_roofline_fraction": round(roofline_ms(B) / step_ms, 4)}
        emit(result, args.out)


def replay_time(graph, steps: int) -> float:
    """ms per replay of a captured step, over `steps` replays after one, timed with CUDA events."""
    return event_ms(graph.graph.replay, steps)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return main_guard(lambda: run(args), [])


if __name__ == "__main__":
    sys.exit(main())
