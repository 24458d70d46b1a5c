"""Golden entries of the attention's per-head q/k norm + partial RoPE (`qk_norm_rope`) and of the model's head
(`final_norm`, `logits`): they replay bit-exactly, equal a computation written here from the spec's definitions
(Gemma RMSNorm, NeoX rotate-half RoPE on the first rotary_dim channels, fp32 logits), and a wrong kernel fails
`compare`."""

from __future__ import annotations

import json

import pytest
import torch
from golden_example import check_manifest

from minimax_ref import golden
from minimax_ref.cli.main import main
from minimax_ref.errors import InputError
from minimax_ref.golden.capture import available_ops
from minimax_ref.golden.contract import HEAD_OPS
from minimax_ref.golden.operands import checkpoint_of
from minimax_ref.weights.loader import load_synthetic
from minimax_ref.weights.synthetic import SyntheticCheckpoint

NEW_OPS = ["qk_norm_rope", "final_norm", "logits"]
LAYERS = 4  # the tiny preset's decoder layers: the head's entries read layer 4
MSA_LAYERS = (1, 2, 3)  # the tiny preset's MSA layers (layer 0 is dense): their qk_norm_rope holds the indexer's norms
QK = ("q", "k", "index_q", "index_k")  # a qk_norm_rope entry's per-head norms
INDEX = [f"index_{w}_{o}" for w in "qk" for o in ("normed", "rope")]  # the indexer's outputs


