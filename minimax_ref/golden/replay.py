"""Replay (`replay_bundle`): every output recomputed from the stored inputs with the engine's pure functions and
compared bit for bit, with the error sizes."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import InputError
from ..weights.checkpoint import DENSE, NVFP4
from .bundle import check_sha256, entry_tensors, read_bundle_manifest
from .contract import QK_NORMS, error_sizes, same
from .fp64 import fp64_outputs
from .operands import (
    activation_codes,
    decode_fused,
    decode_operand,
    from_pages,
    quantized_input,
    routing_metadata,
)


def replay_linear(t: dict, key: str, fmt: str, x: torch.Tensor, dtype: torch.dtype, emulate: bool) -> torch.Tensor:
    return F.linear(quantized_input(x, fmt, t, key, emulate), decode_operand(t, key, fmt, dtype))


def replay_moe(t: dict, p: dict, dtype: torch.dtype, emulate: bool) -> torch.Tensor:
    from ..model.linear import set_activation_formats
    from ..model.mlp import MLP
    from ..model.moe import Experts, Routing, route

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


def _routing_checks(t: dict, p: dict) -> list[Check]:
    """The routing a moe entry gives (topk_ids, topk_weights) and its grouped-GEMM metadata, recomputed."""
    from ..model.moe import route

    if "topk_ids" not in t:
        return []
    r = route(t["x"], t["gate_weight"], t.get("bias"), p["top_k"], t.get("expert_mask"))
    meta = routing_metadata(r.expert_ids, r.weights, p["num_experts"], p["used_experts"], p.get("align_block"))
    return [(name, got, t[name]) for name, got in meta.items()]


def _replay_entry(t: dict, p: dict, op: str, dtype: torch.dtype, emulate: bool, kv_scale: float) -> list[Check]:
    """(check name, recomputed, stored) for every output of one entry (and its fp64 outputs, when stored)."""
    checks = _replay_outputs(t, p, op, dtype, emulate, kv_scale)
    if any(n.endswith(".fp64") for n in t):
        checks += [(f"{n}.fp64", v, t[f"{n}.fp64"]) for n, v in fp64_outputs(op, t, p, emulate).items()]
    return checks


def _code_checks(t: dict, inputs: dict[str, str], fmt: str) -> list[Check]:
    """The stored activation codes and scales of each input (`{name}_codes`, `{name}_scale`, present with
    act_quant="emulate") against the input quantized again with its linear's input scale."""
    checks: list[Check] = []
    for name, key in inputs.items():
        if f"{name}_codes" in t:
            again = activation_codes(t[name], fmt, t.get(f"{key}.input_scale"))
            checks += [(f"{name}_{part}", again[part], t[f"{name}_{part}"]) for part in ("codes", "scale")]
    return checks


def _replay_outputs(t: dict, p: dict, op: str, dtype: torch.dtype, emulate: bool, kv_scale: float) -> list[Check]:
    from ..model.moe import route
    from ..model.norm import gemma_rms_norm

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
        checks.append(("y", replay_moe(t, p, dtype, emulate), t["y"]))
        checks += _fused_checks(t, p, dtype) + _routing_checks(t, p)
    elif op == "nvfp4_linear":
        checks.append(("y", replay_linear(t, "w1", NVFP4, t["x"], dtype, emulate), t["y"]))
        if "y2" in t:  # single-op bundles hold one GEMM
            checks.append(("y2", replay_linear(t, "w2", NVFP4, t["h"], dtype, emulate), t["y2"]))
        if "x_hat" in t:
            checks.append(("x_hat", quantized_input(t["x"], NVFP4, t, "w1", True), t["x_hat"]))
        checks += _code_checks(t, {"x": "w1", "h": "w2"}, NVFP4)
    elif op == "mxfp8_linear":
        checks.append(("y", replay_linear(t, "w", p["format"], t["x"], dtype, emulate), t["y"]))
        if "x_hat" in t:
            checks.append(("x_hat", quantized_input(t["x"], p["format"], t, "w", True), t["x_hat"]))
        checks += _code_checks(t, {"x": "w"}, p["format"])
    elif op == "qk_norm_rope":
        checks += _replay_qk_norm_rope(t, p)
    elif op == "final_norm":
        checks.append(("y", gemma_rms_norm(t["x"], t["weight"], p["eps"]), t["y"]))
    elif op == "logits":
        checks.append(("logits", replay_linear(t, "w", p["format"], t["x"], dtype, emulate).float(), t["logits"]))
    elif op in ("attention", "indexer", "msa"):
        checks += _replay_attention(t, p, op, dtype, kv_scale, t, "")
        if "block_table" in t:
            checks += _replay_paged(t, p, op, dtype, kv_scale)
    return checks


def _replay_qk_norm_rope(t: dict, p: dict) -> list[Check]:
    """The RoPE tables again from the positions (inputs, checked: a kernel may compute its own), then each head's
    norm (q, k and, on MSA layers, the indexer's index_q, index_k) and the rotation of the normed value as the layer
    computes them (`norm.gemma_rms_norm`, `rope.apply_rope`)."""
    from ..model.norm import gemma_rms_norm
    from ..model.rope import apply_rope, rope_cos_sin, rope_inv_freq

    cos, sin = rope_cos_sin(t["positions"], rope_inv_freq(p["rotary_dim"], p["rope_theta"]))
    checks = [("cos", cos, t["cos"]), ("sin", sin, t["sin"])]
    for which in (w for w in QK_NORMS if w in t):  # q, k; index_q, index_k on MSA layers
        normed = gemma_rms_norm(t[which], t[f"{which}_norm.weight"], p["eps"])
        checks += [(f"{which}_normed", normed, t[f"{which}_normed"]),
                   (f"{which}_rope", apply_rope(normed, t["cos"], t["sin"]), t[f"{which}_rope"])]
    return checks


def _replay_attention(t: dict, p: dict, op: str, dtype: torch.dtype, kv_scale: float, ref: dict, tag: str,
                      rows: torch.Tensor | None = None) -> list[Check]:
    """Recompute `op` from the inputs in `t`; compare with `ref` (only query rows `rows` [B, T] when given)."""
    from ..model.attention import causal_attention
    from ..model.msa import gather_block_attention, index_scores, select_blocks

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


def replay_bundle(path: str | Path, ops: Sequence[str] | None = None) -> list[dict]:
    """Recompute every op of a golden bundle (or only the entries of `ops`) with the engine's functions; one row per
    check: file, check, ok (bit-exact), and the error sizes (`error_sizes`). Files whose sha256 differs from the
    manifest's are refused first (`check_sha256`)."""
    path = Path(path)
    manifest = read_bundle_manifest(path)
    check_sha256(path, manifest)
    num = manifest["numerics"]
    dtype = getattr(torch, num["dtype"])
    emulate = num["act_quant"] == "emulate"
    results = []
    for ent in manifest["entries"]:
        if ops is not None and ent["op"] not in ops:
            continue
        tensors = entry_tensors(path, ent)
        try:
            checks = _replay_entry(tensors, ent["params"], ent["op"], dtype, emulate, num["kv_scale"])
        except KeyError as e:
            raise InputError(f"{path / ent['file']}: the bundle's {ent['op']} entry lacks {e.args[0]!r} (a damaged "
                             "or hand-edited bundle: export it again)") from None
        for name, got, want in checks:
            results.append({"file": ent["file"], "check": name, "ok": same(got, want), **error_sizes(got, want)})
    return results
