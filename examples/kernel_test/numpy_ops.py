"""Every op of a golden bundle in plain numpy, written from the manifest's contracts and tensor descriptions alone
(ml_dtypes only to round to bf16): no minimax_ref function is used. `run(entry)` computes every output of an
entry from its inputs, as a kernel would: attention, indexer and MSA read their keys from the paged views
(block_table, seq_lens, k_pages / v_pages / index_k_pages), never from the dense k / v / ik, and the NVFP4 / MXFP8
GEMMs decode the packed bytes. `test_kernels.py` checks it against a bundle; `impl.py` hands it to
`minimax-ref golden --replay BUNDLE --impl impl:run`.

The readers of the formats (manifest `contracts.OP.tensors`):
- E2M1: code bit 3 the sign, bits 0-2 index (0, 0.5, 1, 1.5, 2, 3, 4, 6); element k of a row in byte k // 2, even k
  in the low nibble.
- E4M3 (float8_e4m3fn): bias 7, subnormals m * 2^-9 at exponent 0, 0x7F / 0xFF NaN. E8M0: 2^(code - 127).
- NVFP4 weight: W[n, k] = e2m1[n, k] * fp32(e4m3(scale[n, k // 16]) * weight_scale_2).
- NVFP4 activation codes: x_hat = e2m1(codes) * fp32(e4m3(scale) / g), g = fp32(1 / input_scale).
- Activation fake-quant (act_quant emulate, where an entry holds no codes: the MoE): the contract's rounding text.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
E2M1 = np.concatenate([E2M1, -E2M1])  # code bit 3 is the sign


# ---------------------------------------------------------------------------------------------- format readers


def e4m3(codes: np.ndarray) -> np.ndarray:
    """float32 values of float8_e4m3fn bytes (bias 7, subnormals below exponent 1, 0x7F / 0xFF NaN)."""
    b = codes.astype(np.int32)
    sign = np.where(b & 0x80, -1.0, 1.0).astype(np.float32)
    exp, man = (b >> 3) & 0xF, (b & 7).astype(np.float32)
    val = np.where(exp == 0, man / 8 * 2.0**-6, (1 + man / 8) * np.exp2(exp - 7.0)).astype(np.float32)
    val = np.where((exp == 15) & (man == 7), np.nan, val)
    return sign * val


def e2m1_codes(packed: np.ndarray) -> np.ndarray:
    """float32 [..., K] of E2M1 bytes [..., K/2] (even element in the low nibble)."""
    return E2M1[np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)]


def nvfp4_weight(weight: np.ndarray, scale: np.ndarray, ws2: float) -> np.ndarray:
    """fp32 [N, K]: e2m1 * fp32(e4m3 scale * weight_scale_2), the bracketed product first."""
    factor = e4m3(scale) * np.float32(ws2)
    return e2m1_codes(weight) * np.repeat(factor, 16, axis=1)


def mxfp8_weight(weight: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """fp32 [..., K]: e4m3 element * 2^(E8M0 code - 127) of its block of 32."""
    return e4m3(weight) * np.repeat(np.exp2(scale.astype(np.float32) - 127), 32, axis=-1)


def nvfp4_activation(codes: np.ndarray, scale: np.ndarray, input_scale: float) -> np.ndarray:
    """The W4A4 input [..., K] of its codes, in fp32: e2m1(codes) * fp32(e4m3(scale) / g), g = fp32(1 /
    input_scale)."""
    g = np.float32(1.0) / np.float32(input_scale)
    return e2m1_codes(codes) * np.repeat(e4m3(scale) / g, 16, axis=-1)


def mxfp8_activation(codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The W8A8 input of its codes: e4m3(codes) * 2^(scale - 127)."""
    return mxfp8_weight(codes, scale)


