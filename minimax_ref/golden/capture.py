"""Model-driven export (`export_golden`): golden entries captured from a real forward (prefill, then greedy decode
steps) through hooks and the forward's `Trace`, long prompts in the engine's query chunks (linear memory)."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import InputError
from ..outdir import staged_folder
from ..weights.checkpoint import DENSE, LM_HEAD, MXFP8, NVFP4, TEXT_PREFIX, Checkpoint
from .bundle import BundleWriter, entry_order
from .contract import (
    ATTENTION_OPS,
    CAPTURE_CHUNK,
    CHUNKED_NOTE,
    FORMAT,
    HEAD_OPS,
    MXFP8_LINEARS,
    ONE_CALL_ELEMENTS,
    OPS,
    QK_NORMS,
    TOLERANCE_RULE,
    producer,
)
from .norm_edges import EDGES_NOTE, NORM_OPS, final_norm_edge, qk_norm_rope_edge, rmsnorm_edge
from .operands import (
    Entry,
    block_table,
    checkpoint_of,
    put_activation_codes,
    put_fused,
    put_linear,
    put_stacked,
    routing_metadata,
    to_pages,
)


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

    def __init__(self, model, ck: Checkpoint, ops: set[str], layers: set[int], chunk: int | None = None,
                 stacked: bool = False, align_block: int | None = None):
        self.model, self.ck, self.ops, self.layers = model, _ReadOnce(ck), ops, layers
        self.stacked, self.align_block = stacked, align_block  # moe entries: stacked operands, padded routing
        self.chunk = chunk  # attention cores captured in query chunks of this many elements (None: one chunk)
        self.writer: BundleWriter | None = None  # given: a layer's finished entries are written when the next starts
        self.entries: dict[tuple[str, int, str], Entry] = {}
        self.phase = ""
        self.handles: list = []
        self.routing: dict[int, object] = {}
        self.emulate = getattr(model, "act_quant", "none") == "emulate"
        self.rope: dict[int, tuple] = {}  # layer -> (positions, cos, sin) of its attention call in this forward
        self.logit_positions: list[int] = []  # per row, the position whose logits the phase samples (set per phase)
        self.head = len(model.layers)  # the layer index of the model's head (final norm, LM head)

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
            if "qk_norm_rope" in self.ops:
                attn = layer.self_attn
                self.handles.append(attn.register_forward_pre_hook(self._rope_tables_hook(L), with_kwargs=True))
                for which in _qk_norms(attn):
                    self.handles.append(getattr(attn, f"{which}_norm").register_forward_hook(
                        self._qk_norm_hook(L, which)))
            if "mxfp8_linear" in self.ops:
                for prefix, module in mxfp8_linears_of(self.ck, L):
                    lin = self.model.get_submodule(module)
                    self.handles.append(lin.register_forward_hook(self._mxfp8_hook(L, prefix)))
            if hasattr(layer, "block_sparse_moe"):
                moe = layer.block_sparse_moe
                self.handles.append(moe.gate.register_forward_hook(self._router_hook(L)))
                self.handles.append(moe.register_forward_hook(self._moe_hook(L)))
        if "final_norm" in self.ops:
            self.handles.append(self.model.norm.register_forward_hook(self._final_norm_hook()))
        if "logits" in self.ops:
            self.handles.append(self.model.lm_head.register_forward_hook(self._logits_hook()))
        return self

    def trace(self):
        """The `Trace` a captured forward takes: the attention cores of the chosen layers, when an attention op is
        chosen."""
        from ..research.trace import Trace

        wanted = self.layers if self.ops & set(ATTENTION_OPS) else set()
        return Trace(layers=set(), attention_layers=set(wanted), attention_chunk_elements=self.chunk)

    def take(self) -> list[Entry]:
        """The current phase's entries (listed in bundle order), handed over to be written; the operands read for
        them are let go."""
        self.ck._read.clear()
        keys = sorted((k for k in self.entries if k[2] == self.phase), key=entry_order)
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
            self.writer.add([self.entries.pop(k) for k in sorted(keys, key=entry_order)])
        return hook

    def _norm_hook(self, L: int, norm: str):
        def hook(module, args, out):
            e = self.entry("rmsnorm", L)
            e.put(f"{norm}.x", args[0], "input")
            e.put(f"{norm}.weight", module.weight, "input")
            e.put(f"{norm}.y", out, "output")
            e.params["eps"] = module.eps
        return hook

    def _rope_tables_hook(self, L: int):
        """Before layer L's attention: keep its positions and RoPE tables (the q/k norm hooks rotate with them)."""
        signature = inspect.signature(self.model.layers[L].self_attn.forward)

        def hook(module, args, kwargs):
            bound = signature.bind(*args, **kwargs).arguments
            self.rope[L] = (bound["pos"], bound["cos"], bound["sin"])
        return hook

    def _qk_norm_hook(self, L: int, which: str):
        """Layer L's per-head norm `{which}_norm` (`QK_NORMS`: q, k, and on MSA layers the indexer's index_q [B, T,
        kv_heads, Di] and index_k [B, T, 1, Di], the head axis of 1 kept as the norm sees it): its input and output,
        and RoPE applied to the output with the layer's tables, the call `Attention.qkv` / `Attention.index_qk`
        makes next (a pure function of what it records here)."""
        from ..model.rope import apply_rope

        def hook(module, args, out):
            pos, cos, sin = self.rope[L]
            e = self.entry("qk_norm_rope", L)
            e.put(which, args[0], "input")
            name = f"{TEXT_PREFIX}layers.{L}.self_attn.{which}_norm.weight"
            e.put(f"{which}_norm.weight", self.ck.read(name), "weight", shared=name)
            e.put("positions", pos, "input")
            e.put("cos", cos, "input")
            e.put("sin", sin, "input")
            e.put(f"{which}_normed", out, "output")
            e.put(f"{which}_rope", apply_rope(out, cos, sin), "output")
            e.params.update({"eps": module.eps, "rotary_dim": cos.shape[-1], "rope_theta": self.model.text.rope_theta})
        return hook

    def _final_norm_hook(self):
        """The model's final norm: the residual stream after the last layer, every position."""
        def hook(module, args, out):
            e = self.entry("final_norm", self.head)
            e.put("x", args[0], "input")
            name = f"{TEXT_PREFIX}norm.weight"
            e.put("weight", self.ck.read(name), "weight", shared=name)
            e.put("y", out, "output")
            e.params["eps"] = module.eps
        return hook

    def _logits_hook(self):
        """The LM head on each row's sampled position (`logit_positions`): the module run again on those B rows
        (without hooks), so the entry holds the [B, V] GEMM a kernel given x computes; a replay of the same shape
        is then bit-exact (BLAS may round the forward's [B * T] rows differently, within the tolerance)."""
        def hook(module, args, out):
            h = args[0]
            rows = torch.arange(h.shape[0], device=h.device)
            x = h[rows, torch.tensor(self.logit_positions, device=h.device)].clone()
            e = self.entry("logits", self.head)
            e.put("x", x, "input")
            prefix, fmt = lm_head_of(self.ck)
            if fmt == DENSE and prefix not in self.ck.formats:  # tied embeddings: the embedding's weight
                e.put("w.weight", self.ck.read(prefix + ".weight"), "weight", shared=prefix + ".weight")
            else:
                put_linear(e, self.ck, prefix, "w")
            e.put("logits", module.forward(x).float(), "output")
            e.params.update({"linear": prefix, "format": fmt, "logit_positions": list(self.logit_positions)})
        return hook

    def _mxfp8_hook(self, L: int, prefix: str):
        def hook(module, args, out):
            e = self.entry("mxfp8_linear", L, prefix.removeprefix(f"{TEXT_PREFIX}layers.{L}."))
            e.put("x", args[0], "input")
            fmt = put_linear(e, self.ck, prefix, "w")
            if self.emulate and module.emulate_act_quant:
                from ..model.linear import emulate_activation_quant

                e.put("x_hat", emulate_activation_quant(args[0], module.act_format, module.input_scale), "output")
                put_activation_codes(e, "x", args[0], fmt, None)
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
            put_fused(e, "shared.gate_proj", "shared.up_proj", "shared.gate_up", formats["shared.gate_proj"])
        for x in used:
            for leaf in ("w1", "w2", "w3"):
                formats[f"experts.{x}.{leaf}"] = put_linear(e, self.ck, f"{base}experts.{x}.{leaf}",
                                                            f"experts.{x}.{leaf}")
            put_fused(e, f"experts.{x}.w1", f"experts.{x}.w3", f"experts.{x}.w13", formats[f"experts.{x}.w1"])
        if self.stacked:
            put_stacked(e, used)
        num_experts = int(module.gate.weight.shape[0])
        for name, t in routing_metadata(routing.expert_ids.cpu(), routing.weights.cpu(), num_experts, used,
                                        self.align_block).items():
            e.put(name, t, "input")
        e.put("y", y, "output")
        e.params.update({"top_k": module.gate.top_k, "scaling": module.scaling, "alpha": module.experts.alpha,
                         "limit": module.experts.limit, "num_experts": num_experts,
                         "used_experts": used, "formats": formats,
                         "shared_expert": module.shared_experts is not None,
                         **({"align_block": self.align_block} if self.align_block is not None else {})})

    def _nvfp4_entry(self, L: int, module, flat, routing) -> None:
        from ..model.linear import emulate_activation_quant
        from ..model.mlp import swiglu_oai

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
        if self.emulate and ex.emulate_act_quant:
            e.put("x_hat", act(x, "w1"), "output")
            put_activation_codes(e, "x", x, NVFP4, ex.w1_input_scale[x_id])
            put_activation_codes(e, "h", h, NVFP4, ex.w2_input_scale[x_id])
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
        from ..model.msa import index_scores, query_chunk
        from ..research.trace import ONE_CHUNK

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
                e.put("k_pages", to_pages(cache.k[L], table, seq_lens, page, seed), "paged")
                e.put("v_pages", to_pages(cache.v[L], table, seq_lens, page, seed + 1), "paged")
            if op in ("msa", "indexer"):
                e.put("index_k_pages", to_pages(cache.index_k[L], table, seq_lens, page, seed + 2), "paged")
            e.params["page_size"] = page


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


