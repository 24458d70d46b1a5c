#!/usr/bin/env python
"""Prefill speed of minimax-ref's attention paths beside `transformers`, on one GPU, the same weights, one run.

    # 1 x H200 (about 2-3 minutes): the scaled model of vs_transformers.py, an 8,192-token prompt. transformers
    # needs `minimax_m3_vl` (5.23; the machine's 5.17 may not have it: unpack the 5.23 wheel, `python3 -m zipfile
    # -e transformers-5.23.0-py3-none-any.whl DIR`, and put DIR on PYTHONPATH (5.23 does not import from the zip
    # itself); else its column is recorded as an error):
    PYTHONPATH=$PWD python3 benchmarks/prefill.py --out prefill.jsonl
    # CPU dry run (the attention kernel is CUDA's: on a CPU `on` and `compiled` keep the gathering path):
    python benchmarks/prefill.py --device cpu --preset tiny --layers 0 --experts 0 --prompt-len 200

The model: `--preset release --layers 6 --experts 16` (3 dense layers, 3 MSA + MoE layers, release widths: hidden
6144, 64 query / 4 kv heads of 128, MSA blocks of 128, top-16), synthetic NVFP4+MXFP8 weights decoded to bf16 at load
(`--weights dequant`: the tensors transformers gets), bf16 KV cache. Each variant of minimax-ref runs on the same
loaded model (`fast.apply` between variants):
* `reference`: the reference engine (`FastPaths()`: MSA gathers its selected key blocks per query chunk);
* `gathering`: `--fast on` with the attention and selection kernels off (`prefill_attention="reference"`,
  `block_selection="reference"`: fp32 SDPA cores, MSA gathering its blocks from the cache);
* `on`: `--fast on` (batched experts, and with triton on CUDA the attention and selection kernels,
  `fast.attention_kernel`, `fast.selection_kernel`);
* `compiled`: `--fast compiled`, the GPU default (its prefill: `on`'s paths, packed weights decoded by one Triton
  kernel, the norms, rotations, activations and expert combine fused, `fast.prefill`, the attention kernel's
  probabilities rounded once to bf16);
* `unfused`: `compiled` without prefill's fusions (`prefill_fusion=False`), to measure what `fast.prefill` saves;
* `reference-selection`: `compiled` with the MSA block selection of the reference's chunked scores
  (`block_selection="reference"`), to measure what `fast.selection_kernel` saves;
* `prefill-experts`: `compiled` with the routed experts multiplied from their packed stacks (`--weights packed`;
  `fast.prefill_experts`), against `compiled`'s decode-then-`torch._grouped_mm`;
* `split-probabilities`: `compiled` with the attention kernel's probabilities as two bf16 parts (`FastPaths(
  attention_probabilities="split")`, the other presets' value sum), what `compiled`'s single part saves.
`transformers`: `MiniMaxM3VLForCausalLM` built from the same decoded weights (vs_transformers.build_transformers),
bf16, SDPA attention (on MSA layers with a [B, heads, S, S] mask of the indexer's selected blocks, so every layer
costs dense attention).

Each system: one warm-up prefill of the whole prompt (its seconds are reported as `warmup_s`), then `--repeats`
timed prefills, the best kept; only the last position goes through the LM head. Agreement: each variant's last
logits against `reference` (and transformers'), relative max error and argmax. `--profile` adds each variant's
device time per kernel kind and its top kernels. On CUDA, `compute_floor`: the prompt's matmul FLOPs (every linear
for every token, top-k experts, the LM head for the last position) at the bf16 matmul rate measured in the same run
(`seed_workload.matmul_rate`), and each variant's `fraction_of_compute_floor`.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from dataclasses import asdict, replace

import torch
from common import (
    BenchmarkError,
    active_linear_elements_per_token,
    emit,
    init_world,
    log,
    main_guard,
    peak_gib,
    prefill,
    reset_peak,
    sync,
)
from seed_workload import matmul_rate

from minimax_ref.fast import FastPaths, apply
from minimax_ref.weights.loader import load_synthetic
from minimax_ref.weights.synth import PRESETS

ON = FastPaths.of(True)
VARIANTS = {"reference": FastPaths(),
            "gathering": replace(ON, prefill_attention="reference", block_selection="reference"), "on": ON,
            "compiled": FastPaths.of("compiled"),
            "unfused": replace(FastPaths.of("compiled"), prefill_fusion=False),
            "reference-selection": replace(FastPaths.of("compiled"), block_selection="reference"),
            "prefill-experts": FastPaths.of("prefill-experts"),
            "split-probabilities": FastPaths.of("split-probabilities")}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="release", choices=sorted(PRESETS), help="synth preset (default: release)")
    p.add_argument("--format", default="nvfp4", choices=["nvfp4", "mxfp8"], help="default: nvfp4")
    p.add_argument("--layers", type=int, default=6, help="layers (default: 6 = 3 dense + 3 MSA; 0 = the preset's)")
    p.add_argument("--experts", type=int, default=16, help="routed experts per layer (default: 16; 0 = preset's)")
    p.add_argument("--weights", default="dequant", choices=["dequant", "packed"],
                   help="ours: decoded to bf16 at load (default; transformers' tensors) or kept packed (transformers\n"
                        "then gets a second, decoded load)")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--prompt-len", type=int, default=8192)
    p.add_argument("--prefill-chunk", type=int, default=8192, help="ours: tokens per prefill call (default: 8192)")
    p.add_argument("--attention-chunk-elements", type=int, default=1 << 26)
    p.add_argument("--variants", default="reference,on,compiled",
                   help=f"comma list of {', '.join(VARIANTS)} (default: reference,on,compiled)")
    p.add_argument("--repeats", type=int, default=2, help="timed prefills per system after the warm-up (default: 2)")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--hf-attn", default="sdpa", choices=["sdpa", "eager"], help="transformers attention")
    p.add_argument("--profile", action="store_true",
                   help="after timing, profile one prefill per variant (CUDA): time per kernel kind, top kernels, and "
                        "the best timed call's wall time beyond the device time (host_gap_ms)")
    p.add_argument("--top", type=int, default=15, help="kernels listed by --profile (default: 15)")
    p.add_argument("--out", default=None)
    return p


def profile_prefill(device: torch.device, fn, top: int) -> dict:
    """Device milliseconds of one call of `fn` per kernel kind and for the `top` kernels (CUPTI)."""
    from profile_decode import kernel_kind
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync(device)
    micros: dict[str, float] = {}
    calls: dict[str, int] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            micros[e.name] = micros.get(e.name, 0.0) + e.device_time_total
            calls[e.name] = calls.get(e.name, 0) + 1
    kinds: dict[str, float] = {}
    for name, us in micros.items():
        kinds[kernel_kind(name)] = kinds.get(kernel_kind(name), 0.0) + us / 1e3
    ranked = sorted(micros.items(), key=lambda kv: -kv[1])[:top]
    return {"device_ms": round(sum(micros.values()) / 1e3, 2),
            "kinds_ms": {k: round(v, 2) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
            "top": [{"kernel": n[:120], "ms": round(us / 1e3, 2), "calls": calls[n]} for n, us in ranked]}


def _timed(device: torch.device, fn, repeats: int) -> tuple[object, float, float, float | None]:
    """(result, warm-up seconds, best of `repeats` timed seconds, peak GiB of the timed runs)."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    warmup = time.perf_counter() - t0
    reset_peak(device)
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return out, warmup, best, peak_gib(device)