def fake_quant_nvfp4(x: np.ndarray, input_scale: float) -> np.ndarray:
    """NVFP4 activation fake-quant, fp32, before the rounding to the compute dtype: blocks of 16 along K,
    g = fp32(1 / input_scale), s = e4m3_rne(g * (amax * fp32(1/6))) saturating at 448, q = e2m1_rne(x * (1 / (s / g)))
    saturating at 6 (0 where s = 0), x_hat = q * fp32(s / g)."""
    x = x.astype(np.float32)
    blocks = x.reshape(*x.shape[:-1], -1, 16)
    g = np.float32(1.0) / np.float32(input_scale)
    amax = np.abs(blocks).max(-1, keepdims=True)
    s = np.clip(g * (amax * (np.float32(1.0) / np.float32(6.0))), -448, 448)
    s = s.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    step = (s / g).astype(np.float32)
    with np.errstate(divide="ignore"):
        r = np.where(s == 0, np.float32(0.0), np.float32(1.0) / step).astype(np.float32)
    q = np.clip(blocks * r, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    return (q * step).reshape(x.shape)


def fake_quant_mxfp8(x: np.ndarray) -> np.ndarray:
    """MXFP8 activation fake-quant: blocks of 32, X = 2^e with the smallest e such that amax <= 448 * 2^e (e in
    [-127, 127], -127 for a zero block), x_hat = e4m3(x / X) * X."""
    x = x.astype(np.float32)
    blocks = x.reshape(*x.shape[:-1], -1, 32).astype(np.float64)
    amax = np.abs(blocks).max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        e = np.ceil(np.log2(np.where(amax > 0, amax, 1.0) / 448.0))
    e = np.where(amax > 448.0 * np.exp2(e), e + 1, e)  # exact comparisons settle log2's rounding
    e = np.where(amax <= 448.0 * np.exp2(e - 1), e - 1, e)
    e = np.clip(np.where(amax > 0, e, -127), -127, 127)
    X = np.exp2(e)
    q = (blocks / X).astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return (q * X).astype(np.float32).reshape(x.shape)


def to_dtype(a: np.ndarray, dtype: str) -> np.ndarray:
    """One rounding to the bundle's compute dtype (fp32 values kept as fp32)."""
    a = np.asarray(a, dtype=np.float32)
    return a.astype(ml_dtypes.bfloat16).astype(np.float32) if dtype == "bfloat16" else a


# ---------------------------------------------------------------------------------------------- ops


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """Gemma RMSNorm over the last dim in fp64: x / sqrt(mean(x^2) + eps) * (1 + w), the (1 + w) unrounded (a bf16
    (1 + w) or another eps fails the bundles' norm edge entries). The caller rounds once to the bundle's dtype."""
    x = x.astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + w.astype(np.float64))


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Partial NeoX rotate-half RoPE of x [B, T, H, D] with the entry's tables cos, sin [B, T, r]: the first r
    channels rotated (channel i with i + r/2), the rest passed through."""
    r = cos.shape[-1]
    x = x.astype(np.float64)
    c, s = cos.astype(np.float64)[:, :, None, :], sin.astype(np.float64)[:, :, None, :]
    xr = x[..., :r]
    rotated = np.concatenate((-xr[..., r // 2:], xr[..., : r // 2]), -1)
    return np.concatenate((xr * c + rotated * s, x[..., r:]), -1)


def router(x: np.ndarray, gate_weight: np.ndarray, bias: np.ndarray | None, top_k: int,
           mask: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(expert_ids [T, top_k] descending by choice, weights [T, top_k], logits [T, E])."""
    logits = x.astype(np.float64) @ gate_weight.astype(np.float64).T
    scores = 1.0 / (1.0 + np.exp(-logits))
    choice = scores + (0.0 if bias is None else bias.astype(np.float64))
    if mask is not None:
        choice = np.where(mask, choice, -np.inf)
    ids = np.argsort(-choice, axis=-1, kind="stable")[:, :top_k]
    chosen = np.take_along_axis(scores, ids, -1)
    return ids, chosen / chosen.sum(-1, keepdims=True), logits