def lm_head_of(ck: Checkpoint) -> tuple[str, str]:
    """(tensor prefix, format) of the LM head's weight: `language_model.lm_head`, or with tied embeddings the
    embedding (`language_model.model.embed_tokens`, a plain weight)."""
    prefix = LM_HEAD.removesuffix(".weight")
    f = ck.formats.get(prefix)
    return (prefix, f.fmt) if f is not None else (f"{TEXT_PREFIX}embed_tokens", DENSE)


def available_ops(ck: Checkpoint, layer: int) -> set[str]:
    """The ops the engine computes at `layer` of checkpoint `ck`; layer num_hidden_layers is the model's head
    (`HEAD_OPS`)."""
    t = ck.config.text
    if layer == t.num_hidden_layers:
        return set(HEAD_OPS)
    ops = {"rmsnorm", "qk_norm_rope"}
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


# How the row-wise entries of a model-driven bundle lay out the batch (weights.md, "The rows of model-driven entries").
ROWS_NOTE = ("the prompts run as one right-padded batch [B, T] (T the longest prompt in the prefill phase, 1 in a "
             "decode phase); entries of row-wise ops hold every position, padding included: mxfp8_linear, rmsnorm, "
             "qk_norm_rope and final_norm as [B, T, ...], router and moe as [B * T, ...] row-major (row b * T + t); "
             "position t of prompt b is padding where t >= len(prompts[b].input_ids) (prefill only). nvfp4_linear "
             "holds the rows routed to its expert (params.tokens: their indices in the [B * T] layout); logits hold "
             "one row per prompt (the position params.logit_positions, whose logits pick the next token); attention "
             "entries mark real queries with cu_seqlens_q")


