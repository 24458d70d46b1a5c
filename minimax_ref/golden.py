"""`minimax-ref golden`: golden tensors for kernel tests, captured from a real forward, and their replay.

Export. The prompt(s) are prefilled through the KV cache in one step (phase `prefill`), then
`--decode-steps` greedy tokens are decoded one at a time (phases `decode0`, `decode1`, ...). During
these forwards, for every chosen op at every chosen layer where the engine computes it, the op's
inputs and outputs are written to `{op}/layer{L:03d}_{phase}.safetensors`:

| op | layers | captured | tensors |
|---|---|---|---|
| `rmsnorm` | all | hooks on input_layernorm, post_attention_layernorm | `{norm}.x`, `{norm}.weight`, `{norm}.y` |
| `mxfp8_linear` | with an MXFP8 linear | forward hook on the layer's first MXFP8 linear | `x`, `w.*` (packed), `y` |
| `attention` | dense attention | the attention core (`Trace.attention`) | `q`, `k`, `v`, `q_pos`, `o`, paged KV |
| `indexer` | MSA | the MSA call (`Trace.attention`) | `iq`, `ik`, `q_pos`, `scores`, `blocks`, paged index keys |
| `msa` | MSA | the MSA call (`Trace.attention`) | `q`, `k`, `v`, `iq`, `ik`, `q_pos`, `o`, `blocks`, paged KV |
| `router` | MoE | hook on `block_sparse_moe.gate` | `x`, `gate_weight`, `bias`, `expert_ids`, `weights`, `logits` |
| `moe` | MoE | forward hook on `block_sparse_moe` | `x`, `y`, router, shared and used routed experts (packed) |
| `nvfp4_linear` | NVFP4 experts | recomputed from the MoE's input | `x`, `w1.*` (packed), `y`; `h`, `w2.*`, `y2` |

Packed operands are the checkpoint's bytes under canonical names: `.weight` (NVFP4: uint8 [N, K/2],
low nibble = even element; MXFP8: float8_e4m3fn [N, K]; BF16: bf16), `.weight_scale` (NVFP4:
float8_e4m3fn [N, K/16]; MXFP8: uint8 E8M0 [N, K/32]), `.weight_scale_2` (fp32 scalar, ModelOpt
meaning: multiplies) and `.input_scale` (fp32 scalar, ModelOpt meaning). The NVFP4 expert chosen is
the one most tokens were routed to (ties: lower id); its `x` rows are those tokens, ascending.

Attention is captured through the forward's `Trace` (`Trace.attention_layers`), and a captured call runs in
one query chunk (`Attention.chunk_for`): the engine's chunking only bounds memory, and one call is what a
kernel computes. Paged KV views: the
layer's cache storage (float8_e4m3fn with `--kv-cache-dtype fp8`, else the compute dtype) cut into
pages of `page_size` tokens: `k_pages`, `v_pages` [P, page_size, kv_heads, D], `index_k_pages`
[P, page_size, index_dim], `block_table` int32 [B, max_pages] (-1 = no page), `seq_lens` int32 [B]
(tokens in the cache for that row after the step). Page ids are a seeded permutation (one block table
per phase, shared by all layers, as in vLLM) so a kernel cannot assume contiguity; slots past a
row's length are zero. Loading a page is `storage.float() * kv_scale` cast to the compute dtype
(`kv_scale` = 1.0, the cache's fp8 rule).

`manifest.json` lists every file with its op, layer, phase, parameters and tensor shapes/dtypes/roles,
plus the numerics mode (dtype, act_quant, kv_cache_dtype), the seed, prompts, decoded tokens and the
recipe of each op (`RECOMPUTE`).

Replay (`replay_bundle`) recomputes every output from the stored inputs with the engine's pure
functions (`norm.gemma_rms_norm`, `moe.route`, `quant.dequant_*`, `linear.emulate_activation_quant`,
`msa.index_scores` / `select_blocks` / `gather_block_attention`, `attention.causal_attention`, and
the MoE's `Experts` / `MLP` modules rebuilt from the packed operands) and compares with `torch.equal`
(same dtype, shape and values: bit-exact). Bit-exactness presumes the CPU BLAS configuration of the
export (library, thread count); the replay copies every loaded tensor into a fresh buffer because
BLAS also rounds differently for differently aligned inputs (safetensors maps tensors at 8-byte
offsets). Paged views are checked by rebuilding each row's keys from
the block table (equal to the captured keys) and recomputing the op from them (equal outputs at the
rows' real query positions).
"""

