"""How much of a compiled decode kernel's time is its launch configuration: the Triton kernels that inductor generates
for the fused packed matmuls and the compiled layers, each relaunched in place with the block sizes and warps that its
compile gave it (`--reduction-config`: the engine's fixed configuration for the large reductions,
`fast.launch.DECODE_REDUCTIONS`, or `tuned`: coordinate-descent tuning for every kernel) and with each of a fixed list,
timed alike. One JSON line.

* `--what weights`: one packed weight at a time (`fused_matmul.py`'s shapes, one row of x), written a few ways and
  compiled as the compiled layers compile (`model.LAYER_INDUCTOR_OPTIONS`, static shapes): `engine`
  (`packed_matmul(..., normal_range=True)`: `normal_range_planes`), `x_fp32` (the same with x handed over in fp32),
  and for NVFP4 `e4m3_int` / `e4m3_cvt` (the E2M1 code re-coded as the E4M3 value e2m1 * 2^-6, widened by the
  conversion instruction, times 64 s, rounded to bf16 with integer operations on the bits, as the engine did
  before, or by the conversion instruction), and for both `words` (`packed_matmul(..., words=True)`: the packed bytes
  read as int32 words, eight NVFP4 or four MXFP8 elements a load, `fast.packed.nvfp4_word_planes`,
  `fast.packed.mxfp8_word_planes`). Every variant's output is checked against
  `fast.packed.packed_matmul_reference` and every NVFP4 variant's planes against `decoded_planes`, bit for bit.
* `--what layers`: a release-width model of 4 layers (3 dense, 1 MSA+MoE; 16 routed experts, NVFP4 + MXFP8 packed,
  fp8 KV cache, an 8,192-token prompt) with `fast="compiled"` (NVFP4 and MXFP8's gate + up read as int32 words;
  `--nvfp4-words` / `--mxfp8-words` change that): the looped Triton reductions of one decode step with at least
  1,024 outputs and 384 reduced indices each (NVFP4's down projection read as words: 384 words, 1,536 bytes a row)
  (the matmuls, attention over the selected keys).

A kernel is relaunched through its Triton function with the grid inductor would use (`XBLOCK` outputs per program),
`enable_fp_fusion` off and fp32 subnormals kept (as inductor compiles it here), and timed as `fused_matmul.py` times
(a CUDA graph of 10 launches, replayed), each launch after a write of `--l2-flush-mib` MiB that evicts its operands
from L2 (that write's own time subtracted); `compiled` is the same relaunch with the compiled configuration.
Relaunching a layer's kernels recomputes their outputs from the step's inputs; those that write in place (the cache)
write what they wrote.

    # 1 x H200 (about 3 minutes each, most of it compiling):
    python benchmarks/launch_configs.py --what weights --out launch_configs.jsonl
    python benchmarks/launch_configs.py --what layers --out launch_configs.jsonl
    python benchmarks/launch_configs.py --what layers --reduction-config tuned --out launch_configs.jsonl
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
import time
from dataclasses import replace

import torch
from common import (
    REDUCTION_CONFIG_HELP,
    WORDS_CHOICES,
    BenchmarkError,
    emit,
    main_guard,
    prefill,
    reduction_config,
    words_settings,
)
from fused_matmul import SHAPES, operands, per_call_s
from fused_variants import bf16_by_bits, e4m3, e4m3_planes

from minimax_ref.fast import FastPaths
from minimax_ref.fast.compiled import LAYER_INDUCTOR_OPTIONS
from minimax_ref.fast.launch import compiled_with_fixed_reductions, tuned_for
from minimax_ref.fast.packed import _bytes_as_int32 as bytes_as_int32
from minimax_ref.fast.packed import _select as select_entries
from minimax_ref.fast.packed import (
    _to_bf16_by_conversion,
    decoded_planes,
    mxfp8_word_planes,
    normal_range_planes,
    nvfp4_word_planes,
    packed_matmul,
    packed_matmul_reference,
)
from minimax_ref.weights.loader import load_synthetic

# (XBLOCK, R0_BLOCK, num_warps): outputs per program, reduced elements per loop step, warps
WEIGHT_CONFIGS = [c for c in itertools.product([1, 2], [256, 512, 1024, 2048, 4096], [4, 8, 16])
                  if 1 <= c[0] * c[1] // (32 * c[2]) <= 16]
# the last six hold several outputs per program: the attention value sums read a cached key's row of values
# (contiguous over the outputs) once for all of them
LAYER_CONFIGS = [(1, 128, 4), (1, 128, 8), (1, 256, 2), (1, 256, 4), (1, 256, 8), (1, 256, 16), (1, 512, 4),
                 (1, 512, 8), (1, 512, 16), (1, 1024, 4), (1, 1024, 8), (2, 256, 8), (2, 512, 4), (2, 512, 8),
                 (4, 512, 16), (4, 1024, 2), (8, 512, 1), (1, 2048, 8),
                 (8, 256, 4), (16, 128, 4), (32, 64, 4), (64, 32, 4), (128, 16, 8), (32, 128, 8),
                 # shorter steps for NVFP4 read as int32 words (8 elements a reduced index)
                 (1, 64, 2), (1, 64, 4), (2, 128, 4), (4, 128, 4)]
WEIGHT_VARIANTS = {"q_proj": ["engine", "x_fp32", "words"], "o_proj": ["engine", "words"],
                   "dense gate_proj": ["engine", "x_fp32", "words"],
                   "4 routed experts w1": ["engine", "x_fp32", "e4m3_int", "e4m3_cvt", "words"],
                   "4 routed experts w2": ["engine", "x_fp32", "words"]}


class Launches:
    """The Triton kernels inductor's compiled code launches (its `CachingAutotuner.run`), with their arguments, while
    `recording`; the wrapper is installed for this process only."""

    def __init__(self):
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner

        self.calls: list = []
        self.recording = False
        run = CachingAutotuner.run

        def recorded(kernel, *args, stream, **kwargs):
            if self.recording:
                self.calls.append((kernel, args))
            return run(kernel, *args, stream=stream, **kwargs)

        CachingAutotuner.run = recorded

    def of(self, fn) -> list:
        self.calls, self.recording = [], True
        try:
            fn()
            torch.cuda.synchronize()
        finally:
            self.recording = False
        return self.calls


def _is_looped_reduction(kernel, args: tuple) -> bool:
    """An inductor reduction with a loop over R0_BLOCK elements, launched with its xnumel and r0numel last."""
    return (bool(kernel.launchers) and "R0_BLOCK" in kernel.launchers[0].config.kwargs
            and all(isinstance(a, int) for a in args[-2:]))


class Timer:
    """Microseconds per call of a function, timed as `fused_matmul.per_call_s` times it, after a write of
    `flush_mib` MiB (larger than the GPU's L2 cache: 50 MiB on an H200) before each call, whose own time, measured
    alone the same way, is subtracted: the call then reads its operands from HBM, as in a decode step, which reads
    each layer's weights once. `flush_mib` 0: calls back to back, which leaves part of a
    kernel's operands in L2 and ranked configurations with short loop steps faster than they were in a step."""

    def __init__(self, flush_mib: int, device: torch.device, iters: int):
        self.iters = iters
        self.flush = torch.empty(flush_mib << 20, dtype=torch.uint8, device=device) if flush_mib else None
        self.flush_us = 1e6 * per_call_s(self.flush.zero_, iters) if flush_mib else 0.0

    def us(self, fn) -> float:
        if self.flush is None:
            return 1e6 * per_call_s(fn, self.iters)

        def flushed():
            self.flush.zero_()
            fn()

        return 1e6 * per_call_s(flushed, self.iters) - self.flush_us


def relaunch_us(kernel, args: tuple, xblock: int, r0_block: int, num_warps: int, num_stages: int,
                timer: Timer) -> float:
    """Microseconds per launch of inductor reduction `kernel` (args: its pointers, then xnumel and r0numel)."""
    if kernel.fn.fn is None:  # compiled in a worker process, which drops the Python function: load it as inductor does
        kernel.fn = kernel._reload_kernel().fn
    grid = ((args[-2] + xblock - 1) // xblock, 1, 1)
    return timer.us(lambda: kernel.fn[grid](*args, XBLOCK=xblock, R0_BLOCK=r0_block, num_warps=num_warps,
                                            num_stages=num_stages, enable_fp_fusion=False, enable_reflect_ftz=False))


def sweep(kernel, args: tuple, configs: list, timer: Timer) -> dict:
    """The compiled configuration's time and the fastest of `configs` (a configuration Triton refuses is
    skipped)."""
    compiled = kernel.launchers[0].config
    xblock, r0_block = compiled.kwargs.get("XBLOCK", 1), compiled.kwargs["R0_BLOCK"]
    out = {"kernel": kernel.fn.__name__[:160], "xnumel": args[-2], "r0numel": args[-1],
           "compiled": {"config": [xblock, r0_block, compiled.num_warps, compiled.num_stages],
                        "us": relaunch_us(kernel, args, xblock, r0_block, compiled.num_warps, compiled.num_stages,
                                          timer)}}
    timed = []
    for xb, rb, nw in configs:
        try:
            timed.append({"config": [xb, rb, nw, 1], "us": relaunch_us(kernel, args, xb, rb, nw, 1, timer)})
        except Exception as e:  # noqa: BLE001 (a configuration this kernel cannot take: too many registers, ...)
            print(f"  {out['kernel'][:60]} {[xb, rb, nw]}: {str(e).splitlines()[0][:120]}", file=sys.stderr)
    out["fastest"] = sorted(timed, key=lambda t: t["us"])[:4]
    return out


def engine_matmul(x, fmt, weight, weight_scale, g, index):
    return packed_matmul(x, fmt, weight, weight_scale, g, torch.bfloat16, index, True)


def words_matmul(x, fmt, weight, weight_scale, g, index):
    return packed_matmul(x, fmt, weight, weight_scale, g, torch.bfloat16, index, True, words=True)


def weights(args: argparse.Namespace, device: torch.device) -> list:
    launches = Launches()
    rows = []
    for name, fmt, experts, n, k, gathered in SHAPES:
        if name not in WEIGHT_VARIANTS:
            continue
        w, s, g = operands(fmt, experts, n, k, device)
        index = torch.arange(gathered, device=device) * 3 % experts if gathered else None
        x = torch.randn(*((gathered,) if gathered else ()), 1, k, device=device).to(torch.bfloat16)
        want = packed_matmul_reference(x, fmt, w, s, g, torch.bfloat16, index).float()
        parts = select_entries(w, s, g, index)
        reference_planes = decoded_planes(fmt, *parts, torch.bfloat16)
        for variant in WEIGHT_VARIANTS[name]:
            if args.variants and variant not in args.variants:
                continue
            options = dict(LAYER_INDUCTOR_OPTIONS)
            expected = reference_planes
            if variant.startswith("e4m3"):
                rounding = bf16_by_bits if variant == "e4m3_int" else _to_bf16_by_conversion
                planes = e4m3_planes(*parts, rounding)
                fn = compiled_with_fixed_reductions(e4m3, args.reductions, dynamic=False, fullgraph=True,
                                                    options=options)
                call = functools.partial(fn, x, w, s, g, index, rounding)
            elif variant == "words":  # the same elements, in word order: compared as whole rows
                expected = [torch.stack(reference_planes, -1).flatten(-3)]
                words = bytes_as_int32(parts[0])
                planes = (nvfp4_word_planes(words, *parts[1:]) if fmt == "nvfp4"
                          else mxfp8_word_planes(words, parts[1]))
                planes = [torch.stack(planes, -1).flatten(-3)]
                fn = compiled_with_fixed_reductions(words_matmul, args.reductions, dynamic=False, fullgraph=True,
                                                    options=options)
                call = functools.partial(fn, x, fmt, w, s, g, index)
            else:
                planes = normal_range_planes(fmt, *parts)
                fn = compiled_with_fixed_reductions(engine_matmul, args.reductions, dynamic=False, fullgraph=True,
                                                    options=options)
                call = functools.partial(fn, x.float() if variant == "x_fp32" else x, fmt, w, s, g, index)
            if not all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(planes, expected)):
                raise BenchmarkError(f"{name} {variant}: the decoded weight's bits differ from decoded_planes")
            t0 = time.perf_counter()
            err = float((call().float() - want).abs().max() / want.abs().max())
            compile_s = time.perf_counter() - t0
            if err > 1e-2:
                raise BenchmarkError(f"{name} {variant}: relative error {err:.3g} against decode-then-matmul")
            reductions = [(k, a) for k, a in launches.of(call) if _is_looped_reduction(k, a)]
            if not reductions:
                raise BenchmarkError(f"{name} {variant}: the compiled product launched no looped reduction kernel")
            kernel, kargs = max(reductions, key=lambda c: c[1][-2] * c[1][-1])
            row = {"weight": name, "format": fmt, "variant": variant, "compile_s": compile_s, "rel_err": err,
                   "compiled_us": args.timer.us(call), **sweep(kernel, kargs, WEIGHT_CONFIGS, args.timer)}
            print(f"{name:20s} {variant:9s} compiled {row['compiled']['us']:6.1f} us {row['compiled']['config']}  "
                  f"fastest "
                  f"{row['fastest'][0]['us']:6.1f} us {row['fastest'][0]['config']}", file=sys.stderr, flush=True)
            rows.append(row)
    return rows


def layers(args: argparse.Namespace, device: torch.device) -> list:
    launches = Launches()
    prompt = 8192
    fast = replace(FastPaths.of("compiled"), layer_reductions=args.reductions)
    fast = replace(fast, nvfp4_words=words_settings(args.nvfp4_words, fast.nvfp4_words)[0],
                   mxfp8_words=words_settings(args.mxfp8_words, fast.mxfp8_words)[0])
    model = load_synthetic("release", format="nvfp4", layers=4, experts=16, device=device, weights="packed",
                           dtype=torch.bfloat16, fast=fast, max_seq_len=prompt + 8, kv_cache_dtype="fp8")
    ids = torch.randint(0, 100_000, (1, prompt), generator=torch.Generator(device=device).manual_seed(3),
                        device=device)
    with torch.no_grad():
        cache = model.new_cache(1, prompt + 8, "fp8")
        tok = prefill(model, cache, ids, 4096).argmax(-1, keepdim=True)
        pos = torch.full((1, 1), prompt, dtype=torch.long, device=device)
        t0 = time.perf_counter()
        for _ in range(2):  # compiles and tunes
            model(tok, positions=pos, cache=cache)
        torch.cuda.synchronize()
        print(f"compiled in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        calls = launches.of(lambda: model(tok, positions=pos, cache=cache))
        rows, seen = [], set()
        for kernel, kargs in calls:
            name = kernel.fn.__name__
            if name in seen or not _is_looped_reduction(kernel, kargs):
                continue
            seen.add(name)
            if kargs[-2] < 1024 or kargs[-1] < 384:  # 384: NVFP4's down projection read as words (3,072 elements)
                continue
            row = sweep(kernel, kargs, LAYER_CONFIGS, args.timer)
            print(f"{row['kernel'][:70]:70s} compiled {row['compiled']['us']:6.1f} us {row['compiled']['config']}  "
                  f"fastest "
                  f"{row['fastest'][0]['us']:6.1f} us {row['fastest'][0]['config']}", file=sys.stderr, flush=True)
            rows.append(row)
    return rows


def run(args: argparse.Namespace) -> None:
    if not torch.cuda.is_available():
        raise BenchmarkError("launch_configs.py relaunches CUDA kernels: run it on a machine with a GPU")
    device = torch.device("cuda")
    args.reductions = reduction_config(args.reduction_config)
    if args.reductions == "auto":  # the engine's table entry for this GPU and torch (None: tuned)
        args.reductions = tuned_for(device)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    if args.l2_flush_mib < 0:
        raise BenchmarkError(f"--l2-flush-mib {args.l2_flush_mib}: give 0 (no flush) or a size in MiB")
    args.timer = Timer(args.l2_flush_mib, device, args.iters)
    out = {"benchmark": "launch_configs", "what": args.what, "command": " ".join(sys.argv), "torch": torch.__version__,
           "device_name": torch.cuda.get_device_name(device),
           "reduction_config": None if args.reductions is None else args.reductions.text(),
           "nvfp4_words": args.nvfp4_words, "mxfp8_words": args.mxfp8_words, "l2_flush_mib": args.l2_flush_mib,
           "l2_flush_us": args.timer.flush_us,
           "kernels": weights(args, device) if args.what == "weights" else layers(args, device)}
    emit(out, args.out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--what", default="weights", choices=["weights", "layers"],
                   help="one packed weight at a time, or a 4-layer model's decode step (default: weights)")
    p.add_argument("--iters", type=int, default=10, help="graph replays timed per configuration (default: 10)")
    p.add_argument("--l2-flush-mib", type=int, default=256,
                   help="MiB written before each timed launch, so that it reads from HBM as a decode step does; its "
                   "own time is subtracted (0: launches back to back, partly from L2) (default: 256)")
    p.add_argument("--reduction-config", default=None, metavar="X,R,W[/X,R,W][/KIND=X,R,W...]|tuned",
                   help=REDUCTION_CONFIG_HELP)
    p.add_argument("--variants", default="", help="--what weights: only these variants, comma-separated (default: all "
                   f"of {sorted({v for vs in WEIGHT_VARIANTS.values() for v in vs})})")
    p.add_argument("--nvfp4-words", default="default", choices=WORDS_CHOICES[:3],
                   help="--what layers: FastPaths.nvfp4_words, the NVFP4 products read the packed bytes as int32 words "
                   "(default: as fast='compiled' sets it, on)")
    p.add_argument("--mxfp8-words", default="default", choices=[*WORDS_CHOICES[:3], "gate_up"],
                   help="--what layers: FastPaths.mxfp8_words, the same for MXFP8; gate_up: only the gate and up "
                   "projections (default: as fast='compiled' sets it)")
    p.add_argument("--out", default=None, help="also append the JSON line to this file")
    args = p.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    return main_guard(lambda: run(args), [])


if __name__ == "__main__":
    sys.exit(main())