def _prompts(*lengths: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(23)
    return [torch.randint(0, 1000, (n,), generator=g).tolist() for n in lengths]


PROMPTS = _prompts(13, 6)  # ragged: the rows' sampled positions differ


@pytest.fixture(scope="module")
def fp32_bundle(tmp_path_factory):
    model = load_synthetic("tiny", dtype=torch.float32)
    out = tmp_path_factory.mktemp("layer_ops") / "fp32"
    # attention and msa too: their queries and cached keys are what qk_norm_rope hands on
    golden.export_golden(model, PROMPTS, out, ops=[*NEW_OPS, "attention", "msa"], decode_steps=2, page_size=8,
                         fp64=True)
    return out


@pytest.fixture(scope="module")
def bf16_bundle(tmp_path_factory):
    model = load_synthetic("tiny", dtype=torch.bfloat16)
    out = tmp_path_factory.mktemp("layer_ops") / "bf16"
    golden.export_golden(model, PROMPTS, out, ops=NEW_OPS, decode_steps=1)
    return out


def _manifest(path) -> dict:
    return json.loads((path / "manifest.json").read_text())


# ---------------------------------------------------------------- independent computations (the spec's definitions)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, one_plus_bf16: bool = False) -> torch.Tensor:
    """Gemma RMSNorm over the last dim, in fp64: x / sqrt(mean(x^2) + eps) * (1 + w). one_plus_bf16: the (1 + w)
    rounded to bf16 (a wrong kernel)."""
    x = x.double()
    one_plus = 1.0 + w.double()
    if one_plus_bf16:
        one_plus = one_plus.bfloat16().double()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * one_plus


def rope(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, theta: float, *, first: bool = True,
         interleaved: bool = False) -> torch.Tensor:
    """NeoX rotate-half RoPE in fp64 on the first `rotary_dim` channels of x [B, T, H, D] (the rest pass through):
    channel i < r/2 pairs with i + r/2 at angle pos * theta^(-2i/r). first=False rotates the LAST rotary_dim
    channels and interleaved=True pairs (2i, 2i+1) (GPT-J): the wrong kernels."""
    x = x.double()
    D, r = x.shape[-1], rotary_dim
    inv = torch.tensor([theta ** (-2.0 * i / r) for i in range(r // 2)], dtype=torch.float64)
    ang = positions.double()[..., None, None] * inv  # [B, T, 1, r/2]
    cos, sin = ang.cos(), ang.sin()
    lo, hi = (0, r) if first else (D - r, D)
    part = x[..., lo:hi]
    if interleaved:
        a, b = part[..., 0::2], part[..., 1::2]
        rot = torch.stack((a * cos - b * sin, b * cos + a * sin), -1).flatten(-2)
    else:
        a, b = part[..., : r // 2], part[..., r // 2:]
        rot = torch.cat((a * cos - b * sin, b * cos + a * sin), -1)
    return torch.cat((x[..., :lo], rot, x[..., hi:]), -1)


def independent(e: golden.GoldenEntry, dtype: torch.dtype, only: tuple[str, ...] = QK,
                **wrong) -> dict[str, torch.Tensor]:
    """The entry's outputs computed here from its inputs (fp64, one rounding to `dtype`; logits fp32). wrong:
    no_weight (norm without its weight), one_plus_bf16 (the norm's (1 + w) in bf16), eps (the norm's eps replaced)
    or rope's first / interleaved (RoPE on the wrong channels); in a qk_norm_rope entry applied to the norms `only`
    (q, k, index_q, index_k) and not to the others."""
    t, p = e.inputs, e.params
    if e.op == "qk_norm_rope":
        out = {}
        for which in (w for w in QK if w in t):  # index_q, index_k: MSA layers
            bad = wrong if which in only else {}
            eps, bf = bad.get("eps", p["eps"]), bad.get("one_plus_bf16", False)
            w = torch.zeros_like(t[f"{which}_norm.weight"]) if bad.get("no_weight") else t[f"{which}_norm.weight"]
            normed = rms_norm(t[which], w, eps, bf)
            kw = {k: v for k, v in bad.items() if k in ("first", "interleaved")}
            out[f"{which}_normed"] = normed.to(dtype)
            out[f"{which}_rope"] = rope(normed, t["positions"], p["rotary_dim"], p["rope_theta"], **kw).to(dtype)
        return out
    eps, bf = wrong.get("eps", p.get("eps")), wrong.get("one_plus_bf16", False)
    if e.op == "final_norm":
        w = torch.zeros_like(t["weight"]) if wrong.get("no_weight") else t["weight"]
        return {"y": rms_norm(t["x"], w, eps, bf).to(dtype)}
    assert e.op == "logits" and p["format"] == "bf16"
    return {"logits": (t["x"].double() @ t["w.weight"].double().T).float()}


# ---------------------------------------------------------------- replay


@pytest.mark.parametrize("which", ["fp32", "bf16"])
def test_new_ops_replay_bit_exactly(which, fp32_bundle, bf16_bundle):
    bundle = fp32_bundle if which == "fp32" else bf16_bundle
    m = _manifest(bundle)
    results = golden.replay_bundle(bundle, NEW_OPS)
    assert results and all(r["ok"] for r in results), [r for r in results if not r["ok"]]
    entries = [e for e in m["entries"] if e["op"] in NEW_OPS]
    assert {e["op"] for e in entries} == set(NEW_OPS)
    for e in entries:  # every output (and the RoPE tables) is recomputed
        checks = {r["check"] for r in results if r["file"] == e["file"]}
        outputs = {n for n, t in e["tensors"].items() if t["role"] in ("output", "fp64")}
        assert outputs and outputs <= checks, (e["file"], outputs - checks)
        if e["op"] == "qk_norm_rope":
            assert {"cos", "sin"} <= checks


def test_entries_lay_out_as_documented(fp32_bundle):
    m = _manifest(fp32_bundle)
    head = {e["op"]: e for e in m["entries"] if e["op"] in HEAD_OPS and e["phase"] == "prefill"}
    assert {e["layer"] for e in m["entries"] if e["op"] in HEAD_OPS} == {LAYERS}  # after the last decoder layer
    assert sorted({e["layer"] for e in m["entries"] if e["op"] == "qk_norm_rope"}) == list(range(LAYERS))
    B, T, H = len(PROMPTS), max(map(len, PROMPTS)), m["model"]["hidden_size"]
    assert head["final_norm"]["tensors"]["x"]["shape"] == [B, T, H]
    lg = head["logits"]
    assert lg["tensors"]["x"]["shape"] == [B, H] and lg["tensors"]["logits"]["shape"] == [B, 1024]
    assert lg["params"]["logit_positions"] == [len(p) - 1 for p in PROMPTS]
    # the weights are stored once, under the checkpoint's names, in the head's / layer's weights file
    assert lg["tensors"]["w.weight"]["stored"] == {"file": "weights/layer004.safetensors",
                                                   "key": "language_model.lm_head.weight"}
    assert head["final_norm"]["tensors"]["weight"]["stored"]["key"] == "language_model.model.norm.weight"
    qk = next(e for e in m["entries"] if e["op"] == "qk_norm_rope" and e["layer"] == 2)
    assert qk["tensors"]["k_norm.weight"]["stored"] == {
        "file": "weights/layer002.safetensors", "key": "language_model.model.layers.2.self_attn.k_norm.weight"}
    ck = SyntheticCheckpoint("tiny", "nvfp4")
    e = next(e for e in golden.load(fp32_bundle, ops=["qk_norm_rope"]) if e.layer == 2)
    assert torch.equal(e.inputs["q_norm.weight"], ck.read("language_model.model.layers.2.self_attn.q_norm.weight"))
    for op in NEW_OPS:  # the contract describes them, with tolerances per kernel dtype
        c = m["contracts"][op]
        assert c["tensors"] and set(c["tolerance"]) == {"float32", "bfloat16"} and c["fp64"], op


def test_indexer_norms_on_msa_layers_only(fp32_bundle, bf16_bundle):
    """Every qk_norm_rope entry of an MSA layer (edge entry included) holds the lightning indexer's norms, in the
    shapes its norms see (index_q [B, T, Hkv, Di], index_k [B, T, 1, Di]) with the checkpoint's weights; a dense
    layer's holds none; the manifest describes them."""
    ck = SyntheticCheckpoint("tiny", "nvfp4")
    t = ck.config.text
    assert tuple(L for L in range(LAYERS) if t.sparse_layers[L]) == MSA_LAYERS
    index_tensors = {"index_q", "index_k", "index_q_norm.weight", "index_k_norm.weight", *INDEX}
    for bundle in (fp32_bundle, bf16_bundle):
        m = _manifest(bundle)
        entries = golden.load(bundle, ops=["qk_norm_rope"])
        assert {(e.layer, e.phase) for e in entries} >= {(L, "prefill") for L in range(LAYERS)}
        for e in entries:
            names = set(e.inputs) | set(e.outputs)
            if e.layer not in MSA_LAYERS:
                assert not {n for n in names if n.startswith("index_")}, e.id
                continue
            assert index_tensors <= names and set(INDEX) <= set(e.outputs), e.id
            (B, T), Hkv, D = e.inputs["q"].shape[:2], t.num_key_value_heads, t.sparse.index_head_dim
            assert tuple(e.inputs["index_q"].shape) == tuple(e.outputs["index_q_rope"].shape) == (B, T, Hkv, D)
            assert tuple(e.inputs["index_k"].shape) == tuple(e.outputs["index_k_rope"].shape) == (B, T, 1, D)
            if e.phase != "edge":  # the checkpoint's weights, stored once under their names
                for w in ("index_q", "index_k"):
                    name = f"language_model.model.layers.{e.layer}.self_attn.{w}_norm.weight"
                    assert torch.equal(e.inputs[f"{w}_norm.weight"], ck.read(name)), (e.id, w)
                    row = next(r for r in m["entries"] if r["file"] == e.file)
                    assert row["tensors"][f"{w}_norm.weight"]["stored"]["key"] == name
        described = m["contracts"]["qk_norm_rope"]["tensors"]
        assert {"index_q", "index_k", "index_q_rope, index_k_rope"} <= set(described)
        check_manifest(bundle)


# ---------------------------------------------------------------- independent computations agree


@pytest.mark.parametrize("which", ["fp32", "bf16"])
def test_outputs_equal_an_independent_computation(which, fp32_bundle, bf16_bundle):
    bundle = fp32_bundle if which == "fp32" else bf16_bundle
    dtype = torch.float32 if which == "fp32" else torch.bfloat16
    entries = golden.load(bundle, ops=NEW_OPS)
    assert {e.op for e in entries} == set(NEW_OPS)
    for e in entries:
        r = golden.compare(e, independent(e, dtype))
        assert r.ok, str(r)
        if e.op == "qk_norm_rope":  # the stored tables are the spec's: cos / sin of cat(a, a), a = pos * inv_freq
            r_, theta = e.params["rotary_dim"], e.params["rope_theta"]
            a = e.inputs["positions"].double()[..., None] * torch.tensor(
                [theta ** (-2.0 * i / r_) for i in range(r_ // 2)], dtype=torch.float64)
            a = torch.cat((a, a), -1)
            assert torch.allclose(e.inputs["cos"].double(), a.cos(), atol=1e-6)
            assert torch.allclose(e.inputs["sin"].double(), a.sin(), atol=1e-6)


def test_fp64_outputs_agree_with_the_independent_computation(fp32_bundle):
    for e in golden.load(fp32_bundle, ops=NEW_OPS):
        mine = independent(e, torch.float64) if e.op != "logits" else {
            "logits": e.inputs["x"].double() @ e.inputs["w.weight"].double().T}
        for name, want in mine.items():  # the rotation: with the stored fp32 tables (ours: fp64 angles)
            tol = 1e-6 if name.endswith("_rope") else 1e-9
            assert torch.allclose(e.fp64[name], want, rtol=tol, atol=tol), (e.id, name)


def test_the_entries_chain_into_the_forward(fp32_bundle):
    """q_rope is attention's queries, k_rope the keys it caches; logits' x is the final norm's y at the sampled
    positions; the prefill logits pick the first decoded tokens (greedy)."""
    m = _manifest(fp32_bundle)
    by = {(e.op, e.layer, e.phase): e for e in golden.load(fp32_bundle)}
    for (op, L, phase), e in by.items():
        if op != "qk_norm_rope" or phase == "edge":  # edge entries: built rows, no forward's
            continue
        core = by.get(("attention", L, phase)) or by[("msa", L, phase)]
        assert torch.equal(e.outputs["q_rope"], core.inputs["q"]), (L, phase)
        pos = e.inputs["positions"]
        cached = torch.stack([core.inputs["k"][b, pos[b]] for b in range(pos.shape[0])])
        assert torch.equal(e.outputs["k_rope"], cached), (L, phase)
        if L in MSA_LAYERS:  # index_q_rope is the indexer's queries, index_k_rope (no head axis) the keys it caches
            assert torch.equal(e.outputs["index_q_rope"], core.inputs["iq"]), (L, phase)
            cached = torch.stack([core.inputs["ik"][b, pos[b]] for b in range(pos.shape[0])])
            assert torch.equal(e.outputs["index_k_rope"][:, :, 0], cached), (L, phase)
    for phase in ("prefill", "decode0", "decode1"):
        fn, lg = by[("final_norm", LAYERS, phase)], by[("logits", LAYERS, phase)]
        rows = [fn.outputs["y"][b, t] for b, t in enumerate(lg.params["logit_positions"])]
        assert torch.equal(lg.inputs["x"], torch.stack(rows)), phase
    first = by[("logits", LAYERS, "prefill")].outputs["logits"].argmax(-1).tolist()
    assert first == [d[0] for d in m["decoded_token_ids"]]


# ---------------------------------------------------------------- wrong kernels fail


# the norm bugs the captured rows hide in bf16 (mean(x^2) >> eps; a bf16 (1 + w) is at most one ulp): the bundles'
# edge entries (phase "edge", golden.norm_edges) catch them, in fp32 and bf16 bundles
NORM_BUGS = {"norm-one-plus-w-in-bf16": {"one_plus_bf16": True}, "norm-eps-1e-5": {"eps": 1e-5},
             "norm-without-eps": {"eps": 0.0}}


@pytest.mark.parametrize("wrong", [{"first": False}, {"interleaved": True}, {"no_weight": True},
                                   *NORM_BUGS.values()],
                         ids=["rope-on-last-channels", "rope-interleaved", "norm-without-weight", *NORM_BUGS])
@pytest.mark.parametrize("which", ["fp32", "bf16"])
def test_a_wrong_qk_norm_rope_kernel_fails(fp32_bundle, bf16_bundle, which, wrong):
    bundle, dtype = (fp32_bundle, torch.float32) if which == "fp32" else (bf16_bundle, torch.bfloat16)
    norm_bug = wrong in NORM_BUGS.values()
    e = next(e for e in golden.load(bundle, ops=["qk_norm_rope"])  # an MSA layer's: the indexer's norms too
             if e.phase == ("edge" if norm_bug else "prefill") and e.layer == MSA_LAYERS[0])
    r = golden.compare(e, independent(e, dtype, **wrong), skip=[] if "no_weight" in wrong or norm_bug else
                       [f"{w}_normed" for w in QK])
    assert not r.ok
    bad = {row["name"] for row in r.rows if not row["ok"]}
    assert {f"{w}_rope" for w in QK} | ({f"{w}_normed" for w in QK} if norm_bug else set()) <= bad, str(r)


@pytest.mark.parametrize("wrong", [{"first": False}, {"interleaved": True}, {"no_weight": True},
                                   *NORM_BUGS.values()],
                         ids=["rope-on-last-channels", "rope-interleaved", "norm-without-weight", *NORM_BUGS])
@pytest.mark.parametrize("which", ["fp32", "bf16"])
def test_a_wrong_indexer_norm_kernel_fails(fp32_bundle, bf16_bundle, which, wrong):
    """A kernel whose q / k norms are right and whose indexer norm or rotation is wrong fails exactly the indexer's
    outputs, in every MSA layer's entry (the norm bugs the bf16 forward hides: in the edge entry)."""
    bundle, dtype = (fp32_bundle, torch.float32) if which == "fp32" else (bf16_bundle, torch.bfloat16)
    norm_bug = wrong in NORM_BUGS.values()
    phases = {"edge"} if norm_bug else {"prefill", "decode0"}
    entries = [e for e in golden.load(bundle, ops=["qk_norm_rope"]) if e.phase in phases and e.layer in MSA_LAYERS]
    assert entries
    want = set(INDEX) if norm_bug or "no_weight" in wrong else {"index_q_rope", "index_k_rope"}
    for e in entries:
        assert golden.compare(e, independent(e, dtype)).ok
        r = golden.compare(e, independent(e, dtype, only=("index_q", "index_k"), **wrong))
        assert {row["name"] for row in r.rows if not row["ok"]} == want, str(r)


@pytest.mark.parametrize("wrong", list(NORM_BUGS.values()), ids=list(NORM_BUGS))
@pytest.mark.parametrize("which", ["fp32", "bf16"])
def test_a_wrong_final_norm_kernel_fails(fp32_bundle, bf16_bundle, which, wrong):
    bundle, dtype = (fp32_bundle, torch.float32) if which == "fp32" else (bf16_bundle, torch.bfloat16)
    entries = golden.load(bundle, ops=["final_norm"])
    assert golden.compare(entries[0], independent(entries[0], dtype)).ok
    assert not all(golden.compare(e, independent(e, dtype, **wrong)).ok for e in entries)
    [edge] = [e for e in entries if e.phase == "edge"]
    assert not golden.compare(edge, independent(edge, dtype, **wrong)).ok


def test_a_wrong_head_kernel_fails(fp32_bundle):
    by = {(e.op, e.phase): e for e in golden.load(fp32_bundle, ops=HEAD_OPS)}
    fn = by[("final_norm", "prefill")]
    assert not golden.compare(fn, independent(fn, torch.float32, no_weight=True)).ok
    lg = by[("logits", "prefill")]
    x0 = fn.outputs["y"][:, 0]  # the first position's hidden, not the sampled one
    assert not golden.compare(lg, {"logits": (x0.double() @ lg.inputs["w.weight"].double().T).float()}).ok
    # bf16 weights read as bf16 by a kernel: fine; a kernel that rounds its x to bf16 in an fp32 bundle is not
    xb = lg.inputs["x"].bfloat16().double()
    assert not golden.compare(lg, {"logits": (xb @ lg.inputs["w.weight"].double().T).float()}).ok


# ---------------------------------------------------------------- selection: --ops, --layers, available_ops


def test_ops_select_the_new_ops(tmp_path):
    assert golden.parse_ops("qk_norm_rope,final_norm,logits") == (NEW_OPS, True)
    model = load_synthetic("tiny", dtype=torch.float32)
    m = golden.export_golden(model, _prompts(5), tmp_path / "a", ops=["final_norm"], layers=[1], explicit_ops=True,
                             decode_steps=0)
    # --layers picks decoder layers; the head's edge entry sits at the head too
    assert [(e["op"], e["layer"], e["phase"]) for e in m["entries"]] == [("final_norm", LAYERS, "edge"),
                                                                          ("final_norm", LAYERS, "prefill")]
    assert m["layers"] == [LAYERS]  # the manifest names the layers it holds entries of
    m = golden.export_golden(model, _prompts(5), tmp_path / "b", ops=["qk_norm_rope"], layers=[1, 3],
                             explicit_ops=True, decode_steps=0)
    assert [(e["op"], e["layer"], e["phase"]) for e in m["entries"]] == [  # the edge entry: the first chosen layer
        ("qk_norm_rope", 1, "edge"), ("qk_norm_rope", 1, "prefill"), ("qk_norm_rope", 3, "prefill")]
    assert m["layers"] == [1, 3]
    ck = checkpoint_of(model)
    assert available_ops(ck, LAYERS) == set(HEAD_OPS)
    assert all("qk_norm_rope" in available_ops(ck, L) and not set(HEAD_OPS) & available_ops(ck, L)
               for L in range(LAYERS))
    # capture attaches from outside and leaves nothing behind on the model
    attn = model.layers[1].self_attn
    for module in (attn, attn.q_norm, attn.k_norm, attn.index_q_norm, attn.index_k_norm, model.norm, model.lm_head):
        assert not module._forward_hooks and not module._forward_pre_hooks
    # the qk_norm_rope edge entry sits at the first chosen MSA layer (with the indexer's rows), else the first layer
    for layers, at, index in (([0, 2, 3], 2, True), ([0], 0, False)):
        m = golden.export_golden(model, _prompts(5), tmp_path / f"edge{at}", ops=["qk_norm_rope"], layers=layers,
                                 decode_steps=0)
        [edge] = [e for e in m["entries"] if e["phase"] == "edge"]
        assert edge["layer"] == at and ("index_q" in edge["tensors"]) == index, layers
    with pytest.raises(InputError, match="unknown op 'qk_rope'"):
        golden.parse_ops("qk_rope")


def test_cli_exports_and_replays_the_new_ops(capsys, tmp_path):
    out = tmp_path / "cli"
    assert main(["golden", "--synthetic-weights", "tiny", "--prompt", "hi", "--ops", "qk_norm_rope,final_norm,logits",
                 "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["ops"] == sorted(NEW_OPS)
    assert main(["golden", "--replay", str(out)]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["mismatches"] == []
    checked = {e["op"] for e in _manifest(out)["entries"]}
    assert checked == set(NEW_OPS)


def test_tied_embeddings_store_the_embedding_as_the_lm_head(tmp_path):
    model = load_synthetic("tiny", dtype=torch.float32, overrides={"tie_word_embeddings": True})
    m = golden.export_golden(model, _prompts(4), tmp_path / "tied", ops=["logits"], decode_steps=0)
    (e,) = m["entries"]
    assert e["tensors"]["w.weight"]["stored"]["key"] == "language_model.model.embed_tokens.weight"
    assert e["params"]["linear"] == "language_model.model.embed_tokens" and e["params"]["format"] == "bf16"
    assert all(r["ok"] for r in golden.replay_bundle(tmp_path / "tied"))
    (entry,) = golden.load(tmp_path / "tied")
    assert torch.equal(entry.inputs["w.weight"].float(), model.embed_tokens.weight)
    assert golden.compare(entry, independent(entry, torch.float32)).ok
