"""Single-op bundles (`golden --op`, `export_op`): one op at any shape from random operands in the release
formats, without a model (swizzled scales, grouped-MoE metadata, paged MSA decode, edge cases)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ..errors import InputError
from ..weights.checkpoint import MXFP8, NVFP4
from ..weights.quant import decode_e2m1, quantize_activation_nvfp4, unpack_fp4
from .bundle import write_bundle
from .contract import FORMAT, TOLERANCE_RULE, producer
from .operands import (
    Entry,
    block_table,
    put_activation_codes,
    put_fused,
    put_stacked,
    quantized_input,
    routing_metadata,
    to_pages,
)
from .replay import replay_linear, replay_moe

SINGLE_OPS = ("nvfp4_linear", "mxfp8_linear", "router", "moe", "msa_decode")


EDGES = {"nvfp4_linear": ("subnormal-scales", "zero-scales"), "mxfp8_linear": (), "router": ("ties",),
         "moe": ("clamp",), "msa_decode": ("forced",)}


# `--sweep`: the shapes of each op (as --shape / --context take them): single rows, odd sizes, N not a multiple of
# 128, an odd number of scale blocks per row, ragged and length-1 contexts.
SWEEPS = {
    "nvfp4_linear": ("1,64,64", "7,200,96", "33,136,272"),
    "mxfp8_linear": ("1,64,64", "7,200,96", "33,130,320"),
    "router": ("1,16,64", "7,128,96", "33,9,40"),
    "moe": ("1,4,64,32", "7,8,64,48", "33,6,32,64"),
    "msa_decode": ("1", "17,300", "2200,1,700"),
}


SWEEP_SEEDS = 3  # --sweep: seeds --seed, --seed + 1, --seed + 2


# How the random operands are drawn (the manifest's `single_op.operands`).
OPERANDS = {
    "nvfp4_linear": "x ~ N(0, 1); weight: uniform random bytes (every E2M1 code); weight_scale: E4M3 of 448 * "
                    "U(0.2, 0.6); weight_scale_2 = K^-0.5 / (rms(e2m1 codes) * rms(scales)) (outputs of unit "
                    "scale); input_scale = fp32(amax(|x|) / (6 * 448)) (ModelOpt's calibration: g = 1 / input_scale "
                    "is far from 1; with --act-quant emulate in float32, moved by at most 64 fp32 ulps where needed "
                    "so that x_hat = q * fp32(s / g) and (q * s) / g differ in some element). Edge "
                    "subnormal-scales: every block scale is an E4M3 code 1-15 (codes 1-7 are subnormal, m * 2^-9) "
                    "and every fourth row (n % 4 == 0) is all subnormal; zero-scales: 1 in 8 block scales is 0",
    "mxfp8_linear": "x ~ N(0, 1); weight: uniform random non-NaN E4M3 bytes; weight_scale: E8M0 exponent calibrated "
                    "for outputs of unit scale, jittered by -1, 0 or +1 per block",
    "router": "x ~ N(0, 1); gate_weight ~ N(0, (2 / sqrt(hidden))^2); bias ~ N(0, 0.01^2). Edge ties: experts 3j, "
              "3j + 1, 3j + 2 have equal weights and biases (exact ties in every row)",
    "moe": "x ~ N(0, 4^2) (|gate| past the SwiGLU limit for a few percent of values: the clamp matters); edge clamp: "
           "x ~ N(0, 16^2) (most gate values clamped); router as the router op; every expert's w1, w3, w2 as "
           "nvfp4_linear's weight, with input_scale = fp32(amax(|x|) / (6 * 448)); no shared expert",
    "msa_decode": "one decode query per row at q_pos = context - 1, rows of different contexts (the release's MSA "
                  "geometry and head counts); q, k, v, iq, ik ~ N(0, 1), k, v, ik zero past a row's context; pages "
                  "of page_size tokens in a seeded random order with one spare page per row, unused slots holding "
                  "filler. Edge forced: the index keys of each row's forced blocks are zero, so their block scores "
                  "(0) fall below every other block's: only the forcing selects them",
}


_RMS_E2M1 = math.sqrt(sum(v * v for v in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)) / 8)


def release_text():
    """The release's text config (widths and attention geometry of single-op bundles)."""
    from ..model.config import parse_model_config
    from ..weights.synth import build_config

    return parse_model_config(build_config("release", "nvfp4"), where="release preset").text


