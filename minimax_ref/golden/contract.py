"""The numerics contract of golden bundles: the ops (`OPS`), the contract a kernel is held to (`CONTRACTS`: formula
in words, accumulation order, rounding points; the tensors' descriptions come from `layouts`; `TOLERANCE` written per
output; weights.md "Golden tolerances" justifies them), the rounding points the fp64 outputs keep
(`FP64`), error sizes (`error_sizes`) and the producer's versions."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from ..errors import InputError

OPS = ("indexer", "msa", "moe", "nvfp4_linear", "mxfp8_linear", "attention", "router", "rmsnorm", "qk_norm_rope",
       "final_norm", "logits")


ATTENTION_OPS = ("attention", "indexer", "msa")  # captured from the forward's trace, with the step's paged views


# Ops of the model's head (after the last decoder layer), in no decoder layer: their entries read layer index
# num_hidden_layers, and `--layers` (which picks decoder layers) does not select them: they are captured whenever
# chosen in `--ops`.
HEAD_OPS = ("final_norm", "logits")

# The per-head norms of a qk_norm_rope entry, by tensor-name prefix (`{which}`, `{which}_norm.weight`,
# `{which}_normed`, `{which}_rope`): the attention's q / k norms on every layer, the lightning indexer's
# index_q / index_k norms on MSA layers only.
QK_NORMS = ("q", "k", "index_q", "index_k")


FORMAT = "minimax-ref golden v1"


MANIFEST = "manifest.json"


# Long prompts: a core whose one-call scores would pass ONE_CALL_ELEMENTS is captured in the engine's query chunks
# of CAPTURE_CHUNK elements (linear memory in the prompt length).
ONE_CALL_ELEMENTS = 1 << 26


CAPTURE_CHUNK = 1 << 24


CHUNKED_NOTE = ("attention cores captured as the engine runs them, in query chunks: dense attention takes "
                "params.chunk_elements (queries per chunk = max(1, chunk_elements // (B * Hq * L))), MSA and the "
                "indexer params.query_chunk queries per chunk, each chunk scoring all L keys; outputs are the chunks' "
                "outputs concatenated along the query axis (the same values a one-call kernel gives within the "
                "tolerance: every query is independent). The indexer's [B, Hi, T, L] scores are quadratic in T and "
                "are left out when there is more than one chunk (its blocks are kept)")


# Tolerance of a float output o (reference) against a kernel's k, elementwise:
#   |k - o| <= atol + rtol * |o|,  atol = atol_rms * rms(o)  (both written per output in the manifest).
# Integer outputs (block ids, expert ids) are compared exactly. Factors by the kernel's compute dtype; weights.md
# ("Golden tolerances") derives them.
TOLERANCE_RULE = ("float outputs: |kernel - reference| <= atol + rtol * |reference| elementwise, atol = atol_rms * "
                  "rms(reference), equal infinities allowed; integer outputs: equal. 'float32': a kernel that "
                  "computes in IEEE fp32 (no TF32) in any summation order; 'bfloat16': a kernel with bf16 operands "
                  "and outputs and fp32 accumulation, the weight's global scale applied to the weight or to the "
                  "accumulator. The norm ops' edge entries (phase 'edge', manifest norm_edges) in a bfloat16 bundle: "
                  "bfloat16 rtol 2^-8, atol 0 (their exact outputs lie at least 2^-13 from a bf16 rounding midpoint)")


TOLERANCE = {  # op -> kernel dtype -> (rtol, atol_rms)
    "rmsnorm": {"float32": (1e-5, 1e-5), "bfloat16": (2**-7, 2**-7)},
    "router": {"float32": (1e-4, 1e-4), "bfloat16": (2**-6, 2**-6)},
    "mxfp8_linear": {"float32": (1e-4, 1e-4), "bfloat16": (2**-6, 2**-6)},
    "nvfp4_linear": {"float32": (1e-4, 1e-4), "bfloat16": (2**-6, 2**-6)},
    "attention": {"float32": (1e-4, 1e-4), "bfloat16": (2**-6, 2**-6)},
    "indexer": {"float32": (1e-4, 1e-4), "bfloat16": (2**-6, 2**-6)},
    "msa": {"float32": (1e-4, 1e-4), "bfloat16": (2**-6, 2**-6)},
    "moe": {"float32": (1e-4, 1e-4), "bfloat16": (2**-5, 2**-5)},
    # rmsnorm's fp32 bound (the rotation adds one fp32 multiply-add per element); bf16: the reference rounds twice
    # (normed, rotated) where a fused kernel rounds once, and the rotation's sum may cancel (atol covers it)
    "qk_norm_rope": {"float32": (1e-5, 1e-5), "bfloat16": (2**-6, 2**-6)},
    "final_norm": {"float32": (1e-5, 1e-5), "bfloat16": (2**-7, 2**-7)},  # rmsnorm's: the same op, one rounding
    "logits": {"float32": (1e-4, 1e-4), "bfloat16": (2**-6, 2**-6)},  # a linear's: one dot product over hidden
}


# The bfloat16 tolerance (rtol, atol_rms) of the norm ops' edge entries in a bfloat16 bundle (`norm_edges`): every
# exact output lies at least 2^-13 (relative) from a bf16 rounding midpoint, so a correct kernel rounds to the
# reference's value (or, unrounded, stays within half an ulp, <= 2^-8 relative); another bf16 value is one ulp off,
# more than 2^-8 relative. Other kernel dtypes and float32 bundles keep `TOLERANCE`.
EDGE_TOLERANCE = {"bfloat16": (2**-8, 0.0)}


_LINEAR_ROUNDING = {
    "float32": "W decoded exactly in fp32 (no rounding beyond the fp32 products stated); y = x @ W^T in fp32",
    "bfloat16": "W = bf16(decoded fp32 weight): the weight is rounded to bf16 AFTER multiplying by weight_scale_2 "
                "(bf16(e2m1 * (s * ws2)) for NVFP4, bf16(e4m3 * 2^(e-127)) for MXFP8, exact unless subnormal); "
                "x bf16; y = bf16(fp32 sum of x * W). A kernel that applies weight_scale_2 to its fp32 "
                "accumulator instead differs within the bfloat16 tolerance",
}


_ACT = ("with numerics.act_quant = 'emulate' the GEMM input a(x) is x fake-quantized (NVFP4: blocks of 16 along K, "
        "g = fp32(1 / input_scale), s = e4m3_rne(g * (amax * fp32(1/6))) saturating at 448, q = e2m1_rne(x * (1 / "
        "(s / g))) saturating at 6 (q = 0 where s = 0), x_hat = q * (s / g): s / g rounded to fp32 first, then the "
        "product, all fp32, then one rounding to the compute dtype; MXFP8: blocks of 32, X = 2^e with the smallest e "
        "such that amax <= 448 * 2^e (e in [-127, 127], -127 for a zero block), x_hat = e4m3(x / X) * X); with "
        "'none' a(x) = x")


CONTRACTS = {
    "rmsnorm": {
        "formula": "y = (x * rsqrt(mean(x^2 over the last dim) + eps)) * (1 + weight), in that grouping (Gemma's "
                   "offset weight)",
        "accumulation": "fp32: mean of squares over the hidden dim in fp32",
        "rounding": {"float32": "all fp32", "bfloat16": "x read as fp32; one rounding of y to bf16 at the end"},
    },
    "router": {
        "formula": "logits = x @ gate_weight^T in fp32; scores = sigmoid(logits); choice = scores + bias (selection "
                   "only); expert_ids = top_k of choice (descending); weights = scores[expert_ids] / sum of them. "
                   "Exact ties in choice are broken as torch.topk does (not the lowest id): compare accepts any "
                   "expert_ids whose choice values equal the reference's, row by row",
        "accumulation": "fp32 dot products over hidden",
        "rounding": {"float32": "all fp32", "bfloat16": "x (bf16) read as fp32; the router is fp32 in every mode"},
    },
    "mxfp8_linear": {
        "formula": "y = a(x) @ W^T, W[n, k] = float(e4m3 w.weight[n, k]) * 2^(w.weight_scale[n, k // 32] - 127)",
        "accumulation": "one dot product over K per output (reference: CPU BLAS order); any order is within tolerance",
        "rounding": {m: f"{r}; {_ACT}" for m, r in _LINEAR_ROUNDING.items()},
    },
    "nvfp4_linear": {
        "formula": "y = a(x) @ W1^T with W1[n, k] = e2m1(w1.weight)[n, k] * (float(e4m3 w1.weight_scale[n, k // 16]) "
                   "* w1.weight_scale_2) (the bracketed product first, fp32); entries with h also give y2 = a(h) @ "
                   "W2^T, W2 decoded from w2.* alike",
        "accumulation": "one dot product over K per output (reference: CPU BLAS order)",
        "rounding": {m: f"{r}; {_ACT}" for m, r in _LINEAR_ROUNDING.items()},
    },
    "attention": {
        "formula": "dense causal GQA: query head h reads kv head h // (Hq / Hkv); s = (q . k) * scale for keys at "
                   "positions <= q_pos, softmax over keys, o = sum p * v",
        "accumulation": "fp32 scores, fp32 softmax (max-subtracted), fp32 value sum; any order (online softmax "
                        "included) is within tolerance",
        "rounding": {"float32": "all fp32", "bfloat16": "q, k, v bf16 (as cached) read as fp32; o fp32"},
    },
    "indexer": {
        "formula": "scores[b, h, t, k] = iq[b, t, h] . ik[b, k] in fp32, no scale, -inf where k > q_pos[b, t]; block "
                   "score = max over the block's keys (the last block padded with -inf); forced blocks get +inf: the "
                   "local_blocks blocks ending at q_pos // block_size and the first init_blocks blocks at or before "
                   "it; blocks = the min(topk_blocks, num_blocks) largest block scores, a selected -inf (no causal "
                   "key) written as -1; the order of the ids is unspecified (compared as a set per query row)",
        "accumulation": "fp32 dot products over index_dim",
        "rounding": {"float32": "all fp32", "bfloat16": "iq, ik bf16 read as fp32; scores fp32"},
    },
    "msa": {
        "formula": "blocks as the indexer's; query head h attends only to the keys of its kv head's (h // G) selected "
                   "blocks at positions <= q_pos (empty slots -1 and future keys masked); s = (q . k) * scale, "
                   "softmax over all those keys together, o = sum p * v",
        "accumulation": "fp32 scores, softmax and value sum over the gathered keys (any order within tolerance)",
        "rounding": {"float32": "all fp32", "bfloat16": "q, k, v bf16 read as fp32; o fp32"},
    },
    "qk_norm_rope": {
        "formula": "per head (q [B, T, Hq, D], k [B, T, Hkv, D]): q_normed = (q * rsqrt(mean(q^2 over the head's D "
                   "channels) + eps)) * (1 + q_norm.weight), in that grouping (Gemma RMSNorm over each head's "
                   "head_dim channels, one "
                   "weight [D] shared by all heads; k_normed alike with k_norm.weight); then partial NeoX RoPE on the "
                   "first r = rotary_dim channels of each head: with h = r / 2, x1 = x[..., :h], x2 = x[..., h:r], "
                   "rope(x)[..., :r] = x[..., :r] * cos + cat(-x2, x1) * sin, channels [r, D) passed through "
                   "unchanged; q_rope = rope(q_normed), k_rope = rope(k_normed), the same tables for every head. "
                   "cos, sin fp32 [B, T, r] = cos / sin of cat(a, a), a[..., i] = fp32(positions) * inv_freq[i], "
                   "inv_freq[i] = 1 / rope_theta^(2i / r) in fp32 (i < r / 2): the stored tables are those; a kernel "
                   "that computes its own must compute them so (at long positions an ulp of inv_freq moves the "
                   "angle past the tolerance). MSA layers: the lightning indexer's queries index_q [B, T, Hkv, Di] "
                   "and key index_k [B, T, 1, Di] alike, each with its own weight (index_q_norm.weight, "
                   "index_k_norm.weight [Di]) over each index head's Di channels, then the same rotation (the same "
                   "tables and rotary_dim) giving index_q_normed / index_q_rope and index_k_normed / index_k_rope; "
                   "the same eps",
        "accumulation": "fp32: mean of squares over each head's D (index heads: Di) channels in fp32; the rotation "
                        "elementwise in fp32",
        "rounding": {"float32": "all fp32",
                     "bfloat16": "q, k (bf16) read as fp32; q_normed = bf16(the norm in fp32), rounded once as the "
                                 "layer hands it to RoPE; q_rope = bf16(the rotation in fp32 of q_normed as rounded): "
                                 "two rounding points (k, index_q, index_k alike). A fused kernel that keeps the "
                                 "normed value in fp32 and rounds once differs within the bfloat16 tolerance"},
    },
    "final_norm": {
        "formula": "the model's final norm on the residual stream after the last decoder layer: y = (x * "
                   "rsqrt(mean(x^2 over hidden) + eps)) * (1 + weight), in that grouping (Gemma's offset weight)",
        "accumulation": "fp32: mean of squares over the hidden dim in fp32",
        "rounding": {"float32": "all fp32", "bfloat16": "x read as fp32; one rounding of y to bf16 at the end"},
    },
    "logits": {
        "formula": "logits = fp32(x @ W^T): the LM head (W [V, hidden], unquantized as the release stores it; "
                   "with tied embeddings the embedding's weight) on the final norm's output at each row's sampled "
                   "position (params.logit_positions), over the whole vocabulary",
        "accumulation": "one dot product over hidden per logit (reference: CPU BLAS on the entry's B rows); any "
                        "order is within tolerance",
        "rounding": {"float32": "all fp32",
                     "bfloat16": "x and W bf16; logits = fp32(bf16(fp32 sum of x * W)): the GEMM output rounded to "
                                 "bf16 (the compute dtype), then widened to fp32"},
    },
    "moe": {
        "formula": "routing: logits = x @ gate_weight^T (fp32), scores = sigmoid(logits), the top_k experts by "
                   "scores + bias, weights = their scores / sum; each chosen expert e: gate = a(x) @ W1_e^T, up = "
                   "a(x) @ W3_e^T, h = (clamp(up, -limit, limit) + 1) * (g * sigmoid(alpha * g)) with g = "
                   "min(gate, limit) (SwiGLU-OAI, elementwise in the compute dtype), y_e = a(h) @ W2_e^T; routed = "
                   "sum over the token's experts of fp32(y_e) * weight; y = routed * scaling, plus fp32(shared(x)) "
                   "when params.shared_expert (the same SwiGLU-OAI MLP with shared.gate_proj / up_proj / down_proj)",
        "accumulation": "routed sum in fp32 in ascending expert id (each expert's contribution added to an fp32 "
                        "accumulator zero-initialised), then * scaling, then + shared, one rounding at the end",
        "rounding": {"float32": "all fp32",
                     "bfloat16": "weights bf16(decoded) as the linears; gate, up, h, y_e and shared(x) rounded to "
                                 "bf16; the routed sum and scaling in fp32; y = bf16(routed * scaling + shared)"},
    },
}


def contract(op: str, dtype: str, fp64: bool = False, tensors: Iterable[str] = (),
             params: Iterable[str] = ()) -> dict:
    """The numerics contract of `op` for a bundle computed in `dtype` ("float32" / "bfloat16"), describing exactly
    the tensor names `tensors` and parameter names `params` its entries hold (`layouts.describe_tensors`); fp64:
    with the text of its fp64 outputs (what they keep of the reference's rounding points)."""
    from .layouts import describe_params, describe_tensors

    c = CONTRACTS[op]
    rounding = c["rounding"].get(dtype, c["rounding"]["float32"])
    tol = {k: {"rtol": r, "atol_rms": a} for k, (r, a) in TOLERANCE[op].items()}
    return {**c, "rounding": rounding, "tensors": describe_tensors(op, tensors), "params": describe_params(params),
            "tolerance": tol, **({"fp64": FP64[op]} if fp64 else {})}


# Outputs compared exactly although they are floats: values the formats define (the fake-quantized input).
EXACT_FLOAT_OUTPUTS = ("x_hat",)


# Integer outputs whose order along the last axis is unspecified: compared as a set per row.
SET_OUTPUTS = ("blocks",)


def tolerance(op: str, name: str, t: torch.Tensor, edge: bool = False) -> dict:
    """Per-kernel-dtype {rtol, atol} of output `name` of `op`; integer outputs and `EXACT_FLOAT_OUTPUTS` are
    {"exact": True}, with "order": "set" for `SET_OUTPUTS` (the ids of a row in any order). edge: an output of a
    norm op's edge entry in a bfloat16 bundle (`EDGE_TOLERANCE` replaces its bfloat16 factors)."""
    if not t.is_floating_point() or name in EXACT_FLOAT_OUTPUTS:
        return {"exact": True, **({"order": "set"} if name in SET_OUTPUTS else {})}
    finite = t[torch.isfinite(t)].double()
    rms = float(finite.square().mean().sqrt()) if finite.numel() else 0.0
    factors = {**TOLERANCE[op], **(EDGE_TOLERANCE if edge else {})}
    return {k: {"rtol": r, "atol": a * rms} for k, (r, a) in factors.items()}


def producer() -> dict:
    """Versions of what computed the bundle."""
    import platform

    import safetensors

    from .. import __version__

    return {"minimax_ref": __version__, "torch": torch.__version__, "safetensors": safetensors.__version__,
            "python": platform.python_version(), "torch_threads": torch.get_num_threads()}


def sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# What the optional fp64 outputs (`fp64=True`, `--fp64`; tensors `{output}.fp64`, role "fp64") keep of the
# reference's rounding points, per op: the format-defined roundings stay, the implementation's go.
FP64 = {
    "rmsnorm": "y in fp64 from x (as stored) and weight; no rounding to the compute dtype",
    "router": "logits = x @ gate_weight^T in fp64, weights = normalised sigmoid(logits) of the reference's "
              "expert_ids in fp64 (the selection is the reference's: integer outputs have no fp64 version)",
    "mxfp8_linear": "W decoded exactly (e4m3 * 2^(e - 127)) in fp64, not rounded to the compute dtype; the GEMM "
                    "input is x as stored (with act_quant = emulate: the activation quantization kept, computed "
                    "as the reference does); y = x @ W^T accumulated in fp64",
    "nvfp4_linear": "W = e2m1 * e4m3 scale * weight_scale_2 in fp64 (the fp32 rounding of scale * weight_scale_2 "
                    "and the rounding of W to the compute dtype dropped); the GEMM input is x (or h) as stored "
                    "(activation quantization kept with act_quant = emulate); accumulation in fp64",
    "moe": "the reference's expert choice; routing weights, each expert's gate / up GEMMs, SwiGLU-OAI (its clamp "
           "kept), down GEMM, routed sum, scaling and shared expert all in fp64 with weights decoded as "
           "nvfp4_linear's fp64 version; with act_quant = emulate the activation quantization of x and h is kept "
           "(h rounded to fp32, then quantized as the reference does)",
    "attention": "scores, softmax and value sum in fp64 from q, k, v as stored",
    "indexer": "scores = iq . ik in fp64 (-inf at future keys); blocks have no fp64 version",
    "msa": "attention over the reference's selected blocks in fp64 from q, k, v as stored",
    "qk_norm_rope": "q_normed, k_normed (MSA layers: index_q_normed, index_k_normed too) in fp64 from q, k "
                    "(index_q, index_k) as stored and the weights; q_rope, k_rope (index_q_rope, index_k_rope) = "
                    "the rotation in fp64 of the fp64 normed values (no rounding between norm and rotation) with "
                    "cos, sin as stored (the fp32 tables kept)",
    "final_norm": "y in fp64 from x (as stored) and weight; no rounding to the compute dtype",
    "logits": "x (as stored) @ W^T with W decoded in fp64 (a bf16 weight: its values), accumulated in fp64; no "
              "rounding to the compute dtype",
}


# The linears of a layer that may be MXFP8, in the order their entries are listed (their `tag`s).
MXFP8_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "self_attn.index_q_proj", "self_attn.index_k_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                 "block_sparse_moe.shared_experts.gate_proj", "block_sparse_moe.shared_experts.up_proj",
                 "block_sparse_moe.shared_experts.down_proj")


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact comparison: same dtype, shape and values."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def error_sizes(got: torch.Tensor, want: torch.Tensor) -> dict:
    """Float `want`: max_abs, max_rel (over nonzero reference elements) and max_ulps (in the reference's dtype, at
    the reference value) of `got` against `want`, computed in fp64; equal elements (equal infinities included)
    count 0, a non-finite difference counts inf. Integer `want` (ids): mismatched (elements that differ) and
    elements. A shape mismatch is an InputError."""
    if tuple(got.shape) != tuple(want.shape):
        raise InputError(f"output shape {tuple(got.shape)} differs from the reference's {tuple(want.shape)}")
    if not want.is_floating_point():  # ids: how many differ, no distances between them
        differ = got.detach().cpu().long() != want.detach().cpu().long()
        return {"mismatched": int(differ.sum()), "elements": want.numel()}
    g, w = got.detach().cpu().double(), want.detach().cpu().double()
    if g.numel() == 0:
        return {"max_abs": 0.0, "max_rel": 0.0, "max_ulps": 0.0}
    equal = (g == w) | (torch.isnan(g) & torch.isnan(w))
    err = torch.where(equal, torch.zeros_like(g), (g - w).abs().nan_to_num(nan=float("inf")))
    nz = w != 0
    rel = torch.where(nz & ~equal, err / w.abs().clamp(min=torch.finfo(torch.float64).tiny), torch.zeros_like(err))
    if want.element_size() == 1:  # float8 (activation codes): no nextafter there
        fi = torch.finfo(want.dtype)
        a = w.abs()
        ulp = torch.where(a >= fi.tiny, torch.exp2(torch.floor(torch.log2(a.clamp(min=fi.tiny)))) * fi.eps,
                          torch.full_like(a, fi.tiny * fi.eps))
        ulps = torch.where(equal, torch.zeros_like(err), err / ulp)
    else:
        a = want.detach().cpu().abs()
        ulp = (torch.nextafter(a, torch.full_like(a, float("inf"))) - a).double()
        ulps = torch.where(equal, torch.zeros_like(err), err / ulp)
    return {"max_abs": float(err.max()), "max_rel": float(rel.max()), "max_ulps": float(ulps.nan_to_num(nan=0.0).max())}
