"""The norm ops' edge entries (phase `edge`, `golden.norm_edges`): a norm kernel with its (1 + weight) rounded to
bf16, or with eps 10x off or left out, fails every norm op (input / post-attention norms, q / k norms, the final
norm) in float32 and bfloat16 bundles, where the captured rows alone pass it in bfloat16; the reference, an fp64
computation rounded once, an unrounded fp32 kernel, a fused norm + RoPE kernel and the numpy example pass. On an MSA
layer the qk_norm_rope entries hold the lightning indexer's norms too (index_q / index_k): a wrong indexer norm in
the numpy example fails them."""

from __future__ import annotations

import json
import math

import ml_dtypes
import numpy as np
import pytest
import torch
from golden_example import numpy_ops

from minimax_ref import golden
from minimax_ref.golden.norm_edges import EDGE, MARGIN, ROWS, clear_of_midpoint
from minimax_ref.model.rope import apply_rope
from minimax_ref.weights.loader import load_synthetic

NORM_OPS = ["rmsnorm", "qk_norm_rope", "final_norm"]
# each norm of the model: (op, the outputs it gives)
NORMS = {"input_layernorm": ("rmsnorm", ["input_layernorm.y"]),
         "post_attention_layernorm": ("rmsnorm", ["post_attention_layernorm.y"]),
         "q_norm": ("qk_norm_rope", ["q_normed", "q_rope"]), "k_norm": ("qk_norm_rope", ["k_normed", "k_rope"]),
         "index_q_norm": ("qk_norm_rope", ["index_q_normed", "index_q_rope"]),
         "index_k_norm": ("qk_norm_rope", ["index_k_normed", "index_k_rope"]),
         "final_norm": ("final_norm", ["y"])}
# the wrong kernels: (1 + w) in bf16; eps 1e-5 for the model's 1e-6 (and 1e-7); no eps
WRONG = {"bf16-one-plus-w": {"one_plus": "bf16"}, "eps-x10": {"eps": 10.0}, "eps-div10": {"eps": 0.1},
         "no-eps": {"eps": 0.0}}


NP = numpy_ops()  # a module of its own: the planted bugs below patch it


QK = ("q", "k", "index_q", "index_k")  # a qk_norm_rope entry's norms (index_q / index_k: MSA layers)
INDEX_OUTPUTS = {"index_q_normed", "index_q_rope", "index_k_normed", "index_k_rope"}
MSA_LAYERS = (1, 2, 3)  # the tiny preset's MSA layers (layer 0 is dense)