def parse_shape(text: str | None, names: tuple[str, ...], optional: int = 0) -> list[int]:
    """`--shape` as positive ints, `names` in order (the last `optional` may be left out)."""
    if text is None:
        raise InputError(f"--shape {','.join(names)} is needed")
    try:
        dims = [int(d) for d in text.split(",")]
    except ValueError:
        raise InputError(f"--shape {text!r}: expected comma-separated integers {','.join(names)}") from None
    if not len(names) - optional <= len(dims) <= len(names) or any(d < 1 for d in dims):
        raise InputError(f"--shape {text!r}: expected {len(names) - optional} to {len(names)} positive integers "
                         f"{','.join(names)}")
    return dims


def parse_contexts(context: str | int | None, batch: int) -> list[int]:
    """The cached tokens of each row of an msa_decode entry: a comma list (one per row), or one C with `batch` rows
    C, C - s, C - 2s, ... (s = max(1, C // (2 * batch)), at least 1): rows of different lengths."""
    if context is None:
        raise InputError("--op msa_decode needs --context C (or C0,C1,... one per row)")
    try:
        ctx = [int(c) for c in str(context).split(",")]
    except ValueError:
        raise InputError(f"--context {context!r}: expected an integer or comma-separated integers") from None
    if any(c < 1 for c in ctx):
        raise InputError(f"--context {context!r}: every context must be >= 1 cached token")
    if batch < 1:
        raise InputError(f"--batch {batch}: must be >= 1")
    if len(ctx) > 1:
        if batch not in (1, len(ctx)):
            raise InputError(f"--context {context!r} gives {len(ctx)} rows but --batch is {batch}: leave out --batch "
                             "with one context per row")
        return ctx
    step = max(1, ctx[0] // (2 * batch))
    return [max(1, ctx[0] - b * step) for b in range(batch)]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def weight_key(e: Entry, name: str) -> str:
    """The key of a single-op entry's weight in the bundle's weights file: the entry's tag (a sweep's shape and
    seed), then the tensor's name."""
    return f"{e.tag}/{name}" if e.tag else name


def put_weights(e: Entry, tensors: dict[str, torch.Tensor]) -> None:
    """Put weight tensors into a single-op entry, stored once in the bundle's weights file."""
    for name, t in tensors.items():
        e.put(name, t, "weight", shared=weight_key(e, name))


def input_scale_of(x: torch.Tensor) -> torch.Tensor:
    """ModelOpt's calibrated NVFP4 activation input scale of x: fp32(amax(|x|) / (6 * 448))."""
    return (x.float().abs().amax() / (6 * 448)).to(torch.float32).reshape(())


def _orders_differ(x: torch.Tensor, input_scale: torch.Tensor) -> bool:
    """Whether x's fake-quant in float32 differs between x_hat = q * fp32(s / g) and (q * s) / g anywhere."""
    codes, scales = quantize_activation_nvfp4(x, input_scale)
    q = decode_e2m1(unpack_fp4(codes)).reshape(*x.shape[:-1], -1, 16)
    s, g = scales.float()[..., None], torch.tensor(1.0) / input_scale
    return bool((q * (s / g) != (q * s) / g).any())


def order_revealing_input_scale(x: torch.Tensor) -> torch.Tensor:
    """`input_scale_of(x)`, or the nearest float32 value at most 64 ulps from it at which the two rounding orders of
    x_hat differ in some element of x (`_orders_differ`). Whether they differ depends on g and the few distinct block
    scales of one activation: at some calibrations no element does, and the bundle could not tell a kernel that
    rounds in the wrong order."""
    base = input_scale_of(x)
    if _orders_differ(x, base):
        return base
    up, down = base.clone(), base.clone()
    for _ in range(64):
        up, down = torch.nextafter(up, up + 1), torch.nextafter(down, down - 1)
        for candidate in (up, down):
            if _orders_differ(x, candidate):
                return candidate
    return base


def nvfp4_operands(N: int, K: int, g: torch.Generator, edge: str | None, key: str = "w1") -> dict[str, torch.Tensor]:
    """Random packed NVFP4 operands `key.*` of an [N, K] weight (`OPERANDS`; input_scale 1.0 until the caller
    calibrates it to its activation)."""
    if K % 16:
        raise InputError(f"--shape: K={K} must be a multiple of 16 for NVFP4")
    weight = torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.int32).to(torch.uint8)
    scale = ((torch.rand(N, K // 16, generator=g) * 0.4 + 0.2) * 448).to(torch.float8_e4m3fn)
    codes = scale.view(torch.uint8).clone()
    if edge == "subnormal-scales":  # subnormal scales beside the smallest normal ones, and rows of only subnormals
        codes = torch.randint(1, 16, codes.shape, generator=g, dtype=torch.int32).to(torch.uint8)
        codes[::4] = torch.randint(1, 8, codes[::4].shape, generator=g, dtype=torch.int32).to(torch.uint8)
    elif edge == "zero-scales":
        codes[torch.rand(codes.shape, generator=g) < 0.125] = 0
    rms_scale = float(codes.view(torch.float8_e4m3fn).float().square().mean().sqrt()) or 1.0
    ws2 = K**-0.5 / (_RMS_E2M1 * rms_scale)
    return {f"{key}.weight": weight, f"{key}.weight_scale": codes.view(torch.float8_e4m3fn),
            f"{key}.weight_scale_2": torch.tensor(ws2, dtype=torch.float32),
            f"{key}.input_scale": torch.tensor(1.0)}


def mxfp8_operands(N: int, K: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Random packed MXFP8 operands `w.*` of an [N, K] weight (module docstring)."""
    if K % 32:
        raise InputError(f"--shape: K={K} must be a multiple of 32 for MXFP8")
    b = torch.randint(0, 256, (N, K), generator=g, dtype=torch.int32)
    b = torch.where((b & 0x7F) == 0x7F, b - 1, b).to(torch.uint8)  # no NaN bytes
    rms = float(b.view(torch.float8_e4m3fn).float().square().mean().sqrt())
    base = 127 + round(math.log2(K**-0.5 / rms))
    e = base + torch.randint(-1, 2, (N, K // 32), generator=g, dtype=torch.int32)
    return {"w.weight": b.view(torch.float8_e4m3fn), "w.weight_scale": e.clamp(0, 254).to(torch.uint8)}


def swizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    """Block scales [R, C] (one per 16 or 32 elements of a row) in the 128x4-tile layout that CUTLASS and
    cuBLASLt block-scaled GEMMs take, flat: zero-padded to [ceil(R/128)*128, ceil(C/4)*4], tiles of 128 rows x
    4 columns in row-major tile order, and element (r, c) of a tile at offset (r % 32) * 16 + (r // 32) * 4 + c."""
    R, C = scales.shape
    rt, ct = -(-R // 128), -(-C // 4)
    raw = scales.view(torch.uint8) if scales.dtype == torch.float8_e4m3fn else scales
    padded = torch.zeros(rt * 128, ct * 4, dtype=raw.dtype)
    padded[:R, :C] = raw
    tiles = padded.view(rt, 4, 32, ct, 4).permute(0, 3, 2, 1, 4)  # [tile row, tile col, r % 32, r // 32, c]
    out = tiles.reshape(-1).contiguous()
    return out.view(torch.float8_e4m3fn) if scales.dtype == torch.float8_e4m3fn else out


def linear_entry(op: str, M: int, N: int, K: int, dtype: torch.dtype, seed: int, edge: str | None,
                 emulate: bool = False, tag: str = "") -> Entry:
    """One GEMM of random operands (`OPERANDS`); with `emulate` (act_quant="emulate") the input is fake-quantized as
    a W4A4 / W8A8 kernel sees it: its codes and block scales are inputs (`x_codes`, `x_scale`, `x_scale_swizzled`)
    and the fake-quantized input an output (`x_hat`)."""
    g = _gen(seed)
    fmt, key = (NVFP4, "w1") if op == "nvfp4_linear" else (MXFP8, "w")
    t = nvfp4_operands(N, K, g, edge) if fmt == NVFP4 else mxfp8_operands(N, K, g)
    x = torch.randn(M, K, generator=g).to(dtype)
    if fmt == NVFP4:  # a float32 W4A4 bundle also tells the rounding orders of x_hat apart
        reveal = emulate and dtype == torch.float32
        t["w1.input_scale"] = order_revealing_input_scale(x) if reveal else input_scale_of(x)
    t[f"{key}.weight_scale_swizzled"] = swizzle_scales(t[f"{key}.weight_scale"])
    e = Entry(op, 0, "op", tag=tag)
    e.put("x", x, "input")
    put_weights(e, t)
    if emulate:
        put_activation_codes(e, "x", x, fmt, t.get(f"{key}.input_scale"))
        e.put("x_scale_swizzled", swizzle_scales(e.tensors["x_scale"]), "input")
        e.put("x_hat", quantized_input(x, fmt, t, key, True), "output")
    e.put("y", replay_linear(t, key, fmt, x, dtype, emulate), "output")
    e.params.update({"format": fmt, "shape": {"M": M, "N": N, "K": K}, "linear": "random", "seed": seed,
                     "edge": edge})
    return e


def router_entry(T: int, E: int, H: int, top_k: int, dtype: torch.dtype, seed: int, edge: str | None,
                 tag: str = "") -> Entry:
    """The router on random operands (`OPERANDS`)."""
    from ..model.moe import route

    if top_k > E:
        raise InputError(f"--shape: E={E} experts is fewer than the release's top_k={top_k}")
    g = _gen(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    w = torch.randn(E, H, generator=g) * (2 / math.sqrt(H))
    bias = torch.randn(E, generator=g) * 0.01
    if edge == "ties":  # groups of three equal experts: with top_k 4 the choice splits a group
        src = torch.arange(E) // 3 * 3
        w, bias = w[src], bias[src]
    r = route(x, w, bias, top_k)
    e = Entry("router", 0, "op", tag=tag)
    e.put("x", x, "input")
    e.put("gate_weight", w, "input")
    e.put("bias", bias, "input")
    e.put("expert_ids", r.expert_ids, "output")
    e.put("weights", r.weights, "output")
    e.put("logits", r.logits, "output")
    e.params.update({"top_k": top_k, "shape": {"T": T, "E": E, "H": H}, "seed": seed, "edge": edge})
    return e


def moe_entry(T: int, E: int, H: int, I: int, dtype: torch.dtype, seed: int, edge: str | None,  # noqa: E741
              tag: str = "", stacked: bool = False, align_block: int | None = None) -> Entry:
    """Routed experts only (no shared expert), every expert NVFP4 [I, H] / [H, I], the release's top_k, scaling
    and SwiGLU-OAI constants (`OPERANDS`); the routing given too (`topk_ids`, `topk_weights`) with grouped-GEMM
    metadata (`routing_metadata`); `stacked`: the [E, ...] operands w13.*, w2.*; `align_block`: the routing padded
    to blocks."""
    from ..model.moe import route

    text = release_text()
    top_k = text.num_experts_per_tok
    if top_k > E:
        raise InputError(f"--shape: E={E} experts is fewer than the release's top_k={top_k}")
    for name, size in (("H", H), ("I", I)):  # both are the K of an NVFP4 product (w13: H, w2: I)
        if size % 16:
            raise InputError(f"--shape: {name}={size} must be a multiple of 16 for NVFP4 (T,E,H,I)")
    g = _gen(seed)
    x = (torch.randn(T, H, generator=g) * (16.0 if edge == "clamp" else 4.0)).to(dtype)
    w = torch.randn(E, H, generator=g) * (2 / math.sqrt(H))
    bias = torch.randn(E, generator=g) * 0.01
    e = Entry("moe", 0, "op", tag=tag)
    e.put("x", x, "input")
    e.put("gate_weight", w, "input")
    e.put("bias", bias, "input")
    formats = {}
    for x_id in range(E):
        for leaf, (n, k) in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
            ops = nvfp4_operands(n, k, g, None, f"experts.{x_id}.{leaf}")
            ops[f"experts.{x_id}.{leaf}.input_scale"] = input_scale_of(x)
            put_weights(e, ops)
            formats[f"experts.{x_id}.{leaf}"] = NVFP4
        put_fused(e, f"experts.{x_id}.w1", f"experts.{x_id}.w3", f"experts.{x_id}.w13", NVFP4)
    if stacked:
        put_stacked(e, range(E))
    e.params.update({"top_k": top_k, "scaling": text.routed_scaling_factor, "alpha": text.swiglu_alpha,
                     "limit": text.swiglu_limit, "num_experts": E, "used_experts": list(range(E)),
                     "formats": formats, "shared_expert": False, "shape": {"T": T, "E": E, "H": H, "I": I},
                     "seed": seed, "edge": edge})
    r = route(x, w, bias, top_k)
    for name, t in routing_metadata(r.expert_ids, r.weights, E, range(E), align_block).items():
        e.put(name, t, "input")
    if align_block is not None:
        e.params["align_block"] = align_block
    e.put("y", replay_moe(e.tensors, e.params, dtype, False), "output")
    return e


def msa_entries(contexts: list[int], dtype: torch.dtype, seed: int, page: int | None, edge: str | None,
                tag: str = "") -> list[Entry]:
    """The indexer and MSA of one decode query per row over rows of `contexts` cached tokens (`OPERANDS`), with
    paged views."""
    from ..model.msa import gather_block_attention, index_scores, select_blocks

    text = release_text()
    sp = text.sparse
    Hq, Hkv, D = text.num_attention_heads, text.num_key_value_heads, text.head_dim
    B, L = len(contexts), max(contexts)
    g = _gen(seed)
    q = torch.randn(B, 1, Hq, D, generator=g).to(dtype)
    k = torch.randn(B, L, Hkv, D, generator=g)
    v = torch.randn(B, L, Hkv, D, generator=g)
    iq = torch.randn(B, 1, sp.index_heads, sp.index_head_dim, generator=g).to(dtype)
    ik = torch.randn(B, L, sp.index_head_dim, generator=g)
    q_pos = torch.tensor(contexts, dtype=torch.long)[:, None] - 1
    for b, n in enumerate(contexts):  # nothing cached past a row's context
        k[b, n:], v[b, n:], ik[b, n:] = 0, 0, 0
        if edge == "forced":  # the forced blocks score lowest: only the forcing selects them
            qb = (n - 1) // sp.block_size
            for j in range(qb + 1):
                if qb - sp.local_blocks < j <= qb or j < sp.init_blocks:
                    ik[b, j * sp.block_size: (j + 1) * sp.block_size] = 0
    k, v, ik = k.to(dtype), v.to(dtype), ik.to(dtype)
    scores = index_scores(iq, ik, q_pos)
    blocks = select_blocks(scores, q_pos, sp.block_size, sp.topk_blocks, sp.local_blocks, sp.init_blocks)
    scale = D**-0.5
    o = gather_block_attention(q, k, v, blocks, q_pos, sp.block_size, scale)
    geometry = {"block_size": sp.block_size, "topk_blocks": sp.topk_blocks, "local_blocks": sp.local_blocks,
                "init_blocks": sp.init_blocks}
    page = page or sp.block_size
    table = block_table(contexts, page, seed)
    ind, msa = Entry("indexer", 0, "op", tag=tag), Entry("msa", 0, "op", tag=tag)
    for name, t in (("iq", iq), ("ik", ik), ("q_pos", q_pos)):
        ind.put(name, t, "input")
    ind.put("scores", scores, "output")
    ind.put("blocks", blocks, "output")
    for name, t in (("q", q), ("k", k), ("v", v), ("iq", iq), ("ik", ik), ("q_pos", q_pos)):
        msa.put(name, t, "input")
    msa.put("o", o, "output")
    msa.put("blocks", blocks, "output")
    for e in (ind, msa):
        e.put("block_table", table, "paged")
        e.put("seq_lens", torch.tensor(contexts, dtype=torch.int32), "paged")
        e.put("cu_seqlens_q", torch.arange(B + 1, dtype=torch.int32), "paged")
        e.put("index_k_pages", to_pages(ik, table, contexts, page, seed + 2), "paged")
        e.params.update({**geometry, "page_size": page, "context": contexts, "batch": B, "seed": seed,
                         "edge": edge})
    msa.put("k_pages", to_pages(k, table, contexts, page, seed), "paged")
    msa.put("v_pages", to_pages(v, table, contexts, page, seed + 1), "paged")
    msa.params["scale"] = scale
    return [ind, msa]


def op_entries(op: str, shape: str | None, context: str | int | None, batch: int, dtype: torch.dtype, seed: int,
               edge: str | None, page_size: int | None, emulate: bool, stacked: bool, align_block: int | None,
               tag: str = "") -> list[Entry]:
    """The entries of one single-op request (one shape, one seed)."""
    text = release_text()
    if op in ("nvfp4_linear", "mxfp8_linear"):
        M, N, K = parse_shape(shape, ("M", "N", "K"))
        return [linear_entry(op, M, N, K, dtype, seed, edge, emulate, tag)]
    if op == "router":
        dims = parse_shape(shape, ("T", "E", "H"), optional=1)
        T, E, H = (*dims, text.hidden_size) if len(dims) == 2 else dims
        return [router_entry(T, E, H, text.num_experts_per_tok, dtype, seed, edge, tag)]
    if op == "moe":
        dims = parse_shape(shape, ("T", "E", "H", "I"), optional=2)
        T, E = dims[:2]
        H = dims[2] if len(dims) > 2 else text.hidden_size
        inter = dims[3] if len(dims) > 3 else text.intermediate_size
        return [moe_entry(T, E, H, inter, dtype, seed, edge, tag, stacked, align_block)]
    return msa_entries(parse_contexts(context, batch), dtype, seed, page_size, edge, tag)


def export_op(op: str, out: str | Path, *, shape: str | None = None, context: str | int | None = None,
              batch: int = 1, dtype: torch.dtype = torch.float32, seed: int = 0, edge: str | None = None,
              page_size: int | None = None, fp64: bool = False, act_quant: str = "none", sweep: bool = False,
              stacked: bool = False, align_block: int | None = None) -> dict:
    """Write the single-op bundle of `op` (module docstring) to the new folder `out`; returns the manifest.
    act_quant "emulate" (the linear ops): the GEMM input fake-quantized, its codes and scales stored. sweep: one
    entry per shape of `SWEEPS[op]` and per seed (seed .. seed + SWEEP_SEEDS - 1), tagged `{shape}-s{seed}`.
    stacked / align_block (moe): the stacked expert operands / the routing padded to blocks."""
    if op not in SINGLE_OPS:
        raise InputError(f"--op {op!r}: choose one of {', '.join(SINGLE_OPS)}")
    if act_quant not in ("none", "emulate"):
        raise InputError(f"--act-quant {act_quant!r}: choose none or emulate")
    if act_quant == "emulate" and op not in ("nvfp4_linear", "mxfp8_linear"):
        raise InputError(f"--act-quant emulate applies to --op nvfp4_linear and mxfp8_linear, not {op}")
    if edge is not None and edge not in EDGES[op]:
        raise InputError(f"--edge {edge!r} does not apply to --op {op} (its edges: {', '.join(EDGES[op]) or 'none'})")
    if (stacked or align_block is not None) and op != "moe":
        raise InputError(f"--stacked and --align-block apply to --op moe, not {op}")
    if align_block is not None and align_block < 1:
        raise InputError(f"--align-block {align_block}: must be >= 1 (vLLM uses 16, 32, 64 or 128)")
    if sweep and (shape is not None or context is not None):
        raise InputError("--sweep takes the op's own shapes: leave out --shape / --context")
    if dtype not in (torch.float32, torch.bfloat16):
        raise InputError(f"--dtype {dtype}: single-op bundles are float32 or bfloat16")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InputError(f"--out {out}: exists and is not an empty folder")
    emulate = act_quant == "emulate"
    if sweep:
        entries = []
        for dims in SWEEPS[op]:
            for s in range(seed, seed + SWEEP_SEEDS):
                tag = f"{dims.replace(',', 'x')}-s{s}"
                shp, ctx = (None, dims) if op == "msa_decode" else (dims, None)
                entries += op_entries(op, shp, ctx, 1, dtype, s, edge, page_size, emulate, stacked, align_block,
                                      tag)
    else:
        entries = op_entries(op, shape, context, batch, dtype, seed, edge, page_size, emulate, stacked,
                             align_block)
    dt = str(dtype).replace("torch.", "")
    manifest = {
        "format": FORMAT,
        "checkpoint": None,
        "single_op": {"op": op, "shape": shape, "context": context, "batch": batch, "edge": edge, "seed": seed,
                      "sweep": list(SWEEPS[op]) if sweep else None, "stacked": stacked, "align_block": align_block,
                      "operands": OPERANDS[op]},
        "producer": producer(),
        "numerics": {"dtype": dt, "act_quant": act_quant, "kv_cache_dtype": "auto", "kv_scale": 1.0},
        "seeds": {"operands": seed, "page_permutation": seed,
                  **({"sweep": f"seeds {seed}..{seed + SWEEP_SEEDS - 1}, each entry's params.seed"} if sweep else {})},
        "ops": [],
        "contracts": {},
        "tolerance_rule": TOLERANCE_RULE,
        "entries": [],
    }
    write_bundle(out, manifest, entries, fp64=fp64, emulate=emulate)
    return manifest
