"""`minimax-ref golden`: golden tensors for kernel tests, captured from a real forward, and their replay.

Export. The prompt(s) are prefilled through the KV cache in one step (phase `prefill`), then
`--decode-steps` greedy tokens are decoded one at a time (phases `decode0`, `decode1`, ...). During
these forwards, for every chosen op at every chosen layer where the engine computes it, the op's
inputs and outputs are written to `{op}/layer{L:03d}_{phase}.safetensors`:

| op | layers | captured | tensors |
|---|---|---|---|
| `rmsnorm` | all | hooks on input_layernorm, post_attention_layernorm | `{norm}.x`, `{norm}.weight`, `{norm}.y` |
| `mxfp8_linear` | with an MXFP8 linear | hooks on every MXFP8 linear (an entry each) | `x`, `w.*` (packed), `y` |
| `attention` | dense attention | the attention core (`Trace.attention`) | `q`, `k`, `v`, `q_pos`, `o`, paged KV |
| `indexer` | MSA | the MSA call (`Trace.attention`) | `iq`, `ik`, `q_pos`, `scores`, `blocks`, paged index keys |
| `msa` | MSA | the MSA call (`Trace.attention`) | `q`, `k`, `v`, `iq`, `ik`, `q_pos`, `o`, `blocks`, paged KV |
| `router` | MoE | hook on `block_sparse_moe.gate` | `x`, `gate_weight`, `bias`, `expert_ids`, `weights`, `logits` |
| `moe` | MoE | forward hook on `block_sparse_moe` | `x`, `y`, router, shared and used experts (packed; fused gate-up) |
| `nvfp4_linear` | NVFP4 experts | recomputed from the MoE's input | `x`, `w1.*` (packed), `y`; `h`, `w2.*`, `y2` |

Packed operands are stored once per bundle, in `weights/layer{L:03d}.safetensors` under
`{checkpoint prefix}.{weight, weight_scale, weight_scale_2, input_scale}`; the manifest row of an entry
names each one's file and key (`tensors.NAME.stored`), and `entry_tensors` / `load` put them back under the
entry's canonical names: `.weight` (NVFP4: uint8 [N, K/2],
low nibble = even element; MXFP8: float8_e4m3fn [N, K]; BF16: bf16), `.weight_scale` (NVFP4:
float8_e4m3fn [N, K/16]; MXFP8: uint8 E8M0 [N, K/32]), `.weight_scale_2` (fp32 scalar, ModelOpt
meaning: multiplies) and `.input_scale` (fp32 scalar, ModelOpt meaning). The NVFP4 expert chosen is
the one most tokens were routed to (ties: lower id); its `x` rows are those tokens, ascending.

Attention is captured through the forward's `Trace` (`Trace.attention_layers`), and a captured call runs in
one query chunk (`Attention.chunk_for`): the engine's chunking only bounds memory, and one call is what a
kernel computes. A long prompt (one-call scores past `ONE_CALL_ELEMENTS`, or `chunk_elements=` given) is captured
in the engine's query chunks instead (`CHUNKED_NOTE`), and entries are written as soon as they are complete (a
layer's when the next one starts; `BundleWriter`), so an export's memory is linear in the prompt length.
`fp64=True` / `--fp64` adds each float output evaluated in fp64 (`FP64`). Paged KV views: the layer's cache
storage (float8_e4m3fn with `--kv-cache-dtype fp8`, else the compute dtype) cut into
pages of `page_size` tokens: `k_pages`, `v_pages` [P, page_size, kv_heads, D], `index_k_pages`
[P, page_size, index_dim], `block_table` int32 [B, max_pages] (-1 = no page), `seq_lens` int32 [B]
(tokens in the cache for that row after the step), `cu_seqlens_q` int32 [B + 1] (varlen offsets of the
rows' real queries). Page ids are a seeded permutation (one block table
per phase, shared by all layers, as in vLLM) so a kernel cannot assume contiguity; slots past a
row's length are zero. Loading a page is `storage.float() * kv_scale` cast to the compute dtype
(`kv_scale` = 1.0, the cache's fp8 rule).

`manifest.json` lists every file with its op, layer, phase, parameters, tensor shapes/dtypes/roles and
sha256, plus the numerics mode (dtype, act_quant, kv_cache_dtype), the seed, prompts, decoded tokens, the
producer's versions, the engine's recipe of each op (`RECOMPUTE`) and, per op, the numerics contract a
kernel is held to (`CONTRACTS`: formula in words, accumulation order, rounding points, layouts; `TOLERANCE`,
written per output as numbers; weights.md "Golden tolerances" justifies them). The model is loaded from a
checkpoint folder or a synthetic preset (`load_synthetic`, `--synthetic-weights`): the packed operands are
re-read from the same source.

Single-op bundles (`--op`, `export_op`): one op at any shape from random operands in the release formats,
without a model (the "single-op bundles" section below).

Test API: `load(path)` gives `GoldenEntry`s (inputs, outputs, params, contract, tolerance; sha256 checked),
`compare(entry, outputs)` applies the tolerance and reports max abs / max rel / max ulps per output, and
`parametrize(path)` is a pytest mark over a bundle's entries; `golden --replay BUNDLE --impl module:function`
(`replay_impl`) runs a user's kernel on every entry and prints its error sizes.

Replay (`replay_bundle`) recomputes every output from the stored inputs with the engine's pure
functions (`norm.gemma_rms_norm`, `moe.route`, `quant.dequant_*`, `linear.emulate_activation_quant`,
`msa.index_scores` / `select_blocks` / `gather_block_attention`, `attention.causal_attention`, and
the MoE's `Experts` / `MLP` modules rebuilt from the packed operands) and compares with `torch.equal`
(same dtype, shape and values: bit-exact), reporting the error sizes as well. Bit-exactness presumes
the CPU BLAS configuration of the export (library, thread count); the replay copies every loaded
tensor into a fresh buffer because BLAS also rounds differently for differently aligned inputs
(safetensors maps tensors at 8-byte offsets). Paged views are checked by rebuilding each row's keys
from the block table (equal to the captured keys) and recomputing the op from them (equal outputs at
the rows' real query positions).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from .checkpoint import DENSE, MXFP8, NVFP4, TEXT_PREFIX, Checkpoint
from .errors import InputError
from .outdir import staged_folder

OPS = ("indexer", "msa", "moe", "nvfp4_linear", "mxfp8_linear", "attention", "router", "rmsnorm")
ATTENTION_OPS = ("attention", "indexer", "msa")  # captured from the forward's trace, with the step's paged views
FORMAT = "minimax-ref golden v1"
MANIFEST = "manifest.json"

RECOMPUTE = {
    "rmsnorm": "y = norm.gemma_rms_norm(x, weight, eps) for input_layernorm and post_attention_layernorm",
    "router": "expert_ids, weights, logits = moe.route(x, gate_weight, bias, top_k, expert_mask)",
    "moe": "W = decode(packed operands).to(dtype) for the shared expert (MLP) and each used routed expert "
           "(Experts, renumbered 0..m-1 in ascending original id); r = moe.route(x, gate_weight, bias, top_k); "
           "y = (Experts(x, r with local ids) * scaling + shared(x).float()).to(dtype)",
    "nvfp4_linear": "y = F.linear(a(x), quant.dequant_nvfp4(w1.weight, w1.weight_scale, w1.weight_scale_2)"
                    ".to(dtype)); a = linear.emulate_activation_quant(., 'nvfp4', w1.input_scale) with "
                    "act_quant=emulate, else identity; y2 likewise from h and w2",
    "mxfp8_linear": "y = F.linear(a(x), quant.dequant_mxfp8(w.weight, w.weight_scale).to(dtype)); "
                    "a = linear.emulate_activation_quant(., 'mxfp8', None) with act_quant=emulate",
    "attention": "o = attention.causal_attention(q, k, v, q_pos, scale, chunk_elements)",
    "indexer": "scores = msa.index_scores(iq, ik, q_pos); blocks = msa.select_blocks(scores, q_pos, "
               "block_size, topk_blocks, local_blocks, init_blocks)",
    "msa": "blocks as indexer; o = msa.gather_block_attention(q, k, v, blocks, q_pos, block_size, scale)",
    "paged": "k[b, p] = (k_pages[block_table[b, p // page_size], p % page_size].float() * kv_scale).to(dtype) "
             "for p < seq_lens[b]; the op recomputed from these keys equals its outputs where q_pos < seq_lens",
}


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


# ---------------------------------------------------------------------------------------------- numerics contract

# Tolerance of a float output o (reference) against a kernel's k, elementwise:
#   |k - o| <= atol + rtol * |o|,  atol = atol_rms * rms(o)  (both written per output in the manifest).
# Integer outputs (block ids, expert ids) are compared exactly. Factors by the kernel's compute dtype; weights.md
# ("Golden tolerances") derives them.
TOLERANCE_RULE = ("float outputs: |kernel - reference| <= atol + rtol * |reference| elementwise, atol = atol_rms * "
                  "rms(reference), equal infinities allowed; integer outputs: equal. 'float32': a kernel that "
                  "computes in IEEE fp32 (no TF32) in any summation order; 'bfloat16': a kernel with bf16 operands "
                  "and outputs and fp32 accumulation, the weight's global scale applied to the weight or to the "
                  "accumulator")
TOLERANCE = {  # op -> kernel dtype -> (rtol, atol_rms)
    "rmsnorm": {"float32": (1e-5, 1e-5), "bfloat16": (2**-7, 2**-7)},
    "router": {"float32": (1e-4, 1e-4), "bfloat16": (2**-6, 2**-6)},
    "mxfp8_linear": {"float32": (1e-4, 1e-4), "bfloat16": (2**-6, 2**-6)},
    "nvfp4_linear": {"float32": (1e-4, 1e-4), "bfloat16": (2**-6, 2**-6)},
    "attention": {"float32": (1e-4, 1e-4), "bfloat16": (2**-6, 2**-6)},
    "indexer": {"float32": (1e-4, 1e-4), "bfloat16": (2**-6, 2**-6)},
    "msa": {"float32": (1e-4, 1e-4), "bfloat16": (2**-6, 2**-6)},
    "moe": {"float32": (1e-4, 1e-4), "bfloat16": (2**-5, 2**-5)},
}

_NVFP4_LAYOUT = ("{w}.weight uint8 [N, K/2]: byte k//2 of row n holds element k, even k in the low nibble, odd k in "
                 "the high nibble; E2M1 code bit 3 = sign, bits 0-2 index (0, 0.5, 1, 1.5, 2, 3, 4, 6). "
                 "{w}.weight_scale float8_e4m3fn [N, K/16], row-major, unswizzled (single-op bundles add the "
                 "swizzled copy CUTLASS / cuBLASLt take). {w}.weight_scale_2 fp32 "
                 "scalar, multiplies. {w}.input_scale fp32 scalar: the activation global scale is 1/input_scale")
_MXFP8_LAYOUT = ("{w}.weight float8_e4m3fn [N, K]; {w}.weight_scale uint8 E8M0 [N, K/32], row-major, unswizzled: "
                 "the block's factor is 2^(code - 127), code 255 = NaN")
_SWIZZLED = ("{w}.weight_scale_swizzled (single-op bundles): the same scales in the 128x4-tile layout of CUTLASS / "
             "cuBLASLt block-scaled GEMMs, flat, zero-padded to [ceil(N/128)*128, ceil(Kb/4)*4] (Kb scales per row); "
             "tiles of 128 rows x 4 scale columns in row-major tile order; scale (r, c) of a tile at offset "
             "(r % 32) * 16 + (r // 32) * 4 + c")
_FUSED_LAYOUT = (
    "{w}.weight / .weight_scale: gate rows then up rows, concatenated along N (not interleaved): rows [0, I) are "
    "{g}, rows [I, 2I) are {u}, each row's packed bytes and block scales as in the separate operands (vLLM's "
    "w13_weight [E, 2I, K/2] / CUTLASS grouped GEMM order; FlashInfer's CUTLASS MoE takes the halves swapped, up "
    "first). NVFP4 {w}.weight_scale_2 and {w}.input_scale are fp32 [2]: entry 0 applies to rows [0, I), entry 1 to "
    "rows [I, 2I) (vLLM's w13_weight_scale_2 [E, 2]). The release writes max(w1, w3) to both, so they are equal "
    "there; when they differ, one global scale cannot serve both halves: scale each half of the output by its own "
    "entry in the epilogue (vLLM takes entry 0 for both and warns; that is not this operand). Stored once per "
    "bundle, beside the separate operands")
_PAGED_LAYOUT = ("k_pages, v_pages [P, page_size, kv_heads, D] and index_k_pages [P, page_size, index_dim] in the "
                 "cache's storage dtype; block_table int32 [B, max_pages] (page id of each row's j-th page, -1 = none, "
                 "ids a seeded permutation); seq_lens int32 [B]: tokens cached for the row after the step; slot s of "
                 "page block_table[b, p // page_size] holds position p of row b; an fp8 page is read as "
                 "(storage.float() * kv_scale) cast to the compute dtype; slots past seq_lens are zero")

_LINEAR_ROUNDING = {
    "float32": "W decoded exactly in fp32 (no rounding beyond the fp32 products stated); y = x @ W^T in fp32",
    "bfloat16": "W = bf16(decoded fp32 weight): the weight is rounded to bf16 AFTER multiplying by weight_scale_2 "
                "(bf16(e2m1 * (s * ws2)) for NVFP4, bf16(e4m3 * 2^(e-127)) for MXFP8, exact unless subnormal); "
                "x bf16; y = bf16(fp32 sum of x * W). A kernel that applies weight_scale_2 to its fp32 "
                "accumulator instead differs within the bfloat16 tolerance",
}
_ACT = ("with numerics.act_quant = 'emulate' the GEMM input is first fake-quantized (NVFP4: blocks of 16 along K, "
        "g = 1/input_scale, s = e4m3(g * (amax * fp32(1/6))), q = e2m1_rne(x * (1 / (s / g))) saturating at 6, "
        "x_hat = q * (s / g), all fp32, one rounding to the compute dtype; MXFP8: blocks of 32, X = 2^e with the "
        "smallest e such that amax <= 448 * 2^e, x_hat = e4m3(x / X) * X); the result is stored as x_hat where "
        "captured. With 'none' the input is used as is")

CONTRACTS = {
    "rmsnorm": {
        "formula": "y = x / sqrt(mean(x^2 over the last dim) + eps) * (1 + weight) (Gemma's offset weight)",
        "accumulation": "fp32: mean of squares over the hidden dim in fp32",
        "rounding": {"float32": "all fp32", "bfloat16": "x read as fp32; one rounding of y to bf16 at the end"},
        "layouts": {"x, y": "[..., hidden]", "weight": "[hidden] fp32 (the offset w, applied as 1 + w)"},
    },
    "router": {
        "formula": "logits = x @ gate_weight^T in fp32; scores = sigmoid(logits); choice = scores + bias (selection "
                   "only); experts masked False in expert_mask are never chosen; expert_ids = top_k of choice "
                   "(descending); weights = scores[expert_ids] / sum of them. Exact ties in choice are broken "
                   "as torch.topk does (not the lowest id): compare accepts any expert_ids whose choice values "
                   "equal the reference's, row by row",
        "accumulation": "fp32 dot products over hidden",
        "rounding": {"float32": "all fp32", "bfloat16": "x (bf16) read as fp32; the router is fp32 in every mode"},
        "layouts": {"x": "[T, hidden]", "gate_weight": "[E, hidden] fp32", "bias": "[E] fp32",
                    "expert_ids": "int64 [T, top_k] in descending choice order", "weights": "fp32 [T, top_k]",
                    "logits": "fp32 [T, E]"},
    },
    "mxfp8_linear": {
        "formula": "y = a(x) @ W^T, W[n, k] = float(e4m3 weight[n, k]) * 2^(weight_scale[n, k // 32] - 127)",
        "accumulation": "one dot product over K per output (reference: CPU BLAS order); any order is within tolerance",
        "rounding": {m: f"{r}; {_ACT}" for m, r in _LINEAR_ROUNDING.items()},
        "layouts": {"x": "[T, K]", "y": "[T, N]", "w.*": _MXFP8_LAYOUT.format(w="w"),
                    "params.linear": "model-driven bundles: one entry per MXFP8 linear of the layer (q/k/v/o, index "
                                     "q/k, dense MLP gate/up/down, shared expert gate/up/down), its checkpoint prefix; "
                                     "the file name ends in its path within the layer",
                    "w.weight_scale_swizzled": _SWIZZLED.format(w="w")},
    },
    "nvfp4_linear": {
        "formula": "y = a(x) @ W1^T with W[n, k] = e2m1(weight)[n, k] * (float(e4m3 weight_scale[n, k // 16]) * "
                   "weight_scale_2) (the bracketed product first, fp32); the expert's gate projection (w1) on its "
                   "tokens; y2 = a(h) @ W2^T, its down projection on h = swiglu_oai(gate, up) (given)",
        "accumulation": "one dot product over K per output (reference: CPU BLAS order)",
        "rounding": {m: f"{r}; {_ACT}" for m, r in _LINEAR_ROUNDING.items()},
        "layouts": {"x": "[T, hidden], the expert's tokens ascending", "h": "[T, intermediate]", "y": "[T, I]",
                    "y2": "[T, hidden]", "w1.*, w2.*": _NVFP4_LAYOUT.format(w="w1 / w2"),
                    "w1.weight_scale_swizzled": _SWIZZLED.format(w="w1")},
    },
    "attention": {
        "formula": "dense causal GQA: query head h reads kv head h // (Hq / Hkv); s = (q . k) * scale for keys at "
                   "positions <= q_pos, softmax over keys, o = sum p * v",
        "accumulation": "fp32 scores, fp32 softmax (max-subtracted), fp32 value sum; any order (online softmax "
                        "included) is within tolerance",
        "rounding": {"float32": "all fp32", "bfloat16": "q, k, v bf16 (as cached) read as fp32; o fp32"},
        "layouts": {"q": "[B, T, Hq, D]", "k, v": "[B, L, Hkv, D], slot = absolute position",
                    "q_pos": "int64 [B, T] absolute positions (right-padded batch)", "o": "fp32 [B, T, Hq, D]",
                    "cu_seqlens_q": "int32 [B + 1]: row b's real queries q[b, :n_b] packed at offset cu[b] "
                                    "(varlen prefill; outputs of padded query slots are not part of the contract)",
                    "paged": _PAGED_LAYOUT},
    },
    "indexer": {
        "formula": "scores[b, h, t, k] = iq[b, t, h] . ik[b, k] in fp32, no scale, -inf where k > q_pos[b, t]; block "
                   "score = max over the block's keys (the last block padded with -inf); forced blocks get +inf: the "
                   "local_blocks blocks ending at q_pos // block_size and the first init_blocks blocks at or before "
                   "it; blocks = the min(topk_blocks, num_blocks) largest block scores in descending order, a "
                   "selected -inf (no causal key) written as -1 (valid ids left-packed)",
        "accumulation": "fp32 dot products over index_dim",
        "rounding": {"float32": "all fp32", "bfloat16": "iq, ik bf16 read as fp32; scores fp32"},
        "layouts": {"iq": "[B, T, Hi, Di]", "ik": "[B, L, Di]", "scores": "fp32 [B, Hi, T, L]",
                    "blocks": "int64 [B, Hi, T, kb] (index head h serves kv head h)", "paged": _PAGED_LAYOUT},
    },
    "msa": {
        "formula": "blocks as the indexer; query head h attends only to the keys of its kv head's (h // G) selected "
                   "blocks at positions <= q_pos (empty slots -1 and future keys masked); s = (q . k) * scale, "
                   "softmax over all those keys together, o = sum p * v",
        "accumulation": "fp32 scores, softmax and value sum over the gathered keys (block list order)",
        "rounding": {"float32": "all fp32", "bfloat16": "q, k, v bf16 read as fp32; o fp32"},
        "layouts": {"q": "[B, T, Hq, D]", "k, v": "[B, L, Hkv, D]", "iq, ik": "as indexer",
                    "blocks": "int64 [B, Hkv, T, kb]", "o": "fp32 [B, T, Hq, D]", "paged": _PAGED_LAYOUT},
    },
    "moe": {
        "formula": "routing as the router op; each used expert e: gate = a(x) @ W1_e^T, up = a(x) @ W3_e^T, "
                   "h = (clamp(up, -limit, limit) + 1) * (g * sigmoid(alpha * g)) with g = min(gate, limit) "
                   "(SwiGLU-OAI, elementwise in the compute dtype), y_e = a(h) @ W2_e^T; routed = sum over the "
                   "token's experts of fp32(y_e) * weight; y = routed * scaling + fp32(shared(x)), shared = the "
                   "same SwiGLU-OAI MLP with gate_proj / up_proj / down_proj",
        "accumulation": "routed sum in fp32 in ascending expert id (each expert's contribution added to an fp32 "
                        "accumulator zero-initialised), then * scaling, then + shared, one rounding at the end",
        "rounding": {"float32": "all fp32",
                     "bfloat16": "weights bf16(decoded) as the linears; gate, up, h, y_e and shared(x) rounded to "
                                 "bf16; the routed sum and scaling in fp32; y = bf16(routed * scaling + shared)"},
        "layouts": {"x, y": "[T, hidden]", "experts.{e}.w1 / w3 / w2.*": _NVFP4_LAYOUT.format(w="experts.{e}.wN")
                    + " (or MXFP8 / bf16: params.formats)", "shared.*": "params.formats gives each one's format",
                    "experts.{e}.w13.*": _FUSED_LAYOUT.format(w="experts.{e}.w13", g="w1 (gate)", u="w3 (up)"),
                    "shared.gate_up.*": _FUSED_LAYOUT.format(w="shared.gate_up", g="gate_proj", u="up_proj"),
                    "params.used_experts": "the routed experts stored (ascending original id)"},
    },
}


def contract(op: str, dtype: str, fp64: bool = False) -> dict:
    """The numerics contract of `op` for a bundle computed in `dtype` ("float32" / "bfloat16"); fp64: with the
    text of its fp64 outputs (what they keep of the reference's rounding points)."""
    c = CONTRACTS[op]
    rounding = c["rounding"].get(dtype, c["rounding"]["float32"])
    tol = {k: {"rtol": r, "atol_rms": a} for k, (r, a) in TOLERANCE[op].items()}
    return {**c, "rounding": rounding, "tolerance": tol, **({"fp64": FP64[op]} if fp64 else {})}


def tolerance(op: str, name: str, t: torch.Tensor) -> dict:
    """Per-kernel-dtype {rtol, atol} of output `name` of `op` (integer outputs: exact)."""
    if not t.is_floating_point():
        return {"exact": True}
    finite = t[torch.isfinite(t)].double()
    rms = float(finite.square().mean().sqrt()) if finite.numel() else 0.0
    return {k: {"rtol": r, "atol": a * rms} for k, (r, a) in TOLERANCE[op].items()}


def producer() -> dict:
    """Versions of what computed the bundle."""
    import platform

    import safetensors

    from . import __version__

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


def weights_file(layer: int) -> str:
    """The bundle-relative file that holds layer `layer`'s packed operands, once."""
    return f"weights/layer{layer:03d}.safetensors"


def tensor_meta(e: Entry, name: str, t: torch.Tensor, file: str | None = None) -> dict:
    """The manifest row of `e`'s tensor `name`; a packed operand's names the weights file it is stored in."""
    meta = {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""), "role": e.roles[name]}
    if name in e.shared:
        meta["stored"] = {"file": file or weights_file(e.layer), "key": e.shared[name]}
    return meta


