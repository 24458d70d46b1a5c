#!/usr/bin/env python
"""minimax-ref beside `transformers` on one GPU, same weights, at the release's widths with fewer layers and
experts (so that transformers fits in bf16): prefill and decode speed, memory, the HBM roofline of the decode
step, and how closely the two agree.

    # 1 x H200 (about 5-8 minutes with the defaults). transformers must have `minimax_m3_vl` (5.23; the
    # machine's 5.17 may not: unpack the 5.23 wheel with `python3 -m zipfile -e WHEEL DIR` and put DIR on
    # PYTHONPATH; 5.23 does not import from the zip itself):
    python benchmarks/vs_transformers.py --out vs_hf.jsonl
    # CPU dry run:
    python benchmarks/vs_transformers.py --device cpu --preset tiny --prompt-len 200 --decode-tokens 8 \\
        --batches 1,4 --bw-gib 0.125

Three systems on the same synthetic weights (`--preset release --layers 6 --experts 16` by default: 3 dense
layers, 3 MSA + MoE layers, 6.7 B parameters of text model):
* `ours_packed`: minimax-ref with packed NVFP4/MXFP8 weights and the fast paths (eager, and the decode
  step in a CUDA graph with `--variants eager,graph`);
* `ours_dequant`: minimax-ref with the weights decoded to bf16 at load (the same bits), fast paths;
* `transformers`: `MiniMaxM3VLForCausalLM` (bf16, router in fp32 as ours, `--hf-attn sdpa`) loaded
  with ours_dequant's decoded weights through tests/oracle.py's name mapping.
Prefill: one `--prompt-len` prompt (8192), only the last position through the LM head (both engines).
Decode: `--decode-tokens` greedy tokens at each of `--batches` (1, 32); batch B copies the prompt's cache
into B rows (transformers: `batch_repeat_interleave`). Agreement: the prefill's last logits and the
greedy tokens of batch 1, ours_dequant against transformers (bf16 both: close, not equal) and
ours_packed against ours_dequant (bit-identical by contract).

`--prefill-attention reference` runs ours' prefill with the fp32 gathering path instead of the attention kernel
(`FastPaths(prefill_attention=...)`; benchmarks/prefill.py compares the attention paths alone).

`--fast fused` (or the variants `fused`, `fused-graph`) runs ours_packed's decode steps with the fused
dequantize-and-multiply of packed weights (`FastPaths(matmul="fused")`; ours_dequant has no packed weights,
so it is unchanged): it is compiled and checked on the model's weights right after loading (`fused_check`;
a failure ends the run), and the JSON adds the estimated bytes the packed weights cost a step, unfused and
fused (`packed_traffic`). The prefill
(longer than 64 tokens) still decodes, so its last logits stay bit-identical to ours_dequant; the decode
steps sum in another order, so greedy tokens may part after a while (bf16 rounding flips MSA blocks).

    # 1 x H200, the fused matmul beside the current graph, minimax-ref only (about 3-4 minutes):
    python benchmarks/vs_transformers.py --skip-transformers --variants graph,fused-graph --decode-tokens 64 \\
        --budget-s 15
"""

from __future__ import annotations

import argparse
import copy
import gc
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from common import (
    FUSED_ROWS_HELP,
    GIB,
    BenchmarkError,
    add_fast_flag,
    check_fused_matmul,
    copy_bandwidth,
    decode,
    decode_step_bytes,
    emit,
    fused_rows_arg,
    init_world,
    log,
    main_guard,
    packed_weight_traffic,
    peak_gib,
    prefill,
    replicate_cache,
    reset_peak,
    sync,
    with_fused_rows,
)

from minimax_ref.fast import FastPaths, apply
from minimax_ref.weights.loader import load_synthetic
from minimax_ref.weights.synth import PRESETS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