def _qk_norms(attn) -> tuple[str, ...]:
    """The per-head norms of an attention module (`QK_NORMS`): q and k, and on an MSA layer the indexer's too."""
    return QK_NORMS if attn.sparse else QK_NORMS[:2]


def norm_edge_entries(model, ck, ops: Sequence[str], layers: Sequence[int], seed: int) -> list[Entry]:
    """The edge entries (phase `edge`, `norm_edges`) of the chosen norm ops: rmsnorm at the first chosen layer,
    qk_norm_rope at the first chosen MSA layer (its q / k norms and the indexer's) or, with none chosen, at the first
    chosen layer (q / k only), final_norm at the head; the dimensions, eps and weight dtypes of the model's own
    norms."""
    text, dtype = model.text, model.dtype
    out = []
    if layers and "rmsnorm" in ops:
        L = min(layers)
        norms = {n: (m.weight.numel(), m.eps, m.weight.dtype)
                 for n in ("input_layernorm", "post_attention_layernorm") for m in [getattr(model.layers[L], n)]}
        out.append(rmsnorm_edge(L, norms, dtype, seed + 101))
    sparse = [L for L in layers if text.sparse_layers[L]]
    L = min(sparse or layers, default=None)
    attn = model.layers[L].self_attn if L is not None else None
    if attn is not None and hasattr(attn, "q_norm") and "qk_norm_rope" in ops:
        heads = {"q": text.num_attention_heads, "k": text.num_key_value_heads, "index_q": text.num_key_value_heads,
                 "index_k": 1}
        norms = {which: (heads[which], getattr(attn, f"{which}_norm").weight.numel(),
                         ck.read(f"{TEXT_PREFIX}layers.{L}.self_attn.{which}_norm.weight").dtype)
                 for which in _qk_norms(attn)}
        out.append(qk_norm_rope_edge(L, norms, attn.q_norm.eps, text.rotary_dim, text.rope_theta, dtype, seed + 102))
    if "final_norm" in ops:
        wdtype = ck.read(f"{TEXT_PREFIX}norm.weight").dtype
        out.append(final_norm_edge(len(model.layers), model.norm.weight.numel(), model.norm.eps, wdtype, dtype,
                                   seed + 103))
    return out