def checkpoint_of(model) -> Checkpoint:
    """The checkpoint `model` was loaded from, to read packed operands: its folder, or the synthetic preset that
    regenerates the same tensors."""
    from .checkpoint import open_checkpoint

    if model.ckpt_path is not None:
        return open_checkpoint(model.ckpt_path)
    spec = getattr(model, "synthetic", None)
    if spec is None:
        raise InputError("golden: the model has neither a checkpoint folder (ckpt_path) nor a synthetic preset; "
                         "load it with load_model(path) or load_synthetic(preset)")
    from .synthetic import SyntheticCheckpoint

    return SyntheticCheckpoint(spec["preset"], spec["fmt"], experts=spec["experts"], layers=spec["layers"],
                               overrides=spec["overrides"], seed=spec["seed"], device=model.device)


@dataclass
class Entry:
    """One golden file: an op at a layer in a phase."""

    op: str
    layer: int
    phase: str
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    params: dict = field(default_factory=dict)
    roles: dict[str, str] = field(default_factory=dict)

    shared: dict[str, str] = field(default_factory=dict)
    tag: str = ""  # which instance, when a layer holds several (mxfp8_linear: the linear's path in the layer)

    def put(self, name: str, t: torch.Tensor, role: str, shared: str | None = None) -> None:
        """Record tensor `name` (a copy: captured activations may be views of buffers the forward reuses);
        `shared`: its key in the layer's weights file (stored once per bundle; packed operands are fresh tensors,
        read from the checkpoint, and are not copied)."""
        t = t.detach()
        self.tensors[name] = (t if shared is not None else t.clone()).contiguous().cpu()
        self.roles[name] = role
        if shared is not None:
            self.shared[name] = shared

    @property
    def file(self) -> str:
        tag = f".{self.tag}" if self.tag else ""
        return f"{self.op}/layer{self.layer:03d}_{self.phase}{tag}.safetensors"