def swiglu_oai(gate: np.ndarray, up: np.ndarray, alpha: float, limit: float) -> np.ndarray:
    g = np.minimum(gate, limit)
    with np.errstate(over="ignore"):  # exp overflows to inf for very negative g: sigmoid 0, exact
        return (np.clip(up, -limit, limit) + 1.0) * (g / (1.0 + np.exp(-alpha * g)))


def weight_of(t: dict[str, np.ndarray], key: str, fmt: str) -> np.ndarray:
    """The decoded weight of linear `key` in format `fmt` (nvfp4, mxfp8, else plain)."""
    if fmt == "nvfp4":
        return nvfp4_weight(t[f"{key}.weight"], t[f"{key}.weight_scale"], float(t[f"{key}.weight_scale_2"]))
    if fmt == "mxfp8":
        return mxfp8_weight(t[f"{key}.weight"], t[f"{key}.weight_scale"])
    return t[f"{key}.weight"].astype(np.float32)


def moe(t: dict[str, np.ndarray], p: dict, emulate: bool = False, dtype: str = "float32") -> np.ndarray:
    """Routed experts (+ the shared expert) from the per-expert operands, in fp64; in a bfloat16 bundle the values
    the contract rounds to bf16 are rounded here too (weights, gate, up, each SwiGLU step, each expert's output,
    the shared output). `emulate`: each GEMM input fake-quantized in its linear's format."""
    x = t["x"].astype(np.float64)
    ids, weights, _ = router(t["x"], t["gate_weight"], t.get("bias"), p["top_k"], t.get("expert_mask"))
    fmts = p["formats"]

    def rnd(v):  # a value the contract keeps in the compute dtype
        return to_dtype(v, dtype).astype(np.float64) if dtype == "bfloat16" else v

    def a(v, key):
        if not emulate or fmts[key] not in ("nvfp4", "mxfp8"):
            return v
        v = to_dtype(v, dtype)
        fq = fake_quant_nvfp4(v, float(t[f"{key}.input_scale"])) if fmts[key] == "nvfp4" else fake_quant_mxfp8(v)
        return to_dtype(fq, dtype).astype(np.float64)

    def swiglu(gate, up):  # SwiGLU-OAI elementwise in the compute dtype: each step rounded
        if dtype != "bfloat16":
            return swiglu_oai(gate, up, p["alpha"], p["limit"])
        g, u = np.minimum(gate, p["limit"]), np.clip(up, -p["limit"], p["limit"])
        sig = rnd(1.0 / (1.0 + np.exp(-rnd(np.float32(p["alpha"]) * g.astype(np.float32)).astype(np.float64))))
        return rnd(rnd(u + 1.0) * rnd(g * sig))

    def mlp(v, gate, up, down):
        lin = {k: rnd(weight_of(t, k, fmts[k]).astype(np.float64)) for k in (gate, up, down)}
        h = swiglu(rnd(a(v, gate) @ lin[gate].T), rnd(a(v, up) @ lin[up].T))
        return rnd(a(h, down) @ lin[down].T)

    y = np.zeros_like(x)
    for e in sorted(set(ids.flatten().tolist())):
        rows, slot = np.nonzero(ids == e)
        y[rows] += mlp(x[rows], f"experts.{e}.w1", f"experts.{e}.w3", f"experts.{e}.w2") * weights[rows, slot, None]
    y *= p["scaling"]
    if p["shared_expert"]:
        y += mlp(x, "shared.gate_proj", "shared.up_proj", "shared.down_proj")
    return y