VARIANTS = ("eager", "graph", "fused", "fused-graph", "compiled", "compiled-graph")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="release", choices=sorted(PRESETS), help="synth preset (default: release)")
    p.add_argument("--format", default="nvfp4", choices=["nvfp4", "mxfp8"], help="default: nvfp4")
    p.add_argument("--layers", type=int, default=6, help="layers (default: 6 = 3 dense + 3 MoE; 0 = the preset's)")
    p.add_argument("--experts", type=int, default=16, help="routed experts per layer (default: 16; 0 = preset's)")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="ours (default: auto = bf16, as transformers keeps it)")
    p.add_argument("--hf-attn", default="sdpa", choices=["sdpa", "eager"], help="transformers attention")
    p.add_argument("--prompt-len", type=int, default=8192)
    p.add_argument("--decode-tokens", type=int, default=512)
    p.add_argument("--batches", default="1,32")
    p.add_argument("--variants", default=None,
                   help=f"ours_packed: a comma list of {','.join(VARIANTS)} (default: eager,graph on CUDA, eager\n"
                        "on CPU); fused*: with the fused packed matmul, compiled*: with it and compiled\n"
                        "decoder layers (FastPaths.compile_layers), whatever --fast says")
    p.add_argument("--max-model-len", type=int, default=None, help="default: prompt-len + decode-tokens")
    p.add_argument("--prefill-chunk", type=int, default=8192)
    p.add_argument("--attention-chunk-elements", type=int, default=1 << 26)
    p.add_argument("--skip-transformers", action="store_true", help="measure minimax-ref only")
    add_fast_flag(p, ["on", "fused"], "on")  # ours: minimax-ref's paths
    p.add_argument("--prefill-attention", default="triton", choices=["triton", "reference"],
                   help="ours: prefill attention (FastPaths.prefill_attention; default: triton, the attention kernel;\n"
                        "reference: fp32 cores over the gathered MSA blocks)")
    p.add_argument("--fused-rows", type=fused_rows_arg, default=None, help=FUSED_ROWS_HELP)
    p.add_argument("--budget-s", type=float, default=40.0, help="stop a decode run early after this (default: 40)")
    p.add_argument("--bw-gib", type=float, default=4.0)
    p.add_argument("--out", default=None)
    return p