def _prompts(*lengths: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(29)
    return [torch.randint(0, 1000, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def bundle(request, tmp_path_factory):
    model = load_synthetic("tiny", dtype=getattr(torch, request.param))
    out = tmp_path_factory.mktemp("norm_edges") / request.param
    golden.export_golden(model, _prompts(11, 4), out, ops=NORM_OPS, decode_steps=1, fp64=True)
    return out


# ---------------------------------------------------------------- kernels


def norm(x: torch.Tensor, w: torch.Tensor, eps: float, one_plus: str = "fp32", eps_factor: float = 1.0,
         rounded: bool = True) -> torch.Tensor:
    """A norm kernel: fp32 x * rsqrt(mean(x^2) + eps) * (1 + w), then one rounding to x's dtype (rounded=False:
    left in fp32). one_plus="bf16": the (1 + w) computed in bf16; eps_factor: eps multiplied (0: no eps)."""
    xf = x.float()
    scale = (1.0 + w.bfloat16()).float() if one_plus == "bf16" else 1.0 + w.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps * eps_factor) * scale
    return y.to(x.dtype) if rounded else y


def kernel(e: golden.GoldenEntry, wrong: dict | None = None, which: str | None = None, rounded: bool = True,
           fused: bool = False) -> dict[str, torch.Tensor]:
    """Every output of a norm entry; `wrong` ({one_plus, eps}) applied to the norm `which` (None: every norm).
    fused: q / k rotated from the fp32 normed value and rounded once."""
    t, p = e.inputs, e.params

    def nrm(name, x, w):
        bad = wrong if wrong and which in (None, name) else {}
        kw = {"one_plus": bad.get("one_plus", "fp32"), "eps_factor": bad.get("eps", 1.0)}
        return norm(x, w, p["eps"], rounded=rounded and not fused, **kw)

    if e.op == "rmsnorm":
        return {f"{n}.y": nrm(n, t[f"{n}.x"], t[f"{n}.weight"]) for n in NORMS if f"{n}.x" in t}
    if e.op == "final_norm":
        return {"y": nrm("final_norm", t["x"], t["weight"])}
    out = {}
    for q in (q for q in QK if q in t):
        normed = nrm(f"{q}_norm", t[q], t[f"{q}_norm.weight"])
        out[f"{q}_normed"] = normed.to(t[q].dtype)
        out[f"{q}_rope"] = apply_rope(normed, t["cos"], t["sin"]).to(t[q].dtype)
    return out


def planted(e: golden.GoldenEntry, wrong: dict) -> dict[str, torch.Tensor]:
    """The numpy example with the bug planted in its rmsnorm (every norm of the entry)."""
    good = NP.rmsnorm

    def bad(x, w, eps):
        if wrong.get("one_plus") == "bf16":  # bf16 add: the exact sum rounded once to bf16
            one_plus = (1.0 + w.astype(np.float64)).astype(ml_dtypes.bfloat16).astype(np.float64)
            x = x.astype(np.float64)
            return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * one_plus
        return good(x, w, eps * wrong["eps"])

    NP.rmsnorm = bad
    try:
        with np.errstate(invalid="ignore", divide="ignore"):  # no eps: the zero rows' 0 / 0
            return NP.run(e)
    finally:
        NP.rmsnorm = good


def _edge(entries):
    return [e for e in entries if e.phase == "edge"]


# ---------------------------------------------------------------- the wrong kernels fail


@pytest.mark.parametrize("wrong", list(WRONG), ids=list(WRONG))
@pytest.mark.parametrize("which", list(NORMS))
def test_a_wrong_norm_kernel_fails_every_norm(bundle, which, wrong):
    """Each wrong kernel, on each norm alone, fails that norm's outputs in the edge entry (one ulp or more off in
    bf16, where the captured entries cannot tell a bf16 (1 + w) or an eps 10x off)."""
    op, outputs = NORMS[which]
    entries = golden.load(bundle, ops=[op])
    dtype = entries[0].numerics["dtype"]
    [edge] = _edge(entries)
    r = golden.compare(edge, kernel(edge, WRONG[wrong], which))
    assert not r.ok, str(r)
    assert {row["name"] for row in r.rows if not row["ok"]} == set(outputs), str(r)
    if dtype == "bfloat16":
        for e in entries:
            if e.phase != "edge":  # the forward's rows: inside the bf16 tolerance
                assert golden.compare(e, kernel(e, WRONG[wrong], which)).ok
        for row in r.rows:
            if not row["ok"] and wrong == "bf16-one-plus-w":
                assert row["max_ulps"] == 1 and row["max_rel"] > row["rtol"] == 2**-8 and row["atol"] == 0


@pytest.mark.parametrize("wrong", list(WRONG), ids=list(WRONG))
def test_the_numpy_example_with_a_planted_norm_bug_fails(bundle, wrong):
    for e in _edge(golden.load(bundle, ops=NORM_OPS)):
        assert golden.compare(e, NP.run(e)).ok
        r = golden.compare(e, planted(e, WRONG[wrong]))
        assert not r.ok and all(not row["ok"] for row in r.rows), str(r)


def _rotate_last_channels(x, cos, sin):
    """A wrong RoPE: the last rotary_dim channels of each head rotated, the first passed through."""
    r = cos.shape[-1]
    return np.concatenate((x[..., :-r].astype(np.float64), NP_ROPE(x[..., -r:], cos, sin)), -1)


NP_ROPE = NP.rope
# the planted indexer-norm bugs: the norm ones (caught by the edge entry) and RoPE on the wrong channels (caught by
# the forward's entries: the edge rows sit at position 0, where the rotation is the identity)
INDEX_BUGS = {**WRONG, "rope-on-last-channels": {"rope": _rotate_last_channels}}


def planted_index(e: golden.GoldenEntry, wrong: dict) -> dict[str, torch.Tensor]:
    """The numpy example whose indexer norm + RoPE carries the bug `wrong` (q / k as the example computes them): a
    fused indexer kernel that gets its own norm wrong."""
    if "rope" not in wrong:
        bad = planted(e, wrong)
    else:
        NP.rope = wrong["rope"]
        try:
            bad = NP.run(e)
        finally:
            NP.rope = NP_ROPE
    good = NP.run(e)
    return {n: bad[n] if n in INDEX_OUTPUTS else v for n, v in good.items()}


@pytest.mark.parametrize("wrong", list(INDEX_BUGS), ids=list(INDEX_BUGS))
def test_the_numpy_example_with_a_planted_indexer_norm_bug_fails(bundle, wrong):
    """A bug in the indexer's norm or rotation alone (eps off or missing, a bf16 (1 + w), RoPE on the last channels)
    fails exactly the indexer's outputs: norm bugs in the edge entry, the rotation bug in the forward's entries of
    every MSA layer; the correct example passes both."""
    entries = golden.load(bundle, ops=["qk_norm_rope"])
    rope_bug = "rope" in INDEX_BUGS[wrong]
    chosen = [e for e in entries if e.phase != "edge" and e.layer in MSA_LAYERS] if rope_bug else _edge(entries)
    assert chosen and all(INDEX_OUTPUTS <= set(e.outputs) for e in chosen)
    for e in chosen:
        assert golden.compare(e, NP.run(e)).ok
        r = golden.compare(e, planted_index(e, INDEX_BUGS[wrong]))
        bad = {row["name"] for row in r.rows if not row["ok"]}
        assert bad == (INDEX_OUTPUTS - ({"index_q_normed", "index_k_normed"} if rope_bug else set())), str(r)


# ---------------------------------------------------------------- correct kernels pass


def test_correct_kernels_pass_every_entry(bundle):
    """The reference's functions (bit-exact), an fp32 kernel left unrounded, a fused norm + RoPE (one rounding),
    an fp64 computation rounded once, and the numpy example: every entry, edge entries included."""
    entries = golden.load(bundle, ops=NORM_OPS)
    assert _edge(entries)
    for e in entries:
        assert golden.compare(e, kernel(e)).ok, e.id
        assert golden.compare(e, kernel(e, rounded=False)).ok, e.id
        assert golden.compare(e, kernel(e, fused=True)).ok, e.id
        r = golden.compare(e, NP.run(e))
        assert r.ok, str(r)
        fp64 = {n: v.to(e.outputs[n].dtype) for n, v in e.fp64.items()}
        if e.op == "qk_norm_rope":  # the fp64 rotation of the unrounded normed value: a fused kernel
            fp64 = {n: v for n, v in fp64.items() if n.endswith("_normed") or e.phase == "edge"}
        assert golden.compare(e, fp64, skip=[n for n in e.outputs if n not in fp64]).ok, e.id
        if e.phase == "edge" and e.numerics["dtype"] == "bfloat16":  # bit-exact: the one rounding is the same
            for name, want in e.outputs.items():
                assert torch.equal(kernel(e)[name], want) and torch.equal(fp64[name], want), (e.id, name)


def test_replay_is_bit_exact_with_the_edge_entries(bundle):
    results = golden.replay_bundle(bundle)
    assert results and all(r["ok"] for r in results)
    assert {r["file"] for r in results} >= {f"{op}/layer{L:03d}_edge.safetensors"
                                            for op, L in (("rmsnorm", 0), ("qk_norm_rope", 1), ("final_norm", 4))}


# ---------------------------------------------------------------- what the edge entries hold


def test_edge_entries_hold_the_documented_rows(bundle):
    m = json.loads((bundle / "manifest.json").read_text())
    dtype = m["numerics"]["dtype"]
    assert "eps" in m["norm_edges"] and "2^-13" in m["norm_edges"]
    rows = {r["file"]: r for r in m["entries"]}
    for e in _edge(golden.load(bundle, ops=NORM_OPS)):
        eps = e.params["eps"]
        assert e.params["edge"] == EDGE and eps == 1e-6
        pairs = {"rmsnorm": [(f"{n}.x", f"{n}.weight") for n in ("input_layernorm", "post_attention_layernorm")],
                 "final_norm": [("x", "weight")], "qk_norm_rope": [(q, f"{q}_norm.weight") for q in QK]}
        for xn, wn in pairs[e.op]:
            x, w = e.inputs[xn].double(), e.inputs[wn].double()
            assert x.shape[:2] == (1, len(ROWS)) and e.inputs[xn].dtype == getattr(torch, dtype)
            # every weight is exact in bf16 while 1 + w is not; |w| in [2^-12, 7 * 2^-9]
            assert torch.equal(w, w.bfloat16().double()) and bool(((1 + w).bfloat16().double() != 1 + w).all())
            assert float(w.abs().min()) >= 2**-12 and float(w.abs().max()) <= 7 * 2**-9
            ms = x.square().mean(-1).flatten()  # per row (per head): zero, eps/4, eps, unit
            kinds = [ROWS[(t + h) % 4] for t in range(x.shape[1]) for h in range(x.shape[2] if x.dim() == 4 else 1)]
            for kind, v in zip(kinds, ms.tolist(), strict=True):  # eps rows: to bf16's rounding of their values
                if kind == "unit":
                    assert v > 1e4 * eps
                else:
                    assert math.isclose(v, {"zero": 0.0, "eps/4": eps / 4, "eps": eps}[kind], rel_tol=2**-7)
            exact = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * (1 + w)
            assert all(clear_of_midpoint(v) for v in exact.flatten().tolist())
        if e.op == "qk_norm_rope":  # the first MSA layer: the indexer's norms too; position 0: no rotation
            assert e.layer == 1 and set(QK) <= set(e.inputs)
            assert not e.inputs["positions"].any() and bool((e.inputs["cos"] == 1).all())
            assert not e.inputs["sin"].any()
            assert all(torch.equal(e.outputs[f"{q}_rope"], e.outputs[f"{q}_normed"]) for q in QK)
        tol = rows[e.file]["tolerance"]
        for name in e.outputs:
            bf, f32 = tol[name]["bfloat16"], tol[name]["float32"]
            assert f32["rtol"] == 1e-5
            if dtype == "bfloat16":
                assert bf == {"rtol": 2**-8, "atol": 0.0}
            else:
                assert bf["rtol"] == golden.TOLERANCE[e.op]["bfloat16"][0] and bf["atol"] > 0
    assert MARGIN == 2**-13


def test_only_chosen_norm_ops_get_edge_entries(tmp_path):
    model = load_synthetic("tiny", dtype=torch.float32)
    m = golden.export_golden(model, _prompts(3), tmp_path / "a", ops=["router", "logits"], decode_steps=0)
    assert "norm_edges" not in m and not [r for r in m["entries"] if r["phase"] == "edge"]
    m = golden.export_golden(model, _prompts(3), tmp_path / "b", ops=["rmsnorm"], layers=[2, 3], decode_steps=0)
    assert [(r["op"], r["layer"]) for r in m["entries"] if r["phase"] == "edge"] == [("rmsnorm", 2)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_edge_entries_at_release_widths(tmp_path, dtype):
    """The construction at the release's widths (hidden 6144; 64 q heads, 4 kv heads of 128; an MSA layer's 4 index
    query heads and one index key of 128): the wrong kernels fail, the correct ones pass, and the entries stay
    small."""
    from minimax_ref.golden.bundle import write_bundle
    from minimax_ref.golden.contract import FORMAT, TOLERANCE_RULE
    from minimax_ref.golden.norm_edges import final_norm_edge, qk_norm_rope_edge, rmsnorm_edge

    dt, bf = getattr(torch, dtype), torch.bfloat16
    entries = [rmsnorm_edge(0, {n: (6144, 1e-6, bf) for n in ("input_layernorm", "post_attention_layernorm")}, dt, 1),
               qk_norm_rope_edge(2, {"q": (64, 128, bf), "k": (4, 128, bf), "index_q": (4, 128, bf),
                                     "index_k": (1, 128, bf)}, 1e-6, 64, 5e6, dt, 2),
               final_norm_edge(60, 6144, 1e-6, bf, dt, 3)]
    manifest = {"format": FORMAT, "numerics": {"dtype": dtype, "act_quant": "none", "kv_scale": 1.0},
                "ops": NORM_OPS, "tolerance_rule": TOLERANCE_RULE}
    write_bundle(tmp_path / "b", manifest, entries)
    assert sum(f.stat().st_size for f in (tmp_path / "b").rglob("*.safetensors")) < 2 << 20  # ~1 MB in fp32
    for e in golden.load(tmp_path / "b"):
        assert golden.compare(e, kernel(e)).ok and golden.compare(e, NP.run(e)).ok
        for wrong in WRONG.values():
            r = golden.compare(e, kernel(e, wrong))
            assert all(not row["ok"] for row in r.rows), str(r)
