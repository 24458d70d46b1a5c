"""`minimax-ref golden`: golden tensors for kernel tests, captured from a real forward, and their replay.

Modules: `contract` (ops, the numerics contract and tolerances), `layouts` (what each tensor, parameter and manifest
key is, in words), `operands` (entries, packed, fused and joined operands, routing metadata, paged views), `fp64`
(fp64 reference outputs), `capture` (model-driven export), `norm_edges` (the norm ops' edge entries), `bundle`
(writing and reading a bundle's files), `replay` (bit-exact recomputation), `api` (load / compare / parametrize / a
user's kernel), `single_ops` (one op at any shape), `cli` (the command).

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
| `qk_norm_rope` | all | hooks on `self_attn`, `q_norm`, `k_norm` | `q`, `k`, `{q,k}_norm.weight`, `positions`, `cos`, |
| | | (RoPE applied to the norms' outputs) | `sin`, `{q,k}_normed`, `{q,k}_rope` |
| | MSA: also | `index_q_norm`, `index_k_norm` | `index_q` [B,T,Hkv,Di], `index_k` [B,T,1,Di], |
| | | | `index_{q,k}_norm.weight`, `index_{q,k}_normed`, `index_{q,k}_rope` |
| `final_norm` | the head (N) | hook on `model.norm` | `x`, `weight`, `y` |
| `logits` | the head (N) | hook on `lm_head`, run on each row's sampled row | `x` [B, hidden], `w.*`, `logits` [B, V] |

Each chosen norm op (`rmsnorm`, `qk_norm_rope`, `final_norm`) also gets one entry in phase `edge`
(`{op}/layer{L:03d}_edge.safetensors`: the first chosen layer; for `qk_norm_rope` the first chosen MSA layer, whose
entry also covers the indexer's norms, when one is chosen; the head for `final_norm`): built rows and weights,
not the forward's, on which a norm kernel with the wrong eps or a bf16 `(1 + w)` fails (`norm_edges`; in a bfloat16
bundle their bfloat16 tolerance is `contract.EDGE_TOLERANCE`).

The head's ops (`HEAD_OPS`) belong to no decoder layer: their entries read layer N = num_hidden_layers and their
weights are in `weights/layer{N:03d}.safetensors`; `--layers` (decoder layers) does not select them, `--ops` does.
Norm weights (q_norm, k_norm, index_q_norm, index_k_norm, the final norm) are stored once, under their checkpoint
names, as the LM head's.

Packed operands are stored once per bundle, in `weights/layer{L:03d}.safetensors` under
`{checkpoint prefix}.{weight, weight_scale, weight_scale_2, input_scale}`; the manifest row of an entry
names each one's file and key (`tensors.NAME.stored`; a fused or stacked operand: `{cat | stack: [refs]}` of the
stored ones, so nothing is stored twice), and `entry_tensors` / `load` put them back under the entry's canonical
names: `.weight` (NVFP4: uint8 [N, K/2],
low nibble = even element; MXFP8: float8_e4m3fn [N, K]; BF16: bf16), `.weight_scale` (NVFP4:
float8_e4m3fn [N, K/16]; MXFP8: uint8 E8M0 [N, K/32]), `.weight_scale_2` (fp32 scalar, ModelOpt
meaning: multiplies) and `.input_scale` (fp32 scalar, ModelOpt meaning). The NVFP4 expert chosen is
the one most tokens were routed to (ties: lower id); its `x` rows are those tokens, ascending.

Attention is captured through the forward's `Trace` (`Trace.attention_layers`), and a captured call runs in one query
chunk (`Trace.attached` sets the layer's `chunk_elements`): the engine's chunking only bounds memory, and one call is
what a kernel computes. A long prompt (one-call scores past `ONE_CALL_ELEMENTS`, or `chunk_elements=` given) is captured
in the engine's query chunks instead (`CHUNKED_NOTE`), and entries are written as soon as they are complete (a layer's
when the next one starts; `BundleWriter`), so an export's memory is linear in the prompt length.
`fp64=True` / `--fp64` adds each float output evaluated in fp64 (`FP64`). Paged KV views: the layer's cache
storage (float8_e4m3fn with `--kv-cache-dtype fp8`, else the compute dtype) cut into
pages of `page_size` tokens: `k_pages`, `v_pages` [P, page_size, kv_heads, D], `index_k_pages`
[P, page_size, index_dim], `block_table` int32 [B, max_pages] (-1 = no page), `seq_lens` int32 [B]
(tokens in the cache for that row after the step), `cu_seqlens_q` int32 [B + 1] (varlen offsets of the
rows' real queries). Page ids are a seeded sample of a pool with one spare page per
row (one block table per phase, shared by all layers, as in vLLM) so a kernel cannot assume contiguity; every slot
that holds no row's position is seeded filler. Loading a page is `storage.float() * kv_scale` cast to the compute dtype
(`kv_scale` = 1.0, the cache's fp8 rule).

`manifest.json` lists every file with its op, layer, phase, parameters, tensor shapes/dtypes/roles and
sha256, plus the numerics mode (dtype, act_quant, kv_cache_dtype), the seed, prompts, decoded tokens, the
producer's versions, its own keys in words (`about`) and, per op, the numerics contract a kernel is held to
(`CONTRACTS`: formula in words, accumulation order, rounding points; `tensors` / `params`: `layouts`' descriptions
of exactly the tensors and parameters the op's entries hold, written when the bundle is finished; `TOLERANCE`,
written per output as numbers; weights.md "Golden tolerances" justifies them). The model is loaded from a
checkpoint folder or a synthetic preset (`load_synthetic`, `--synthetic-weights`): the packed operands are
re-read from the same source.

Single-op bundles (`--op`, `export_op`): one op at any shape from random operands in the release formats,
without a model (`single_ops.py`), with edge cases that hit their edge, routing metadata, stacked operands, and
`--sweep` (several shapes and seeds in one bundle).

Test API: `load(path)` gives `GoldenEntry`s (inputs, outputs, params, contract, tolerance; sha256 checked),
`compare(entry, outputs, skip=...)` checks every output not skipped (a missing one fails, so does checking nothing):
floats within the tolerance with max abs / max rel / max ulps, integers as integers, MSA blocks as sets, attention
at the real queries; `parametrize(path)` is a pytest mark over a bundle's entries; `golden --replay BUNDLE --impl
module:function` (`replay_impl`) runs a user's kernel on every entry and prints its error sizes (exit 1 on a
failure, a missing output or nothing checked).

Replay (`replay_bundle`) recomputes every output from the stored inputs with the engine's pure
functions (`norm.gemma_rms_norm`, `rope.apply_rope` / `rope_cos_sin`, `moe.route`, `quant.dequant_*`,
`linear.emulate_activation_quant`, `msa.index_scores` / `select_blocks` / `gather_block_attention`,
`attention.causal_attention`, and
the MoE's `Experts` / `MLP` modules rebuilt from the packed operands) and compares with `torch.equal`
(same dtype, shape and values: bit-exact), reporting the error sizes as well. Bit-exactness presumes
the CPU BLAS configuration of the export (library, thread count); the replay copies every loaded
tensor into a fresh buffer because BLAS also rounds differently for differently aligned inputs
(safetensors maps tensors at 8-byte offsets). Paged views are checked by rebuilding each row's keys
from the block table (equal to the captured keys) and recomputing the op from them (equal outputs at
the rows' real query positions).
"""

from .api import Comparison, GoldenEntry, compare, load, parametrize, replay_impl
from .bundle import BundleWriter, entry_tensors, read_bundle_manifest
from .capture import export_golden, parse_layers, parse_ops
from .cli import build_parser, run
from .contract import ATTENTION_OPS, CAPTURE_CHUNK, CONTRACTS, FP64, OPS, TOLERANCE, contract, error_sizes, tolerance
from .operands import from_pages
from .replay import replay_bundle
from .single_ops import SINGLE_OPS, export_op

__all__ = ["ATTENTION_OPS", "BundleWriter", "CAPTURE_CHUNK", "CONTRACTS", "Comparison", "FP64", "GoldenEntry", "OPS",
           "SINGLE_OPS", "TOLERANCE", "build_parser", "compare", "contract", "entry_tensors", "error_sizes",
           "export_golden", "export_op", "from_pages", "load", "parametrize", "parse_layers", "parse_ops",
           "read_bundle_manifest", "replay_bundle", "replay_impl", "run", "tolerance"]