def _agreement(a: torch.Tensor, b: torch.Tensor) -> dict:
    return {"last_logits_rel_max_err": float((a - b).abs().max() / b.abs().max()),
            "argmax_equal": bool(torch.equal(a.argmax(-1), b.argmax(-1)))}


def run(args: argparse.Namespace, holder: list) -> None:
    world, device = init_world(args.device, 600)
    holder.append(world)
    if world.size != 1:
        raise BenchmarkError("prefill.py runs on one device: start it with python, not torchrun")
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        raise BenchmarkError(f"--variants {args.variants!r}: choose from {list(VARIANTS)}")
    if args.repeats < 1:
        raise BenchmarkError("--repeats must be >= 1")
    result: dict = {"benchmark": "prefill", "command": " ".join(sys.argv), "params": vars(args),
                    "torch": torch.__version__,
                    "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    hf_error = None
    if not args.skip_transformers:
        try:
            import transformers
            from transformers.models.minimax_m3_vl import MiniMaxM3VLForCausalLM  # noqa: F401
            result["transformers"] = transformers.__version__
        except ImportError as e:
            hf_error = f"transformers without minimax_m3_vl ({e}); carry transformers==5.23.0"
            log(world, f"skipping transformers: {hf_error}")
    common = dict(format=args.format, layers=args.layers or None, experts=args.experts or None, device=device,
                  max_seq_len=args.prompt_len, attention_chunk_elements=args.attention_chunk_elements)
    ids = torch.randint(0, min(100_000, PRESETS[args.preset].text["vocab_size"]), (1, args.prompt_len),
                        generator=torch.Generator(device=device).manual_seed(3), device=device)

    log(world, f"loading {args.preset} layers={args.layers} experts={args.experts} weights={args.weights}")
    model = load_synthetic(args.preset, weights=args.weights, **common)
    t = model.text
    result["model"] = {"layers": t.num_hidden_layers, "sparse_layers": sum(t.sparse_layers), "experts":
                       t.num_local_experts, "hidden": t.hidden_size, "heads": t.num_attention_heads,
                       "kv_heads": t.num_key_value_heads, "weights_gib": model.load_stats["memory_bytes"] / 2**30}
    # the compute floor: the prompt's matmul FLOPs (every linear for every token, the LM head for the last one) at
    # the bf16 matmul rate measured now
    flops = 2 * (active_linear_elements_per_token(model, lm_head=False) * args.prompt_len
                 + model.lm_head.in_features * model.lm_head.out_features)
    if device.type == "cuda":
        rate = matmul_rate(device)
        result["compute_floor"] = {"prefill_tflop": flops / 1e12, "bf16_matmul_tflop_per_s": rate / 1e12,
                                   "tokens_per_s": args.prompt_len * rate / flops}
    cache = model.new_cache(1, args.prompt_len)
    systems: dict = {}
    logits: dict = {}
    with torch.no_grad():
        for name in variants:
            paths = apply(model, VARIANTS[name])
            log(world, f"ours {name}: warm-up then {args.repeats} timed prefills of {args.prompt_len} tokens")
            try:
                last, warmup, secs, peak = _timed(device, lambda: prefill(model, cache, ids, args.prefill_chunk),
                                                  args.repeats)
            except Exception as e:  # a variant that fails (a kernel that does not build) must not hide the others
                if isinstance(e, torch.OutOfMemoryError) or name == "reference":
                    raise
                systems[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
                log(world, f"ours {name} failed: {systems[name]['error']}")
                continue
            systems[name] = {"fast_paths": asdict(paths), "warmup_s": warmup, "seconds": secs,
                             "tokens_per_s": args.prompt_len / secs, "peak_gib": peak}
            if "compute_floor" in result:
                systems[name]["fraction_of_compute_floor"] = (args.prompt_len / secs
                                                              / result["compute_floor"]["tokens_per_s"])
            if args.profile and device.type == "cuda":
                prof = profile_prefill(device, lambda: prefill(model, cache, ids, args.prefill_chunk), args.top)
                # the best timed call's wall time beyond the kernels' device time: where the GPU waited for the host
                prof["host_gap_ms"] = round(1e3 * secs - prof["device_ms"], 2)
                systems[name]["profile"] = prof
                log(world, f"ours {name} profile: {systems[name]['profile']}")
            logits[name] = last.float().cpu()
            log(world, f"ours {name}: {args.prompt_len / secs:,.0f} tokens/s (warm-up {warmup:.1f} s)")
    cache = None  # freed before transformers loads
    if not args.skip_transformers and hf_error is None:
        from vs_transformers import build_transformers

        apply(model, False)
        if args.weights == "packed":
            del model
            gc.collect()
            log(world, "loading the same weights decoded, for transformers")
            model = load_synthetic(args.preset, weights="dequant", **common)
        log(world, f"transformers {result['transformers']}: building from the decoded weights")
        hf = build_transformers(model, args.hf_attn, device)
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        with torch.no_grad():
            out, warmup, secs, peak = _timed(device, lambda: hf(ids, use_cache=True, logits_to_keep=1),
                                             args.repeats)
        systems["transformers"] = {"attn": args.hf_attn, "warmup_s": warmup, "seconds": secs,
                                   "tokens_per_s": args.prompt_len / secs, "peak_gib": peak}
        logits["transformers"] = out.logits[:, -1].float().cpu()
        log(world, f"transformers: {args.prompt_len / secs:,.0f} tokens/s")
        del hf, out
    elif hf_error:
        systems["transformers"] = {"error": hf_error}

    agreement = {}
    for name, lg in logits.items():
        if name != "reference" and "reference" in logits:
            agreement[f"{name}_vs_reference"] = _agreement(lg, logits["reference"])
        if name not in ("reference", "transformers") and "transformers" in logits:
            agreement[f"{name}_vs_transformers"] = _agreement(lg, logits["transformers"])
    speed = {name: s["tokens_per_s"] for name, s in systems.items() if "tokens_per_s" in s}
    # each variant of ours over transformers and over the variants before it (`on` over `reference`, ...)
    order = {"transformers": -1} | {name: i for i, name in enumerate(VARIANTS)}
    ratios = {f"{name}_over_{base}": speed[name] / speed[base] for name in variants
              for base in ("transformers", "on", "reference")
              if name in speed and base in speed and order[base] < order[name]}
    result.update({"systems": systems, "agreement": agreement, "speedups": ratios})
    for key, value in ratios.items():
        log(world, f"{key}: {value:.2f}x")
    emit(result, args.out)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    holder: list = []
    return main_guard(lambda: run(args, holder), holder)


if __name__ == "__main__":
    sys.exit(main())