# ---------------------------------------------------------------------------------------------- operands


def put_linear(e: Entry, ck: Checkpoint, prefix: str, key: str) -> str:
    """Put linear `prefix`'s packed operands into `e` under `key.*`, stored once per bundle under
    `prefix.*` (the same canonical leaves); returns the linear's format."""
    ops, fmt = linear_operands(ck, prefix, key)
    for name, t in ops.items():
        e.put(name, t, "weight", shared=prefix + name[len(key):])
    return fmt


def put_fused(e: Entry, gate: str, up: str, key: str, fmt: str, prefix: str | None) -> None:
    """Put the fused gate-up operand `key.*` (`fuse_gate_up`) of `e`'s operands `gate.*`, `up.*`; stored once per
    bundle under `prefix.*` when given (model-driven bundles), else in the entry's file."""
    for name, t in fuse_gate_up(e.tensors, gate, up, key, fmt).items():
        e.put(name, t, "weight", shared=None if prefix is None else prefix + name[len(key):])


def linear_operands(ck: Checkpoint, prefix: str, key: str) -> tuple[dict[str, torch.Tensor], str]:
    """A linear's stored tensors under canonical names `{key}.weight/.weight_scale/.weight_scale_2/
    .input_scale` (global scales in the ModelOpt meaning), and its format."""
    f = ck.formats[prefix]
    out = {f"{key}.weight": ck.read(f.weight)}
    if f.fmt == MXFP8:
        out[f"{key}.weight_scale"] = ck.read(f.scale)
    elif f.fmt == NVFP4:
        g = ck.read_scalar(f.scale_2)
        out[f"{key}.weight_scale"] = ck.read(f.scale)
        out[f"{key}.weight_scale_2"] = 1.0 / g if f.compressed_tensors else g
        out[f"{key}.input_scale"] = ck.input_scale(prefix).reshape(())
    return out, f.fmt


def decode_operand(t: dict[str, torch.Tensor], key: str, fmt: str, dtype: torch.dtype) -> torch.Tensor:
    """The weight of packed operand `key` decoded exactly to fp32, then cast to `dtype` (the loader's rule)."""
    from .quant import dequant_mxfp8, dequant_nvfp4

    if fmt == NVFP4:
        w = dequant_nvfp4(t[f"{key}.weight"], t[f"{key}.weight_scale"], t[f"{key}.weight_scale_2"], name=key)
    elif fmt == MXFP8:
        w = dequant_mxfp8(t[f"{key}.weight"], t[f"{key}.weight_scale"], name=key)
    else:
        w = t[f"{key}.weight"].float()
    return w.to(dtype)


def fuse_gate_up(t: dict[str, torch.Tensor], gate: str, up: str, key: str, fmt: str) -> dict[str, torch.Tensor]:
    """The fused gate-up operand `key.*` of packed operands `gate.*` [I, K] and `up.*` [I, K], as vLLM's
    `w13_*` and CUTLASS grouped GEMMs take it: `key.weight` [2I, ...] = gate rows then up rows (concatenated
    along N, not interleaved), `key.weight_scale` likewise; NVFP4 global scales cannot be shared when they
    differ, so `key.weight_scale_2` and `key.input_scale` are fp32 [2]: entry 0 applies to rows [0, I) (gate),
    entry 1 to rows [I, 2I) (up) (vLLM's `w13_weight_scale_2 [E, 2]` order)."""
    out = {f"{key}.weight": torch.cat([t[f"{gate}.weight"], t[f"{up}.weight"]])}
    if fmt in (NVFP4, MXFP8):
        out[f"{key}.weight_scale"] = torch.cat([t[f"{gate}.weight_scale"], t[f"{up}.weight_scale"]])
    for leaf in ("weight_scale_2", "input_scale"):
        if fmt == NVFP4 and f"{gate}.{leaf}" in t:
            out[f"{key}.{leaf}"] = torch.stack([t[f"{gate}.{leaf}"].reshape(()).float(),
                                                t[f"{up}.{leaf}"].reshape(()).float()])
    return out


def decode_fused(t: dict[str, torch.Tensor], key: str, fmt: str, dtype: torch.dtype) -> torch.Tensor:
    """The fused gate-up weight `key` [2I, K] decoded as `decode_operand` decodes each half (NVFP4: row half j
    with weight_scale_2[j])."""
    if fmt != NVFP4:
        return decode_operand(t, key, fmt, dtype)
    n = t[f"{key}.weight"].shape[0] // 2
    halves = []
    for j, rows in enumerate((slice(0, n), slice(n, 2 * n))):
        half = {f"{key}.weight": t[f"{key}.weight"][rows], f"{key}.weight_scale": t[f"{key}.weight_scale"][rows],
                f"{key}.weight_scale_2": t[f"{key}.weight_scale_2"][j]}
        halves.append(decode_operand(half, key, fmt, dtype))
    return torch.cat(halves)


def _act(x: torch.Tensor, fmt: str, t: dict[str, torch.Tensor], key: str, emulate: bool) -> torch.Tensor:
    from .linear import emulate_activation_quant

    if not emulate or fmt == DENSE:
        return x
    return emulate_activation_quant(x, fmt, t.get(f"{key}.input_scale"))


# ---------------------------------------------------------------------------------------------- fp64 references

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
}


def _decode64(t: dict[str, torch.Tensor], key: str, fmt: str) -> torch.Tensor:
    """A packed operand's weight in fp64, exactly as the format defines it (NVFP4: e2m1 * scale exact in fp32,
    times weight_scale_2 in fp64; a fused operand's halves with their own weight_scale_2)."""
    from .quant import dequant_nvfp4

    if fmt != NVFP4:
        return decode_operand(t, key, fmt, torch.float32).double()
    w = dequant_nvfp4(t[f"{key}.weight"], t[f"{key}.weight_scale"], 1.0, name=key).double()
    ws2 = t[f"{key}.weight_scale_2"].double().reshape(-1)
    if ws2.numel() == 2:  # fused gate-up: rows [0, I) and [I, 2I)
        return w * ws2.repeat_interleave(w.shape[0] // 2)[:, None]
    return w * ws2[0]


def _swiglu64(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1.0) * (gate * torch.sigmoid(alpha * gate))


def _attention64(q, k, v, q_pos, scale, allowed=None) -> torch.Tensor:
    """fp64 GQA attention of q [B, T, Hq, D] over k, v [B, L, Hkv, D], keys <= q_pos; `allowed(sl)` ->
    bool [B, Hkv, t, L] restricts further (MSA blocks). One query at a time keeps memory linear."""
    B, T, Hq, D = q.shape
    L, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    kf = k.double().permute(0, 2, 1, 3)  # [B, Hkv, L, D]
    vf = v.double().permute(0, 2, 1, 3)
    out = torch.empty(B, T, Hq, D, dtype=torch.float64)
    k_pos = torch.arange(L)
    for t0 in range(T):
        qg = q[:, t0].double().view(B, Hkv, G, D)
        s = torch.einsum("bhgd,bhld->bhgl", qg, kf) * scale
        keep = (k_pos[None, :] <= q_pos[:, t0, None])[:, None, None, :]
        if allowed is not None:
            keep = keep & allowed(t0)[:, :, None, :]
        p = torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1)
        out[:, t0] = torch.einsum("bhgl,bhld->bhgd", p, vf).reshape(B, Hq, D)
    return out


def fp64_outputs(op: str, t: dict[str, torch.Tensor], p: dict, emulate: bool) -> dict[str, torch.Tensor]:
    """The fp64 version (`FP64`) of each float output of an entry with tensors `t` and params `p`."""
    out: dict[str, torch.Tensor] = {}
    if op == "rmsnorm":
        for norm in ("input_layernorm", "post_attention_layernorm"):
            if f"{norm}.x" in t:
                x = t[f"{norm}.x"].double()
                y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + p["eps"])
                out[f"{norm}.y"] = y * (1.0 + t[f"{norm}.weight"].double())
    elif op == "router":
        logits = t["x"].double() @ t["gate_weight"].double().T
        chosen = torch.sigmoid(logits).gather(-1, t["expert_ids"].long())
        out.update(logits=logits, weights=chosen / chosen.sum(-1, keepdim=True))
    elif op in ("mxfp8_linear", "nvfp4_linear"):
        fmt, key = (p["format"], "w") if op == "mxfp8_linear" else (NVFP4, "w1")
        out["y"] = _act(t["x"], fmt, t, key, emulate).double() @ _decode64(t, key, fmt).T
        if "y2" in t:
            out["y2"] = _act(t["h"], NVFP4, t, "w2", emulate).double() @ _decode64(t, "w2", NVFP4).T
        if "x_hat" in t:
            out["x_hat"] = t["x_hat"].double()
    elif op == "moe":
        out["y"] = _moe64(t, p, emulate)
    elif op == "attention":
        out["o"] = _attention64(t["q"], t["k"], t["v"], t["q_pos"], p["scale"])
    elif op == "indexer":
        from .msa import mask_future

        if "scores" in t:
            out["scores"] = mask_future(torch.einsum("bthd,bld->bhtl", t["iq"].double(), t["ik"].double()),
                                        t["q_pos"])
    elif op == "msa":
        blocks, bs, L = t["blocks"], p["block_size"], t["k"].shape[1]
        key_block = torch.arange(L) // bs

        def allowed(t0: int) -> torch.Tensor:  # [B, Hkv, 1, L]
            return (key_block[None, None, :, None] == blocks[:, :, t0, None, :]).any(-1)

        out["o"] = _attention64(t["q"], t["k"], t["v"], t["q_pos"], p["scale"], allowed)
    return out


def _moe64(t: dict[str, torch.Tensor], p: dict, emulate: bool) -> torch.Tensor:
    from .moe import route

    x = t["x"]
    fmts = p["formats"]
    r = route(x, t["gate_weight"], t.get("bias"), p["top_k"], t.get("expert_mask"))  # the reference's choice
    logits = x.double() @ t["gate_weight"].double().T
    chosen = torch.sigmoid(logits).gather(-1, r.expert_ids)
    weights = chosen / chosen.sum(-1, keepdim=True)

    def lin(a: torch.Tensor, key: str) -> torch.Tensor:
        fmt = fmts[key]
        a = _act(a.float() if emulate and fmt != DENSE else a, fmt, t, key, emulate)
        return a.double() @ _decode64(t, key, fmt).T

    def mlp(a: torch.Tensor, g: str, u: str, d: str) -> torch.Tensor:
        return lin(_swiglu64(lin(a, g), lin(a, u), p["alpha"], p["limit"]), d)

    y = torch.zeros(x.shape, dtype=torch.float64)
    for e in p["used_experts"]:  # ascending expert id, as the reference
        rows, slot = (r.expert_ids == e).nonzero(as_tuple=True)
        if rows.numel():
            y[rows] += mlp(x[rows], f"experts.{e}.w1", f"experts.{e}.w3", f"experts.{e}.w2") * weights[rows, slot,
                                                                                                       None]
    y = y * p["scaling"]
    if p["shared_expert"]:
        y = y + mlp(x, "shared.gate_proj", "shared.up_proj", "shared.down_proj")
    return y


def add_fp64(e: Entry, emulate: bool) -> None:
    """Put the fp64 version of each of `e`'s float outputs (`{name}.fp64`, role "fp64")."""
    for name, t in fp64_outputs(e.op, e.tensors, e.params, emulate).items():
        e.put(f"{name}.fp64", t, "fp64")


# ---------------------------------------------------------------------------------------------- paging