def from_pages(pages: np.ndarray, table: np.ndarray, seq_lens: np.ndarray, length: int) -> np.ndarray:
    """[B, length, ...] rebuilt from a paged view: position p < seq_lens[b] from slot p % page of page
    table[b, p // page]; nothing else is read (zeros there)."""
    page = pages.shape[1]
    out = np.zeros((len(seq_lens), length, *pages.shape[2:]), dtype=np.float64)
    for b, n in enumerate(seq_lens):
        for p0 in range(0, min(int(n), length), page):
            m = min(page, int(n) - p0, length - p0)
            out[b, p0: p0 + m] = pages[table[b, p0 // page], :m]
    return out


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, scale: float,
              allowed=None) -> np.ndarray:
    """GQA over keys at positions <= q_pos (and `allowed(b, h_kv, t)` -> bool [L] when given): fp64 [B, T, Hq, D]."""
    B, T, Hq, D = q.shape
    L, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    o = np.zeros((B, T, Hq, D))
    for b in range(B):
        for t in range(T):
            causal = np.arange(L) <= q_pos[b, t]
            for hk in range(Hkv):
                keep = causal if allowed is None else causal & allowed(b, hk, t)
                if not keep.any():
                    continue
                kk, vv = k[b, keep, hk].astype(np.float64), v[b, keep, hk].astype(np.float64)
                s = q[b, t, hk * G:(hk + 1) * G].astype(np.float64) @ kk.T * scale
                pr = np.exp(s - s.max(-1, keepdims=True))
                o[b, t, hk * G:(hk + 1) * G] = (pr / pr.sum(-1, keepdims=True)) @ vv
    return o


def indexer(iq: np.ndarray, ik: np.ndarray, q_pos: np.ndarray, bs: int, topk: int, local: int, init: int
            ) -> tuple[np.ndarray, np.ndarray]:
    """(scores [B, Hi, T, L] fp32 with -inf past q_pos, blocks [B, Hi, T, kb] with -1 for a selected block with no
    causal key; the ids' order is unspecified)."""
    B, T, Hi, _ = iq.shape
    L = ik.shape[1]
    scores = np.einsum("bthd,bld->bhtl", iq.astype(np.float64), ik.astype(np.float64))
    scores = np.where(np.arange(L)[None, None, None, :] > q_pos[:, None, :, None], -np.inf, scores)
    nb = -(-L // bs)
    padded = np.full((B, Hi, T, nb * bs), -np.inf)
    padded[..., :L] = scores
    block = padded.reshape(B, Hi, T, nb, bs).max(-1)
    j = np.arange(nb)
    qb = (q_pos // bs)[:, None, :, None]
    forced = ((j <= qb) & (j > qb - local)) | ((j < init) & (j <= qb))
    block = np.where(forced, np.inf, block)
    kb = min(topk, nb)
    ids = np.argsort(-block, axis=-1, kind="stable")[..., :kb]
    ids = np.where(np.take_along_axis(block, ids, -1) == -np.inf, -1, ids)
    return scores.astype(np.float32), ids


def msa(q, k, v, blocks, q_pos, bs, scale) -> np.ndarray:
    """Attention over the keys of each kv head's selected blocks (-1: none)."""
    L = k.shape[1]
    key_block = np.arange(L) // bs

    def allowed(b, hk, t):
        return np.isin(key_block, blocks[b, hk, t][blocks[b, hk, t] >= 0])

    return attention(q, k, v, q_pos, scale, allowed)


# ---------------------------------------------------------------------------------------------- an entry


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """numpy of a bundle tensor: fp8 as its bytes (the readers decode them), bf16 as fp32 (exact)."""
    t = t.detach().cpu()
    if t.dtype in (torch.float8_e4m3fn, torch.uint8):
        return t.view(torch.uint8).numpy()
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.float().numpy()
    return t.numpy()


def keys(t: dict[str, np.ndarray], name: str, pages: str, dense: np.ndarray) -> np.ndarray:
    """The keys / values a paged kernel reads: rebuilt from `pages` when the entry has a paged view, else as given;
    fp8 pages are read as e4m3 * kv_scale (1.0)."""
    if "block_table" not in t or pages not in t:
        return dense
    pg = t[pages]
    if pg.dtype == np.uint8:
        pg = e4m3(pg)
    return from_pages(pg, t["block_table"], t["seq_lens"], dense.shape[1])


def run(entry) -> dict[str, torch.Tensor]:
    """Every output of a golden entry (`entry.inputs`, `entry.params`, `entry.numerics`), computed here."""
    t = {k: as_numpy(v) for k, v in entry.inputs.items()}
    p, op, dt = entry.params, entry.op, entry.numerics["dtype"]
    emulate = entry.numerics["act_quant"] == "emulate"
    out: dict[str, np.ndarray] = {}
    if op == "rmsnorm":
        for norm in ("input_layernorm", "post_attention_layernorm"):
            if f"{norm}.x" in t:
                out[f"{norm}.y"] = to_dtype(rmsnorm(t[f"{norm}.x"], t[f"{norm}.weight"], p["eps"]), dt)  # one rounding
    elif op == "qk_norm_rope":  # q, k; on MSA layers the indexer's index_q [B, T, Hkv, Di], index_k [B, T, 1, Di]
        for a in (a for a in ("q", "k", "index_q", "index_k") if a in t):
            normed = to_dtype(rmsnorm(t[a], t[f"{a}_norm.weight"], p["eps"]), dt)  # the layer's rounding point
            out[f"{a}_normed"] = normed
            out[f"{a}_rope"] = rope(normed, t["cos"], t["sin"])
    elif op == "final_norm":
        out["y"] = to_dtype(rmsnorm(t["x"], t["weight"], p["eps"]), dt)
    elif op == "logits":
        out["logits"] = t["x"].astype(np.float64) @ weight_of(t, "w", p["format"]).astype(np.float64).T
    elif op == "router":
        ids, w, logits = router(t["x"], t["gate_weight"], t.get("bias"), p["top_k"], t.get("expert_mask"))
        out.update(expert_ids=ids, weights=w, logits=logits)
    elif op in ("nvfp4_linear", "mxfp8_linear"):
        key, fmt = ("w1", "nvfp4") if op == "nvfp4_linear" else ("w", p["format"])
        gemms = [("x", "y", key)] + ([("h", "y2", "w2")] if "h" in t else [])
        for a, y, k in gemms:
            if emulate and f"{a}_codes" in t:
                if fmt == "nvfp4":
                    x_hat = nvfp4_activation(t[f"{a}_codes"], t[f"{a}_scale"], float(t[f"{k}.input_scale"]))
                else:
                    x_hat = mxfp8_activation(t[f"{a}_codes"], t[f"{a}_scale"])
                x_hat = to_dtype(x_hat, dt)
                if a == "x" and "x_hat" in entry.outputs:
                    out["x_hat"] = x_hat
            else:
                x_hat = t[a]
            out[y] = x_hat.astype(np.float64) @ weight_of(t, k, fmt).astype(np.float64).T
    elif op == "moe":
        out["y"] = moe(t, p, emulate, dt)
    elif op == "attention":
        k = keys(t, "k", "k_pages", t["k"])
        v = keys(t, "v", "v_pages", t["v"])
        out["o"] = attention(t["q"], k, v, t["q_pos"], p["scale"])
    elif op in ("indexer", "msa"):
        ik = keys(t, "ik", "index_k_pages", t["ik"])
        scores, blocks = indexer(t["iq"], ik, t["q_pos"], p["block_size"], p["topk_blocks"], p["local_blocks"],
                                 p["init_blocks"])
        out["blocks"] = blocks
        if op == "indexer" and "scores" in entry.outputs:
            out["scores"] = scores
        if op == "msa":
            k = keys(t, "k", "k_pages", t["k"])
            v = keys(t, "v", "v_pages", t["v"])
            out["o"] = msa(t["q"], k, v, blocks, t["q_pos"], p["block_size"], p["scale"])
    res = {}
    for name, a in out.items():
        ref = entry.outputs[name]
        res[name] = torch.from_numpy(np.ascontiguousarray(a)).to(ref.dtype if not ref.is_floating_point() or
                                                                  name == "x_hat" else torch.float32)
    return res
