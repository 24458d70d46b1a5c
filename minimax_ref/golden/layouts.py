"""What each tensor and parameter of a golden entry is, in words, keyed by name pattern (`TENSORS`, `PARAMS`), and
the manifest's own keys (`ABOUT`). A bundle's manifest carries, per op, exactly the descriptions of the tensors and
parameters its entries hold (`describe_tensors`, `describe_params`): a name no pattern covers is a programming
error, raised when the bundle is written, so the text cannot drift from the files."""

from __future__ import annotations

import re
from collections.abc import Iterable

# Placeholders of a name pattern: `{e}` an expert id, `{w}` a routed expert's projection, `{proj}` a shared expert's,
# `{norm}` one of a layer's two norms, `{out}` an output name (fp64 versions).
PLACEHOLDERS = {"{e}": r"\d+", "{w}": r"w[123]", "{proj}": r"(?:gate_proj|up_proj|down_proj)",
                "{norm}": r"(?:input_layernorm|post_attention_layernorm)", "{out}": r".+"}


_E2M1 = ("E2M1 code bit 3 = sign, bits 0-2 index (0, 0.5, 1, 1.5, 2, 3, 4, 6); element k of a row in byte k // 2, even "
         "k in the low nibble, odd k in the high nibble")


_NVFP4 = {
    "weight": f"NVFP4 weight, uint8 [N, K/2]: {_E2M1}",
    "weight_scale": "NVFP4 block scales, float8_e4m3fn [N, K/16], row-major, unswizzled: scale (n, k // 16) multiplies "
                    "element (n, k); E4M3 subnormals (codes 1-7 = m * 2^-9) are values, not zeros",
    "weight_scale_2": "NVFP4 global weight scale, fp32 scalar (ModelOpt meaning: multiplies): W[n, k] = e2m1[n, k] * "
                      "(float(scale[n, k // 16]) * weight_scale_2), the bracketed product first, in fp32",
    "input_scale": "NVFP4 activation global scale, fp32 scalar (ModelOpt meaning): the activation's global factor is "
                   "g = fp32(1 / input_scale); used only with numerics.act_quant = 'emulate'",
}


_ANY_FORMAT = {
    "weight": "a linear's packed weight in the format params.formats names for it: NVFP4 uint8 [N, K/2] (" + _E2M1
              + "); MXFP8 float8_e4m3fn [N, K]; bf16 [N, K] (a plain weight)",
    "weight_scale": "its block scales: NVFP4 float8_e4m3fn [N, K/16] (multiplies elements k of block k // 16); "
                    "MXFP8 uint8 E8M0 [N, K/32] (factor 2^(code - 127), code 255 = NaN); row-major, unswizzled",
    "weight_scale_2": "NVFP4 only: fp32 scalar global weight scale, multiplies (e2m1 * (scale * weight_scale_2))",
    "input_scale": "NVFP4 only: fp32 scalar activation global scale; g = fp32(1 / input_scale) (with "
                   "numerics.act_quant = 'emulate')",
}


_FUSED = {
    "weight": "fused gate-up weight [2I, ...]: rows [0, I) are the gate projection's rows, rows [I, 2I) the up "
              "projection's (concatenated along N, not interleaved: vLLM's w13_weight / CUTLASS grouped GEMM order; "
              "FlashInfer's CUTLASS MoE takes the halves swapped), packed as the separate weights",
    "weight_scale": "the fused weight's block scales [2I, ...]: gate rows then up rows, as the separate scales",
    "weight_scale_2": "NVFP4: fp32 [2], entry 0 the gate half's global scale (rows [0, I)), entry 1 the up half's "
                      "(vLLM's w13_weight_scale_2[e] order). Where they differ one global scale cannot serve both "
                      "halves: scale each half's output by its own entry",
    "input_scale": "NVFP4: fp32 [2], the gate and up projections' activation input scales (equal in the release)",
}


_STACKED = ("the n = len(params.used_experts) experts' operands stacked along a new leading axis, index i holding "
            "expert used_experts[i] (a single-op bundle uses every expert, so index e is expert e): ")


_MXFP8_CODES = ("{x}_codes float8_e4m3fn [..., K] and {x}_scale uint8 E8M0 [..., K/32]: the quantized GEMM input a "
                "W8A8 kernel takes; x_hat = float({x}_codes) * 2^({x}_scale - 127)")