def block_table(seq_lens: Sequence[int], page: int, seed: int) -> torch.Tensor:
    """int32 [B, max_pages]: page ids of each row's tokens (a seeded permutation of 0..P-1), -1 padded."""
    need = [-(-n // page) for n in seq_lens]
    perm = torch.randperm(sum(need), generator=torch.Generator().manual_seed(seed)).to(torch.int32)
    table = torch.full((len(seq_lens), max(need)), -1, dtype=torch.int32)
    start = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[start: start + n]
        start += n
    return table


def to_pages(buf: torch.Tensor, table: torch.Tensor, seq_lens: Sequence[int], page: int) -> torch.Tensor:
    """Cache storage `buf` [B, S, ...] cut into pages [P, page, ...] by `table`; slots past a row's
    length are zero."""
    P = int((table >= 0).sum())
    pages = torch.zeros((P, page, *buf.shape[2:]), dtype=buf.dtype)
    for b, n in enumerate(seq_lens):
        for j in range(-(-n // page)):
            m = min(page, n - j * page)
            pages[int(table[b, j]), :m] = buf[b, j * page: j * page + m].cpu()
    return pages


def from_pages(pages: torch.Tensor, table: torch.Tensor, seq_lens: Sequence[int], length: int,
               dtype: torch.dtype, kv_scale: float) -> torch.Tensor:
    """Rows rebuilt from pages: [B, length, ...] in `dtype`, zero past each row's length."""
    page = pages.shape[1]
    out = torch.zeros((len(seq_lens), length, *pages.shape[2:]), dtype=dtype)
    for b, n in enumerate(seq_lens):
        for p0 in range(0, min(n, length), page):
            m = min(page, n - p0, length - p0)
            blk = pages[int(table[b, p0 // page]), :m]
            out[b, p0: p0 + m] = (blk.float() * kv_scale).to(dtype) if blk.dtype == torch.float8_e4m3fn else blk
    return out


# ---------------------------------------------------------------------------------------------- capture


class _ReadOnce:
    """A checkpoint whose tensors are read (or, synthetic, generated) once per export: every phase's entries
    share them."""

    def __init__(self, ck: Checkpoint):
        self._ck, self._read = ck, {}

    def read(self, name: str) -> torch.Tensor:
        if name not in self._read:
            self._read[name] = self._ck.read(name)
        return self._read[name]

    def __getattr__(self, name: str):
        return getattr(self._ck, name)


class _Capture:
    """Module hooks and a `Trace` that record the chosen ops during forwards."""

    def __init__(self, model, ck: Checkpoint, ops: set[str], layers: set[int], chunk: int | None = None):
        self.model, self.ck, self.ops, self.layers = model, _ReadOnce(ck), ops, layers
        self.chunk = chunk  # attention cores captured in query chunks of this many elements (None: one chunk)
        self.writer: BundleWriter | None = None  # given: a layer's finished entries are written when the next starts
        self.entries: dict[tuple[str, int, str], Entry] = {}
        self.phase = ""
        self.handles: list = []
        self.routing: dict[int, object] = {}
        self.emulate = getattr(model, "act_quant", "none") == "emulate"

    def entry(self, op: str, layer: int, tag: str = "") -> Entry:
        key = (op, layer, self.phase, tag)
        if key not in self.entries:
            self.entries[key] = Entry(op, layer, self.phase, tag=tag)
        return self.entries[key]

    # ---- install / remove
    def __enter__(self) -> _Capture:
        for L, layer in enumerate(self.model.layers):
            self.handles.append(layer.register_forward_pre_hook(self._flush_hook(L)))
            if L not in self.layers:
                continue
            if "rmsnorm" in self.ops:
                for norm in ("input_layernorm", "post_attention_layernorm"):
                    self.handles.append(getattr(layer, norm).register_forward_hook(self._norm_hook(L, norm)))
            if "mxfp8_linear" in self.ops:
                for prefix, module in mxfp8_linears_of(self.ck, L):
                    lin = self.model.get_submodule(module)
                    self.handles.append(lin.register_forward_hook(self._mxfp8_hook(L, prefix)))
            if hasattr(layer, "block_sparse_moe"):
                moe = layer.block_sparse_moe
                self.handles.append(moe.gate.register_forward_hook(self._router_hook(L)))
                self.handles.append(moe.register_forward_hook(self._moe_hook(L)))
        return self

    def trace(self):
        """The `Trace` a captured forward takes: the attention cores of the chosen layers, when an attention op is
        chosen."""
        from .model import Trace

        wanted = self.layers if self.ops & set(ATTENTION_OPS) else set()
        return Trace(layers=set(), attention_layers=set(wanted), attention_chunk_elements=self.chunk)

    def take(self) -> list[Entry]:
        """The current phase's entries (listed in bundle order), handed over to be written; the operands read for
        them are let go."""
        self.ck._read.clear()
        keys = sorted((k for k in self.entries if k[2] == self.phase), key=_entry_order)
        return [self.entries.pop(k) for k in keys]

    def record_attention(self, trace) -> None:
        """The attention entries of one forward, from its trace."""
        for L, core in sorted(trace.attention.items()):
            if "blocks" in core:
                self._msa(L, core)
            else:
                self._causal(L, core)

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    # ---- hooks
    def _flush_hook(self, L: int):
        """Before layer L runs: write the finished entries of the layers before it (not the attention ones: those
        come from the trace after the forward, with the step's paged views)."""
        def hook(module, args):
            if self.writer is None:
                return
            keys = [k for k in self.entries if k[2] == self.phase and k[1] < L and k[0] not in ATTENTION_OPS]
            self.writer.add([self.entries.pop(k) for k in sorted(keys, key=_entry_order)])
        return hook

    def _norm_hook(self, L: int, norm: str):
        def hook(module, args, out):
            e = self.entry("rmsnorm", L)
            e.put(f"{norm}.x", args[0], "input")
            e.put(f"{norm}.weight", module.weight, "input")
            e.put(f"{norm}.y", out, "output")
            e.params["eps"] = module.eps
        return hook

    def _mxfp8_hook(self, L: int, prefix: str):
        def hook(module, args, out):
            e = self.entry("mxfp8_linear", L, prefix.removeprefix(f"{TEXT_PREFIX}layers.{L}."))
            e.put("x", args[0], "input")
            fmt = put_linear(e, self.ck, prefix, "w")
            e.put("y", out, "output")
            e.params.update({"linear": prefix, "format": fmt})
        return hook

    def _router_hook(self, L: int):
        def hook(module, args, out):
            self.routing[L] = out
            if "router" not in self.ops:
                return
            e = self.entry("router", L)
            e.put("x", args[0], "input")
            e.put("gate_weight", module.weight, "input")
            if module.e_score_correction_bias is not None:
                e.put("bias", module.e_score_correction_bias, "input")
            if module.expert_mask is not None:
                e.put("expert_mask", module.expert_mask, "input")
            e.put("expert_ids", out.expert_ids, "output")
            e.put("weights", out.weights, "output")
            e.put("logits", out.logits, "output")
            e.params["top_k"] = module.top_k
        return hook

    def _moe_hook(self, L: int):
        def hook(module, args, out):
            flat = args[0].reshape(-1, args[0].shape[-1])
            routing = self.routing.pop(L)
            if "moe" in self.ops:
                self._moe_entry(L, module, flat, routing, out.reshape(flat.shape))
            if "nvfp4_linear" in self.ops:
                self._nvfp4_entry(L, module, flat, routing)
        return hook

    def _moe_entry(self, L: int, module, flat, routing, y) -> None:
        e = self.entry("moe", L)
        e.put("x", flat, "input")
        e.put("gate_weight", module.gate.weight, "input")
        if module.gate.e_score_correction_bias is not None:
            e.put("bias", module.gate.e_score_correction_bias, "input")
        if module.gate.expert_mask is not None:
            e.put("expert_mask", module.gate.expert_mask, "input")
        used = sorted(set(routing.expert_ids.flatten().tolist()))
        base = f"{TEXT_PREFIX}layers.{L}.block_sparse_moe."
        formats = {}
        if module.shared_experts is not None:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                formats[f"shared.{proj}"] = put_linear(e, self.ck, f"{base}shared_experts.{proj}", f"shared.{proj}")
            put_fused(e, "shared.gate_proj", "shared.up_proj", "shared.gate_up", formats["shared.gate_proj"],
                      f"{base}shared_experts.gate_up")
        for x in used:
            for leaf in ("w1", "w2", "w3"):
                formats[f"experts.{x}.{leaf}"] = put_linear(e, self.ck, f"{base}experts.{x}.{leaf}",
                                                            f"experts.{x}.{leaf}")
            put_fused(e, f"experts.{x}.w1", f"experts.{x}.w3", f"experts.{x}.w13", formats[f"experts.{x}.w1"],
                      f"{base}experts.{x}.w13")
        e.put("y", y, "output")
        e.params.update({"top_k": module.gate.top_k, "scaling": module.scaling, "alpha": module.experts.alpha,
                         "limit": module.experts.limit, "num_experts": int(module.gate.weight.shape[0]),
                         "used_experts": used, "formats": formats,
                         "shared_expert": module.shared_experts is not None})

    def _nvfp4_entry(self, L: int, module, flat, routing) -> None:
        from .linear import emulate_activation_quant
        from .mlp import swiglu_oai

        base = f"{TEXT_PREFIX}layers.{L}.block_sparse_moe.experts."
        if self.ck.formats[f"{base}0.w1"].fmt != NVFP4:
            return
        ex = module.experts
        counts = torch.bincount(routing.expert_ids.flatten().cpu(), minlength=ex.num_experts)
        x_id = int(torch.argmax(counts))  # first maximum: ties go to the lower id
        tokens = (routing.expert_ids == x_id).any(-1).nonzero().flatten()
        x = flat[tokens]

        def act(t, leaf):
            if not ex.emulate_act_quant:
                return t
            return emulate_activation_quant(t, ex.act_format, getattr(ex, f"{leaf}_input_scale")[x_id])

        gate = F.linear(act(x, "w1"), ex.weight("w1", x_id))  # decoded now when the model keeps weights packed
        up = F.linear(act(x, "w3"), ex.weight("w3", x_id))
        h = swiglu_oai(gate, up, ex.alpha, ex.limit)
        e = self.entry("nvfp4_linear", L)
        e.put("x", x, "input")
        e.put("h", h, "input")
        for leaf in ("w1", "w2"):
            put_linear(e, self.ck, f"{base}{x_id}.{leaf}", leaf)
        e.put("y", gate, "output")
        e.put("y2", F.linear(act(h, "w2"), ex.weight("w2", x_id)), "output")
        if self.emulate:
            e.put("x_hat", act(x, "w1"), "output")
        e.params.update({"expert": x_id, "tokens": tokens.tolist(), "format": NVFP4})

    # ---- attention, from the trace
    def _causal(self, L: int, core: dict) -> None:
        if "attention" not in self.ops:
            return
        e = self.entry("attention", L)
        for name in ("q", "k", "v", "q_pos"):
            e.put(name, core[name], "input")
        e.put("o", core["o"], "output")
        e.params.update({"scale": core["scale"], "chunk_elements": core["chunk_elements"]})

    def _msa(self, L: int, core: dict) -> None:
        from .attention import ONE_CHUNK
        from .msa import index_scores, query_chunk

        geometry = {name: core[name] for name in ("block_size", "topk_blocks", "local_blocks", "init_blocks")}
        T = core["q"].shape[1]
        if core["chunk_elements"] != ONE_CHUNK:  # the engine's query chunks (`msa.msa_attention`)
            geometry["query_chunk"] = query_chunk(core["q"], core["k"], core["iq"], core["block_size"],
                                                  core["topk_blocks"], core["chunk_elements"])
        if "indexer" in self.ops:
            e = self.entry("indexer", L)
            for name in ("iq", "ik", "q_pos"):
                e.put(name, core[name], "input")
            if geometry.get("query_chunk", T) >= T:  # [B, Hi, T, L] is quadratic: left out of a chunked capture
                e.put("scores", index_scores(core["iq"], core["ik"], core["q_pos"]), "output")
            e.put("blocks", core["blocks"], "output")
            e.params.update(geometry)
        if "msa" in self.ops:
            e = self.entry("msa", L)
            for name in ("q", "k", "v", "iq", "ik", "q_pos"):
                e.put(name, core[name], "input")
            e.put("o", core["o"], "output")
            e.put("blocks", core["blocks"], "output")
            e.params.update({**geometry, "scale": core["scale"]})

    # ---- paged views after a step
    def add_pages(self, cache, seq_lens: list[int], page: int, seed: int, q_lens: list[int]) -> None:
        """Paged views of the step's cache, and the varlen query offsets: `cu_seqlens_q` int32 [B + 1], row b's
        real queries are q[b, :q_lens[b]] (right padding excluded), packed at cu_seqlens_q[b]."""
        table = block_table(seq_lens, page, seed)
        cu = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0).to(torch.int32)
        for (op, L, phase, _), e in self.entries.items():
            if phase != self.phase or op not in ("attention", "msa", "indexer"):
                continue
            e.put("block_table", table, "paged")
            e.put("seq_lens", torch.tensor(seq_lens, dtype=torch.int32), "paged")
            e.put("cu_seqlens_q", cu, "paged")
            if op in ("attention", "msa"):
                e.put("k_pages", to_pages(cache.k[L], table, seq_lens, page), "paged")
                e.put("v_pages", to_pages(cache.v[L], table, seq_lens, page), "paged")
            if op in ("msa", "indexer"):
                e.put("index_k_pages", to_pages(cache.index_k[L], table, seq_lens, page), "paged")
            e.params["page_size"] = page


# The linears of a layer that may be MXFP8, in the order their entries are listed (their `tag`s).
MXFP8_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "self_attn.index_q_proj", "self_attn.index_k_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                 "block_sparse_moe.shared_experts.gate_proj", "block_sparse_moe.shared_experts.up_proj",
                 "block_sparse_moe.shared_experts.down_proj")


def mxfp8_linears_of(ck: Checkpoint, layer: int) -> list[tuple[str, str]]:
    """(tensor prefix, engine module path) of every MXFP8 linear of `layer`, in `MXFP8_LINEARS` order."""
    p = f"{TEXT_PREFIX}layers.{layer}."
    out = []
    for leaf in MXFP8_LINEARS:
        f = ck.formats.get(p + leaf)
        if f is not None and f.fmt == MXFP8:
            out.append((p + leaf, ck.linears[p + leaf].module))
    return out


def mxfp8_linear_of(ck: Checkpoint, layer: int) -> tuple[str, str] | None:
    """(tensor prefix, engine module path) of the first MXFP8 linear of `layer`, or None."""
    found = mxfp8_linears_of(ck, layer)
    return found[0] if found else None


def _entry_order(key: tuple[str, int, str, str]) -> tuple:
    op, layer, phase, tag = key
    return OPS.index(op), layer, phase, MXFP8_LINEARS.index(tag) if tag in MXFP8_LINEARS else -1, tag


def available_ops(ck: Checkpoint, layer: int) -> set[str]:
    """The ops the engine computes at `layer` of checkpoint `ck`."""
    t = ck.config.text
    ops = {"rmsnorm"}
    ops.add("indexer" if t.sparse_layers[layer] else "attention")
    if t.sparse_layers[layer]:
        ops.add("msa")
    if t.moe_layers[layer]:
        ops.update({"router", "moe"})
        if ck.formats[f"{TEXT_PREFIX}layers.{layer}.block_sparse_moe.experts.0.w1"].fmt == NVFP4:
            ops.add("nvfp4_linear")
    if mxfp8_linear_of(ck, layer) is not None:
        ops.add("mxfp8_linear")
    return ops


def parse_ops(text: str | None) -> tuple[list[str], bool]:
    """(ops, explicit) from a comma list (None = all ops, not explicit)."""
    if text is None:
        return list(OPS), False
    ops = [o.strip() for o in text.split(",") if o.strip()]
    bad = [o for o in ops if o not in OPS]
    if bad or not ops:
        raise InputError(f"--ops: unknown op {bad[0] if bad else text!r} (known: {', '.join(OPS)})")
    return ops, True


def parse_layers(text: str | None, n_layers: int) -> list[int]:
    """Layer indices from a comma list with ranges (`1,3-5`); None or `all` = every layer."""
    if text is None or text.strip() == "all":
        return list(range(n_layers))
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        try:
            lo, _, hi = part.partition("-")
            rng = range(int(lo), int(hi or lo) + 1)
        except ValueError:
            raise InputError(f"--layers: {part!r} is not a layer index or range") from None
        bad = [L for L in rng if not 0 <= L < n_layers]
        if bad or not rng:
            raise InputError(f"--layers: layer {bad[0] if bad else part} is outside [0, {n_layers})")
        out.update(rng)
    return sorted(out)


@torch.no_grad()
def export_golden(model, prompts: Sequence[Sequence[int]], out: str | Path, *, ops: Sequence[str] = OPS,
                  layers: Sequence[int] | None = None, explicit_ops: bool = False, decode_steps: int = 1,
                  page_size: int | None = None, seed: int = 0, prompt_texts: Sequence[str] | None = None,
                  fp64: bool = False, chunk_elements: int | None = None) -> dict:
    """Run prefill + `decode_steps` greedy decode steps on `prompts` (token ids) and write the bundle.

    Ops missing at a chosen layer are skipped; with `explicit_ops`, an op found at none of the chosen
    layers is an InputError. fp64: add each float output's fp64 version (`FP64`). chunk_elements: capture the
    attention cores in the engine's query chunks of this many elements (`CHUNKED_NOTE`); None: one call per core
    unless that call's scores would exceed `ONE_CALL_ELEMENTS`, then chunks of `CAPTURE_CHUNK`. Entries are
    written as they are complete (a layer's when the next starts). Returns the manifest.
    """
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InputError(f"--out {out}: exists and is not an empty folder")
    world = getattr(model, "world", None)
    if world is not None and world.size > 1:
        raise InputError("golden captures whole tensors: load the model in one process (no tensor parallelism)")
    ck = checkpoint_of(model)
    text = model.text
    layers = list(range(text.num_hidden_layers)) if layers is None else list(layers)
    for op in ops:
        if op not in OPS:
            raise InputError(f"--ops: unknown op {op!r} (known: {', '.join(OPS)})")
        if explicit_ops and not any(op in available_ops(ck, L) for L in layers):
            kinds = sorted({text.layer_kind(L) for L in layers})
            raise InputError(f"--ops {op}: no chosen layer computes it (layers {layers} are {', '.join(kinds)})")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise InputError("golden needs at least one non-empty prompt")
    if decode_steps < 0:
        raise InputError(f"--decode-steps {decode_steps} must be >= 0")
    page = page_size or text.sparse.block_size
    if page < 1:
        raise InputError(f"--page-size {page} must be >= 1")
    rt = getattr(model, "runtime", None)
    kv_dtype = rt.kv_cache_dtype if rt else "auto"
    lengths = [len(p) for p in prompts]
    B, T = len(prompts), max(lengths)
    max_len = rt.max_seq_len if rt else T + decode_steps
    if T + decode_steps > max_len:
        raise InputError(f"prompt ({T} tokens) + {decode_steps} decode steps exceed --max-model-len {max_len}")
    device = model.device
    ids = torch.zeros(B, T, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = torch.tensor(list(p), dtype=torch.long, device=device)
    if chunk_elements is None:  # one chunk while the one-call core stays small; else the engine's query chunks
        heads = max(text.num_attention_heads, text.sparse.index_heads if any(text.sparse_layers) else 0)
        chunk_elements = CAPTURE_CHUNK if B * heads * T * (T + decode_steps) > ONE_CALL_ELEMENTS else None
    emulate = getattr(model, "act_quant", "none") == "emulate"
    decoded: list[list[int]] = [[] for _ in prompts]
    manifest = {
        "format": FORMAT,
        "checkpoint": str(model.ckpt_path) if model.ckpt_path is not None else None,
        "synthetic": getattr(model, "synthetic", None) if model.ckpt_path is None else None,
        "producer": producer(),
        "numerics": {"dtype": str(model.dtype).replace("torch.", ""), "act_quant": getattr(model, "act_quant", "none"),
                     "kv_cache_dtype": kv_dtype, "kv_scale": 1.0},
        "seeds": {"page_permutation": seed, "note": "phase i of a bundle uses seed + i (prefill: seed); "
                  "decoding is greedy, so no sampling seed"},
        "model": {"hidden_size": text.hidden_size, "num_attention_heads": text.num_attention_heads,
                  "num_key_value_heads": text.num_key_value_heads, "head_dim": text.head_dim,
                  "num_local_experts": text.num_local_experts, "num_experts_per_tok": text.num_experts_per_tok,
                  "rms_norm_eps": text.rms_norm_eps, "msa_block_size": text.sparse.block_size,
                  "msa_topk_blocks": text.sparse.topk_blocks},
        "prompts": [{"input_ids": list(map(int, p)), **({"text": prompt_texts[i]} if prompt_texts else {})}
                    for i, p in enumerate(prompts)],
        "decoded_token_ids": decoded,
        "page_size": page,
        "attention_capture": ({"chunk_elements": chunk_elements, "note": CHUNKED_NOTE} if chunk_elements
                              else {"chunk_elements": None, "note": "each attention core captured as one call"}),
        "ops": list(ops),
        "layers": layers,
        "recompute": RECOMPUTE,
        "contracts": {op: contract(op, str(model.dtype).replace("torch.", ""), fp64) for op in ops},
        "tolerance_rule": TOLERANCE_RULE,
        "weights_files": [],
        "entries": [],
    }
    device = model.device
    ids = torch.zeros(B, T, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = torch.tensor(list(p), dtype=torch.long, device=device)
    cache = model.new_cache(B, T + decode_steps, kv_dtype)
    # written under a temporary name and renamed when complete: a failure (a full disk) leaves nothing behind;
    # each phase's entries are written (and dropped) when the phase is done
    with staged_folder(out) as tmp, _Capture(model, ck, set(ops), set(layers), chunk_elements) as cap:
        writer = cap.writer = BundleWriter(tmp, manifest, fp64=fp64, emulate=emulate)
        cap.phase = "prefill"
        trace = cap.trace()
        logits = model(ids, positions=torch.arange(T, device=device).expand(B, T), cache=cache, trace=trace)
        cap.record_attention(trace)
        trace.reset()
        cap.add_pages(cache, lengths, page, seed, lengths)
        writer.add(cap.take())
        nxt = torch.stack([logits[b, n - 1].argmax() for b, n in enumerate(lengths)])
        del logits
        for step in range(decode_steps):
            cap.phase = f"decode{step}"
            for b in range(B):
                decoded[b].append(int(nxt[b]))
            pos = torch.tensor([n + step for n in lengths], device=device)[:, None]
            trace = cap.trace()
            logits = model(nxt[:, None], positions=pos, cache=cache, trace=trace)
            cap.record_attention(trace)
            trace.reset()
            cap.add_pages(cache, [n + step + 1 for n in lengths], page, seed + step + 1, [1] * B)
            writer.add(cap.take())
            nxt = logits[:, 0].argmax(-1)
        writer.finish()
    return manifest


class BundleWriter:
    """Writes a bundle's entries into the staging folder `tmp` as they are complete (`add`: each entry's own file,
    its manifest row, and the packed operands not yet stored; the entries' tensors are then dropped, so a long
    export holds about one layer's entries at a time), and at the end the manifest (`finish`). Each packed operand is
    stored once: in `weights/layerNNN.safetensors` when the layer's first phase uses it, in
    `weights/layerNNN_{phase}.safetensors` when a later phase first does (a routed expert chosen only there)."""

    def __init__(self, tmp: Path, manifest: dict, *, fp64: bool = False, emulate: bool = False):
        self.tmp, self.manifest, self.fp64, self.emulate = tmp, manifest, fp64, emulate
        manifest.setdefault("weights_files", [])
        manifest.setdefault("entries", [])
        if fp64:
            manifest["numerics"]["fp64_outputs"] = True
        self.stored: dict[tuple[int, str], str] = {}  # (layer, key) -> the weights file holding it
        self.largest = 0  # elements of the largest tensor written

    def add(self, entries: Sequence[Entry]) -> None:
        new: dict[int, dict[str, torch.Tensor]] = {}
        for e in entries:
            for name, key in e.shared.items():
                if (e.layer, key) not in self.stored:
                    new.setdefault(e.layer, {}).setdefault(key, e.tensors[name])
        for L, tensors in sorted(new.items()):
            rel, n = weights_file(L), 0
            while (self.tmp / rel).exists():
                n += 1
                rel = weights_file(L).replace(".safetensors", f"_{entries[0].phase}{f'_{n}' if n > 1 else ''}"
                                                               ".safetensors")
            (self.tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(self.tmp / rel), metadata={"layer": str(L)})
            self.manifest["weights_files"].append({"file": rel, "layer": L, "sha256": sha256(self.tmp / rel)})
            self.stored.update({(L, key): rel for key in tensors})
        del new
        for e in entries:
            if self.fp64:
                add_fp64(e, self.emulate)
            path = self.tmp / e.file
            path.parent.mkdir(parents=True, exist_ok=True)
            own = {n: t for n, t in e.tensors.items() if n not in e.shared}
            self.largest = max([self.largest, *(t.numel() for t in own.values())])
            save_file(own, str(path), metadata={"op": e.op, "layer": str(e.layer), "phase": e.phase})
            self.manifest["entries"].append({
                "file": e.file, "op": e.op, "layer": e.layer, "phase": e.phase, **({"tag": e.tag} if e.tag else {}),
                "params": e.params,
                "sha256": sha256(path),
                "tensors": {n: tensor_meta(e, n, t, self.stored.get((e.layer, e.shared.get(n, "")))) for n, t in
                            e.tensors.items()},
                "tolerance": {n: tolerance(e.op, n, t) for n, t in e.tensors.items() if e.roles[n] == "output"}})
            e.tensors = {}  # written: the entry's memory is released

    def finish(self) -> None:
        self.manifest["entries"].sort(key=lambda m: _entry_order((m["op"], m["layer"], m["phase"], m.get("tag", ""))))
        (self.tmp / MANIFEST).write_text(json.dumps(self.manifest, indent=1) + "\n")


def write_bundle(out: Path, manifest: dict, entries: Sequence[Entry], *, fp64: bool = False,
                 emulate: bool = False) -> None:
    """Write `entries` (their packed operands once per layer under weights/) and `manifest` (its `entries` and
    `weights_files` filled here) into the new folder `out`; fp64: add each entry's fp64 outputs first."""
    # written under a temporary name and renamed when complete: a failure (a full disk) leaves nothing behind
    with staged_folder(out) as tmp:
        w = BundleWriter(tmp, manifest, fp64=fp64, emulate=emulate)
        w.add(entries)
        w.finish()


# ---------------------------------------------------------------------------------------------- replay


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact comparison: same dtype, shape and values."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _replay_linear(t: dict, key: str, fmt: str, x: torch.Tensor, dtype: torch.dtype, emulate: bool) -> torch.Tensor:
    return F.linear(_act(x, fmt, t, key, emulate), decode_operand(t, key, fmt, dtype))


def _replay_moe(t: dict, p: dict, dtype: torch.dtype, emulate: bool) -> torch.Tensor:
    from .linear import set_activation_formats
    from .mlp import MLP
    from .moe import Experts, Routing, route

    x = t["x"]
    H = x.shape[-1]
    routing = route(x, t["gate_weight"], t.get("bias"), p["top_k"], t.get("expert_mask"))
    used = p["used_experts"]
    fmts = p["formats"]
    ws = {leaf: torch.stack([decode_operand(t, f"experts.{e}.{leaf}", fmts[f"experts.{e}.{leaf}"], dtype)
                             for e in used]) for leaf in ("w1", "w2", "w3")}
    act = {fmt for leaf in ws for fmt in [fmts[f"experts.{used[0]}.{leaf}"]] if fmt != DENSE}
    ex = Experts(len(used), H, ws["w1"].shape[1], p["alpha"], p["limit"], act_format=min(act, default=None),
                 emulate=emulate)
    for leaf, w in ws.items():
        setattr(ex, leaf, torch.nn.Parameter(w, requires_grad=False))
        scales = [t.get(f"experts.{e}.{leaf}.input_scale") for e in used]
        if all(s is not None for s in scales):
            setattr(ex, f"{leaf}_input_scale", torch.stack([s.reshape(()) for s in scales]))
        else:
            setattr(ex, f"{leaf}_input_scale", torch.ones(len(used)))
    local = torch.searchsorted(torch.tensor(used), routing.expert_ids)
    y = ex(x, Routing(local, routing.weights, routing.logits)) * p["scaling"]
    if p["shared_expert"]:
        projs = ("gate_proj", "up_proj", "down_proj")
        shared = {proj: decode_operand(t, f"shared.{proj}", fmts[f"shared.{proj}"], dtype) for proj in projs}
        mlp = MLP(H, shared["gate_proj"].shape[0], p["alpha"], p["limit"])
        set_activation_formats(mlp, {proj: fmts[f"shared.{proj}"] for proj in projs}, emulate)
        for proj, w in shared.items():
            lin = getattr(mlp, proj)
            lin.weight = torch.nn.Parameter(w, requires_grad=False)
            lin.input_scale = t.get(f"shared.{proj}.input_scale")
        y = y + mlp(x).float()
    return y.to(x.dtype)


Check = tuple[str, torch.Tensor, torch.Tensor]  # (name, recomputed, stored)


def _fused_checks(t: dict, p: dict, dtype: torch.dtype) -> list[Check]:
    """The fused gate-up operands of a moe entry decode to its gate rows then its up rows."""
    fmts = p["formats"]
    pairs = [(f"experts.{e}.w13", f"experts.{e}.w1", f"experts.{e}.w3") for e in p["used_experts"]]
    if p.get("shared_expert"):
        pairs.append(("shared.gate_up", "shared.gate_proj", "shared.up_proj"))
    checks = []
    for key, gate, up in pairs:
        if f"{key}.weight" in t:
            sep = torch.cat([decode_operand(t, gate, fmts[gate], dtype), decode_operand(t, up, fmts[up], dtype)])
            checks.append((f"{key} (fused)", decode_fused(t, key, fmts[gate], dtype), sep))
    return checks


def _replay_entry(t: dict, p: dict, op: str, dtype: torch.dtype, emulate: bool, kv_scale: float) -> list[Check]:
    """(check name, recomputed, stored) for every output of one entry (and its fp64 outputs, when stored)."""
    checks = _replay_outputs(t, p, op, dtype, emulate, kv_scale)
    if any(n.endswith(".fp64") for n in t):
        checks += [(f"{n}.fp64", v, t[f"{n}.fp64"]) for n, v in fp64_outputs(op, t, p, emulate).items()]
    return checks


def _replay_outputs(t: dict, p: dict, op: str, dtype: torch.dtype, emulate: bool, kv_scale: float) -> list[Check]:
    from .moe import route
    from .norm import gemma_rms_norm

    checks: list[Check] = []
    if op == "rmsnorm":
        for norm in ("input_layernorm", "post_attention_layernorm"):
            if f"{norm}.x" in t:
                y = gemma_rms_norm(t[f"{norm}.x"], t[f"{norm}.weight"], p["eps"])
                checks.append((f"{norm}.y", y, t[f"{norm}.y"]))
    elif op == "router":
        r = route(t["x"], t["gate_weight"], t.get("bias"), p["top_k"], t.get("expert_mask"))
        checks += [("expert_ids", r.expert_ids, t["expert_ids"]), ("weights", r.weights, t["weights"]),
                   ("logits", r.logits, t["logits"])]
    elif op == "moe":
        checks.append(("y", _replay_moe(t, p, dtype, emulate), t["y"]))
        checks += _fused_checks(t, p, dtype)
    elif op == "nvfp4_linear":
        checks.append(("y", _replay_linear(t, "w1", NVFP4, t["x"], dtype, emulate), t["y"]))
        if "y2" in t:  # single-op bundles hold one GEMM
            checks.append(("y2", _replay_linear(t, "w2", NVFP4, t["h"], dtype, emulate), t["y2"]))
        if "x_hat" in t:
            checks.append(("x_hat", _act(t["x"], NVFP4, t, "w1", True), t["x_hat"]))
    elif op == "mxfp8_linear":
        checks.append(("y", _replay_linear(t, "w", p["format"], t["x"], dtype, emulate), t["y"]))
    elif op in ("attention", "indexer", "msa"):
        checks += _replay_attention(t, p, op, dtype, kv_scale, t, "")
        if "block_table" in t:
            checks += _replay_paged(t, p, op, dtype, kv_scale)
    return checks


def _replay_attention(t: dict, p: dict, op: str, dtype: torch.dtype, kv_scale: float, ref: dict, tag: str,
                      rows: torch.Tensor | None = None) -> list[Check]:
    """Recompute `op` from the inputs in `t`; compare with `ref` (only query rows `rows` [B, T] when given)."""
    from .attention import causal_attention
    from .msa import gather_block_attention, index_scores, select_blocks

    def cmp(name: str, got: torch.Tensor, want: torch.Tensor, dims: int) -> Check:
        if rows is None or got.shape != want.shape:
            return tag + name, got, want
        # dims: where the query axis is (1 for [B, T, ...], 2 for [B, H, T, ...])
        m = rows if dims == 1 else rows[:, None, :].expand(got.shape[0], got.shape[1], rows.shape[1])
        return tag + name, got[m], want[m]

    out = []
    if op == "attention":
        o = causal_attention(t["q"], t["k"], t["v"], t["q_pos"], p["scale"], chunk_elements=p["chunk_elements"])
        out.append(cmp("o", o, ref["o"], 1))
        return out
    T = t["q_pos"].shape[1]
    chunk = p.get("query_chunk", T)  # a chunked capture: the engine's query chunks, as `msa.msa_attention`
    scores, blocks, o = [], [], []
    for s0 in range(0, T, chunk):
        sl = slice(s0, s0 + chunk)
        sc = index_scores(t["iq"][:, sl], t["ik"], t["q_pos"][:, sl])
        blocks.append(select_blocks(sc, t["q_pos"][:, sl], p["block_size"], p["topk_blocks"], p["local_blocks"],
                                    p["init_blocks"]))
        if "scores" in ref:
            scores.append(sc)
        del sc
        if op == "msa":
            o.append(gather_block_attention(t["q"][:, sl], t["k"], t["v"], blocks[-1], t["q_pos"][:, sl],
                                            p["block_size"], p["scale"]))
    if op == "indexer" and scores:
        out.append(cmp("scores", torch.cat(scores, 2), ref["scores"], 2))
    out.append(cmp("blocks", torch.cat(blocks, 2), ref["blocks"], 2))
    if op == "msa":
        out.append(cmp("o", torch.cat(o, 1), ref["o"], 1))
    return out


def _replay_paged(t: dict, p: dict, op: str, dtype: torch.dtype, kv_scale: float) -> list[Check]:
    """Rebuild keys from the paged views, check them against the captured keys, recompute the op."""
    table, seq = t["block_table"], t["seq_lens"].tolist()
    rebuilt = dict(t)
    checks = []
    for name, pages in (("k", "k_pages"), ("v", "v_pages"), ("ik", "index_k_pages")):
        if pages not in t:
            continue
        want = t[name]
        got = from_pages(t[pages], table, seq, want.shape[1], want.dtype, kv_scale)
        checks.append((f"paged.{name}", torch.cat([got[b, :n] for b, n in enumerate(seq)]),
                       torch.cat([want[b, :n] for b, n in enumerate(seq)])))
        rebuilt[name] = got
    rows = t["q_pos"] < torch.tensor(seq)[:, None]
    return checks + _replay_attention(rebuilt, p, op, dtype, kv_scale, t, "paged.", rows)


def replay_bundle(path: str | Path) -> list[dict]:
    """Recompute every op of a golden bundle with the engine's functions; one row per check: file, check, ok
    (bit-exact), and the error sizes (`error_sizes`)."""
    path = Path(path)
    manifest = read_bundle_manifest(path)
    num = manifest["numerics"]
    dtype = getattr(torch, num["dtype"])
    emulate = num["act_quant"] == "emulate"
    results = []
    for ent in manifest["entries"]:
        tensors = entry_tensors(path, ent)
        try:
            checks = _replay_entry(tensors, ent["params"], ent["op"], dtype, emulate, num["kv_scale"])
        except KeyError as e:
            raise InputError(f"{path / ent['file']}: the bundle's {ent['op']} entry lacks {e.args[0]!r} (a damaged "
                             "or hand-edited bundle: export it again)") from None
        for name, got, want in checks:
            results.append({"file": ent["file"], "check": name, "ok": same(got, want), **error_sizes(got, want)})
    return results


def entry_tensors(path: Path, ent: dict) -> dict[str, torch.Tensor]:
    """Every tensor of manifest entry `ent` of bundle `path`: its own file's and its packed operands from the
    shared weights file. Fresh (allocator-aligned) copies: safetensors maps tensors at 8-byte offsets, and CPU
    BLAS takes different code paths (different rounding) for differently aligned small matrices."""
    tensors = {k: v.clone() for k, v in load_file(str(path / ent["file"])).items()}
    stored: dict[str, list[tuple[str, str]]] = {}
    for name, meta in ent.get("tensors", {}).items():
        if isinstance(meta, dict) and "stored" in meta:
            stored.setdefault(meta["stored"]["file"], []).append((name, meta["stored"]["key"]))
    for rel, names in stored.items():
        shared = load_file(str(path / rel))
        for name, key in names:
            if key in shared:
                tensors[name] = shared[key].clone()
    return tensors


# ---------------------------------------------------------------------------------------------- test API


@dataclass
class GoldenEntry:
    """One entry of a bundle, as `load` gives it: `inputs` (the op's operands, packed weights included),
    `outputs` (the reference's results), `params`, the op's numerics `contract` and per-output `tolerance`."""

    file: str
    op: str
    layer: int
    phase: str
    params: dict
    inputs: dict[str, torch.Tensor]
    outputs: dict[str, torch.Tensor]
    tolerance: dict[str, dict]
    contract: dict
    numerics: dict
    fp64: dict[str, torch.Tensor] = field(default_factory=dict)  # output name -> its fp64 version (when exported)

    @property
    def id(self) -> str:
        return self.file.removesuffix(".safetensors")


def load(path: str | Path, *, ops: Sequence[str] | None = None, verify: bool = True) -> list[GoldenEntry]:
    """The entries of golden bundle `path` (only those of `ops` when given). verify: check every file's sha256
    against the manifest (an InputError names the files that differ)."""
    path = Path(path)
    manifest = read_bundle_manifest(path)
    if verify:
        files = [(w["file"], w.get("sha256")) for w in manifest.get("weights_files", [])]
        files += [(e["file"], e.get("sha256")) for e in manifest["entries"]]
        bad = [f for f, h in files if h is not None and sha256(path / f) != h]
        if bad:
            raise InputError(f"{path}: {len(bad)} files differ from the manifest's sha256 ({', '.join(bad[:5])}); "
                             "export the bundle again, or load(verify=False) to read them anyway")
    out = []
    for ent in manifest["entries"]:
        if ops is not None and ent["op"] not in ops:
            continue
        t = entry_tensors(path, ent)
        roles = {n: m["role"] for n, m in ent["tensors"].items()}
        out.append(GoldenEntry(
            file=ent["file"], op=ent["op"], layer=ent["layer"], phase=ent["phase"], params=ent["params"],
            inputs={n: v for n, v in t.items() if roles.get(n) not in ("output", "fp64")},
            outputs={n: v for n, v in t.items() if roles.get(n) == "output"},
            fp64={n.removesuffix(".fp64"): v for n, v in t.items() if roles.get(n) == "fp64"},
            tolerance=ent.get("tolerance", {}), contract=manifest.get("contracts", {}).get(ent["op"], {}),
            numerics=manifest["numerics"]))
    return out


def error_sizes(got: torch.Tensor, want: torch.Tensor) -> dict:
    """max_abs, max_rel (over nonzero reference elements) and max_ulps (in the reference's dtype, at the
    reference value) of `got` against `want`, computed in fp64; equal elements (equal infinities included)
    count 0, a non-finite difference counts inf. A shape mismatch is an InputError."""
    if tuple(got.shape) != tuple(want.shape):
        raise InputError(f"output shape {tuple(got.shape)} differs from the reference's {tuple(want.shape)}")
    g, w = got.detach().cpu().double(), want.detach().cpu().double()
    if g.numel() == 0:
        return {"max_abs": 0.0, "max_rel": 0.0, "max_ulps": 0.0}
    equal = (g == w) | (torch.isnan(g) & torch.isnan(w))
    err = torch.where(equal, torch.zeros_like(g), (g - w).abs().nan_to_num(nan=float("inf")))
    nz = w != 0
    rel = torch.where(nz & ~equal, err / w.abs().clamp(min=torch.finfo(torch.float64).tiny), torch.zeros_like(err))
    if want.is_floating_point():
        a = want.detach().cpu().abs()
        ulp = (torch.nextafter(a, torch.full_like(a, float("inf"))) - a).double()
        ulps = torch.where(equal, torch.zeros_like(err), err / ulp)
    else:
        ulps = err
    return {"max_abs": float(err.max()), "max_rel": float(rel.max()), "max_ulps": float(ulps.nan_to_num(nan=0.0).max())}


@dataclass
class Comparison:
    """`compare`'s result: one row per output (name, ok, max_abs, max_rel, max_ulps, atol, rtol; with fp64
    outputs in the bundle also `fp64` and `reference_fp64`: {max_abs, max_rel} of the kernel's and of the
    reference's output against the fp64 version)."""

    entry: str
    kernel_dtype: str
    rows: list[dict]

    @property
    def ok(self) -> bool:
        return all(r["ok"] for r in self.rows)

    def __str__(self) -> str:
        lines = [f"{self.entry} ({self.kernel_dtype} tolerance): {'ok' if self.ok else 'FAILED'}"]
        for r in self.rows:
            lines.append(f"  {r['name']}: {'ok' if r['ok'] else 'OUT OF TOLERANCE'} max_abs {r['max_abs']:.3g} "
                         f"max_rel {r['max_rel']:.3g} max_ulps {r['max_ulps']:.3g} (atol {r['atol']:.3g}, "
                         f"rtol {r['rtol']:.3g}, {r['bad']} elements out)"
                         + (f"; against fp64: max_abs {r['fp64']['max_abs']:.3g} (the reference's "
                            f"{r['reference_fp64']['max_abs']:.3g})" if "fp64" in r else ""))
        return "\n".join(lines)


def compare(entry: GoldenEntry, outputs: dict[str, torch.Tensor] | torch.Tensor, *,
            kernel_dtype: str | None = None) -> Comparison:
    """Compare a kernel's `outputs` (a dict by output name, or one tensor for a one-output entry) with the
    entry's reference under the manifest's tolerance for `kernel_dtype` ("float32" / "bfloat16"; default: the
    bundle's compute dtype). Outputs the kernel does not give are not compared; a name the entry lacks is an
    InputError."""
    kd = kernel_dtype or entry.numerics["dtype"]
    if kd not in ("float32", "bfloat16"):
        raise InputError(f"kernel_dtype {kd!r}: choose float32 or bfloat16")
    if isinstance(outputs, torch.Tensor):
        if len(entry.outputs) != 1:
            raise InputError(f"{entry.id} has outputs {sorted(entry.outputs)}: pass a dict by name")
        outputs = {next(iter(entry.outputs)): outputs}
    unknown = sorted(set(outputs) - set(entry.outputs))
    if unknown:
        raise InputError(f"{entry.id}: no output named {unknown[0]!r} (outputs: {sorted(entry.outputs)})")
    rows = []
    for name, got in outputs.items():
        want = entry.outputs[name]
        sizes = error_sizes(got, want)
        tol = entry.tolerance.get(name, {})
        if tol.get("exact") or not want.is_floating_point():
            atol = rtol = 0.0
        else:
            if kd not in tol:
                raise InputError(f"{entry.id}: the manifest gives no {kd} tolerance for {name!r}")
            atol, rtol = tol[kd]["atol"], tol[kd]["rtol"]
        g, w = got.detach().cpu().double(), want.double()
        equal = (g == w) | (torch.isnan(g) & torch.isnan(w))
        if name == "expert_ids" and "logits" in entry.outputs:
            equal |= tied_choice(entry, got)[:, None]  # rows whose choice differs only among exact ties
        bad = int((~equal & ~((g - w).abs() <= atol + rtol * w.abs())).sum())
        row = {"name": name, "ok": bad == 0, "bad": bad, "atol": atol, "rtol": rtol, **sizes}
        if name in entry.fp64:  # errors of the kernel and of the reference against the fp64 version
            for label, t in (("fp64", got), ("reference_fp64", want)):
                e64 = error_sizes(t, entry.fp64[name])
                row[label] = {"max_abs": e64["max_abs"], "max_rel": e64["max_rel"]}
        rows.append(row)
    return Comparison(entry.id, kd, rows)


def replay_impl(path: str | Path, impl: str, *, ops: Sequence[str] | None = None, device: str = "cpu",
                kernel_dtype: str | None = None) -> list[dict]:
    """Run a user's kernel `impl` ("module:function", importable) on every entry of bundle `path` (of `ops`):
    function(entry) gets the entry with its inputs on `device` and returns {output name: tensor} (or None: not
    this entry). One row per compared output: file, output, ok, bad, max_abs, max_rel, max_ulps, atol, rtol."""
    import importlib

    try:
        dev = torch.device(device)
    except RuntimeError:
        raise InputError(f"--device {device!r}: not a torch device (cpu, cuda, cuda:1, ...)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"--device {device}: CUDA is not available here")
    mod_name, _, fn_name = impl.partition(":")
    if not mod_name or not fn_name:
        raise InputError(f"--impl {impl!r}: expected MODULE:FUNCTION, e.g. my_kernels.golden:run")
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
    except (ImportError, AttributeError) as e:
        raise InputError(f"--impl {impl!r}: cannot import it ({e}); is the module on PYTHONPATH?") from None
    rows = []
    for entry in load(path, ops=ops):
        entry.inputs = {k: v.to(dev) for k, v in entry.inputs.items()}  # outputs: compare brings them to the host
        got = fn(entry)
        if got is None:
            continue
        result = compare(entry, got, kernel_dtype=kernel_dtype)
        rows += [{"file": entry.file, "output": r.pop("name"), **r} for r in result.rows]
    return rows


def tied_choice(entry: GoldenEntry, expert_ids: torch.Tensor) -> torch.Tensor:
    """bool [T]: row t of a kernel's `expert_ids` chooses experts whose choice values (sigmoid(logits) + bias,
    fp32) equal, as a multiset, those of the reference's choice: a different resolution of exact ties."""
    scores = torch.sigmoid(entry.outputs["logits"].float())
    bias = entry.inputs.get("bias")
    choice = scores if bias is None else scores + bias.float()
    ids = expert_ids.detach().cpu().long()
    if ids.shape != entry.outputs["expert_ids"].shape or bool(((ids < 0) | (ids >= choice.shape[-1])).any()):
        return torch.zeros(ids.shape[0], dtype=torch.bool)
    mine = choice.gather(-1, ids).sort(-1).values
    ref = choice.gather(-1, entry.outputs["expert_ids"].long()).sort(-1).values
    distinct = torch.tensor([len(set(r.tolist())) == len(r) for r in ids], dtype=torch.bool)
    return (mine == ref).all(-1) & distinct


def parametrize(path: str | Path, *, ops: Sequence[str] | None = None, argname: str = "golden_entry"):
    """A `pytest.mark.parametrize` over the entries of bundle `path` (ids: `op/layerNNN_phase`):

        @golden.parametrize("bundle/", ops=["nvfp4_linear"])
        def test_my_gemm(golden_entry):
            assert golden.compare(golden_entry, {"y": my_gemm(golden_entry.inputs)}).ok
    """
    import pytest

    entries = load(path, ops=ops)
    return pytest.mark.parametrize(argname, entries, ids=[e.id for e in entries])


# ---------------------------------------------------------------------------------------------- single-op bundles

# `minimax-ref golden --op OP`: single-op golden bundles at any shape, from random operands in the release
# formats, without building a model.
#
# * `nvfp4_linear --shape M,N,K`: `x` [M, K], packed `w1.*` [N, K], `y` [M, N];
# * `mxfp8_linear --shape M,N,K`: `x` [M, K], packed `w.*` [N, K], `y` [M, N];
# * `router --shape T,E[,H]` (H: the release's hidden size): `x`, `gate_weight`, `bias`; `expert_ids`,
#   `weights`, `logits`;
# * `moe --shape T,E[,H,I]` (H, I: the release's): routed NVFP4 experts (no shared expert), `x`, `gate_weight`,
#   `bias`, packed `experts.{e}.w1/w3/w2.*`, grouped-GEMM metadata `sorted_token_ids` / `expert_offsets`, `y`;
# * `msa_decode --context C --batch B`: one decode query per row at position C - 1 against C cached keys: an
#   `indexer` and an `msa` entry, with paged views.
#
# Operands (decided here): activations and keys N(0, 1) in the compute dtype; NVFP4 weights uniformly random
# bytes (every byte is two valid E2M1 codes) with E4M3 block scales 448 * U(0.2, 0.6) and `weight_scale_2`
# giving a weight standard deviation of K^-1/2; MXFP8 weights uniformly random non-NaN E4M3 bytes with E8M0
# block exponents around K^-1/2; router rows N(0, 4/H) in fp32 and bias N(0, 0.01^2). Attention geometry
# (heads, head_dim, block size, top-k blocks, forced blocks) is the release's, so a context above
# top-k x block size (2048) makes the selection drop blocks.
#
# Edge cases (`--edge`): `subnormal-scales` (a quarter of the NVFP4 block scales are E4M3 subnormals),
# `zero-scales` (an eighth of them are zero: whole zero blocks), `ties` (router: experts 3j, 3j+1, 3j+2
# have equal rows and bias, so their scores tie exactly and the top 4 takes part of a group: the tie-break
# decides, and `golden.compare` accepts any resolution of the tie), `clamp` (moe: inputs 16x larger, so most
# gate and up values pass the SwiGLU-OAI limit and are clamped).
#
# The outputs are computed by the same functions `replay_bundle` uses; the manifest is the model-driven one's,
# with `single_op` naming the op, shape, edge and seed.

SINGLE_OPS = ("nvfp4_linear", "mxfp8_linear", "router", "moe", "msa_decode")
EDGES = {"nvfp4_linear": ("subnormal-scales", "zero-scales"), "mxfp8_linear": (), "router": ("ties",),
         "moe": ("clamp",), "msa_decode": ()}
_RMS_E2M1 = math.sqrt(sum(v * v for v in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)) / 8)


def release_text():
    """The release's text config (widths and attention geometry of single-op bundles)."""
    from .config import parse_model_config
    from .synth import build_config

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


def linear_entry(op: str, M: int, N: int, K: int, dtype: torch.dtype, seed: int, edge: str | None) -> Entry:
    g = _gen(seed)
    fmt, key = (NVFP4, "w1") if op == "nvfp4_linear" else (MXFP8, "w")
    t = nvfp4_operands(N, K, g, edge) if fmt == NVFP4 else mxfp8_operands(N, K, g)
    x = torch.randn(M, K, generator=g).to(dtype)
    e = Entry(op, 0, "op")
    e.put("x", x, "input")
    for name, v in t.items():
        e.put(name, v, "weight")
    e.put(f"{key}.weight_scale_swizzled", swizzle_scales(t[f"{key}.weight_scale"]), "weight")
    e.put("y", _replay_linear({**t}, key, fmt, x, dtype, False), "output")
    e.params.update({"format": fmt, "shape": {"M": M, "N": N, "K": K}, "linear": "random"})
    return e


def router_entry(T: int, E: int, H: int, top_k: int, dtype: torch.dtype, seed: int, edge: str | None) -> Entry:
    from .moe import route

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
    from .moe import route

    r = route(x, w, bias, top_k)
    flat = r.expert_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    e.put("sorted_token_ids", (order // top_k).to(torch.int32), "input")
    counts = torch.bincount(flat, minlength=E)
    e.put("expert_offsets", torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(torch.int32), "input")
    e.put("y", _replay_moe(e.tensors, e.params, dtype, False), "output")
    return e


def msa_entries(C: int, B: int, dtype: torch.dtype, seed: int, page: int | None) -> list[Entry]:
    from .msa import gather_block_attention, index_scores, select_blocks

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
              page_size: int | None = None, fp64: bool = False) -> dict:
    """Write the single-op bundle of `op` (module docstring) to the new folder `out`; returns the manifest."""
    if op not in SINGLE_OPS:
        raise InputError(f"--op {op!r}: choose one of {', '.join(SINGLE_OPS)}")
    if edge is not None and edge not in EDGES[op]:
        raise InputError(f"--edge {edge!r} does not apply to --op {op} (its edges: {', '.join(EDGES[op]) or 'none'})")
    if dtype not in (torch.float32, torch.bfloat16):
        raise InputError(f"--dtype {dtype}: single-op bundles are float32 or bfloat16")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InputError(f"--out {out}: exists and is not an empty folder")
    text = release_text()
    if op in ("nvfp4_linear", "mxfp8_linear"):
        entries = [linear_entry(op, *parse_shape(shape, ("M", "N", "K")), dtype, seed, edge)]
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
        "numerics": {"dtype": dt, "act_quant": "none", "kv_cache_dtype": "auto", "kv_scale": 1.0},
        "seeds": {"operands": seed, "page_permutation": seed},
        "ops": sorted({e.op for e in entries}),
        "contracts": {e.op: contract(e.op, dt, fp64) for e in entries},
        "tolerance_rule": TOLERANCE_RULE,
        "entries": [],
    }
    write_bundle(out, manifest, entries, fp64=fp64)
    return manifest


# ---------------------------------------------------------------------------------------------- CLI


def build_parser(p: argparse.ArgumentParser) -> None:
    """Flags of `minimax-ref golden` (model flags default to the float32 golden mode)."""
    from .cli import add_model_flags

    add_model_flags(p)
    p.set_defaults(dtype="float32")
    p.add_argument("--prompt", action="append", default=None, help="prompt text (repeat for a batch)")
    p.add_argument("--chat", action="store_true", help="render each prompt as one user turn")
    p.add_argument("--ops", default=None, help=f"comma list of ops (default: all): {','.join(OPS)}")
    p.add_argument("--layers", default=None, help="comma list of layers or ranges, e.g. 0,3-5 (default: all)")
    p.add_argument("--out", type=Path, default=None, help="bundle folder to write (new or empty)")
    p.add_argument("--decode-steps", type=int, default=1, help="greedy decode steps after the prefill (default: 1)")
    p.add_argument("--page-size", type=int, default=None,
                   help="tokens per KV page in the paged views (default: the MSA block size)")
    p.add_argument("--seed", type=int, default=0, help="seed of the page permutation (default: 0)")
    p.add_argument("--replay", type=Path, default=None, metavar="BUNDLE",
                   help="instead of exporting, recompute every op of BUNDLE and report mismatches and error sizes")
    p.add_argument("--impl", default=None, metavar="MODULE:FUNCTION",
                   help="with --replay: test your kernel instead of the engine: FUNCTION(entry) gets each "
                        "golden.GoldenEntry (inputs on --device) and returns {output name: tensor} or None to skip")
    p.add_argument("--kernel-dtype", choices=["float32", "bfloat16"], default=None,
                   help="with --impl: the tolerance column to apply (default: the bundle's dtype)")
    p.add_argument("--op", default=None, help="single-op bundle from random operands, no model: nvfp4_linear, "
                   "mxfp8_linear (--shape M,N,K), router (--shape T,E[,H]), moe (--shape T,E[,H,I]), "
                   "msa_decode (--context, --batch)")
    p.add_argument("--shape", default=None, help="with --op: the op's dimensions, comma-separated")
    p.add_argument("--context", type=int, default=None, help="with --op msa_decode: cached tokens per row")
    p.add_argument("--batch", type=int, default=1, help="with --op msa_decode: rows (default: 1)")
    p.add_argument("--fp64", action="store_true", help="also store each float output evaluated in fp64 from the "
                   "same decoded operands (format-defined roundings kept; the manifest's contracts say which)")
    p.add_argument("--edge", default=None, help="with --op: an edge case (nvfp4_linear: subnormal-scales, "
                   "zero-scales; router: ties; moe: clamp)")


def run(args: argparse.Namespace) -> int:
    """`minimax-ref golden`: write a bundle (prints a JSON summary) or replay one (exit 1 on mismatch)."""
    if args.replay is not None and args.impl is not None:
        ops = parse_ops(args.ops)[0] if args.ops else None
        rows = replay_impl(args.replay, args.impl, ops=ops, device=args.device, kernel_dtype=args.kernel_dtype)
        bad = [r for r in rows if not r["ok"]]
        json.dump({"bundle": str(args.replay), "impl": args.impl, "checks": len(rows), "failures": bad,
                   "results": rows}, sys.stdout)
        sys.stdout.write("\n")
        return 1 if bad else 0
    if args.replay is not None:
        results = replay_bundle(args.replay)
        bad = [r for r in results if not r["ok"]]
        worst = {k: max((r[k] for r in results), default=0.0) for k in ("max_abs", "max_rel", "max_ulps")}
        json.dump({"bundle": str(args.replay), "checks": len(results), "mismatches": bad, "worst": worst,
                   "results": results}, sys.stdout)
        sys.stdout.write("\n")
        return 1 if bad else 0
    if args.op is not None:
        if args.out is None:
            raise InputError("--op needs --out")
        m = export_op(args.op, args.out, shape=args.shape, context=args.context, batch=args.batch,
                      dtype=getattr(torch, args.dtype) if args.dtype != "auto" else torch.float32, seed=args.seed,
                      edge=args.edge, page_size=args.page_size, fp64=args.fp64)
        files = [args.out / e["file"] for e in m["entries"]]
        json.dump({"out": str(args.out), "op": args.op, "files": len(files),
                   "bytes": sum(f.stat().st_size for f in files)}, sys.stdout)
        sys.stdout.write("\n")
        return 0
    if not args.prompt or args.out is None:
        raise InputError("give --prompt and --out (or --replay BUNDLE, or --op OP)")
    from .cli import load_from_args
    from .config import load_model_config
    from .embedded import default_checkpoint
    from .generate import encode_prompt

    ops, explicit = parse_ops(args.ops)
    if args.synthetic_weights is None:  # a bad --layers is refused before the weights are read
        ckpt = args.ckpt_path or default_checkpoint()
        parse_layers(args.layers, load_model_config(ckpt).text.num_hidden_layers)
    model, tok, _ = load_from_args(args)
    layers = parse_layers(args.layers, model.text.num_hidden_layers)
    prompts = [encode_prompt(tok, p, chat=args.chat) for p in args.prompt]
    manifest = export_golden(model, prompts, args.out, ops=ops, layers=layers, explicit_ops=explicit,
                             decode_steps=args.decode_steps, page_size=args.page_size, seed=args.seed,
                             prompt_texts=args.prompt, fp64=args.fp64)
    json.dump({"out": str(args.out), "files": len(manifest["entries"]),
               "ops": sorted({e["op"] for e in manifest["entries"]}), "layers": manifest["layers"]}, sys.stdout)
    sys.stdout.write("\n")
    return 0


# ---------------------------------------------------------------------------------------------- bundle validation


def read_bundle_manifest(path: Path) -> dict:
    """The manifest of golden bundle `path`, after checking the bundle is whole: the manifest is JSON of this
    format with numerics and entries, and every entry's file exists and is a complete safetensors file. Every
    problem found is raised together as one InputError (a damaged bundle must not end in a traceback)."""
    from .checkpoint import _read_header

    mf = path / MANIFEST
    if not mf.is_file():
        raise InputError(f"{path}: no {MANIFEST} (not a golden bundle)")
    try:
        manifest = json.loads(mf.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{mf}: not valid JSON ({e}); export the bundle again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise InputError(f"{mf}: format {got!r} is not {FORMAT!r}")
    problems = []
    num = manifest.get("numerics")
    if not isinstance(num, dict) or not all(k in num for k in ("dtype", "act_quant", "kv_scale")):
        problems.append("'numerics' must hold dtype, act_quant and kv_scale")
    elif not isinstance(getattr(torch, str(num["dtype"]), None), torch.dtype):
        problems.append(f"numerics.dtype {num['dtype']!r} is not a torch dtype")
    entries = manifest.get("entries")
    if not isinstance(entries, list):
        problems.append("'entries' must be a list")
        entries = []
    for i, ent in enumerate(entries):
        if not isinstance(ent, dict) or not all(k in ent for k in ("file", "op", "params")):
            problems.append(f"entries[{i}] must hold file, op and params")
            continue
        f = path / str(ent["file"])
        if not f.is_file():
            problems.append(f"entries[{i}]: {ent['file']} is missing")
            continue
        try:
            _read_header(f)
        except (ValueError, json.JSONDecodeError, OSError) as e:
            problems.append(f"entries[{i}]: {ent['file']} cannot be read ({e})")
        tensors = ent.get("tensors") if isinstance(ent.get("tensors"), dict) else {}
        stored = [m["stored"] for m in tensors.values() if isinstance(m, dict) and "stored" in m]
        if not all(isinstance(st, dict) and isinstance(st.get("file"), str) and isinstance(st.get("key"), str)
                   for st in stored):
            problems.append(f"entries[{i}]: a 'stored' reference is not {{file, key}}")
            continue
        for rel in sorted({st["file"] for st in stored}):
            if not (path / rel).is_file():
                problems.append(f"entries[{i}]: its weights file {rel} is missing")
    if problems:
        raise InputError(f"{path}: damaged golden bundle ({len(problems)} problems); export it again:\n"
                         + "\n".join(f"  - {p}" for p in problems[:20]))
    return manifest