from __future__ import annotations

import argparse
import json
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


@dataclass
class Entry:
    """One golden file: an op at a layer in a phase."""

    op: str
    layer: int
    phase: str
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    params: dict = field(default_factory=dict)
    roles: dict[str, str] = field(default_factory=dict)

    def put(self, name: str, t: torch.Tensor, role: str) -> None:
        self.tensors[name] = t.detach().clone().contiguous().cpu()
        self.roles[name] = role

    @property
    def file(self) -> str:
        return f"{self.op}/layer{self.layer:03d}_{self.phase}.safetensors"


# ---------------------------------------------------------------------------------------------- operands


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


def _act(x: torch.Tensor, fmt: str, t: dict[str, torch.Tensor], key: str, emulate: bool) -> torch.Tensor:
    from .linear import emulate_activation_quant

    if not emulate or fmt == DENSE:
        return x
    return emulate_activation_quant(x, fmt, t.get(f"{key}.input_scale"))


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


class _Capture:
    """Module hooks and a `Trace` that record the chosen ops during forwards."""

    def __init__(self, model, ck: Checkpoint, ops: set[str], layers: set[int]):
        self.model, self.ck, self.ops, self.layers = model, ck, ops, layers
        self.entries: dict[tuple[str, int, str], Entry] = {}
        self.phase = ""
        self.handles: list = []
        self.routing: dict[int, object] = {}
        self.emulate = getattr(model, "act_quant", "none") == "emulate"

    def entry(self, op: str, layer: int) -> Entry:
        key = (op, layer, self.phase)
        if key not in self.entries:
            self.entries[key] = Entry(op, layer, self.phase)
        return self.entries[key]

    # ---- install / remove
    def __enter__(self) -> _Capture:
        for L, layer in enumerate(self.model.layers):
            if L not in self.layers:
                continue
            if "rmsnorm" in self.ops:
                for norm in ("input_layernorm", "post_attention_layernorm"):
                    self.handles.append(getattr(layer, norm).register_forward_hook(self._norm_hook(L, norm)))
            if "mxfp8_linear" in self.ops and (found := mxfp8_linear_of(self.ck, L)) is not None:
                prefix, module = found
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

        wanted = self.layers if self.ops & {"attention", "indexer", "msa"} else set()
        return Trace(layers=set(), attention_layers=set(wanted))

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
            e = self.entry("mxfp8_linear", L)
            e.put("x", args[0], "input")
            ops, fmt = linear_operands(self.ck, prefix, "w")
            for k, v in ops.items():
                e.put(k, v, "weight")
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
                ops, formats[f"shared.{proj}"] = linear_operands(self.ck, f"{base}shared_experts.{proj}",
                                                                 f"shared.{proj}")
                for k, v in ops.items():
                    e.put(k, v, "weight")
        for x in used:
            for leaf in ("w1", "w2", "w3"):
                ops, formats[f"experts.{x}.{leaf}"] = linear_operands(self.ck, f"{base}experts.{x}.{leaf}",
                                                                      f"experts.{x}.{leaf}")
                for k, v in ops.items():
                    e.put(k, v, "weight")
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
        counts = torch.bincount(routing.expert_ids.flatten().cpu(), minlength=ex.w1.shape[0])
        x_id = int(torch.argmax(counts))  # first maximum: ties go to the lower id
        tokens = (routing.expert_ids == x_id).any(-1).nonzero().flatten()
        x = flat[tokens]

        def act(t, leaf):
            if not ex.emulate_act_quant:
                return t
            return emulate_activation_quant(t, ex.act_format, getattr(ex, f"{leaf}_input_scale")[x_id])

        gate = F.linear(act(x, "w1"), ex.w1[x_id])
        up = F.linear(act(x, "w3"), ex.w3[x_id])
        h = swiglu_oai(gate, up, ex.alpha, ex.limit)
        e = self.entry("nvfp4_linear", L)
        e.put("x", x, "input")
        e.put("h", h, "input")
        for leaf in ("w1", "w2"):
            ops, _ = linear_operands(self.ck, f"{base}{x_id}.{leaf}", leaf)
            for k, v in ops.items():
                e.put(k, v, "weight")
        e.put("y", gate, "output")
        e.put("y2", F.linear(act(h, "w2"), ex.w2[x_id]), "output")
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
        from .msa import index_scores

        geometry = {name: core[name] for name in ("block_size", "topk_blocks", "local_blocks", "init_blocks")}
        if "indexer" in self.ops:
            e = self.entry("indexer", L)
            for name in ("iq", "ik", "q_pos"):
                e.put(name, core[name], "input")
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
    def add_pages(self, cache, seq_lens: list[int], page: int, seed: int) -> None:
        table = block_table(seq_lens, page, seed)
        for (op, L, phase), e in self.entries.items():
            if phase != self.phase or op not in ("attention", "msa", "indexer"):
                continue
            e.put("block_table", table, "paged")
            e.put("seq_lens", torch.tensor(seq_lens, dtype=torch.int32), "paged")
            if op in ("attention", "msa"):
                e.put("k_pages", to_pages(cache.k[L], table, seq_lens, page), "paged")
                e.put("v_pages", to_pages(cache.v[L], table, seq_lens, page), "paged")
            if op in ("msa", "indexer"):
                e.put("index_k_pages", to_pages(cache.index_k[L], table, seq_lens, page), "paged")
            e.params["page_size"] = page


