"""Single-op bundles (`golden --op`, `export_op`): one op at any shape from random operands in the release
formats, without a model (swizzled scales, grouped-MoE metadata, paged MSA decode, edge cases)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ..errors import InputError
from ..weights.checkpoint import MXFP8, NVFP4
from .bundle import write_bundle
from .contract import FORMAT, TOLERANCE_RULE, contract, producer
from .operands import Entry, block_table, put_activation_codes, put_fused, to_pages
from .replay import replay_linear, replay_moe

SINGLE_OPS = ("nvfp4_linear", "mxfp8_linear", "router", "moe", "msa_decode")


EDGES = {"nvfp4_linear": ("subnormal-scales", "zero-scales"), "mxfp8_linear": (), "router": ("ties",),
         "moe": ("clamp",), "msa_decode": ()}


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


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def nvfp4_operands(N: int, K: int, g: torch.Generator, edge: str | None) -> dict[str, torch.Tensor]:
    """Random packed NVFP4 operands `w1.*` of an [N, K] weight (module docstring)."""
    if K % 16:
        raise InputError(f"--shape: K={K} must be a multiple of 16 for NVFP4")
    weight = torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.int32).to(torch.uint8)
    scale = ((torch.rand(N, K // 16, generator=g) * 0.4 + 0.2) * 448).to(torch.float8_e4m3fn)
    codes = scale.view(torch.uint8).clone()
    if edge == "subnormal-scales":
        pick = torch.rand(codes.shape, generator=g) < 0.25
        codes[pick] = torch.randint(1, 8, (int(pick.sum()),), generator=g, dtype=torch.int32).to(torch.uint8)
    elif edge == "zero-scales":
        codes[torch.rand(codes.shape, generator=g) < 0.125] = 0
    rms_scale = float(codes.view(torch.float8_e4m3fn).float().square().mean().sqrt()) or 1.0
    ws2 = K**-0.5 / (_RMS_E2M1 * rms_scale)
    return {"w1.weight": weight, "w1.weight_scale": codes.view(torch.float8_e4m3fn),
            "w1.weight_scale_2": torch.tensor(ws2, dtype=torch.float32), "w1.input_scale": torch.tensor(1.0)}


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
                 emulate: bool = False) -> Entry:
    """One GEMM of random operands; with `emulate` (act_quant="emulate") the input is fake-quantized as a W4A4 /
    W8A8 kernel sees it, and its codes and block scales are inputs too (`x_codes`, `x_scale`)."""
    g = _gen(seed)
    fmt, key = (NVFP4, "w1") if op == "nvfp4_linear" else (MXFP8, "w")
    t = nvfp4_operands(N, K, g, edge) if fmt == NVFP4 else mxfp8_operands(N, K, g)
    x = torch.randn(M, K, generator=g).to(dtype)
    e = Entry(op, 0, "op")
    e.put("x", x, "input")
    for name, v in t.items():
        e.put(name, v, "weight")
    e.put(f"{key}.weight_scale_swizzled", swizzle_scales(t[f"{key}.weight_scale"]), "weight")
    if emulate:
        put_activation_codes(e, "x", x, fmt, t.get(f"{key}.input_scale"))
    e.put("y", replay_linear({**t}, key, fmt, x, dtype, emulate), "output")
    e.params.update({"format": fmt, "shape": {"M": M, "N": N, "K": K}, "linear": "random"})
    return e


def router_entry(T: int, E: int, H: int, top_k: int, dtype: torch.dtype, seed: int, edge: str | None) -> Entry:
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
    e = Entry("router", 0, "op")
    e.put("x", x, "input")
    e.put("gate_weight", w, "input")
    e.put("bias", bias, "input")
    e.put("expert_ids", r.expert_ids, "output")
    e.put("weights", r.weights, "output")
    e.put("logits", r.logits, "output")
    e.params.update({"top_k": top_k, "shape": {"T": T, "E": E, "H": H}})
    return e


def moe_entry(T: int, E: int, H: int, I: int, dtype: torch.dtype, seed: int, edge: str | None) -> Entry:  # noqa: E741
    """Routed experts only (no shared expert), every expert NVFP4 [I, H] / [H, I], the release's top_k, scaling
    and SwiGLU-OAI constants; with grouped-GEMM metadata: `sorted_token_ids` (the T * top_k (token, slot) pairs'
    tokens, grouped by expert ascending, stable) and `expert_offsets` int32 [E + 1] into it."""
    text = release_text()
    top_k = text.num_experts_per_tok
    if top_k > E:
        raise InputError(f"--shape: E={E} experts is fewer than the release's top_k={top_k}")
    g = _gen(seed)
    x = torch.randn(T, H, generator=g) * (16.0 if edge == "clamp" else 1.0)  # clamp: |gate| well past the limit
    x = x.to(dtype)
    w = torch.randn(E, H, generator=g) * (2 / math.sqrt(H))
    bias = torch.randn(E, generator=g) * 0.01
    e = Entry("moe", 0, "op")
    e.put("x", x, "input")
    e.put("gate_weight", w, "input")
    e.put("bias", bias, "input")
    formats = {}
    for x_id in range(E):
        for leaf, (n, k) in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
            for name, v in nvfp4_operands(n, k, g, None).items():
                e.put(f"experts.{x_id}.{leaf}.{name.split('.', 1)[1]}", v, "weight")
            formats[f"experts.{x_id}.{leaf}"] = NVFP4
        put_fused(e, f"experts.{x_id}.w1", f"experts.{x_id}.w3", f"experts.{x_id}.w13", NVFP4, None)
    e.params.update({"top_k": top_k, "scaling": text.routed_scaling_factor, "alpha": text.swiglu_alpha,
                     "limit": text.swiglu_limit, "num_experts": E, "used_experts": list(range(E)),
                     "formats": formats, "shared_expert": False, "shape": {"T": T, "E": E, "H": H, "I": I}})
    from ..model.moe import route

    r = route(x, w, bias, top_k)
    flat = r.expert_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    e.put("sorted_token_ids", (order // top_k).to(torch.int32), "input")
    counts = torch.bincount(flat, minlength=E)
    e.put("expert_offsets", torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(torch.int32), "input")
    e.put("y", replay_moe(e.tensors, e.params, dtype, False), "output")
    return e


def msa_entries(C: int, B: int, dtype: torch.dtype, seed: int, page: int | None) -> list[Entry]:
    from ..model.msa import gather_block_attention, index_scores, select_blocks

    text = release_text()
    sp = text.sparse
    Hq, Hkv, D = text.num_attention_heads, text.num_key_value_heads, text.head_dim
    g = _gen(seed)
    q = torch.randn(B, 1, Hq, D, generator=g).to(dtype)
    k = torch.randn(B, C, Hkv, D, generator=g).to(dtype)
    v = torch.randn(B, C, Hkv, D, generator=g).to(dtype)
    iq = torch.randn(B, 1, sp.index_heads, sp.index_head_dim, generator=g).to(dtype)
    ik = torch.randn(B, C, sp.index_head_dim, generator=g).to(dtype)
    q_pos = torch.full((B, 1), C - 1, dtype=torch.long)
    scores = index_scores(iq, ik, q_pos)
    blocks = select_blocks(scores, q_pos, sp.block_size, sp.topk_blocks, sp.local_blocks, sp.init_blocks)
    scale = D**-0.5
    o = gather_block_attention(q, k, v, blocks, q_pos, sp.block_size, scale)
    geometry = {"block_size": sp.block_size, "topk_blocks": sp.topk_blocks, "local_blocks": sp.local_blocks,
                "init_blocks": sp.init_blocks}
    page = page or sp.block_size
    seq = [C] * B
    table = block_table(seq, page, seed)
    ind, msa = Entry("indexer", 0, "op"), Entry("msa", 0, "op")
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
        e.put("seq_lens", torch.tensor(seq, dtype=torch.int32), "paged")
        e.put("index_k_pages", to_pages(ik, table, seq, page), "paged")
        e.params.update({**geometry, "page_size": page, "context": C, "batch": B})
    msa.put("k_pages", to_pages(k, table, seq, page), "paged")
    msa.put("v_pages", to_pages(v, table, seq, page), "paged")
    msa.params["scale"] = scale
    return [ind, msa]


def export_op(op: str, out: str | Path, *, shape: str | None = None, context: int | None = None,
              batch: int = 1, dtype: torch.dtype = torch.float32, seed: int = 0, edge: str | None = None,
              page_size: int | None = None, fp64: bool = False, act_quant: str = "none") -> dict:
    """Write the single-op bundle of `op` (module docstring) to the new folder `out`; returns the manifest.
    act_quant "emulate" (the linear ops): the GEMM input fake-quantized, its codes and scales stored."""
    if op not in SINGLE_OPS:
        raise InputError(f"--op {op!r}: choose one of {', '.join(SINGLE_OPS)}")
    if act_quant not in ("none", "emulate"):
        raise InputError(f"--act-quant {act_quant!r}: choose none or emulate")
    if act_quant == "emulate" and op not in ("nvfp4_linear", "mxfp8_linear"):
        raise InputError(f"--act-quant emulate applies to --op nvfp4_linear and mxfp8_linear, not {op}")
    if edge is not None and edge not in EDGES[op]:
        raise InputError(f"--edge {edge!r} does not apply to --op {op} (its edges: {', '.join(EDGES[op]) or 'none'})")
    if dtype not in (torch.float32, torch.bfloat16):
        raise InputError(f"--dtype {dtype}: single-op bundles are float32 or bfloat16")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InputError(f"--out {out}: exists and is not an empty folder")
    text = release_text()
    if op in ("nvfp4_linear", "mxfp8_linear"):
        M, N, K = parse_shape(shape, ("M", "N", "K"))
        entries = [linear_entry(op, M, N, K, dtype, seed, edge, act_quant == "emulate")]
    elif op == "router":
        dims = parse_shape(shape, ("T", "E", "H"), optional=1)
        T, E, H = (*dims, text.hidden_size) if len(dims) == 2 else dims
        entries = [router_entry(T, E, H, text.num_experts_per_tok, dtype, seed, edge)]
    elif op == "moe":
        dims = parse_shape(shape, ("T", "E", "H", "I"), optional=2)
        T, E = dims[:2]
        H = dims[2] if len(dims) > 2 else text.hidden_size
        inter = dims[3] if len(dims) > 3 else text.intermediate_size
        entries = [moe_entry(T, E, H, inter, dtype, seed, edge)]
    else:
        if context is None or context < 1 or batch < 1:
            raise InputError("--op msa_decode needs --context C >= 1 (and --batch B >= 1)")
        entries = msa_entries(context, batch, dtype, seed, page_size)
    dt = str(dtype).replace("torch.", "")
    manifest = {
        "format": FORMAT,
        "checkpoint": None,
        "single_op": {"op": op, "shape": shape, "context": context, "batch": batch, "edge": edge, "seed": seed},
        "producer": producer(),
        "numerics": {"dtype": dt, "act_quant": act_quant, "kv_cache_dtype": "auto", "kv_scale": 1.0},
        "seeds": {"operands": seed, "page_permutation": seed},
        "ops": sorted({e.op for e in entries}),
        "contracts": {e.op: contract(e.op, dt, fp64) for e in entries},
        "tolerance_rule": TOLERANCE_RULE,
        "entries": [],
    }
    write_bundle(out, manifest, entries, fp64=fp64)
    return manifest
