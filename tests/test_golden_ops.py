"""`minimax-ref golden --op`: single-op bundles at release widths from random operands, checked against
independent computations (a numpy NVFP4 / MXFP8 GEMM, dense-over-selected attention written here) through
the test API, with the edge cases kernels miss."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

from minimax_ref import golden
from minimax_ref.cli.main import main

EXAMPLE = Path(__file__).parents[1] / "examples" / "kernel_test" / "nvfp4_gemm.py"
M, N, K = 8, 3072, 6144  # release widths: routed expert w1 is [3072, 6144]


def _np_gemm():
    spec = importlib.util.spec_from_file_location("nvfp4_gemm", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _export(capsys, out: Path, *argv: str) -> dict:
    assert main(["golden", *argv, "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["bytes"] == sum(f.stat().st_size for f in out.rglob("*.safetensors"))
    return summary


@pytest.mark.parametrize("edge", [None, "subnormal-scales", "zero-scales"])
def test_nvfp4_linear_at_release_width(capsys, tmp_path, edge):
    out = tmp_path / "b"
    _export(capsys, out, "--op", "nvfp4_linear", "--shape", f"{M},{N},{K}", *(["--edge", edge] if edge else []))
    [e] = golden.load(out)
    t = e.inputs
    assert tuple(t["x"].shape) == (M, K) and tuple(t["w1.weight"].shape) == (N, K // 2)
    codes = t["w1.weight_scale"].view(torch.uint8)
    if edge == "subnormal-scales":
        assert ((codes >= 1) & (codes <= 7)).float().mean() > 0.2
    if edge == "zero-scales":
        assert (codes == 0).float().mean() > 0.1
    y = _np_gemm().gemm_fp32(t["x"].numpy(), t["w1.weight"].numpy(), codes.numpy(), float(t["w1.weight_scale_2"]))
    r = golden.compare(e, {"y": torch.from_numpy(y)})
    assert r.ok, str(r)
    assert main(["golden", "--replay", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["mismatches"] == []


def test_mxfp8_linear_bf16_against_numpy(capsys, tmp_path):
    out = tmp_path / "b"
    _export(capsys, out, "--op", "mxfp8_linear", "--shape", "4,512,6144", "--dtype", "bfloat16")
    [e] = golden.load(out)
    t = e.inputs
    w = _np_gemm().e4m3(t["w.weight"].view(torch.uint8).numpy())
    w = w * np.repeat(np.exp2(t["w.weight_scale"].numpy().astype(np.float32) - 127), 32, axis=1)
    x = t["x"].float().numpy().astype(ml_dtypes.bfloat16).astype(np.float32)
    y = (x @ w.astype(ml_dtypes.bfloat16).astype(np.float32).T).astype(ml_dtypes.bfloat16)
    got = torch.from_numpy(y.astype(np.float32)).bfloat16()
    r = golden.compare(e, {"y": got})
    assert r.ok, str(r)
    assert e.outputs["y"].dtype == torch.bfloat16


def _selected_attention(q, k, v, blocks, pos, bs, scale):
    """Attention of one decode query per row over the keys of its kv head's selected blocks, by loops."""
    B, _, Hq, D = q.shape
    Hkv = k.shape[2]
    o = torch.zeros(B, 1, Hq, D, dtype=torch.float64)
    for b in range(B):
        for h in range(Hq):
            kh = h // (Hq // Hkv)
            keys = sorted(p for j in blocks[b, kh, 0].tolist() if j >= 0
                          for p in range(j * bs, (j + 1) * bs) if p <= pos)
            kk, vv = k[b, keys, kh].double(), v[b, keys, kh].double()
            p = torch.softmax(kk @ q[b, 0, h].double() * scale, dim=0)
            o[b, 0, h] = p @ vv
    return o