def mxfp8_linear_of(ck: Checkpoint, layer: int) -> tuple[str, str] | None:
    """(tensor prefix, engine module path) of the first MXFP8 linear of `layer`, or None."""
    p = f"{TEXT_PREFIX}layers.{layer}."
    order = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "self_attn.index_q_proj", "self_attn.index_k_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
             "block_sparse_moe.shared_experts.gate_proj", "block_sparse_moe.shared_experts.up_proj",
             "block_sparse_moe.shared_experts.down_proj"]
    for leaf in order:
        f = ck.formats.get(p + leaf)
        if f is not None and f.fmt == MXFP8:
            return p + leaf, ck.linears[p + leaf].module
    return None


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
                  page_size: int | None = None, seed: int = 0, prompt_texts: Sequence[str] | None = None) -> dict:
    """Run prefill + `decode_steps` greedy decode steps on `prompts` (token ids) and write the bundle.

    Ops missing at a chosen layer are skipped; with `explicit_ops`, an op found at none of the chosen
    layers is an InputError. Returns the manifest.
    """
    from .checkpoint import open_checkpoint

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InputError(f"--out {out}: exists and is not an empty folder")
    world = getattr(model, "world", None)
    if world is not None and world.size > 1:
        raise InputError("golden captures whole tensors: load the model in one process (no tensor parallelism)")
    ck = open_checkpoint(model.ckpt_path)
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
    cache = model.new_cache(B, T + decode_steps, kv_dtype)
    decoded: list[list[int]] = [[] for _ in prompts]
    with _Capture(model, ck, set(ops), set(layers)) as cap:
        cap.phase = "prefill"
        trace = cap.trace()
        logits = model(ids, positions=torch.arange(T, device=device).expand(B, T), cache=cache, trace=trace)
        cap.record_attention(trace)
        cap.add_pages(cache, lengths, page, seed)
        nxt = torch.stack([logits[b, n - 1].argmax() for b, n in enumerate(lengths)])
        for step in range(decode_steps):
            cap.phase = f"decode{step}"
            for b in range(B):
                decoded[b].append(int(nxt[b]))
            pos = torch.tensor([n + step for n in lengths], device=device)[:, None]
            trace = cap.trace()
            logits = model(nxt[:, None], positions=pos, cache=cache, trace=trace)
            cap.record_attention(trace)
            cap.add_pages(cache, [n + step + 1 for n in lengths], page, seed + step + 1)
            nxt = logits[:, 0].argmax(-1)
    entries = [cap.entries[k] for k in sorted(cap.entries, key=lambda k: (OPS.index(k[0]), k[1], k[2]))]
    manifest = {
        "format": FORMAT,
        "checkpoint": str(model.ckpt_path),
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
        "ops": list(ops),
        "layers": layers,
        "recompute": RECOMPUTE,
        "entries": [],
    }
    # written under a temporary name and renamed when complete: a failure (a full disk) leaves nothing behind
    with staged_folder(out) as tmp:
        for e in entries:
            path = tmp / e.file
            path.parent.mkdir(parents=True, exist_ok=True)
            save_file(e.tensors, str(path), metadata={"op": e.op, "layer": str(e.layer), "phase": e.phase})
            manifest["entries"].append({
                "file": e.file, "op": e.op, "layer": e.layer, "phase": e.phase, "params": e.params,
                "tensors": {n: {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
                                "role": e.roles[n]} for n, t in e.tensors.items()}})
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


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