_NVFP4_CODES = ("the quantized GEMM input a W4A4 kernel takes: {x}_codes uint8 [..., K/2] packed E2M1 as the "
                "weight, {x}_scale float8_e4m3fn [..., K/16]; with g = fp32(1 / input_scale) of the linear (a power "
                "of two only by accident), x_hat = e2m1({x}_codes) * fp32(float({x}_scale) / g): the scale divided "
                "by g first, rounded to fp32, then multiplied (not (e2m1 * scale) / g)")


_SWIZZLED = ("the same block scales in the 128x4-tile layout of CUTLASS / cuBLASLt block-scaled GEMMs, flat: "
             "zero-padded to [ceil(R/128)*128, ceil(C/4)*4] (R rows, C scales per row), tiles of 128 rows x 4 "
             "columns in row-major tile order, scale (r, c) of a tile at offset (r % 32) * 16 + (r // 32) * 4 + c")


_PAGED = {
    "k_pages, v_pages": "the keys / values as a paged cache, [P, page_size, kv_heads, D] in the cache's storage dtype "
                        "(float8_e4m3fn with kv_cache_dtype fp8: read as (storage.float() * kv_scale) cast to the "
                        "compute dtype); position p of row b is slot p % page_size of page "
                        "block_table[b, p // page_size]. Slots past a row's seq_lens and pages no row uses hold "
                        "arbitrary filler: a kernel must not read them",
    "index_k_pages": "the indexer's keys as a paged cache, [P, page_size, index_dim], addressed as k_pages",
    "block_table": "int32 [B, max_pages]: block_table[b, j] = the page holding row b's positions [j * page_size, "
                   "(j + 1) * page_size); -1 past the row's last page (rows are ragged); page ids are a seeded "
                   "random sample of 0..P-1, neither ascending nor contiguous, and some pages belong to no row",
    "seq_lens": "int32 [B]: tokens in row b's cache after this step (the row's query positions are below it)",
    "cu_seqlens_q": "int32 [B + 1]: varlen query offsets: row b's real queries q[b, :n_b] (the right-padded batch "
                    "without its padding) sit at [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of the packed query axis; "
                    "outputs of padded query slots are not part of the contract",
}


