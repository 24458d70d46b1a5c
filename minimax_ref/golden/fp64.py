"""fp64 reference outputs (`--fp64`): each float output evaluated in fp64 from the same decoded operands, the
format-defined roundings kept and the accumulation rounding dropped (`contract.FP64` says which, per op)."""

from __future__ import annotations

import torch

from ..weights.checkpoint import DENSE, NVFP4
from .contract import QK_NORMS
from .operands import Entry, decode_operand, quantized_input


def _decode64(t: dict[str, torch.Tensor], key: str, fmt: str) -> torch.Tensor:
    """A packed operand's weight in fp64, exactly as the format defines it (NVFP4: e2m1 * scale exact in fp32,
    times weight_scale_2 in fp64; a fused operand's halves with their own weight_scale_2)."""
    from ..weights.quant import dequant_nvfp4

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


def rms_norm64(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma RMSNorm of x [..., D] over its last dim in fp64, the (1 + weight) scale included."""
    x = x.double()
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * (1.0 + weight.double())


def _rope64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Partial NeoX RoPE in fp64 of x [B, T, H, D] with the tables cos, sin [B, T, r] (widened): the first r
    channels rotated, the rest passed through."""
    r = cos.shape[-1]
    xr, h = x[..., :r], r // 2
    rotated = torch.cat((-xr[..., h:], xr[..., :h]), dim=-1)
    out = xr * cos.double()[:, :, None, :] + rotated * sin.double()[:, :, None, :]
    return torch.cat((out, x[..., r:]), dim=-1)


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
    elif op == "qk_norm_rope":
        for which in (w for w in QK_NORMS if w in t):  # q, k; index_q, index_k on MSA layers
            normed = rms_norm64(t[which], t[f"{which}_norm.weight"], p["eps"])
            out[f"{which}_normed"] = normed
            out[f"{which}_rope"] = _rope64(normed, t["cos"], t["sin"])
    elif op == "final_norm":
        out["y"] = rms_norm64(t["x"], t["weight"], p["eps"])
    elif op in ("mxfp8_linear", "nvfp4_linear", "logits"):
        fmt, key = (NVFP4, "w1") if op == "nvfp4_linear" else (p["format"], "w")
        out["logits" if op == "logits" else "y"] = (quantized_input(t["x"], fmt, t, key, emulate).double()
                                                    @ _decode64(t, key, fmt).T)
        if "y2" in t:
            out["y2"] = quantized_input(t["h"], NVFP4, t, "w2", emulate).double() @ _decode64(t, "w2", NVFP4).T
        if "x_hat" in t:
            out["x_hat"] = t["x_hat"].double()
    elif op == "moe":
        out["y"] = _moe64(t, p, emulate)
    elif op == "attention":
        out["o"] = _attention64(t["q"], t["k"], t["v"], t["q_pos"], p["scale"])
    elif op == "indexer":
        from ..model.msa import mask_future

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
    from ..model.moe import route

    x = t["x"]
    fmts = p["formats"]
    r = route(x, t["gate_weight"], t.get("bias"), p["top_k"], t.get("expert_mask"))  # the reference's choice
    logits = x.double() @ t["gate_weight"].double().T
    chosen = torch.sigmoid(logits).gather(-1, r.expert_ids)
    weights = chosen / chosen.sum(-1, keepdim=True)

    def lin(a: torch.Tensor, key: str) -> torch.Tensor:
        fmt = fmts[key]
        a = quantized_input(a.float() if emulate and fmt != DENSE else a, fmt, t, key, emulate)
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