def _replay_entry(t: dict, p: dict, op: str, dtype: torch.dtype, emulate: bool, kv_scale: float
                  ) -> list[tuple[str, bool]]:
    """(check name, passed) for every output of one entry."""
    from .moe import route
    from .norm import gemma_rms_norm

    checks: list[tuple[str, bool]] = []
    if op == "rmsnorm":
        for norm in ("input_layernorm", "post_attention_layernorm"):
            if f"{norm}.x" in t:
                y = gemma_rms_norm(t[f"{norm}.x"], t[f"{norm}.weight"], p["eps"])
                checks.append((f"{norm}.y", same(y, t[f"{norm}.y"])))
    elif op == "router":
        r = route(t["x"], t["gate_weight"], t.get("bias"), p["top_k"], t.get("expert_mask"))
        checks += [("expert_ids", same(r.expert_ids, t["expert_ids"])), ("weights", same(r.weights, t["weights"])),
                   ("logits", same(r.logits, t["logits"]))]
    elif op == "moe":
        checks.append(("y", same(_replay_moe(t, p, dtype, emulate), t["y"])))
    elif op == "nvfp4_linear":
        checks.append(("y", same(_replay_linear(t, "w1", NVFP4, t["x"], dtype, emulate), t["y"])))
        checks.append(("y2", same(_replay_linear(t, "w2", NVFP4, t["h"], dtype, emulate), t["y2"])))
        if "x_hat" in t:
            checks.append(("x_hat", same(_act(t["x"], NVFP4, t, "w1", True), t["x_hat"])))
    elif op == "mxfp8_linear":
        checks.append(("y", same(_replay_linear(t, "w", p["format"], t["x"], dtype, emulate), t["y"])))
    elif op in ("attention", "indexer", "msa"):
        checks += _replay_attention(t, p, op, dtype, kv_scale, t, "")
        if "block_table" in t:
            checks += _replay_paged(t, p, op, dtype, kv_scale)
    return checks


def _replay_attention(t: dict, p: dict, op: str, dtype: torch.dtype, kv_scale: float, ref: dict, tag: str,
                      rows: torch.Tensor | None = None) -> list[tuple[str, bool]]:
    """Recompute `op` from the inputs in `t`; compare with `ref` (only query rows `rows` [B, T] when given)."""
    from .attention import causal_attention
    from .msa import gather_block_attention, index_scores, select_blocks

    def cmp(name: str, got: torch.Tensor, want: torch.Tensor, dims: int) -> tuple[str, bool]:
        if rows is None:
            return tag + name, same(got, want)
        # dims: where the query axis is (1 for [B, T, ...], 2 for [B, H, T, ...])
        m = rows if dims == 1 else rows[:, None, :].expand(got.shape[0], got.shape[1], rows.shape[1])
        return tag + name, got.dtype == want.dtype and got.shape == want.shape and torch.equal(got[m], want[m])

    out = []
    if op == "attention":
        o = causal_attention(t["q"], t["k"], t["v"], t["q_pos"], p["scale"], chunk_elements=p["chunk_elements"])
        out.append(cmp("o", o, ref["o"], 1))
        return out
    scores = index_scores(t["iq"], t["ik"], t["q_pos"])
    blocks = select_blocks(scores, t["q_pos"], p["block_size"], p["topk_blocks"], p["local_blocks"],
                           p["init_blocks"])
    if op == "indexer":
        out.append(cmp("scores", scores, ref["scores"], 2))
        out.append(cmp("blocks", blocks, ref["blocks"], 2))
    else:
        o = gather_block_attention(t["q"], t["k"], t["v"], blocks, t["q_pos"], p["block_size"], p["scale"])
        out += [cmp("blocks", blocks, ref["blocks"], 2), cmp("o", o, ref["o"], 1)]
    return out