TENSORS: dict[str, dict[str, str]] = {
    "rmsnorm": {
        "{norm}.x": "the norm's input [..., hidden] (compute dtype)",
        "{norm}.weight": "fp32 [hidden]: Gemma's offset weight w, applied as (1 + w)",
        "{norm}.y": "output [..., hidden]: x / sqrt(mean(x^2) + eps) * (1 + w)",
    },
    "router": {
        "x": "[T, hidden] the MoE input",
        "gate_weight": "fp32 [E, hidden] router weight",
        "bias": "fp32 [E] selection bias (e_score_correction_bias): added for the choice only, not to the weights",
        "expert_mask": "bool [E]: experts present in the checkpoint; a False expert is never chosen",
        "expert_ids": "int64 [T, top_k]: chosen experts in descending choice order",
        "weights": "fp32 [T, top_k]: the chosen experts' sigmoid scores divided by their sum, aligned with expert_ids",
        "logits": "fp32 [T, E]: x @ gate_weight^T",
    },
    "mxfp8_linear": {
        "x": "[..., K] the GEMM input (compute dtype; model-driven: the linear's input as the layer has it)",
        "y": "[..., N] the output (compute dtype)",
        "w.weight": "MXFP8 weight, float8_e4m3fn [N, K]",
        "w.weight_scale": "MXFP8 block scales, uint8 E8M0 [N, K/32], row-major, unswizzled: block (n, k // 32) "
                          "factor 2^(code - 127), code 255 = NaN",
        "w.weight_scale_swizzled": "w.weight_scale, " + _SWIZZLED,
        "x_codes, x_scale": _MXFP8_CODES.format(x="x"),
        "x_scale_swizzled": "x_scale, " + _SWIZZLED,
        "x_hat": "[..., K] output: the fake-quantized input the reference multiplies, compared exactly (a "
                 "format-defined value)",
    },
    "nvfp4_linear": {
        "x": "[M, K] the GEMM input (compute dtype); model-driven: the tokens routed to params.expert, ascending",
        "y": "[M, N] output: a(x) @ W1^T with W1 decoded from w1.*",
        "w1.weight": _NVFP4["weight"],
        "w1.weight_scale": _NVFP4["weight_scale"],
        "w1.weight_scale_2": _NVFP4["weight_scale_2"],
        "w1.input_scale": _NVFP4["input_scale"],
        "w1.weight_scale_swizzled": "w1.weight_scale, " + _SWIZZLED,
        "h": "[M, intermediate] second GEMM input: the expert's SwiGLU-OAI output swiglu(gate, up), as computed",
        "y2": "[M, hidden] output: a(h) @ W2^T with W2 decoded from w2.* (the expert's down projection)",
        "w2.weight": _NVFP4["weight"] + " (the down projection)",
        "w2.weight_scale": _NVFP4["weight_scale"],
        "w2.weight_scale_2": _NVFP4["weight_scale_2"],
        "w2.input_scale": _NVFP4["input_scale"],
        "x_codes, x_scale": _NVFP4_CODES.format(x="x") + "; g from w1.input_scale",
        "x_scale_swizzled": "x_scale, " + _SWIZZLED,
        "h_codes, h_scale": _NVFP4_CODES.format(x="h") + "; g from w2.input_scale",
        "x_hat": "[M, K] output: the fake-quantized x the reference multiplies, e2m1(x_codes) * fp32(x_scale / g), "
                 "then rounded once to the compute dtype; compared exactly (a format-defined value)",
    },
    "moe": {
        "x": "[T, hidden] the MoE input",
        "y": "[T, hidden] output",
        "gate_weight": "fp32 [E, hidden] router weight",
        "bias": "fp32 [E] selection bias: added for the choice only",
        "expert_mask": "bool [E]: experts present in the checkpoint; a False expert is never chosen",
        "experts.{e}.{w}.weight": "routed expert e's projection (w1 gate [I, hidden], w3 up [I, hidden], w2 down "
                                  "[hidden, I]): " + _ANY_FORMAT["weight"],
        "experts.{e}.{w}.weight_scale": _ANY_FORMAT["weight_scale"],
        "experts.{e}.{w}.weight_scale_2": _ANY_FORMAT["weight_scale_2"],
        "experts.{e}.{w}.input_scale": _ANY_FORMAT["input_scale"],
        "experts.{e}.w13.weight": "expert e's " + _FUSED["weight"] + " (gate = w1, up = w3)",
        "experts.{e}.w13.weight_scale": _FUSED["weight_scale"],
        "experts.{e}.w13.weight_scale_2": _FUSED["weight_scale_2"],
        "experts.{e}.w13.input_scale": _FUSED["input_scale"],
        "shared.{proj}.weight": "the shared expert's projection (gate_proj, up_proj [I_s, hidden], down_proj "
                                "[hidden, I_s]): " + _ANY_FORMAT["weight"],
        "shared.{proj}.weight_scale": _ANY_FORMAT["weight_scale"],
        "shared.{proj}.weight_scale_2": _ANY_FORMAT["weight_scale_2"],
        "shared.{proj}.input_scale": _ANY_FORMAT["input_scale"],
        "shared.gate_up.weight": "the shared expert's " + _FUSED["weight"] + " (gate = gate_proj, up = up_proj)",
        "shared.gate_up.weight_scale": _FUSED["weight_scale"],
        "shared.gate_up.weight_scale_2": _FUSED["weight_scale_2"],
        "shared.gate_up.input_scale": _FUSED["input_scale"],
        "w13.weight": _STACKED + "experts.{e}.w13.weight stacked: [n, 2I, ...] (NVFP4: uint8 [n, 2I, hidden/2])",
        "w13.weight_scale": _STACKED + "experts.{e}.w13.weight_scale stacked: [n, 2I, ...]",
        "w13.weight_scale_2": _STACKED + "experts.{e}.w13.weight_scale_2 stacked: fp32 [n, 2] (gate, up)",
        "w13.input_scale": _STACKED + "experts.{e}.w13.input_scale stacked: fp32 [n, 2] (gate, up)",
        "w2.weight": _STACKED + "experts.{e}.w2.weight stacked: [n, hidden, ...] (NVFP4: uint8 [n, hidden, I/2])",
        "w2.weight_scale": _STACKED + "experts.{e}.w2.weight_scale stacked: [n, hidden, ...]",
        "w2.weight_scale_2": _STACKED + "experts.{e}.w2.weight_scale_2 stacked: fp32 [n]",
        "w2.input_scale": _STACKED + "experts.{e}.w2.input_scale stacked: fp32 [n]",
        "topk_ids": "int32 [T, top_k]: the routing, given so that the expert GEMMs can be tested alone: the chosen "
                    "experts in descending choice order (the router op's expert_ids)",
        "topk_weights": "fp32 [T, top_k]: the routing weights aligned with topk_ids (before the scaling factor)",
        "sorted_token_ids": "int32 [T * top_k]: the token of every (token, slot) pair of topk_ids, grouped by expert "
                            "ascending, tokens ascending within an expert (a stable sort of topk_ids.flatten() by "
                            "expert, then // top_k); the rows a grouped GEMM gathers",
        "expert_offsets": "int32 [E + 1]: expert e's pairs are sorted_token_ids[expert_offsets[e]: "
                          "expert_offsets[e + 1]] (expert_offsets[0] = 0, expert_offsets[E] = T * top_k)",
        "align.sorted_token_ids": "int32 [align.num_tokens_post_padded]: vLLM's moe_align_block_size layout for "
                                  "block size params.align_block: the flat pair indices t * top_k + k of "
                                  "topk_ids.flatten(), grouped by expert ascending (ascending within an expert), "
                                  "each expert's group padded with the value T * top_k (no pair) to a multiple of "
                                  "the block size; experts without pairs take no block",
        "align.expert_ids": "int32 [align.num_tokens_post_padded / align_block]: the expert of each block of "
                            "align.sorted_token_ids, as its index in params.used_experts (the stacked operands' "
                            "index; in a single-op bundle the expert id itself)",
        "align.num_tokens_post_padded": "int32 [1]: the length of align.sorted_token_ids",
    },
    "attention": {
        "q": "[B, T, Hq, D] queries (right-padded batch; compute dtype)",
        "k, v": "[B, L, Hkv, D] the cache contents, slot = absolute position (compute dtype as cached)",
        "q_pos": "int64 [B, T] absolute position of each query",
        "o": "fp32 [B, T, Hq, D] output",
        **_PAGED,
    },
    "indexer": {
        "iq": "[B, T, Hi, Di] index queries",
        "ik": "[B, L, Di] index keys, slot = absolute position",
        "q_pos": "int64 [B, T] absolute position of each query; rows differ",
        "scores": "fp32 [B, Hi, T, L] output: iq . ik, -inf at keys past q_pos",
        "blocks": "int64 [B, Hi, T, kb] output: selected block ids of each query and index head (index head h "
                  "serves kv head h); -1 for a selected slot with no causal key; ORDER UNSPECIFIED (forced blocks "
                  "are tied at +inf): compared as a set per query row",
        **{k: v for k, v in _PAGED.items() if k != "k_pages, v_pages"},
    },
    "msa": {
        "q": "[B, T, Hq, D] queries",
        "k, v": "[B, L, Hkv, D] the cache contents, slot = absolute position",
        "iq": "[B, T, Hi, Di] index queries",
        "ik": "[B, L, Di] index keys",
        "q_pos": "int64 [B, T] absolute position of each query; rows differ",
        "o": "fp32 [B, T, Hq, D] output",
        "blocks": "int64 [B, Hkv, T, kb] output: the selected blocks (as the indexer's); ORDER UNSPECIFIED: "
                  "compared as a set per query row",
        **_PAGED,
    },
    "qk_norm_rope": {
        "q": "[B, T, Hq, D] the queries before their norm: q_proj's output split into heads (compute dtype)",
        "k": "[B, T, Hkv, D] this step's keys before their norm: k_proj's output split into heads",
        "q_norm.weight, k_norm.weight": "[D] the per-head norms' Gemma offset weights w, applied as (1 + w); the "
                                        "checkpoint's tensors as stored (bf16 in the release), read as fp32",
        "positions": "int64 [B, T] absolute position of each token (the RoPE angle's factor)",
        "cos, sin": "fp32 [B, T, rotary_dim] the RoPE tables at positions: cos / sin of cat(a, a), a = "
                    "fp32(positions) * inv_freq (NeoX layout: channel i pairs with channel i + rotary_dim / 2)",
        "q_normed, k_normed": "output, [B, T, H, D] (compute dtype): each head RMS-normalised with (1 + w), before "
                              "RoPE",
        "q_rope, k_rope": "output, [B, T, H, D] (compute dtype): the normed heads with their first rotary_dim "
                          "channels rotated (the rest as q_normed / k_normed): what attention takes as queries "
                          "and writes to the cache as keys",
        "index_q": "MSA layers only: [B, T, Hkv, Di] the lightning indexer's queries before their norm: "
                   "index_q_proj's output split into index heads (one per kv head; compute dtype)",
        "index_k": "MSA layers only: [B, T, 1, Di] this step's indexer key before its norm: index_k_proj's output "
                   "with a head axis of 1, the shape the per-head norm takes (the indexer's keys drop that axis: "
                   "[B, L, Di])",
        "index_q_norm.weight, index_k_norm.weight": "MSA layers only: [Di] the indexer norms' Gemma offset weights "
                                                    "w, applied as (1 + w); the checkpoint's tensors as stored "
                                                    "(bf16 in the release), read as fp32",
        "index_q_normed, index_k_normed": "MSA layers only: output, [B, T, Hkv, Di] / [B, T, 1, Di] (compute "
                                          "dtype): each index head RMS-normalised over its Di channels with "
                                          "(1 + w), before RoPE",
        "index_q_rope, index_k_rope": "MSA layers only: output, [B, T, Hkv, Di] / [B, T, 1, Di] (compute dtype): "
                                      "the normed index heads with their first rotary_dim channels rotated by the "
                                      "same tables (the rest as index_q_normed / index_k_normed): what the indexer "
                                      "takes as its queries iq, and, without the head axis of 1, writes to its "
                                      "cache as the keys ik",
    },
    "final_norm": {
        "x": "[B, T, hidden] the residual stream after the last decoder layer (compute dtype)",
        "weight": "[hidden] the final norm's Gemma offset weight w, applied as (1 + w); the checkpoint's tensor as "
                  "stored (bf16 in the release), read as fp32",
        "y": "[B, T, hidden] output: x / sqrt(mean(x^2) + eps) * (1 + w) (compute dtype): the LM head's input",
    },
    "logits": {
        "x": "[B, hidden] the final norm's output at each row's sampled position (params.logit_positions; the "
             "final_norm entry's y at those positions), compute dtype",
        "w.weight": "the LM head's weight [V, hidden] as the checkpoint stores it: unquantized (bf16 in the "
                    "release; the loader refuses a quantized LM head), with tied embeddings the embedding's weight",
        "logits": "fp32 [B, V] output: the whole vocabulary's logits of each row (x @ W^T)",
    },
}