def test_msa_decode_selection_matters(capsys, tmp_path):
    C, B = 4096 + 77, 2  # more than topk_blocks x block_size = 2048 keys
    out = tmp_path / "b"
    _export(capsys, out, "--op", "msa_decode", "--context", str(C), "--batch", str(B))
    ind, msa = golden.load(out)
    p = msa.params
    bs, topk = p["block_size"], p["topk_blocks"]
    ctx = p["context"]
    assert ctx[0] == C and ctx[1] < C and min(ctx) > topk * bs  # rows of different lengths, both past the budget
    assert msa.inputs["q_pos"][:, 0].tolist() == [n - 1 for n in ctx]
    blocks = msa.outputs["blocks"]
    assert tuple(blocks.shape) == (B, 4, 1, topk) and bool((blocks >= 0).all())
    local = torch.tensor([(n - 1) // bs for n in ctx])[:, None, None, None]
    assert bool((blocks == local).any(-1).all())  # the local block is always there
    # index scores recomputed here, and the selected blocks are the top block maxima
    iq, ik = ind.inputs["iq"].double(), ind.inputs["ik"].double()
    scores = torch.einsum("bthd,bld->bhtl", iq, ik)
    scores = scores.masked_fill(torch.arange(scores.shape[-1]) >= torch.tensor(ctx)[:, None, None, None], float("-inf"))
    assert golden.compare(ind, {"scores": scores.float(), "blocks": blocks}).ok
    t = msa.inputs
    o = torch.cat([_selected_attention(t["q"][b:b + 1], t["k"][b:b + 1], t["v"][b:b + 1], blocks[b:b + 1], n - 1, bs,
                                       p["scale"]) for b, n in enumerate(ctx)])
    r = golden.compare(msa, {"o": o.float(), "blocks": blocks})
    assert r.ok, str(r)
    # a kernel that ignores the block list (dense causal attention over every key) fails
    dense = torch.zeros_like(o)
    causal = torch.arange(t["k"].shape[1])[None, :] < torch.tensor(ctx)[:, None]
    for h in range(t["q"].shape[2]):
        kh = h // (t["q"].shape[2] // t["k"].shape[2])
        s = torch.einsum("bd,bld->bl", t["q"][:, 0, h].double(), t["k"][:, :, kh].double()) * p["scale"]
        s = s.masked_fill(~causal, float("-inf"))
        dense[:, 0, h] = torch.einsum("bl,bld->bd", torch.softmax(s, -1), t["v"][:, :, kh].double())
    assert not golden.compare(msa, {"o": dense.float(), "blocks": blocks}).ok
    # the paged views rebuild the keys
    table, page = t["block_table"], p["page_size"]
    for b in range(B):
        for pos_ in (0, page + 3, ctx[b] - 1):
            assert torch.equal(t["k_pages"][int(table[b, pos_ // page]), pos_ % page], t["k"][b, pos_])


def test_router_ties(capsys, tmp_path):
    out = tmp_path / "b"
    _export(capsys, out, "--op", "router", "--shape", "64,128", "--edge", "ties")
    [e] = golden.load(out)
    logits = e.outputs["logits"]
    group = torch.arange(128) // 3 * 3
    assert torch.equal(logits, logits[:, group])  # experts 3j, 3j+1, 3j+2 tie exactly
    # a kernel that breaks exact ties towards the lowest id (a stable descending sort, written here)
    bias = e.inputs["bias"]
    choice = torch.sigmoid(logits) + bias
    lowest = torch.stack([torch.tensor(sorted(range(128), key=lambda j: (-float(c[j]), j))[:4]) for c in choice])
    assert not torch.equal(lowest, e.outputs["expert_ids"])  # torch.topk resolves these ties otherwise
    rest = {"weights": e.outputs["weights"], "logits": e.outputs["logits"]}
    assert golden.compare(e, {"expert_ids": lowest, **rest}).ok
    # a choice that is not a tie-resolution fails: replace the 4th expert by one outside the top groups
    wrong = lowest.clone()
    worst = choice.argmin(-1)
    wrong[:, 3] = worst
    r = golden.compare(e, {"expert_ids": wrong, **rest})
    assert not r.ok and r.rows[0]["bad"] > 0 and r.rows[0]["name"] == "expert_ids"
    assert golden.compare(e, dict(e.outputs)).ok


@pytest.mark.parametrize("argv, why", [
    (["--op", "flash", "--shape", "1,2,3"], r"--op 'flash': choose one of"),
    (["--op", "nvfp4_linear", "--shape", "8,16,20"], r"K=20 must be a multiple of 16"),
    (["--op", "nvfp4_linear", "--shape", "8,x,16"], r"expected comma-separated integers"),
    (["--op", "nvfp4_linear"], r"--shape M,N,K is needed"),
    (["--op", "router", "--shape", "4,16", "--edge", "zero-scales"], r"does not apply to --op router"),
    (["--op", "msa_decode"], r"needs --context"),
    (["--op", "msa_decode", "--context", "9,x"], r"--context '9,x': expected an integer"),
    (["--op", "msa_decode", "--context", "0"], r"--context .0.: every context must be >= 1 cached token"),
    (["--op", "msa_decode", "--context", "9,8", "--batch", "3"], r"gives 2 rows but --batch is 3"),
    (["--op", "router", "--shape", "4,16", "--stacked"], r"--stacked and --align-block apply to --op moe"),
    (["--op", "moe", "--shape", "4,4,32,32", "--align-block", "0"], r"--align-block 0: must be >= 1"),
])
def test_bad_single_op_requests(capsys, tmp_path, argv, why):
    rc = main(["golden", *argv, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and re.search(why, err), err


@pytest.mark.parametrize("op, key, shape", [("nvfp4_linear", "w1", "3,200,96"), ("mxfp8_linear", "w", "3,130,320")])
def test_swizzled_scales_follow_the_tile_formula(capsys, tmp_path, op, key, shape):
    """The cuBLASLt block-scaling layout, element by element (N not a multiple of 128, scale columns not of 4)."""
    out = tmp_path / "b"
    _export(capsys, out, "--op", op, "--shape", shape)
    [e] = golden.load(out)
    raw = e.inputs[f"{key}.weight_scale"].view(torch.uint8)
    swz = e.inputs[f"{key}.weight_scale_swizzled"].view(torch.uint8)
    R, C = raw.shape
    n_col_tiles = -(-C // 4)
    assert swz.numel() == -(-R // 128) * 128 * n_col_tiles * 4
    seen = torch.zeros(swz.numel(), dtype=torch.bool)
    for r in range(R):
        for c in range(C):
            off = ((r // 128) * n_col_tiles + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
            assert int(swz[off]) == int(raw[r, c]), (r, c)
            seen[off] = True
    assert int(swz[~seen].count_nonzero()) == 0  # padding is zero


def _moe_numpy(t: dict, p: dict, clamp: bool) -> tuple[np.ndarray, float]:
    """The routed MoE from the manifest's formula, in numpy (the example's GEMM per expert): y, and the fraction
    of gate values past the SwiGLU limit."""
    gemm = _np_gemm().gemm_fp32
    x = t["x"].numpy().astype(np.float64)
    logits = x @ t["gate_weight"].numpy().astype(np.float64).T
    scores = 1 / (1 + np.exp(-logits))
    choice = scores + t["bias"].numpy()
    k, limit, alpha = p["top_k"], p["limit"], p["alpha"]
    y = np.zeros(x.shape, dtype=np.float64)
    past = []
    for tok in range(x.shape[0]):
        ids = np.argsort(-choice[tok], kind="stable")[:k]
        w = scores[tok, ids] / scores[tok, ids].sum()
        xt = t["x"].numpy()[tok: tok + 1]
        for e, we in zip(ids, w):
            def lin(leaf, a, e=e):
                pre = f"experts.{e}.{leaf}."
                return gemm(a, t[pre + "weight"].numpy(), t[pre + "weight_scale"].view(torch.uint8).numpy(),
                            float(t[pre + "weight_scale_2"]))
            gate, up = lin("w1", xt), lin("w3", xt)
            past.append(np.abs(gate) > limit)
            if clamp:
                gate, up = np.minimum(gate, limit), np.clip(up, -limit, limit)
            with np.errstate(over="ignore"):  # exp overflows to inf for very negative gates: sigmoid 0, exact
                h = (up + 1) * (gate / (1 + np.exp(-alpha * gate)))
            y[tok] += we * lin("w2", h.astype(np.float32))[0]
    return (y * p["scaling"]).astype(np.float32), float(np.concatenate(past).mean())


def test_moe_with_the_swiglu_clamp_active(capsys, tmp_path):
    out = tmp_path / "b"
    _export(capsys, out, "--op", "moe", "--shape", "12,8,256,128", "--edge", "clamp")
    [e] = golden.load(out)
    t, p = e.inputs, e.params
    y, past = _moe_numpy(t, p, clamp=True)
    assert past > 0.3  # the clamp is active
    r = golden.compare(e, {"y": torch.from_numpy(y)})
    assert r.ok, str(r)
    y_noclamp, _ = _moe_numpy(t, p, clamp=False)
    assert not golden.compare(e, {"y": torch.from_numpy(y_noclamp)}).ok  # a kernel without the clamp fails
    # grouped-GEMM metadata: tokens grouped by expert, ascending, offsets into that list
    from minimax_ref.model.moe import route

    ids = route(t["x"], t["gate_weight"], t["bias"], p["top_k"]).expert_ids
    off, sorted_ids = t["expert_offsets"].tolist(), t["sorted_token_ids"].tolist()
    assert off[0] == 0 and off[-1] == ids.numel() == len(sorted_ids)
    for x_id in range(p["num_experts"]):
        want = [tok for tok in range(ids.shape[0]) for j in ids[tok].tolist() if j == x_id]
        assert sorted_ids[off[x_id]: off[x_id + 1]] == want


def test_replay_runs_a_users_kernel(capsys, tmp_path, monkeypatch):
    out = tmp_path / "b"
    _export(capsys, out, "--op", "nvfp4_linear", "--shape", "4,256,512")
    monkeypatch.syspath_prepend(str(EXAMPLE.parent))
    assert main(["golden", "--replay", str(out), "--impl", "impl:nvfp4_linear"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["failures"] == [] and [r["output"] for r in res["results"]] == ["y"]
    assert res["results"][0]["max_abs"] < res["results"][0]["atol"]
    # a kernel that reads the other nibble order fails, and the rows say by how much
    (tmp_path / "wrong_kernel.py").write_text(
        "import impl\n"
        "def run(entry):\n"
        "    w = entry.inputs['w1.weight']\n"
        "    entry.inputs['w1.weight'] = ((w & 15) << 4) | (w >> 4)\n"
        "    return impl.nvfp4_linear(entry)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["golden", "--replay", str(out), "--impl", "wrong_kernel:run"]) == 1
    [bad] = json.loads(capsys.readouterr().out)["failures"]
    assert bad["output"] == "y" and bad["bad"] > 0 and bad["max_abs"] > bad["atol"]
    assert main(["golden", "--replay", str(out), "--impl", "no_such_module:run"]) == 2
    assert "cannot import it" in capsys.readouterr().err


def _x_hat_nvfp4(codes: np.ndarray, scale: np.ndarray, input_scale: float) -> np.ndarray:
    """The W4A4 input from its operand, written from the contract's layout text: e2m1(codes) * (scale / g),
    g = fp32(1 / input_scale), in fp32."""
    M = codes.shape[0]
    q = _np_gemm().E2M1[np.stack([codes & 0xF, codes >> 4], axis=-1).reshape(M, -1)]
    g = np.float32(1.0) / np.float32(input_scale)
    return q * np.repeat(_np_gemm().e4m3(scale) / g, 16, axis=1)


@pytest.mark.parametrize("op", ["nvfp4_linear", "mxfp8_linear"])
def test_activation_codes_of_a_w4a4_w8a8_gemm(capsys, tmp_path, op):
    """`--act-quant emulate`: the bundle holds the quantized input as a W4A4 / W8A8 kernel takes it (codes and block
    scales); decoded from the layout text in numpy, it is the fake-quantized input that the reference multiplied
    (the GEMM of it against the weight decoded in numpy meets the tolerance), and it differs from x."""
    out = tmp_path / "b"
    _export(capsys, out, "--op", op, "--shape", "8,256,512", "--act-quant", "emulate")
    [e] = golden.load(out)
    t = e.inputs
    assert "x_codes, x_scale" in e.contract["tensors"] and json.loads(
        (out / "manifest.json").read_text())["numerics"]["act_quant"] == "emulate"
    x = t["x"].numpy()
    if op == "nvfp4_linear":
        assert t["x_codes"].dtype == torch.uint8 and tuple(t["x_scale"].shape) == (8, 512 // 16)
        x_hat = _x_hat_nvfp4(t["x_codes"].numpy(), t["x_scale"].view(torch.uint8).numpy(), float(t["w1.input_scale"]))
        y = _np_gemm().gemm_fp32(x_hat, t["w1.weight"].numpy(), t["w1.weight_scale"].view(torch.uint8).numpy(),
                                 float(t["w1.weight_scale_2"]))
    else:
        assert t["x_codes"].dtype == torch.float8_e4m3fn and tuple(t["x_scale"].shape) == (8, 512 // 32)
        x_hat = _np_gemm().e4m3(t["x_codes"].view(torch.uint8).numpy()) * np.repeat(
            np.exp2(t["x_scale"].numpy().astype(np.float32) - 127), 32, axis=1)
        w = _np_gemm().e4m3(t["w.weight"].view(torch.uint8).numpy()) * np.repeat(
            np.exp2(t["w.weight_scale"].numpy().astype(np.float32) - 127), 32, axis=1)
        y = x_hat @ w.T
    assert np.abs(x_hat - x).max() > 1e-3  # the input really was quantized
    r = golden.compare(e, {"y": torch.from_numpy(y), "x_hat": torch.from_numpy(x_hat.astype(np.float32))})
    assert r.ok, str(r)
    assert main(["golden", "--replay", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["mismatches"] == []


def test_activation_codes_in_model_driven_bundles(capsys, tiny_nvfp4, tmp_path):
    """A model exported with --act-quant emulate: every MXFP8 linear entry and the NVFP4 expert entry carry their
    inputs' codes and scales, consistent with the captured x_hat, and replay checks them bit for bit."""
    out = tmp_path / "b"
    assert main(["golden", "--ckpt-path", str(tiny_nvfp4), "--prompt", "codes", "--act-quant", "emulate",
                 "--ops", "mxfp8_linear,nvfp4_linear", "--out", str(out)]) == 0
    capsys.readouterr()
    entries = golden.load(out)
    assert {e.op for e in entries} == {"mxfp8_linear", "nvfp4_linear"}
    for e in entries:
        assert {"x_codes", "x_scale"} <= set(e.inputs), e.id
    nv = next(e for e in entries if e.op == "nvfp4_linear")
    t = nv.inputs
    x_hat = _x_hat_nvfp4(t["x_codes"].numpy(), t["x_scale"].view(torch.uint8).numpy(), float(t["w1.input_scale"]))
    np.testing.assert_array_equal(x_hat.astype(np.float32), nv.outputs["x_hat"].float().numpy())
    assert main(["golden", "--replay", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["mismatches"] == []