def _replay_paged(t: dict, p: dict, op: str, dtype: torch.dtype, kv_scale: float) -> list[tuple[str, bool]]:
    """Rebuild keys from the paged views, check them against the captured keys, recompute the op."""
    table, seq = t["block_table"], t["seq_lens"].tolist()
    rebuilt = dict(t)
    checks = []
    for name, pages in (("k", "k_pages"), ("v", "v_pages"), ("ik", "index_k_pages")):
        if pages not in t:
            continue
        want = t[name]
        got = from_pages(t[pages], table, seq, want.shape[1], want.dtype, kv_scale)
        ok = all(torch.equal(got[b, :n], want[b, :n]) for b, n in enumerate(seq))
        checks.append((f"paged.{name}", ok))
        rebuilt[name] = got
    rows = t["q_pos"] < torch.tensor(seq)[:, None]
    return checks + _replay_attention(rebuilt, p, op, dtype, kv_scale, t, "paged.", rows)


def replay_bundle(path: str | Path) -> list[dict]:
    """Recompute every op of a golden bundle; one row per check: file, check, ok."""
    path = Path(path)
    manifest = read_bundle_manifest(path)
    num = manifest["numerics"]
    dtype = getattr(torch, num["dtype"])
    emulate = num["act_quant"] == "emulate"
    results = []
    for ent in manifest["entries"]:
        # Fresh (allocator-aligned) copies: safetensors maps tensors at 8-byte offsets, and CPU BLAS
        # takes different code paths (different rounding) for differently aligned small matrices.
        tensors = {k: v.clone() for k, v in load_file(str(path / ent["file"])).items()}
        try:
            checks = _replay_entry(tensors, ent["params"], ent["op"], dtype, emulate, num["kv_scale"])
        except KeyError as e:
            raise InputError(f"{path / ent['file']}: the bundle's {ent['op']} entry lacks {e.args[0]!r} (a damaged "
                             "or hand-edited bundle: export it again)") from None
        for name, ok in checks:
            results.append({"file": ent["file"], "check": name, "ok": bool(ok)})
    return results


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
                   help="instead of exporting, recompute every op of BUNDLE and report mismatches")


def run(args: argparse.Namespace) -> int:
    """`minimax-ref golden`: write a bundle (prints a JSON summary) or replay one (exit 1 on mismatch)."""
    if args.replay is not None:
        results = replay_bundle(args.replay)
        bad = [r for r in results if not r["ok"]]
        json.dump({"bundle": str(args.replay), "checks": len(results), "mismatches": bad}, sys.stdout)
        sys.stdout.write("\n")
        return 1 if bad else 0
    if not args.prompt or args.out is None:
        raise InputError("give --prompt and --out (or --replay BUNDLE)")
    from .cli import load_from_args
    from .config import load_model_config
    from .embedded import default_checkpoint
    from .generate import encode_prompt

    ops, explicit = parse_ops(args.ops)
    ckpt = args.ckpt_path or default_checkpoint()
    layers = parse_layers(args.layers, load_model_config(ckpt).text.num_hidden_layers)
    args.ckpt_path = ckpt
    model, tok, _ = load_from_args(args)
    prompts = [encode_prompt(tok, p, chat=args.chat) for p in args.prompt]
    manifest = export_golden(model, prompts, args.out, ops=ops, layers=layers, explicit_ops=explicit,
                             decode_steps=args.decode_steps, page_size=args.page_size, seed=args.seed,
                             prompt_texts=args.prompt)
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
    if problems:
        raise InputError(f"{path}: damaged golden bundle ({len(problems)} problems); export it again:\n"
                         + "\n".join(f"  - {p}" for p in problems[:20]))
    return manifest