def _time(device, fn):
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def build_transformers(dense_model, attn: str, device: torch.device):
    """transformers' model with `dense_model`'s weights: built directly in bf16 on the device (no fp32
    copy), routers and selection biases kept fp32 as minimax-ref computes them."""
    from oracle import hf_text_config, hf_text_state_dict
    from transformers.models.minimax_m3_vl import MiniMaxM3VLForCausalLM

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            hf = MiniMaxM3VLForCausalLM(hf_text_config(dense_model, attn)).eval()
    finally:
        torch.set_default_dtype(default)
    for layer in hf.model.layers:
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.float()
    missing, unexpected = hf.load_state_dict(hf_text_state_dict(dense_model), strict=False)
    missing = [k for k in missing if "rotary" not in k and "inv_freq" not in k]
    if missing or unexpected:
        raise BenchmarkError(f"transformers weight mapping: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return hf


def measure_ours(name, model, ids, args, device, batches, variants, max_len, kv_elem, fasts: dict) -> dict:
    """Prefill and decode speed of minimax-ref's `model`; `fasts` gives each variant's fast paths."""
    out: dict = {"weights_gib": model.load_stats["memory_bytes"] / GIB}
    cache = model.new_cache(1, max_len, args.kv_cache_dtype)
    with torch.no_grad():
        prefill(model, cache, ids[:, : min(512, ids.shape[1])], args.prefill_chunk)  # warm-up
        reset_peak(device)
        last, secs = _time(device, lambda: prefill(model, cache, ids, args.prefill_chunk))
        out["prefill"] = {"seconds": secs, "tokens_per_s": ids.shape[1] / secs, "peak_gib": peak_gib(device)}
        log_fn(f"{name} prefill: {ids.shape[1] / secs:.1f} tokens/s")
        out["last_logits"] = last.float().cpu()
        out["decode"] = {}
        for variant in variants:
            apply(model, fasts[variant])
            for B in batches:
                reset_peak(device)
                c = cache if B == 1 else replicate_cache(model, cache, B, args.kv_cache_dtype)
                key = f"{variant}/{B}"
                try:
                    if B == 1 and variant == variants[0]:  # record batch-1 greedy tokens for the agreement check
                        out["tokens"] = greedy_tokens_ours(model, c, last, ids.shape[1], min(32, args.decode_tokens))
                    r = decode(model, c, last.expand(B, -1), ids.shape[1], args.decode_tokens,
                               graph=variant.endswith("graph"), budget_s=args.budget_s)
                    out["decode"][key] = {"steps": r.steps, "tokens_per_s": r.tokens_per_s, "step_ms": r.step_ms,
                                          "peak_gib": peak_gib(device)}
                    log_fn(f"{name} decode {key}: {r.tokens_per_s:.2f} tokens/s")
                except Exception as e:
                    if not variant.endswith("graph") or isinstance(e, torch.OutOfMemoryError):
                        raise
                    out["decode"][key] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
                    log_fn(f"{name} decode {key} failed: {out['decode'][key]['error']}")
                del c
    out["roofline_bytes"] = {str(B): decode_step_bytes(model, B, ids.shape[1] + args.decode_tokens // 2, kv_elem)
                             for B in batches}
    return out


def greedy_tokens_ours(model, cache, last, start, n) -> list[int]:
    ids = last.argmax(-1, keepdim=True)
    toks = [int(ids)]
    for i in range(n - 1):
        ids = model(ids, positions=torch.tensor([[start + i]], device=ids.device), cache=cache)[:, -1].argmax(-1, True)
        toks.append(int(ids))
    return toks


def measure_transformers(hf, ids, args, device, batches) -> dict:
    out: dict = {"weights_gib": sum(p.numel() * p.element_size() for p in hf.parameters()) / GIB}
    with torch.no_grad():
        hf(ids[:, : min(512, ids.shape[1])], use_cache=True, logits_to_keep=1)  # warm-up
        reset_peak(device)
        res, secs = _time(device, lambda: hf(ids, use_cache=True, logits_to_keep=1))
        past, last = res.past_key_values, res.logits[:, -1]
        out["prefill"] = {"seconds": secs, "tokens_per_s": ids.shape[1] / secs, "peak_gib": peak_gib(device)}
        log_fn(f"transformers prefill: {ids.shape[1] / secs:.1f} tokens/s")
        out["last_logits"] = last.float().cpu()
        out["decode"] = {}
        for B in batches:
            reset_peak(device)
            p = copy.deepcopy(past)
            if B > 1:
                p.batch_repeat_interleave(B)
            tok = last.argmax(-1, keepdim=True).expand(B, 1).contiguous()
            tokens = [int(tok[0])]
            steps = 0
            sync(device)
            t0 = time.perf_counter()
            while steps < args.decode_tokens:
                o = hf(tok, past_key_values=p, use_cache=True, logits_to_keep=1)
                tok = o.logits[:, -1].argmax(-1, keepdim=True)
                steps += 1
                if B == 1 and len(tokens) < 32:
                    tokens.append(int(tok[0]))
                if steps % 8 == 0:
                    sync(device)
                    if time.perf_counter() - t0 > args.budget_s:
                        break
            sync(device)
            secs = time.perf_counter() - t0
            out["decode"][f"eager/{B}"] = {"steps": steps, "tokens_per_s": B * steps / secs,
                                          "step_ms": 1e3 * secs / steps, "peak_gib": peak_gib(device)}
            if B == 1:
                out["tokens"] = tokens[: min(32, args.decode_tokens)]
            log_fn(f"transformers decode {B}: {B * steps / secs:.2f} tokens/s")
            del p
    return out


def log_fn(*parts):
    print(f"[{time.strftime('%H:%M:%S')}]", *parts, file=sys.stderr, flush=True)


def _agreement(a: dict, b: dict) -> dict:
    la, lb = a["last_logits"], b["last_logits"]
    ta, tb = a.get("tokens", []), b.get("tokens", [])
    n = min(len(ta), len(tb))
    first_diff = next((i for i in range(n) if ta[i] != tb[i]), None)
    return {"last_logits_rel_max_err": float((la - lb).abs().max() / lb.abs().max()),
            "last_logits_bit_identical": bool(torch.equal(la, lb)), "argmax_equal": bool(torch.equal(
                la.argmax(-1), lb.argmax(-1))), "greedy_tokens_compared": n,
            "greedy_tokens_equal_prefix": n if first_diff is None else first_diff}


def run(args: argparse.Namespace, holder: list) -> None:
    world, device = init_world(args.device, 600)
    holder.append(world)
    if world.size != 1:
        raise BenchmarkError("vs_transformers.py runs on one GPU: start it with python, not torchrun")
    batches = [int(b) for b in args.batches.split(",") if b]
    variants = (args.variants or ("eager,graph" if device.type == "cuda" else "eager")).split(",")
    for v in variants:
        if v not in VARIANTS:
            raise BenchmarkError(f"--variants {v!r}: choose from {list(VARIANTS)}")
    if any(v.endswith("graph") for v in variants) and device.type != "cuda":
        raise BenchmarkError("--variants graph / fused-graph need CUDA")
    need = args.prompt_len + args.decode_tokens
    max_len = args.max_model_len or need
    if max_len < need:
        raise BenchmarkError(f"--max-model-len {max_len} cannot hold --prompt-len + --decode-tokens = {need}")
    fast = replace(with_fused_rows(FastPaths.of(args.fast), args.fused_rows),
                   prefill_attention=args.prefill_attention)
    fused = with_fused_rows(FastPaths.of("fused"), args.fused_rows)
    compiled = with_fused_rows(FastPaths.of("compiled"), args.fused_rows)
    fasts = {v: fused if v.startswith("fused") else compiled if v.startswith("compiled") else fast for v in variants}
    hf_error = None
    if not args.skip_transformers:
        try:
            import transformers
            from transformers.models.minimax_m3_vl import MiniMaxM3VLForCausalLM  # noqa: F401
        except ImportError as e:
            hf_error = f"transformers without minimax_m3_vl ({e}); carry transformers==5.23.0"
            log_fn(f"skipping transformers: {hf_error}")
    result: dict = {"benchmark": "vs_transformers", "command": " ".join(sys.argv), "params": vars(args),
                    "torch": torch.__version__, "device_name": torch.cuda.get_device_name(device)
                    if device.type == "cuda" else "cpu"}
    if not args.skip_transformers and hf_error is None:
        result["transformers"] = transformers.__version__
    bw = copy_bandwidth(device, int(args.bw_gib * GIB))
    result["copy_bandwidth"] = bw
    common = dict(format=args.format, layers=args.layers or None, experts=args.experts or None, device=device,
                  fast=fast, max_seq_len=max_len, kv_cache_dtype=args.kv_cache_dtype,
                  attention_chunk_elements=args.attention_chunk_elements)
    ids = torch.randint(0, min(100_000, PRESETS[args.preset].text["vocab_size"]), (1, args.prompt_len),
                        generator=torch.Generator(device=device).manual_seed(3), device=device)
    kv_elem = 1 if args.kv_cache_dtype == "fp8" else 2
    systems: dict = {}

    log(world, f"ours_packed: materialising {args.preset} layers={args.layers} experts={args.experts}")
    packed = load_synthetic(args.preset, weights="packed", **common)
    result["model"] = {"layers": packed.text.num_hidden_layers, "experts": packed.text.num_local_experts,
                       "hidden": packed.text.hidden_size, "fast_paths": asdict(packed.fast)}
    if any(f.matmul == "fused" for f in fasts.values()):
        log(world, "compiling and checking the fused packed matmul")
        apply(packed, fused)
        with torch.no_grad():
            result["fused_check"] = check_fused_matmul(packed, batches, fused.fused_rows)
        log(world, f"fused matmul checked in {result['fused_check']['seconds']:.1f} s")
    result["packed_traffic"] = {str(B): packed_weight_traffic(packed, B, fused.fused_rows) for B in batches}
    systems["ours_packed"] = measure_ours("ours_packed", packed, ids, args, device, batches, variants, max_len, kv_elem,
                                          fasts)
    del packed
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    log(world, "ours_dequant: the same weights decoded at load")
    dense = load_synthetic(args.preset, weights="dequant", **common)
    systems["ours_dequant"] = measure_ours("ours_dequant", dense, ids, args, device, batches, ["eager"], max_len,
                                           kv_elem, {"eager": fast})
    if not args.skip_transformers and hf_error is None:
        log(world, f"transformers {result['transformers']}: building from ours_dequant's weights")
        hf = build_transformers(dense, args.hf_attn, device)
        del dense
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        systems["transformers"] = measure_transformers(hf, ids, args, device, batches)
        del hf
    elif hf_error:
        systems["transformers"] = {"error": hf_error}

    agree = {"ours_packed_vs_ours_dequant": _agreement(systems["ours_packed"], systems["ours_dequant"])}
    if "prefill" in systems.get("transformers", {}):
        agree["ours_dequant_vs_transformers"] = _agreement(systems["ours_dequant"], systems["transformers"])
    for s in systems.values():
        s.pop("last_logits", None)
    roof = {}
    for B in batches:
        rb = systems["ours_packed"]["roofline_bytes"][str(B)]
        step_s = rb["bytes"] / bw["bytes_per_s"]
        roof[str(B)] = {"bytes_per_step": rb["bytes"], "by_family": rb["by_family"], "roofline_step_ms": 1e3 * step_s,
                        "roofline_tokens_per_s": B / step_s}
        for name, s in systems.items():
            for key, d in s.get("decode", {}).items():
                if key.endswith(f"/{B}") and "tokens_per_s" in d:
                    roof[str(B)][f"fraction_{name}_{key.split('/')[0]}"] = d["tokens_per_s"] * step_s / B
    hf_s = systems.get("transformers", {})
    ratios = {}
    if "prefill" in hf_s:
        ratios["prefill_ours_packed_over_transformers"] = (systems["ours_packed"]["prefill"]["tokens_per_s"]
                                                           / hf_s["prefill"]["tokens_per_s"])
        for B in batches:
            theirs = hf_s["decode"].get(f"eager/{B}", {}).get("tokens_per_s")
            for key, d in systems["ours_packed"]["decode"].items():
                if key.endswith(f"/{B}") and theirs and "tokens_per_s" in d:
                    name = f"decode_b{B}_ours_packed_{key.split('/')[0]}_over_transformers"
                    ratios[name] = d["tokens_per_s"] / theirs
    result.update({"systems": systems, "agreement": agree, "roofline": roof, "speedups": ratios})
    emit(result, args.out)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    holder: list = []
    return main_guard(lambda: run(args, holder), holder)


if __name__ == "__main__":
    sys.exit(main())
