"""Other ways to write the fused packed matmul, timed beside the engine's, one row of x, at the release's shapes:
what was tried to make the NVFP4 / MXFP8 decode-and-multiply cheaper, and what each costs. One JSON line.

Each variant is a function `torch.compile`d as the compiled layers compile (`model.LAYER_INDUCTOR_OPTIONS`, static
shapes), timed as `fused_matmul.py` times (a CUDA graph of 10 products, replayed), and checked
against `fast.packed.packed_matmul_reference` (relative error; the bit-exact ones agree to the bf16 output's rounding):

* `engine`: `packed_matmul(..., normal_range=True)`, what PackedWeight runs in range (`normal_range_planes`);
* `e4m3` (NVFP4): what the engine did before: the E2M1 code re-coded as the E4M3 value e2m1 * 2^-6, widened by the
  conversion instruction, times 64 s, rounded to bf16 with integer operations on the bits;
* `x_fp32`: the same with x handed over in fp32 (what a producer that stored fp32 would save: no widening of x);
* `word_int`, `word_veltkamp`, `word_e4m3` (NVFP4): the weight read as int32 words, 8 codes each, one scale per
  word, x transposed to match; magnitudes built on the fp32 bits (e2m1 * 2^-126, a subnormal for code 1) and
  rounded to bf16 on the bits, or by Veltkamp splitting (t = v * 65537; t - (t - v): exact ties-to-even for
  normal fp32 without FMA contraction), or through the E4M3 conversion as `normal_range_planes` does;
* `template_mm` (NVFP4): decode then `torch.matmul` with `max_autotune` (inductor's Triton matmul templates, which
  may fuse a pointwise prologue);
* timing only, not the weight's bits: `no_rounding` (NVFP4: the engine's planes without the bf16 rounding),
  `bf16_reduction` (the same reduction over the weight decoded to bf16 beforehand: 3.6x the bytes, no decoding)
  and `bytes_only` (NVFP4: the packed bytes times x, no decoding: the loads alone).

    # 1 x H200 (about 3 minutes, most of it compiling):
    python benchmarks/fused_variants.py --out fused_variants.jsonl
"""

from __future__ import annotations

import argparse
import sys

import torch
from common import BenchmarkError, emit, main_guard
from fused_matmul import SHAPES, operands, per_call_s

from minimax_ref.fast.compiled import LAYER_INDUCTOR_OPTIONS, materialize
from minimax_ref.fast.packed import (
    _e2m1_times_2_pow_minus_126,
    _global,
    activation_planes,
    decode_fast,
    normal_range_planes,
    packed_matmul,
    packed_matmul_reference,
)
from minimax_ref.fast.packed import _select as select_entries

SIGN = -(1 << 31)
EXACT = ("engine", "e4m3", "x_fp32", "word_int", "word_veltkamp", "word_e4m3", "template_mm")


def _e2m1_as_e4m3(bits: torch.Tensor) -> torch.Tensor:
    e4m3 = ((bits & 7) << 2) | ((bits & 8) << 4)
    return e4m3.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)


def _round_bits(v: torch.Tensor) -> torch.Tensor:
    b = v.view(torch.int32)
    return (b + 0x7FFF + ((b >> 16) & 1)) & -65536


def _round_veltkamp(v: torch.Tensor) -> torch.Tensor:
    t = v * 65537.0
    return (t - (t - v)).view(torch.int32)