def parse_ops(text: str | None) -> tuple[list[str], bool]:
    """(ops, explicit) from a comma list (None = all ops, not explicit)."""
    if text is None:
        return list(OPS), False
    ops = [o.strip() for o in text.split(",") if o.strip()]
    ops = list(dict.fromkeys(e for o in ops for e in SINGLE_OP_ENTRIES.get(o, (o,))))
    bad = [o for o in ops if o not in OPS]
    if bad or not ops:
        aliases = ", ".join(f"{name} = {' + '.join(entries)}" for name, entries in SINGLE_OP_ENTRIES.items())
        raise InputError(f"--ops: unknown op {bad[0] if bad else text!r} (known: {', '.join(OPS)}; {aliases})")
    return ops, True


# A single op whose bundle holds entries of other op names: `--ops` takes its name for them.
SINGLE_OP_ENTRIES = {"msa_decode": ("indexer", "msa")}


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
                  fp64: bool = False, chunk_elements: int | None = None, stacked: bool = False,
                  align_block: int | None = None) -> dict:
    """Run prefill + `decode_steps` greedy decode steps on `prompts` (token ids) and write the bundle.

    Ops missing at a chosen layer are skipped; with `explicit_ops`, an op found at none of the chosen
    layers is an InputError. fp64: add each float output's fp64 version (`FP64`). chunk_elements: capture the
    attention cores in the engine's query chunks of this many elements (`CHUNKED_NOTE`); None: one call per core
    unless that call's scores would exceed `ONE_CALL_ELEMENTS`, then chunks of `CAPTURE_CHUNK`. Entries are
    written as they are complete (a layer's when the next starts). stacked / align_block: moe entries also hold
    the stacked operands of their used experts / the routing padded to blocks (`routing_metadata`). Returns the
    manifest.
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
        if explicit_ops and op not in HEAD_OPS and not any(op in available_ops(ck, L) for L in layers):
            kinds = sorted({text.layer_kind(L) for L in layers})
            raise InputError(f"--ops {op}: no chosen layer computes it (layers {layers} are {', '.join(kinds)})")
    if (stacked or align_block is not None) and "moe" not in ops:
        raise InputError("--stacked and --align-block apply to moe entries: add moe to --ops")
    if align_block is not None and align_block < 1:
        raise InputError(f"--align-block {align_block}: must be >= 1 (vLLM uses 16, 32, 64 or 128)")
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
                  "rms_norm_eps": text.rms_norm_eps, "rope_theta": text.rope_theta, "rotary_dim": text.rotary_dim,
                  "msa_block_size": text.sparse.block_size, "msa_topk_blocks": text.sparse.topk_blocks},
        "rows": ROWS_NOTE,
        "prompts": [{"input_ids": list(map(int, p)), **({"text": prompt_texts[i]} if prompt_texts else {})}
                    for i, p in enumerate(prompts)],
        "decoded_token_ids": decoded,
        "page_size": page,
        "attention_capture": ({"chunk_elements": chunk_elements, "note": CHUNKED_NOTE} if chunk_elements
                              else {"chunk_elements": None, "note": "each attention core captured as one call"}),
        "ops": list(ops),
        "layers": layers,
        **({"norm_edges": EDGES_NOTE} if set(ops) & set(NORM_OPS) else {}),
        "contracts": {},  # written at the end, describing exactly the tensors the entries hold
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
    with staged_folder(out) as tmp, _Capture(model, ck, set(ops), set(layers), chunk_elements, stacked,
                                             align_block) as cap:
        writer = cap.writer = BundleWriter(tmp, manifest, fp64=fp64, emulate=emulate)
        # the norm ops' edge entries first: built and written before the forward's large tensors exist
        writer.add(norm_edge_entries(model, cap.ck, ops, layers, seed))
        cap.phase = "prefill"
        cap.logit_positions = [n - 1 for n in lengths]  # the logits that pick each row's first token
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
            cap.logit_positions = [0] * B
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