# the fp64 version of any float output
for _op in TENSORS:
    TENSORS[_op]["{out}.fp64"] = "fp64 version of output {out} (numerics.fp64_outputs; contracts.OP.fp64 says what " \
                                 "it keeps of the reference's roundings)"


PARAMS: dict[str, str] = {
    "eps": "RMSNorm epsilon",
    "top_k": "experts per token",
    "format": "the weight's format: nvfp4, mxfp8 or bf16 (a plain weight: the logits' LM head in the release)",
    "rotary_dim": "channels of each head that RoPE rotates: the first rotary_dim of head_dim (the rest pass through)",
    "rope_theta": "RoPE base: inv_freq[i] = 1 / rope_theta^(2i / rotary_dim)",
    "logit_positions": "per row b, the position t whose logits the entry holds: the last prompt token in the prefill "
                       "phase (its logits give the first decoded token), 0 in a decode phase (the one token)",
    "linear": "model-driven: the linear's checkpoint prefix; single-op: 'random'",
    "shape": "the op's dimensions as requested",
    "seed": "seed of the random operands",
    "edge": "the edge case the operands were built for (null: none)",
    "expert": "the routed expert the entry's GEMMs belong to",
    "tokens": "the token rows (of the flattened batch) routed to that expert, ascending",
    "scaling": "routed scaling factor (multiplies the routed sum)",
    "alpha": "SwiGLU-OAI alpha: h = (clamp(up, -limit, limit) + 1) * (g * sigmoid(alpha * g)), g = min(gate, limit)",
    "limit": "SwiGLU-OAI clamp limit",
    "num_experts": "E, the router's experts",
    "used_experts": "the routed experts whose operands the entry holds (ascending id)",
    "formats": "format of each linear (nvfp4, mxfp8 or bf16), by name prefix",
    "shared_expert": "whether the entry holds a shared expert (added unweighted to the routed sum)",
    "align_block": "block size of the align.* routing metadata",
    "scale": "attention softmax scale (head_dim^-0.5)",
    "chunk_elements": "dense attention: elements per query chunk of the capture (null: one call)",
    "block_size": "MSA block size (keys per block)",
    "topk_blocks": "MSA blocks selected per query and kv head (kb = min(topk_blocks, blocks))",
    "local_blocks": "MSA forced local blocks: the local_blocks blocks ending at the query's block",
    "init_blocks": "MSA forced initial blocks: the first init_blocks blocks at or before the query's block",
    "query_chunk": "MSA / indexer: queries per chunk of a chunked capture",
    "page_size": "tokens per page of the paged views",
    "context": "single-op msa_decode: cached tokens per row, row by row",
    "batch": "rows",
}


