"""Golden bundles cannot pass silently and their edge cases are hit: every `--edge` / `--act-quant` bundle fails
the planted kernel it exists to catch. The kernels are `examples/kernel_test/numpy_ops.py` (plain numpy, written
from the manifest) with one bug planted each; the correct one passes the same bundle."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from golden_example import numpy_ops

from minimax_ref import golden
from minimax_ref.cli.main import main
from minimax_ref.errors import InputError
from minimax_ref.weights.loader import load_model

EXAMPLE = Path(__file__).parents[1] / "examples" / "kernel_test"


NP = numpy_ops()  # a module of its own: the planted bugs below patch it


def _one(tmp_path: Path, op: str, **kw) -> list[golden.GoldenEntry]:
    out = tmp_path / f"{op}-{len(list(tmp_path.iterdir()))}"
    golden.export_op(op, out, **kw)
    return golden.load(out)


def _passes(entry, outputs, **kw) -> bool:
    return golden.compare(entry, outputs, **kw).ok


# ------------------------------------------------------------------------------------ no silent pass


def test_compare_fails_on_missing_outputs_and_on_nothing_checked(tmp_path):
    [e] = _one(tmp_path, "nvfp4_linear", shape="4,32,64", act_quant="emulate")
    assert set(e.outputs) == {"x_hat", "y"}
    full = NP.run(e)
    assert _passes(e, full)
    r = golden.compare(e, {})
    assert not r.ok and {row["name"] for row in r.rows if row.get("missing")} == {"x_hat", "y"}
    assert "MISSING" in str(r) and "x_hat" in str(r)
    r = golden.compare(e, {"y": full["y"]})  # a GEMM that does not give the quantized input
    assert not r.ok and [row["name"] for row in r.rows if row.get("missing")] == ["x_hat"]
    r = golden.compare(e, {"y": full["y"]}, skip=["x_hat"])  # ... says so
    assert r.ok and r.skipped == ["x_hat"] and "left out: x_hat" in str(r)
    r = golden.compare(e, {}, skip=["x_hat", "y"])
    assert not r.ok and r.checked == 0 and "nothing was checked" in str(r)
    with pytest.raises(InputError, match="no output named 'z'"):
        golden.compare(e, {"y": full["y"]}, skip=["z"])


def _module(monkeypatch, name: str, fn) -> str:
    mod = type(sys)(name)
    mod.run = fn
    monkeypatch.setitem(sys.modules, name, mod)
    return f"{name}:run"


def test_replay_impl_fails_when_nothing_is_checked_or_an_output_is_missing(capsys, tmp_path, monkeypatch):
    out = tmp_path / "b"
    golden.export_op("nvfp4_linear", out, shape="4,32,64", act_quant="emulate")
    replay = ["golden", "--replay", str(out), "--impl"]
    assert main([*replay, _module(monkeypatch, "k_none", lambda e: None)]) == 1
    cap = capsys.readouterr()
    res = json.loads(cap.out)
    assert res["checks"] == 0 and res["skipped_entries"] == ["nvfp4_linear/layer000_op.safetensors"]
    assert "nothing was checked (the implementation returned None for every entry)" in cap.err
    assert main([*replay, _module(monkeypatch, "k_empty", lambda e: {})]) == 1
    cap = capsys.readouterr()
    res = json.loads(cap.out)
    assert res["checks"] == 0 and sorted(res["missing"]) == ["nvfp4_linear/layer000_op.safetensors:x_hat",
                                                             "nvfp4_linear/layer000_op.safetensors:y"]
    assert "nothing was checked" in cap.err
    y_only = _module(monkeypatch, "k_y", lambda e: {"y": NP.run(e)["y"]})
    assert main([*replay, y_only]) == 1
    assert "1 outputs were not given: nvfp4_linear/layer000_op.safetensors:x_hat" in capsys.readouterr().err
    assert main([*replay, y_only, "--skip-outputs", "x_hat"]) == 0
    assert json.loads(capsys.readouterr().out)["checks"] == 1
    assert main([*replay, y_only, "--skip-outputs", "x_hat,nope"]) == 2
    assert "--skip-outputs 'nope'" in capsys.readouterr().err
    extra = _module(monkeypatch, "k_extra", lambda e: {**NP.run(e), "debug": NP.run(e)["y"]})
    assert main([*replay, extra]) == 0  # an output the entry lacks is named, not compared
    assert json.loads(capsys.readouterr().out)["ignored"] == ["nvfp4_linear/layer000_op.safetensors:debug"]

    def raising(entry):
        raise ValueError("my kernel's own failure")

    assert main([*replay, _module(monkeypatch, "k_raise", raising)]) == 2  # its traceback, as a user error
    err = capsys.readouterr().err
    assert "--impl k_raise:run raised on nvfp4_linear/layer000_op.safetensors" in err
    assert "ValueError: my kernel's own failure" in err and "api.py" not in err
    assert main([*replay, y_only, "--ops", "router"]) == 1  # no entry of that op: nothing checked
    assert "nothing was checked (no entry of --ops router)" in capsys.readouterr().err
    monkeypatch.syspath_prepend(str(EXAMPLE))
    assert main([*replay, "impl:run"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["ok"] and res["checks"] == 2 and res["failures"] == []


def test_integer_outputs_are_compared_as_integers(tmp_path):
    [e] = _one(tmp_path, "router", shape="9,16,64")
    ids = e.outputs["expert_ids"].clone()
    assert set(ids[1].tolist()) != set(ids[2].tolist())
    ids[1] = ids[2]  # another token's choice
    r = golden.compare(e, {"expert_ids": ids, "weights": e.outputs["weights"], "logits": e.outputs["logits"]})
    row = next(x for x in r.rows if x["name"] == "expert_ids")
    assert not row["ok"] and row["bad"] >= 1 and row["elements"] == 36 and row["compared"] == "elementwise"
    assert "max_ulps" not in row and "max_rel" not in row and "elements differ" in str(r)
    with pytest.raises(InputError, match="holds integers"):
        golden.compare(e, {"expert_ids": e.outputs["expert_ids"].float(), "weights": e.outputs["weights"],
                           "logits": e.outputs["logits"]})


# ------------------------------------------------------------------------------------ NVFP4 edges


def _ftz(scale_bytes: np.ndarray) -> np.ndarray:
    """A kernel that flushes subnormal E4M3 scales (codes 1-7, sign dropped) to zero."""
    return np.where((scale_bytes & 0x78) == 0, 0, scale_bytes).astype(np.uint8)


def _gemm(t, scale) -> torch.Tensor:
    w = NP.nvfp4_weight(t["w1.weight"].numpy(), scale, float(t["w1.weight_scale_2"]))
    return torch.from_numpy(t["x"].double().numpy() @ w.T.astype(np.float64)).float()


def test_subnormal_scales_fail_a_flush_to_zero_kernel(tmp_path):
    [plain] = _one(tmp_path, "nvfp4_linear", shape="8,256,512")
    [edge] = _one(tmp_path, "nvfp4_linear", shape="8,256,512", edge="subnormal-scales")
    codes = edge.inputs["w1.weight_scale"].view(torch.uint8)
    sub = (codes >= 1) & (codes <= 7)
    assert sub.float().mean() > 0.5 and bool(sub[::4].all())  # every fourth row is all subnormal
    for e in (plain, edge):
        t = e.inputs
        s = t["w1.weight_scale"].view(torch.uint8).numpy()
        assert _passes(e, {"y": _gemm(t, s)})
        flushed = _passes(e, {"y": _gemm(t, _ftz(s))})
        assert flushed == (e is plain)  # the plain bundle cannot tell; the edge bundle fails the kernel


def test_zero_scales_fail_a_kernel_that_reads_a_zero_scale_as_unset(tmp_path):
    """A zero block scale zeroes its block; a kernel that takes a zero byte for "no scale" (1.0) fails."""
    [plain] = _one(tmp_path, "nvfp4_linear", shape="8,256,512")
    [edge] = _one(tmp_path, "nvfp4_linear", shape="8,256,512", edge="zero-scales")
    assert float((edge.inputs["w1.weight_scale"].view(torch.uint8) == 0).float().mean()) > 0.1
    for e in (plain, edge):
        t = e.inputs
        s = t["w1.weight_scale"].view(torch.uint8).numpy()
        assert _passes(e, {"y": _gemm(t, s)})
        unset = np.where(s == 0, 0x38, s).astype(np.uint8)  # 0x38: E4M3 1.0
        assert _passes(e, {"y": _gemm(t, unset)}) == (e is plain)


def _threshold_topk(choice: torch.Tensor, k: int) -> torch.Tensor:
    """A top-k by descending distinct values (each round: the first expert holding the largest value below the last
    one taken): right without ties, and it skips the rest of a tie."""
    out = []
    for row in choice.tolist():
        ids, last = [], float("inf")
        for _ in range(k):
            best = max(v for v in row if v < last)
            ids.append(row.index(best))
            last = best
        out.append(ids)
    return torch.tensor(out)


def test_router_ties_fail_a_top_k_that_skips_tied_experts(tmp_path):
    [plain] = _one(tmp_path, "router", shape="16,30,64")
    [ties] = _one(tmp_path, "router", shape="16,30,64", edge="ties")
    for e in (plain, ties):
        t, top_k = e.inputs, e.params["top_k"]
        choice = torch.sigmoid(e.outputs["logits"]) + t["bias"]
        ids = _threshold_topk(choice, top_k)
        w = torch.sigmoid(e.outputs["logits"]).gather(-1, ids)
        got = {"expert_ids": ids, "weights": w / w.sum(-1, keepdim=True), "logits": e.outputs["logits"]}
        assert _passes(e, got) == (e is plain)
        assert _passes(e, NP.run(e))


# ------------------------------------------------------------------------------------ activation quantization


def _x_hat_qs_over_g(t, dtype: str) -> np.ndarray:
    """The rounding point moved: (e2m1 * scale) / g instead of e2m1 * (scale / g)."""
    g = np.float32(1.0) / np.float32(float(t["w1.input_scale"]))
    q = NP.e2m1_codes(t["x_codes"].numpy())
    s = np.repeat(NP.e4m3(t["x_scale"].view(torch.uint8).numpy()), 16, axis=1)
    return NP.to_dtype((q * s) / g, dtype)


def _x_hat_no_global_scale(t, dtype: str) -> np.ndarray:
    """The activation global scale forgotten: e2m1 * scale."""
    q = NP.e2m1_codes(t["x_codes"].numpy())
    return NP.to_dtype(q * np.repeat(NP.e4m3(t["x_scale"].view(torch.uint8).numpy()), 16, axis=1), dtype)


def _with_x_hat(e, x_hat: np.ndarray) -> dict:
    t = e.inputs
    w = NP.nvfp4_weight(t["w1.weight"].numpy(), t["w1.weight_scale"].view(torch.uint8).numpy(),
                        float(t["w1.weight_scale_2"]))
    out = {"x_hat": torch.from_numpy(x_hat).to(e.outputs["x_hat"].dtype),
           "y": torch.from_numpy(x_hat.astype(np.float64) @ w.T.astype(np.float64)).float()}
    if "y2" in e.outputs:
        out["y2"] = NP.run(e)["y2"]
    return out


def _rounding_points_differ(e) -> bool:
    t, dt = e.inputs, e.numerics["dtype"]
    good = NP.nvfp4_activation(t["x_codes"].numpy(), t["x_scale"].view(torch.uint8).numpy(), float(t["w1.input_scale"]))
    return bool((NP.to_dtype(good, dt) != _x_hat_qs_over_g(t, dt)).any())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_single_op_activation_quant_catches_the_global_scale_and_the_rounding_point(tmp_path, dtype):
    [e] = _one(tmp_path, "nvfp4_linear", shape="16,128,256", act_quant="emulate", dtype=dtype)
    t, dt = e.inputs, e.numerics["dtype"]
    g = 1 / float(t["w1.input_scale"])
    assert g > 100  # calibrated from x, as ModelOpt does: far from 1
    assert _passes(e, NP.run(e))
    assert not _passes(e, _with_x_hat(e, _x_hat_no_global_scale(t, dt)))
    if dtype == torch.bfloat16:
        return  # the two rounding points differ by one fp32 ulp: the rounding to bf16 hides it (almost always)
    r = golden.compare(e, _with_x_hat(e, _x_hat_qs_over_g(t, dt)))
    assert _rounding_points_differ(e) and not r.ok
    assert [row["name"] for row in r.rows if not row["ok"]] == ["x_hat"]  # y alone could not tell


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_every_float32_w4a4_bundle_tells_the_rounding_points_apart(tmp_path, seed):
    """At some calibrations no element of an activation rounds differently in the two orders (the README's own
    command, seed 0, was one): the bundle's input_scale is then moved by a few fp32 ulps until one does, and x_hat is
    still exactly the fake-quant of x under the stored input_scale."""
    [e] = _one(tmp_path, "nvfp4_linear", shape="16,512,1024", act_quant="emulate", dtype=torch.float32, seed=seed)
    t = e.inputs
    calibrated = (t["x"].float().abs().amax() / (6 * 448)).to(torch.float32)
    ulps = abs(int(t["w1.input_scale"].view(torch.int32)) - int(calibrated.view(torch.int32)))
    assert ulps <= 64 and _rounding_points_differ(e)
    assert _passes(e, NP.run(e)) and not _passes(e, _with_x_hat(e, _x_hat_qs_over_g(t, "float32")))


def test_model_driven_activation_quant_catches_the_rounding_point(tiny_nvfp4, tmp_path):
    model = load_model(tiny_nvfp4, dtype=torch.float32, act_quant="emulate")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (40, 13)]
    golden.export_golden(model, prompts, tmp_path / "b", ops=["nvfp4_linear"], layers=[1, 2], decode_steps=1)
    entries = golden.load(tmp_path / "b")
    assert entries and all(e.tolerance["x_hat"] == {"exact": True} for e in entries)
    for e in entries:
        assert _passes(e, NP.run(e)), str(golden.compare(e, NP.run(e)))
    e = max(entries, key=lambda e: e.inputs["x"].shape[0])
    assert _rounding_points_differ(e)
    golden.export_golden(model, prompts, tmp_path / "mx", ops=["mxfp8_linear"], layers=[1], decode_steps=1)
    mx = golden.load(tmp_path / "mx")  # W8A8 entries carry x_hat as the W4A4 ones do (a kernel gives it everywhere)
    assert mx and all(set(m.outputs) == {"y", "x_hat"} and _passes(m, NP.run(m)) for m in mx)
    assert not _passes(e, _with_x_hat(e, _x_hat_qs_over_g(e.inputs, "float32")))
    assert not _passes(e, _with_x_hat(e, _x_hat_no_global_scale(e.inputs, "float32")))


# ------------------------------------------------------------------------------------ MSA decode: ragged and paged


def _planted(e, **changes) -> dict:
    """numpy_ops.run on a copy of the entry whose inputs a buggy kernel would read differently."""
    bad = copy.copy(e)
    bad.inputs = {**e.inputs, **changes}
    return NP.run(bad)


@pytest.fixture(scope="module")
def ragged(tmp_path_factory):
    out = tmp_path_factory.mktemp("ragged") / "b"
    golden.export_op("msa_decode", out, context="2300,700,1", page_size=64, seed=4)
    return golden.load(out)


def test_msa_decode_rows_are_ragged_and_paged_out_of_order(ragged):
    ind, msa = ragged
    t = msa.inputs
    table, seq = t["block_table"], t["seq_lens"]
    assert seq.tolist() == [2300, 700, 1] and t["q_pos"][:, 0].tolist() == [2299, 699, 0]
    pages = [-(-n // 64) for n in seq.tolist()]
    assert [int((row >= 0).sum()) for row in table] == pages and bool((table[1:] == -1).any())
    used = table[table >= 0]
    assert t["k_pages"].shape[0] > used.numel() and len(set(used.tolist())) == used.numel()  # spare pages
    assert not torch.equal(table[0, :pages[0]], table[0, 0] + torch.arange(pages[0], dtype=torch.int32))
    assert bool((msa.outputs["blocks"][0] >= 0).all()) and bool((msa.outputs["blocks"][2] == -1).any())
    for e in ragged:
        assert _passes(e, NP.run(e)), str(golden.compare(e, NP.run(e)))


def test_msa_decode_fails_kernels_that_ignore_the_rows_or_the_pages(ragged):
    _, msa = ragged
    t = msa.inputs
    table, seq, q_pos = t["block_table"], t["seq_lens"], t["q_pos"]
    B, n = table.shape
    # one context for the whole batch (the longest): short rows read table entries of -1 (the last page: filler)
    assert not _passes(msa, _planted(msa, seq_lens=seq.max().expand(B).clone(), q_pos=q_pos.max().expand(B, 1).clone()))
    # row 0's query position for every row
    assert not _passes(msa, _planted(msa, q_pos=q_pos[:1].expand(B, 1).clone()))
    # a row's pages taken as contiguous from its first page
    contiguous = (table[:, :1] + torch.arange(n, dtype=torch.int32)) % t["k_pages"].shape[0]
    assert not _passes(msa, _planted(msa, block_table=torch.where(table >= 0, contiguous, table)))
    # the pool read in order, as if pages were allocated row after row
    in_order = torch.full_like(table, -1)
    start = 0
    for b in range(B):
        k = int((table[b] >= 0).sum())
        in_order[b, :k] = torch.arange(start, start + k, dtype=torch.int32)
        start += k
    assert not _passes(msa, _planted(msa, block_table=in_order))


def test_forced_blocks_are_selected_by_forcing_and_compared_as_sets(tmp_path):
    ind, msa = _one(tmp_path, "msa_decode", context="2300,2100", edge="forced")
    p = msa.params
    for e in (ind, msa):
        assert _passes(e, NP.run(e))
    blocks = msa.outputs["blocks"]
    local = (msa.inputs["q_pos"][:, 0] // p["block_size"])[:, None, None]
    assert bool((blocks == local[..., None]).any(-1).all())  # forced in ...
    scores = ind.outputs["scores"]
    bs = p["block_size"]
    for b in range(2):  # ... although its block score is the lowest of the row
        nb = -(-int(msa.inputs["seq_lens"][b]) // bs)
        block_max = torch.stack([scores[b, :, 0, j * bs:(j + 1) * bs].amax(-1) for j in range(nb)], -1)
        assert bool((block_max.argmin(-1) == local[b, 0, 0]).all())
    # a kernel that does not force the local block
    t = msa.inputs
    unforced = {}
    for name, e in (("indexer", ind), ("msa", msa)):
        unforced[name] = NP.run(e) | {"blocks": torch.from_numpy(NP.indexer(
            NP.as_numpy(t["iq"]), NP.as_numpy(e.inputs["ik"]), t["q_pos"].numpy(), bs, p["topk_blocks"], 0,
            p["init_blocks"])[1])}
    assert not _passes(ind, unforced["indexer"])
    # the same blocks in ascending order (the order is unspecified): passes
    sorted_blocks = blocks.sort(-1).values
    assert not torch.equal(sorted_blocks, blocks)
    r = golden.compare(msa, {"o": msa.outputs["o"], "blocks": sorted_blocks})
    assert r.ok and next(x for x in r.rows if x["name"] == "blocks")["compared"] == "as sets along the last axis"
    moved = blocks.clone()
    moved[0, 0, 0, 0] = (int(blocks[0, 0, 0].max()) + 1)  # a different set fails
    assert not golden.compare(msa, {"o": msa.outputs["o"], "blocks": moved}).ok


# ------------------------------------------------------------------------------------ MoE clamp


def _no_clamp_moe(e) -> torch.Tensor:
    saved = NP.swiglu_oai
    try:
        NP.swiglu_oai = lambda gate, up, alpha, limit: (up + 1.0) * (gate / (1.0 + np.exp(-alpha * gate)))
        with np.errstate(over="ignore"):
            return torch.from_numpy(NP.moe({k: NP.as_numpy(v) for k, v in e.inputs.items()}, e.params)).float()
    finally:
        NP.swiglu_oai = saved


@pytest.mark.parametrize("edge", [None, "clamp"])
def test_moe_bundles_hit_the_swiglu_clamp(tmp_path, edge):
    [e] = _one(tmp_path, "moe", shape="12,8,128,64", edge=edge)
    t, p = e.inputs, e.params
    gates = np.concatenate([NP.as_numpy(t["x"]) @ NP.weight_of({k: NP.as_numpy(v) for k, v in t.items()},
                                                                f"experts.{x}.w1", "nvfp4").T for x in range(8)])
    past = float((gates > p["limit"]).mean())
    assert past > (0.3 if edge else 0.01)
    assert _passes(e, NP.run(e))
    assert not _passes(e, {"y": _no_clamp_moe(e)})  # a kernel without the clamp fails


@pytest.mark.parametrize("op", ["nvfp4_linear", "mxfp8_linear"])
def test_act_quant_bundles_fail_a_kernel_that_multiplies_the_unquantized_input(tmp_path, op):
    """`--act-quant emulate`: the reference multiplies the quantized input; a kernel that takes x as it is (and gives
    it as x_hat) fails both outputs, while the same kernel on the plain bundle passes."""
    [plain] = _one(tmp_path, op, shape="8,128,256")
    [emu] = _one(tmp_path, op, shape="8,128,256", act_quant="emulate")
    key, fmt = ("w1", "nvfp4") if op == "nvfp4_linear" else ("w", "mxfp8")
    for e in (plain, emu):
        t = {k: NP.as_numpy(v) for k, v in e.inputs.items()}
        y = t["x"].astype(np.float64) @ NP.weight_of(t, key, fmt).astype(np.float64).T
        got = {"y": torch.from_numpy(y).float()} | ({"x_hat": e.inputs["x"]} if "x_hat" in e.outputs else {})
        r = golden.compare(e, got)
        assert r.ok == (e is plain), str(r)
        if e is emu:
            assert {row["name"] for row in r.rows if not row["ok"]} == {"x_hat", "y"}


def test_single_op_names_and_messages(tmp_path, capsys):
    """`--ops msa_decode` selects the entries an msa_decode bundle holds (indexer and msa); a bad moe shape names
    the dimension that is wrong; a bad context is not blamed on --batch; a missing folder is said to be missing."""
    out = tmp_path / "msa"
    golden.export_op("msa_decode", out, context="40")
    assert main(["golden", "--replay", str(out), "--ops", "msa_decode"]) == 0
    checked = {r["file"].split("/")[0] for r in json.loads(capsys.readouterr().out)["results"]}
    assert checked == {"indexer", "msa"}
    for argv, message in (
            (["--op", "moe", "--shape", "8,8,64,30"], "--shape: I=30 must be a multiple of 16 for NVFP4 (T,E,H,I)"),
            (["--op", "msa_decode", "--context", "300,0"], "--context '300,0': every context must be >= 1"),
            (["--replay", str(tmp_path / "nope")], "nope: no such folder")):
        assert main(["golden", *argv, "--out", str(tmp_path / "o")] if "--op" in argv else ["golden", *argv]) == 2
        assert message in capsys.readouterr().err