def word_planes(words: torch.Tensor, weight_scale: torch.Tensor, g: torch.Tensor, how: str) -> list[torch.Tensor]:
    """NVFP4 words int32 `[*L, N, K/8]` -> 8 fp32 planes `[*L, N, K/16, 2]` (code j of each word)."""
    *lead, n, kw = words.shape
    words = words.view(*lead, n, kw // 2, 2)
    e4m3 = how == "e4m3"
    s = (weight_scale.to(torch.float32) * (_global(g, lead) * (64.0 if e4m3 else 2.0**126))).unsqueeze(-1)
    rnd = _round_veltkamp if how == "veltkamp" else _round_bits
    planes = []
    for j in range(8):
        if e4m3:
            mag = (words >> (4 * j - 2)) if j else (words << 2)
            v = (mag & 0x1C).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
        else:
            shift = 22 - 4 * j
            v = (((words << shift) if shift >= 0 else (words >> -shift)) & (7 << 22)).view(torch.float32)
        sign = ((words << (28 - 4 * j)) if j < 7 else words) & SIGN
        planes.append((rnd(v * s) ^ sign).view(torch.float32))
    return planes


def word_matmul(x, words, weight_scale, g, index, how):
    words, weight_scale, g = select_entries(words, weight_scale, g, index)  # gathered as int32: an indirect load
    planes = word_planes(words, weight_scale, g, how)
    *lead, m, k = x.shape
    xs = materialize(x.to(torch.float32).view(*lead, m, k // 16, 2, 8).movedim(-1, -3).contiguous())
    terms = xs[..., 0, None, 0, :, :] * planes[0]
    for j in range(1, 8):
        terms = terms + xs[..., 0, None, j, :, :] * planes[j]
    return terms.sum((-2, -1)).to(torch.bfloat16).unsqueeze(-2)


def nvfp4_product(x, planes):
    xs = activation_planes("nvfp4", x)
    terms = xs[0][..., 0, None, :, :] * planes[0] + xs[1][..., 0, None, :, :] * planes[1]
    return terms.sum((-2, -1)).to(torch.bfloat16).unsqueeze(-2)


def bf16_by_bits(v: torch.Tensor) -> torch.Tensor:
    return _round_bits(v).view(torch.float32)


def e4m3_planes(weight, weight_scale, g, rounding):
    """NVFP4 planes by the E4M3 re-coding (e2m1 * 2^-6 widened by the conversion, times 64 s), rounded to bf16 by
    `rounding`."""
    *lead, n, half_k = weight.shape
    s64 = (weight_scale.to(torch.float32) * (64.0 * _global(g, lead))).unsqueeze(-1)
    data = weight.view(*lead, n, half_k // 8, 8).to(torch.int32)
    return [rounding(_e2m1_as_e4m3(codes) * s64) for codes in (data, data >> 4)]


def e4m3(x, weight, weight_scale, g, index, rounding=bf16_by_bits):
    weight, weight_scale, g = select_entries(weight, weight_scale, g, index)
    return nvfp4_product(x, e4m3_planes(weight, weight_scale, g, rounding))


def no_rounding(x, weight, weight_scale, g, index):
    weight, weight_scale, g = select_entries(weight, weight_scale, g, index)
    *lead, n, half_k = weight.shape
    s = (weight_scale.to(torch.float32) * _global(g, lead) * 2.0**126).unsqueeze(-1)
    data = weight.view(*lead, n, half_k // 8, 8).to(torch.int32)
    return nvfp4_product(x, [code * s for code in _e2m1_times_2_pow_minus_126(data)])


def template_mm(x, weight, weight_scale, g, index):
    weight, weight_scale, g = select_entries(weight, weight_scale, g, index)
    planes = normal_range_planes("nvfp4", weight, weight_scale, g)
    *lead, n, blocks, _ = planes[0].shape
    w = torch.stack(planes, -1).reshape(*lead, n, blocks * 16).to(torch.bfloat16)
    return torch.matmul(x, w.transpose(-1, -2))


def bf16_reduction(x, w_bf16):
    return (x.float()[..., 0, None, :] * w_bf16.float()).sum(-1).to(torch.bfloat16).unsqueeze(-2)


def bytes_only(x_even, weight):
    return (x_even.float()[..., 0, None, :] * weight.float()).sum(-1).to(torch.bfloat16).unsqueeze(-2)


def measure(shape: tuple, iters: int, device: torch.device) -> dict:
    name, fmt, experts, n, k, gathered = shape
    w, s, g = operands(fmt, experts, n, k, device)
    index = torch.arange(gathered, device=device) * 3 % experts if gathered else None
    x = torch.randn(*((gathered,) if gathered else ()), 1, k, device=device).to(torch.bfloat16)
    parts = select_entries(w, s, g, index)
    nbytes = sum(t.numel() * t.element_size() for t in parts[:2])
    want = packed_matmul_reference(x, fmt, w, s, g, torch.bfloat16, index).float()
    options = dict(LAYER_INDUCTOR_OPTIONS)

    def compiled(fn, **extra):
        return torch.compile(fn, dynamic=False, options={**options, **extra})

    engine = compiled(packed_matmul)
    variants = {"engine": (engine, (x, fmt, w, s, g, torch.bfloat16, index, True)),
                "x_fp32": (engine, (x.float(), fmt, w, s, g, torch.bfloat16, index, True)),
                "bf16_reduction": (compiled(bf16_reduction), (x, decode_fast(fmt, *parts, torch.bfloat16)))}
    if fmt == "nvfp4":
        words = w.view(torch.int32)
        for how in ("int", "veltkamp", "e4m3"):
            variants[f"word_{how}"] = (compiled(word_matmul), (x, words, s, g, index, how))
        variants["e4m3"] = (compiled(e4m3), (x, w, s, g, index))
        variants["template_mm"] = (compiled(template_mm, max_autotune=True), (x, w, s, g, index))
        variants["no_rounding"] = (compiled(no_rounding), (x, w, s, g, index))
        variants["bytes_only"] = (compiled(bytes_only), (x[..., ::2].contiguous(), parts[0]))
    case: dict = {"name": name, "format": fmt, "N": n, "K": k, "gathered": gathered, "packed_bytes": nbytes}
    for vname, (fn, args) in variants.items():
        got = fn(*args).float()
        err = float((got - want).abs().max() / want.abs().max())
        if vname in EXACT and err > 1e-2:
            raise BenchmarkError(f"{name} {vname}: relative error {err:.3g} against decode-then-matmul")
        t = per_call_s(lambda: fn(*args), iters)  # noqa: B023 (called here, in this iteration)
        case[vname] = {"us": 1e6 * t, "packed_bytes_per_s": nbytes / t, "rel_err": err if vname in EXACT else None}
    print(f"{name:22s} " + "  ".join(f"{v} {case[v]['us']:.1f}" for v in variants), file=sys.stderr, flush=True)
    return case


def run(args: argparse.Namespace) -> None:
    if not torch.cuda.is_available():
        raise BenchmarkError("fused_variants.py measures CUDA kernels: run it on a machine with a GPU")
    unknown = sorted(set(args.shapes) - {shape[0] for shape in SHAPES})
    if unknown:
        raise BenchmarkError(f"--shapes: unknown weights {unknown}; known: {[shape[0] for shape in SHAPES]}")
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
    device = torch.device("cuda")
    out = {"benchmark": "fused_variants", "command": " ".join(sys.argv), "torch": torch.__version__,
           "device_name": torch.cuda.get_device_name(device),
           "cases": [measure(shape, args.iters, device) for shape in SHAPES if shape[0] in args.shapes]}
    emit(out, args.out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["q_proj", "dense gate_proj", "4 routed experts w1",
                                                    "4 routed experts w2"],
                   help=f"weights of fused_matmul.py's list (default: four of {[s[0] for s in SHAPES]})")
    p.add_argument("--iters", type=int, default=50, help="graph replays timed (default: 50)")
    p.add_argument("--out", default=None, help="also append the JSON line to this file")
    args = p.parse_args(argv)
    return main_guard(lambda: run(args), [])


if __name__ == "__main__":
    sys.exit(main())