def pattern(key: str) -> re.Pattern:
    """The regex of one name pattern (placeholders `PLACEHOLDERS`)."""
    rx = re.escape(key)
    for ph, sub in PLACEHOLDERS.items():
        rx = rx.replace(re.escape(ph), sub)
    return re.compile(rx)


def describe_tensors(op: str, names: Iterable[str]) -> dict[str, str]:
    """The descriptions (`TENSORS[op]`) of the tensors `names` of entries of `op`: a description is kept when one of
    its key's names is present, and every present name must be covered. Raises RuntimeError naming a tensor no
    pattern describes (a bundle must not hold an undescribed tensor)."""
    table = TENSORS[op]
    names = set(names)
    out: dict[str, str] = {}
    covered: set[str] = set()
    for key, text in table.items():
        rxs = [pattern(k.strip()) for k in key.split(",")]
        hit = {n for n in names if any(rx.fullmatch(n) for rx in rxs)}
        if hit:
            out[key] = text
            covered |= hit
    missing = sorted(names - covered)
    if missing:
        raise RuntimeError(f"golden: op {op} holds tensors no description covers: {missing}")
    return out


def describe_params(names: Iterable[str]) -> dict[str, str]:
    """The descriptions (`PARAMS`) of the parameters `names`; RuntimeError for one not described."""
    names = set(names)
    missing = sorted(names - set(PARAMS))
    if missing:
        raise RuntimeError(f"golden: parameters without a description: {missing}")
    return {n: PARAMS[n] for n in sorted(names)}


ABOUT = {
    "entries": "one row per entry: file (its own safetensors file, bundle-relative), op, layer, phase, tag (which "
               "instance: a linear's path in the layer, a sweep's shape and seed), params, sha256 of the file, "
               "tensors and tolerance",
    "entries[].tensors": "every tensor of the entry: shape, dtype, role (input: an operand; weight: a packed or "
                         "plain weight operand; paged: a paged view of the cache and its addressing; output: the "
                         "reference's result; fp64: an output's fp64 version); a tensor without 'stored' is under its "
                         "own name in the entry's file",
    "entries[].tensors.NAME.stored": "a tensor kept in a weights file (stored once per bundle): {file, key} names "
                                     "the file and the key; {cat: [refs]} is the refs' tensors concatenated along "
                                     "axis 0 (a fused gate-up operand: gate rows then up rows); {stack: [refs]} "
                                     "stacks them along a new axis 0 (a [2] global-scale pair, an [E, ...] stacked "
                                     "operand); refs nest",
    "weights_files": "the files that hold weight tensors (each once per bundle, under the checkpoint's tensor name "
                     "for a model-driven bundle, the entry's tag and tensor name for a single-op one), with their "
                     "sha256; entry files hold no weight",
    "entries[].tolerance": "per output: {float32: {rtol, atol}, bfloat16: {rtol, atol}} by the kernel's compute "
                           "dtype (tolerance_rule), or {exact: true} (integers and format-defined values), with "
                           "'order': 'set' where the order along the last axis is unspecified",
    "contracts": "per op: formula, accumulation, rounding (for the bundle's dtype), tensors (a description of every "
                 "tensor name its entries hold, by name pattern: {e} an expert id, {w} w1 / w2 / w3, {proj} a "
                 "shared expert projection, {norm} a norm, {out} an output), params, tolerance factors",
    "norm_edges": "model-driven bundles with a norm op: what the norm ops' edge entries (phase 'edge') hold and "
                  "why, and their bfloat16 tolerance",
    "rows": "model-driven bundles: how entries of row-wise ops lay out the batch, and where its padding is",
    "numerics": "dtype (the reference's compute dtype), act_quant (emulate: GEMM inputs fake-quantized as W4A4 / "
                "W8A8 kernels see them), kv_cache_dtype, kv_scale, fp64_outputs",
}
