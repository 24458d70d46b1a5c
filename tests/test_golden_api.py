"""Golden bundles as a kernel team uses them: `--synthetic-weights` exports, the numerics contract in the
manifest (tolerances, layouts, versions, hashes), packed weights stored once, and the test API
(`golden.load`, `golden.compare`, `golden.parametrize`, `--replay` error sizes)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from golden_example import check_manifest, run_example
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from minimax_ref import golden
from minimax_ref.cli.main import main
from minimax_ref.errors import InputError
from minimax_ref.golden.contract import sha256
from minimax_ref.weights.loader import load_model, load_synthetic

ROOT = Path(__file__).parents[1]
EXAMPLE = ROOT / "examples" / "kernel_test"


def _prompts(*lengths: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 1000, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def bundle(tiny_nvfp4, tmp_path_factory):
    out = tmp_path_factory.mktemp("golden-api") / "fp32"
    golden.export_golden(load_model(tiny_nvfp4, dtype=torch.float32), _prompts(70, 23), out, decode_steps=2,
                         page_size=8)
    return out


@pytest.fixture(scope="module")
def bf16_bundle(tiny_nvfp4, tmp_path_factory):
    out = tmp_path_factory.mktemp("golden-api") / "bf16"
    golden.export_golden(load_model(tiny_nvfp4, dtype=torch.bfloat16), _prompts(70, 23), out, decode_steps=1,
                         ops=["nvfp4_linear", "moe"])
    return out


@pytest.fixture(scope="module")
def manifest(bundle):
    return json.loads((bundle / "manifest.json").read_text())


# ------------------------------------------------------------------------------------ --synthetic-weights


def test_synthetic_weights_from_the_cli(capsys, tmp_path):
    out = tmp_path / "synth"
    assert main(["golden", "--synthetic-weights", "tiny", "--prompt", "Hello synthetic world", "--ops",
                 "nvfp4_linear,router,msa", "--layers", "2", "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["ops"] == ["msa", "nvfp4_linear", "router"] and summary["layers"] == [2]
    m = json.loads((out / "manifest.json").read_text())
    assert m["checkpoint"] is None and m["synthetic"]["preset"] == "tiny" and m["synthetic"]["fmt"] == "nvfp4"
    assert main(["golden", "--replay", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["mismatches"] == []


def test_synthetic_weights_with_a_checkpoint_is_refused(capsys, tiny_nvfp4, tmp_path):
    rc = main(["golden", "--synthetic-weights", "tiny", "--ckpt-path", str(tiny_nvfp4), "--prompt", "hi",
               "--out", str(tmp_path / "o")])
    assert rc == 2 and "not both" in capsys.readouterr().err


@pytest.mark.parametrize("weights", ["packed", "dequant"])
def test_synthetic_weights_from_python(tmp_path, weights):
    model = load_synthetic("tiny", dtype=torch.float32, weights=weights)
    m = golden.export_golden(model, _prompts(40), tmp_path / "b", decode_steps=1)
    assert {e["op"] for e in m["entries"]} == set(golden.OPS)
    results = golden.replay_bundle(tmp_path / "b")
    assert results and all(r["ok"] for r in results), [r for r in results if not r["ok"]]
    # the stored packed operands are the synthetic checkpoint's bytes
    from minimax_ref.weights.synthetic import SyntheticCheckpoint

    ck = SyntheticCheckpoint("tiny", "nvfp4")
    e = next(e for e in golden.load(tmp_path / "b", ops=["nvfp4_linear"]))
    prefix = f"language_model.model.layers.{e.layer}.block_sparse_moe.experts.{e.params['expert']}.w1"
    assert torch.equal(e.inputs["w1.weight"], ck.read(prefix + ".weight"))


def test_a_model_without_a_source_is_an_input_error(tiny_nvfp4, tmp_path):
    model = load_model(tiny_nvfp4, dtype=torch.float32)
    model.ckpt_path = None
    with pytest.raises(InputError, match="neither a checkpoint folder"):
        golden.export_golden(model, _prompts(5), tmp_path / "b")


# ------------------------------------------------------------------------------------ the manifest's contract


def test_manifest_states_the_numerics_contract(manifest):
    assert set(manifest["contracts"]) == set(golden.OPS)
    for op, c in manifest["contracts"].items():
        assert {"formula", "accumulation", "rounding", "tensors", "params", "tolerance"} <= set(c), op
        assert set(c["tolerance"]) == {"float32", "bfloat16"}
        # words, not the engine's internal function names
        assert not re.search(r"\b(msa|moe|quant|linear|norm|attention)\.[a-z_]+\(", json.dumps(c)), op
    assert "-1" in manifest["contracts"]["indexer"]["formula"]
    assert "clamp" in manifest["contracts"]["moe"]["formula"]
    assert "ascending expert id" in manifest["contracts"]["moe"]["accumulation"]
    assert "low nibble" in manifest["contracts"]["nvfp4_linear"]["tensors"]["w1.weight"]
    assert "-1 past the row's last page" in manifest["contracts"]["msa"]["tensors"]["block_table"]
    assert manifest["producer"]["torch"] == torch.__version__
    assert manifest["producer"]["minimax_ref"]


def test_manifest_describes_exactly_the_tensors_it_holds(bundle, bf16_bundle):
    for path in (bundle, bf16_bundle):
        check_manifest(path)
    m = json.loads((bundle / "manifest.json").read_text())
    assert "expert_mask" not in json.dumps(m["contracts"])  # no entry holds one here
    assert set(m["about"]) >= {"weights_files", "entries[].tensors.NAME.stored", "entries[].tolerance"}
    tensors = m["contracts"]["attention"]["tensors"]
    assert "cu_seqlens_q" in tensors and "filler" in tensors["k_pages, v_pages"]


def test_bf16_contract_names_the_rounding_point(bf16_bundle):
    m = json.loads((bf16_bundle / "manifest.json").read_text())
    assert "AFTER multiplying by weight_scale_2" in m["contracts"]["nvfp4_linear"]["rounding"]


def test_every_output_has_a_tolerance(manifest, bundle):
    for e in manifest["entries"]:
        outputs = {n for n, t in e["tensors"].items() if t["role"] == "output"}
        assert set(e["tolerance"]) == outputs, e["file"]
        t = golden.entry_tensors(bundle, e)
        for name in outputs:
            tol = e["tolerance"][name]
            if not t[name].is_floating_point():
                assert tol == ({"exact": True, "order": "set"} if name == "blocks" else {"exact": True})
                continue
            finite = t[name][torch.isfinite(t[name])].double()
            rms = float(finite.square().mean().sqrt())
            rtol, a = golden.TOLERANCE[e["op"]]["float32"]
            assert tol["float32"] == {"rtol": rtol, "atol": pytest.approx(a * rms, rel=1e-12)}
            assert tol["bfloat16"]["atol"] > tol["float32"]["atol"] or rms == 0


def test_file_hashes(manifest, bundle):
    files = manifest["entries"] + manifest["weights_files"]
    assert files
    for f in files:
        assert f["sha256"] == hashlib.sha256((bundle / f["file"]).read_bytes()).hexdigest()


def _leaves(ref: dict) -> list[tuple[str, str]]:
    """(file, key) of every stored tensor a `stored` reference reads."""
    if "file" in ref:
        return [(ref["file"], ref["key"])]
    return [leaf for part in next(iter(ref.values())) for leaf in _leaves(part)]


def test_weights_are_stored_once(manifest, bundle):
    stored = [leaf for e in manifest["entries"] for m in e["tensors"].values() if "stored" in m
              for leaf in _leaves(m["stored"])]
    assert len(stored) > len(set(stored))  # several phases and ops share the same operands
    for e in manifest["entries"]:
        with safe_open(str(bundle / e["file"]), framework="pt") as f:
            assert not any(e["tensors"][n]["role"] == "weight" for n in f.keys()), e["file"]
    files = {w["file"] for w in manifest["weights_files"]}
    assert all(f"weights/layer{w['layer']:03d}" in w["file"] for w in manifest["weights_files"])
    keys = [k for f in files for k in safe_open(str(bundle / f), framework="pt").keys()]
    assert len(keys) == len(set(keys))  # no operand in two files
    for file, key in set(stored):
        assert file in files
        with safe_open(str(bundle / file), framework="pt") as f:
            assert key in f.keys()
    # moe at layer 1 in every phase points at the same bytes
    moe = [e for e in manifest["entries"] if e["op"] == "moe" and e["layer"] == 1]
    assert len(moe) == 3
    keys = [{n: json.dumps(m["stored"]) for n, m in e["tensors"].items() if "stored" in m} for e in moe]
    common = set(keys[0]) & set(keys[1])
    assert common and all(keys[0][n] == keys[1][n] for n in common)


def test_a_missing_weights_file_is_one_error(bundle, tmp_path, capsys):
    copy = tmp_path / "b"
    shutil.copytree(bundle, copy)
    (copy / "weights" / "layer002.safetensors").unlink()
    assert main(["golden", "--replay", str(copy)]) == 2
    assert "weights file weights/layer002.safetensors is missing" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ test API


def test_load_gives_inputs_and_outputs(bundle, manifest):
    entries = golden.load(bundle)
    assert [e.file for e in entries] == [e["file"] for e in manifest["entries"]]
    for e, m in zip(entries, manifest["entries"]):
        roles = {n: t["role"] for n, t in m["tensors"].items()}
        assert set(e.outputs) == {n for n, r in roles.items() if r == "output"}
        assert set(e.inputs) == {n for n, r in roles.items() if r != "output"}
        assert e.contract == manifest["contracts"][e.op] and e.tolerance == m["tolerance"]
    assert {e.op for e in golden.load(bundle, ops=["router", "msa"])} == {"router", "msa"}


def test_load_checks_hashes(bundle, manifest, tmp_path):
    copy = tmp_path / "b"
    shutil.copytree(bundle, copy)
    e = next(e for e in manifest["entries"] if e["op"] == "router")
    t = load_file(str(copy / e["file"]))
    t["weights"].view(-1)[0] += 1.0
    save_file(t, str(copy / e["file"]))
    with pytest.raises(InputError, match=re.escape(e["file"])):
        golden.load(copy)
    assert len(golden.load(copy, verify=False)) == len(manifest["entries"])


def test_compare_reports_error_sizes_and_applies_the_tolerance(bundle):
    e = next(e for e in golden.load(bundle, ops=["nvfp4_linear"]) if e.phase == "prefill")
    exact = golden.compare(e, dict(e.outputs))
    assert exact.ok and all(r["max_abs"] == 0 == r["max_ulps"] for r in exact.rows)
    y2 = e.outputs["y2"]
    y = e.outputs["y"].clone()
    i = int(y.abs().argmax())
    y.view(-1)[i] = torch.nextafter(y.view(-1)[i], torch.tensor(float("inf")))
    one_ulp = golden.compare(e, {"y": y, "y2": y2})
    want = e.outputs["y"].view(-1)[i]
    assert one_ulp.ok and [r["name"] for r in one_ulp.rows] == ["y", "y2"]
    assert one_ulp.rows[0]["max_ulps"] == 1.0
    assert one_ulp.rows[0]["max_abs"] == pytest.approx(float(y.view(-1)[i] - want))
    tol = e.tolerance["y"]["float32"]
    y.view(-1)[i] = want + 2 * (tol["atol"] + tol["rtol"] * abs(float(want)))
    bad = golden.compare(e, {"y": y}, skip=["y2"])
    assert not bad.ok and bad.rows[0]["bad"] == 1 and "OUT OF TOLERANCE" in str(bad)
    assert golden.compare(e, {"y": y}, kernel_dtype="bfloat16", skip=["y2"]).ok  # within the bf16 tolerance


def test_compare_integer_outputs_are_exact(bundle):
    e = next(iter(golden.load(bundle, ops=["indexer"])))
    blocks = e.outputs["blocks"].clone()
    blocks.view(-1)[0] += 1
    r = golden.compare(e, {"blocks": blocks})
    row = next(x for x in r.rows if x["name"] == "blocks")
    assert not r.ok and row["bad"] == 1 and row["elements"] == blocks.numel() and "max_abs" not in row


def test_compare_bad_calls_are_input_errors_and_extra_outputs_are_ignored(bundle):
    e = next(iter(golden.load(bundle, ops=["nvfp4_linear"])))
    r = golden.compare(e, {"z": e.outputs["y"], **e.outputs})  # an output the entry lacks: not compared, named
    assert r.ok and r.ignored == ["z"] and "ignored: z" in str(r)
    r = golden.compare(e, {"z": e.outputs["y"]})  # ... and it stands in for none of the entry's
    assert not r.ok and all(row.get("missing") for row in r.rows)
    with pytest.raises(InputError, match=r"output .y. has shape \(\d+, 1\), the reference.s is \(\d+, \d+\)"):
        golden.compare(e, {"y": e.outputs["y"][..., :1]})
    with pytest.raises(InputError, match="pass a dict by name"):
        golden.compare(e, e.outputs["y"])
    with pytest.raises(InputError, match="choose float32 or bfloat16"):
        golden.compare(e, {"y": e.outputs["y"]}, kernel_dtype="fp8")


def test_parametrize_over_a_bundle(bundle, manifest):
    mark = golden.parametrize(bundle, ops=["router"])
    argname, entries = mark.args[0], mark.args[1]
    assert argname == "golden_entry"
    assert [e.file for e in entries] == [e["file"] for e in manifest["entries"] if e["op"] == "router"]
    assert mark.kwargs["ids"] == [e.file.removesuffix(".safetensors") for e in entries]


def test_replay_reports_error_sizes(bundle, manifest, tmp_path, capsys):
    copy = tmp_path / "b"
    shutil.copytree(bundle, copy)
    e = next(e for e in manifest["entries"] if e["op"] == "moe" and e["phase"] == "decode0")
    t = load_file(str(copy / e["file"]))
    flat = t["y"].view(-1)
    flat[3] = torch.nextafter(flat[3], torch.tensor(float("inf")))
    save_file(t, str(copy / e["file"]))
    assert main(["golden", "--replay", str(copy)]) == 2  # a changed file is named, not replayed
    assert "1 files differ from the manifest's sha256" in capsys.readouterr().err
    mf = json.loads((copy / "manifest.json").read_text())  # as another engine's export would describe it
    next(x for x in mf["entries"] if x["file"] == e["file"])["sha256"] = sha256(copy / e["file"])
    (copy / "manifest.json").write_text(json.dumps(mf))
    assert main(["golden", "--replay", str(copy)]) == 1
    out = json.loads(capsys.readouterr().out)
    [bad] = out["mismatches"]
    assert (bad["file"], bad["check"], bad["max_ulps"]) == (e["file"], "y", 1.0) and bad["max_abs"] > 0
    assert out["worst"]["max_ulps"] == 1.0 and len(out["results"]) == out["checks"]


# ------------------------------------------------------------------------------------ an independent kernel


def _example_module():
    spec = importlib.util.spec_from_file_location("nvfp4_gemm", EXAMPLE / "nvfp4_gemm.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_independent_numpy_gemm_passes_and_a_wrong_one_fails(bundle, bf16_bundle):
    np_gemm = _example_module()
    for path, gemm in ((bundle, np_gemm.gemm_fp32), (bf16_bundle, np_gemm.gemm_bf16)):
        for e in golden.load(path, ops=["nvfp4_linear"]):
            t = e.inputs
            x, w, g = t["x"].float().numpy(), t["w1.weight"].numpy(), float(t["w1.weight_scale_2"])
            s = t["w1.weight_scale"].view(torch.uint8).numpy()
            y = torch.from_numpy(gemm(x, w, s, g).astype("float32")).to(e.outputs["y"].dtype)
            assert golden.compare(e, {"y": y}, skip=["y2"]).ok, str(golden.compare(e, {"y": y}, skip=["y2"]))
            swapped = ((w & 0xF) << 4) | (w >> 4)  # the other nibble order
            y_bad = torch.from_numpy(gemm(x, swapped, s, g).astype("float32")).to(e.outputs["y"].dtype)
            assert not golden.compare(e, {"y": y_bad}, skip=["y2"]).ok


def test_the_bf16_accumulator_scaling_kernel_needs_the_bf16_tolerance(bf16_bundle):
    """The reference rounds bf16(e2m1 * s * ws2); scaling the fp32 accumulator instead is not bit-exact but is
    within the stated bf16 tolerance."""
    np_gemm = _example_module()
    diffs = []
    for e in golden.load(bf16_bundle, ops=["nvfp4_linear"]):
        t = e.inputs
        y = np_gemm.gemm_bf16(t["x"].float().numpy(), t["w1.weight"].numpy(),
                              t["w1.weight_scale"].view(torch.uint8).numpy(), float(t["w1.weight_scale_2"]))
        r = golden.compare(e, {"y": torch.from_numpy(y.astype("float32")).bfloat16()}, skip=["y2"])
        assert r.ok, str(r)
        diffs.append(r.rows[0]["max_abs"])
    assert max(diffs) > 0


def test_example_runs_against_a_bundle(bundle, tmp_path):
    """The example passes every entry of a bundle of every op, the MSA layers' indexer norms (qk_norm_rope's
    index_q / index_k) included."""
    proc = run_example([bundle], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    entries = golden.load(bundle)
    assert any("index_q_rope" in e.outputs and "index_k_rope" in e.outputs for e in entries if e.op == "qk_norm_rope")
    n = len(entries) + sum(1 for e in entries if e.op == "nvfp4_linear")  # every output; the GEMM alone
    assert f"{n} passed" in proc.stdout, proc.stdout


def test_varlen_query_offsets(bundle, manifest):
    for e in manifest["entries"]:
        if e["op"] not in ("attention", "msa", "indexer"):
            continue
        t = golden.entry_tensors(bundle, e)
        cu = t["cu_seqlens_q"].tolist()
        want = [70, 23] if e["phase"] == "prefill" else [1, 1]
        assert cu == [0, want[0], want[0] + want[1]], (e["file"], cu)
        done = 0 if e["phase"] == "prefill" else int(e["phase"].removeprefix("decode")) + 1
        assert t["seq_lens"].tolist() == [70 + done, 23 + done]


# ------------------------------------------------------------------------------------ every MXFP8 linear


def _checkpoint_mxfp8_linears(ckpt) -> dict[int, set[str]]:
    """Per layer, the linears stored as MXFP8 (float8_e4m3fn weight with a uint8 block scale), read from the
    checkpoint's safetensors headers."""
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    out: dict[int, set[str]] = {}
    for name, file in index.items():
        m = re.fullmatch(r"language_model\.model\.layers\.(\d+)\.(.+)\.weight", name)
        if not m or ".experts." in name:
            continue
        with safe_open(str(ckpt / file), framework="pt") as f:
            if f.get_slice(name).get_dtype() == "F8_E4M3":
                out.setdefault(int(m.group(1)), set()).add(m.group(2))
    return out


def test_every_mxfp8_linear_is_captured(bundle, manifest, tiny_nvfp4):
    np_gemm = _example_module()
    want = _checkpoint_mxfp8_linears(tiny_nvfp4)
    entries = [e for e in manifest["entries"] if e["op"] == "mxfp8_linear"]
    for phase in ("prefill", "decode0", "decode1"):
        got: dict[int, set[str]] = {}
        for e in entries:
            if e["phase"] == phase:
                got.setdefault(e["layer"], set()).add(e["tag"])
        assert got == want, phase
    assert any("shared_experts" in t for ts in want.values() for t in ts)
    assert any("index_q_proj" in t for ts in want.values() for t in ts)
    assert any(t.startswith("mlp.") for ts in want.values() for t in ts)
    for e in golden.load(bundle, ops=["mxfp8_linear"]):
        assert e.params["linear"].endswith(e.file.split(".", 1)[1].removesuffix(".safetensors"))
        t = e.inputs
        w = np_gemm.e4m3(t["w.weight"].view(torch.uint8).numpy())
        w = w * np.repeat(np.exp2(t["w.weight_scale"].numpy().astype(np.float32) - 127), 32, axis=1)
        y = t["x"].double().numpy() @ w.astype(np.float64).T  # numpy, fp64
        r = golden.compare(e, {"y": torch.from_numpy(y).float()})
        assert r.ok, str(r)
    # stored once: the shared expert's operands of the moe entry and of its mxfp8_linear entries are one key
    moe = next(e for e in manifest["entries"] if e["op"] == "moe" and e["layer"] == 1 and e["phase"] == "prefill")
    lin = next(e for e in entries if e["layer"] == 1 and e["tag"] == "block_sparse_moe.shared_experts.gate_proj")
    assert moe["tensors"]["shared.gate_proj.weight"]["stored"] == lin["tensors"]["w.weight"]["stored"]
    with safe_open(str(bundle / "weights" / "layer001.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    assert len(keys) == len(set(keys))


def test_replay_checks_every_mxfp8_linear(bundle, manifest):
    files = {e["file"] for e in manifest["entries"] if e["op"] == "mxfp8_linear"}
    results = golden.replay_bundle(bundle)
    checked = {r["file"] for r in results if r["check"] == "y" and r["ok"]}
    assert files <= checked


# ------------------------------------------------------------------------------------ fused gate-up operand


def _nvfp4_np(weight, scale, ws2_per_row) -> np.ndarray:
    """fp64 [N, K] from the layout alone: e2m1 * e4m3 scale * the row's weight_scale_2."""
    np_gemm = _example_module()
    return np_gemm.unscaled_weight(weight, scale).astype(np.float64) * np.asarray(ws2_per_row, np.float64)[:, None]


def test_fused_gate_up_equals_the_separate_products(capsys, tmp_path):
    out = tmp_path / "moe"
    assert main(["golden", "--op", "moe", "--shape", "6,4,64,32", "--out", str(out)]) == 0
    capsys.readouterr()
    [e] = golden.load(out)
    t = e.inputs
    x = t["x"].double().numpy()
    m = json.loads((out / "manifest.json").read_text())
    assert "rows [0, I) are the gate projection's rows" in m["contracts"]["moe"]["tensors"]["experts.{e}.w13.weight"]
    for x_id in range(4):
        p = f"experts.{x_id}."
        w13 = t[p + "w13.weight"]
        assert tuple(w13.shape) == (64, 32) and tuple(t[p + "w13.weight_scale"].shape) == (64, 4)
        assert torch.equal(w13[:32], t[p + "w1.weight"]) and torch.equal(w13[32:], t[p + "w3.weight"])
        ws2 = t[p + "w13.weight_scale_2"]
        assert ws2.tolist() == [float(t[p + "w1.weight_scale_2"]), float(t[p + "w3.weight_scale_2"])]
        assert ws2[0] != ws2[1]  # the global scales differ: one shared scale could not hold both
        scale13 = t[p + "w13.weight_scale"].view(torch.uint8).numpy()
        fused = x @ _nvfp4_np(w13.numpy(), scale13, np.repeat(ws2.double().numpy(), 32)).T
        gate = x @ _nvfp4_np(t[p + "w1.weight"].numpy(), t[p + "w1.weight_scale"].view(torch.uint8).numpy(),
                             [float(t[p + "w1.weight_scale_2"])] * 32).T
        up = x @ _nvfp4_np(t[p + "w3.weight"].numpy(), t[p + "w3.weight_scale"].view(torch.uint8).numpy(),
                           [float(t[p + "w3.weight_scale_2"])] * 32).T
        np.testing.assert_allclose(fused, np.concatenate([gate, up], axis=1), rtol=1e-12, atol=1e-12)
        # one global scale for both halves (vLLM's w13_weight_scale_2[:, 0]) is not the same operand
        shared = x @ _nvfp4_np(w13.numpy(), scale13, np.repeat(float(ws2[0]), 64)).T
        assert not np.allclose(shared[:, 32:], up, rtol=1e-3)


def test_fused_operands_in_model_driven_bundles(bundle, manifest):
    moe = [e for e in manifest["entries"] if e["op"] == "moe"]
    for ent in moe:
        for x_id in ent["params"]["used_experts"]:
            meta = ent["tensors"][f"experts.{x_id}.w13.weight"]
            parts = [leaf["key"] for leaf in meta["stored"]["cat"]]  # no bytes of its own: gate rows, then up rows
            assert parts == [f"{p}block_sparse_moe.experts.{x_id}.{w}.weight" for w in ("w1", "w3")
                             for p in [parts[0].split("block_sparse_moe")[0]]]
        assert "shared.gate_up.weight" in ent["tensors"]
    e = next(e for e in golden.load(bundle, ops=["moe"]) if e.phase == "prefill")
    x_id = e.params["used_experts"][0]
    p = f"experts.{x_id}."
    n = e.inputs[p + "w1.weight"].shape[0]
    assert torch.equal(e.inputs[p + "w13.weight"], torch.cat([e.inputs[p + "w1.weight"], e.inputs[p + "w3.weight"]]))
    assert tuple(e.inputs[p + "w13.weight_scale_2"].shape) == (2,) and e.inputs[p + "w13.weight"].shape[0] == 2 * n
    fused = {r["check"] for r in golden.replay_bundle(bundle) if r["check"].endswith("(fused)") and r["ok"]}
    assert f"{p}w13 (fused)" in fused and "shared.gate_up (fused)" in fused


# ------------------------------------------------------------------------------------ fp64 reference outputs


def test_fp64_outputs_of_a_single_op_bundle(capsys, tmp_path):
    out = tmp_path / "b"
    assert main(["golden", "--op", "nvfp4_linear", "--shape", "5,64,128", "--fp64", "--out", str(out)]) == 0
    capsys.readouterr()
    [e] = golden.load(out)
    m = json.loads((out / "manifest.json").read_text())
    assert m["numerics"]["fp64_outputs"] is True and "fp64" in m["contracts"]["nvfp4_linear"]
    assert set(e.fp64) == {"y"} and e.fp64["y"].dtype == torch.float64 and "y.fp64" not in e.inputs
    t = e.inputs
    w = _nvfp4_np(t["w1.weight"].numpy(), t["w1.weight_scale"].view(torch.uint8).numpy(),
                  [float(t["w1.weight_scale_2"])] * 64)
    want = t["x"].double().numpy() @ w.T
    np.testing.assert_allclose(e.fp64["y"].numpy(), want, rtol=1e-12, atol=1e-12)
    r = golden.compare(e, {"y": e.fp64["y"].float()})
    assert r.ok and r.rows[0]["fp64"]["max_abs"] < r.rows[0]["reference_fp64"]["max_abs"] + 1e-30
    assert r.rows[0]["reference_fp64"]["max_abs"] <= r.rows[0]["atol"]  # the fp32 reference is within tolerance
    assert "against fp64" in str(r)
    assert main(["golden", "--replay", str(out)]) == 0
    res = json.loads(capsys.readouterr().out)
    assert {r["check"] for r in res["results"]} == {"y", "y.fp64"}


def test_fp64_outputs_of_a_model_driven_bundle(tmp_path):
    model = load_synthetic("tiny", dtype=torch.bfloat16)
    m = golden.export_golden(model, _prompts(30), tmp_path / "b", decode_steps=0, layers=[0, 1], fp64=True,
                             ops=["rmsnorm", "router", "moe", "attention", "msa", "indexer", "mxfp8_linear"])
    assert m["numerics"]["fp64_outputs"] is True
    for op in m["ops"]:
        assert m["contracts"][op]["fp64"] == golden.FP64[op]
    check_manifest(tmp_path / "b")  # the fp64 versions described too
    results = golden.replay_bundle(tmp_path / "b")
    assert results and all(r["ok"] for r in results), [r for r in results if not r["ok"]]
    for e in golden.load(tmp_path / "b"):
        floats = {n for n, v in e.outputs.items() if v.is_floating_point()}
        assert set(e.fp64) == floats, e.id
        r = golden.compare(e, dict(e.outputs), kernel_dtype="bfloat16")
        for row in r.rows:
            if row["name"] in e.fp64:  # the bf16 reference is within its stated bf16 tolerance of fp64
                ref = e.outputs[row["name"]].double()
                err = (ref - e.fp64[row["name"]]).abs().nan_to_num(0.0)
                assert bool((err <= row["atol"] + row["rtol"] * ref.abs()).all()), (e.id, row)
    # rmsnorm in fp64, by hand
    e = next(e for e in golden.load(tmp_path / "b", ops=["rmsnorm"]))
    x = e.inputs["input_layernorm.x"].double()
    w = e.inputs["input_layernorm.weight"].double()
    y = x / torch.sqrt(x.square().mean(-1, keepdim=True) + e.params["eps"]) * (1 + w)
    assert torch.allclose(e.fp64["input_layernorm.y"], y, rtol=1e-13, atol=0)


# ------------------------------------------------------------------------------------ long prompts: chunks


def _largest_captured(manifest) -> int:
    return max(int(np.prod(m["shape"])) for e in manifest["entries"] for m in e["tensors"].values()
               if m["role"] != "weight")


def test_chunked_capture_grows_linearly(tmp_path):
    model = load_synthetic("tiny", dtype=torch.float32)
    sizes = {}
    for T in (96, 192):
        out = tmp_path / f"t{T}"
        m = golden.export_golden(model, _prompts(T), out, decode_steps=1, chunk_elements=4096,
                                 ops=["attention", "indexer", "msa"], layers=[0, 1])
        assert m["attention_capture"]["chunk_elements"] == 4096
        sizes[T] = _largest_captured(m)
        pre = {e["op"]: e for e in m["entries"] if e["phase"] == "prefill"}
        assert "scores" not in pre["indexer"]["tensors"]  # [B, Hi, T, L]: quadratic, left out
        assert pre["msa"]["params"]["query_chunk"] < T
        dec = next(e for e in m["entries"] if e["op"] == "indexer" and e["phase"] == "decode0")
        assert "scores" in dec["tensors"]  # one query: linear
        results = golden.replay_bundle(out)
        assert results and all(r["ok"] for r in results), [r for r in results if not r["ok"]]
        check_manifest(out)  # the chunked capture's notes included
    assert sizes[192] == 2 * sizes[96]  # linear in T
    # a one-call capture holds the quadratic scores
    m = golden.export_golden(model, _prompts(192), tmp_path / "one", decode_steps=0, ops=["indexer"], layers=[1])
    assert m["attention_capture"]["chunk_elements"] is None and _largest_captured(m) >= 192 * 192


def test_entries_are_written_layer_by_layer(tmp_path, monkeypatch):
    """A layer's entries are written when the next layer starts, so capture holds about one layer at a time."""
    calls = []
    add = golden.BundleWriter.add

    def spy(self, entries):
        calls.append(sorted({(e.phase, e.layer, e.op in golden.ATTENTION_OPS) for e in entries}))
        return add(self, entries)

    monkeypatch.setattr(golden.BundleWriter, "add", spy)
    model = load_synthetic("tiny", dtype=torch.float32)
    golden.export_golden(model, _prompts(20), tmp_path / "b", decode_steps=0, ops=["rmsnorm", "moe", "msa"])
    written = [c for c in calls if c]
    assert written[0] == [("edge", 0, False)]  # the rmsnorm edge entry, written before the forward
    prefill = written[1:]
    assert prefill[:3] == [[("prefill", 0, False)], [("prefill", 1, False)], [("prefill", 2, False)]]
    assert ("prefill", 3, False) in prefill[3] and ("prefill", 3, True) in prefill[3]  # the last, with attention


SLOW_4K = r"""
import json, resource, sys
import torch
from minimax_ref import golden
from minimax_ref.model.config import parse_model_config
from minimax_ref.weights.loader import load_synthetic
from minimax_ref.research.plan import plan_memory
from minimax_ref.weights.synth import build_config
T, out, dtype = int(sys.argv[1]), sys.argv[2], getattr(torch, sys.argv[3])
kw = dict(experts=8, layers=2, overrides={"vocab_size": 8192, "moe_layer_freq": [0, 1], "sparse_attention_freq": [0, 1],
                                          "sparse_disable_index_value": [0, 1]})
cfg = parse_model_config(build_config("release", "nvfp4", **kw), where="release")
plan = plan_memory(cfg, tp=1, gpu_memory_gib=1000, max_model_len=T + 1, dtype_bytes=torch.finfo(dtype).bits // 8,
                   weights="dequant")
model = load_synthetic("release", dtype=dtype, max_seq_len=T + 1, weights="dequant", **kw)
ids = torch.randint(0, 8192, (T,), generator=torch.Generator().manual_seed(0)).tolist()
m = golden.export_golden(model, [ids], out, decode_steps=1)
print(json.dumps({"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "predicted": plan["weights_bytes_per_card"] + plan["kv_gib_for_max_model_len"] * 2**30
                  + plan["activation_reserve_gib"] * 2**30, "capture": m["attention_capture"]["chunk_elements"]}))
"""
MARGIN = 1 << 30  # the interpreter, torch and the synthetic generator's temporaries


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_4k_release_width_export_within_the_plan(tmp_path, dtype):
    """4K tokens at release widths (hidden 6144, 64 heads, experts 3072 wide; 2 layers: one dense, one MSA + MoE;
    8 experts; vocabulary 8192) exported from --synthetic-weights (decoded weights, in bfloat16 and in float32, the
    golden mode): the peak RSS stays within `plan --weights dequant --dtype ...`'s weights + KV + activation reserve
    for that configuration, plus MARGIN. weights.md ("Golden bundles", long prompts) gives the measured numbers."""
    proc = subprocess.run([sys.executable, "-c", SLOW_4K, "4096", str(tmp_path / "b"), dtype], capture_output=True,
                          text=True, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["capture"] == golden.CAPTURE_CHUNK
    assert r["peak_rss"] <= r["predicted"] + MARGIN, r
    m = json.loads((tmp_path / "b" / "manifest.json").read_text())
    pre = {e["op"]: e for e in m["entries"] if e["phase"] == "prefill" and e["layer"] == 1}
    assert pre["msa"]["params"]["query_chunk"] < 4096 and "scores" not in pre["indexer"]["tensors"]
    assert pre["msa"]["tensors"]["o"]["shape"] == [1, 4096, 64, 128]


# ------------------------------------------------------------------------------------ --replay --impl --device


def test_replay_impl_moves_inputs_to_the_device(capsys, tmp_path, monkeypatch):
    out = tmp_path / "b"
    assert main(["golden", "--op", "nvfp4_linear", "--shape", "4,32,64", "--out", str(out)]) == 0
    capsys.readouterr()
    seen = []
    mod = type(sys)("device_probe")

    def run(entry):
        seen.append({k: v.device.type for k, v in entry.inputs.items()})
        return {"y": entry.outputs["y"].to(entry.inputs["x"].device)}

    mod.run = run
    monkeypatch.setitem(sys.modules, "device_probe", mod)
    assert main(["golden", "--replay", str(out), "--impl", "device_probe:run", "--device", "cpu"]) == 0
    assert json.loads(capsys.readouterr().out)["failures"] == []
    assert seen and all(d == "cpu" for s in seen for d in s.values())
    calls = []
    monkeypatch.setattr(golden.api, "load", lambda *a, **k: calls.append(k) or [])
    golden.replay_impl(out, "device_probe:run", device="meta")
    assert calls  # the device reaches the loop; a bad one is refused before any entry runs
    with pytest.raises(InputError, match="--device"):
        golden.replay_impl(out, "device_probe:run", device="nonsense")


@pytest.mark.gpu
def test_replay_impl_on_cuda(capsys, tmp_path, monkeypatch):
    out = tmp_path / "b"
    assert main(["golden", "--op", "nvfp4_linear", "--shape", "4,32,64", "--out", str(out)]) == 0
    capsys.readouterr()
    mod = type(sys)("cuda_probe")

    def run(entry):
        assert all(v.device.type == "cuda" for v in entry.inputs.values())
        return {"y": entry.outputs["y"].cuda()}  # outputs on the device are brought back to compare

    mod.run = run
    monkeypatch.setitem(sys.modules, "cuda_probe", mod)
    assert main(["golden", "--replay", str(out), "--impl", "cuda_probe:run", "--device", "cuda"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["failures"] == [] and res["results"][0]["max_abs"] == 0.0
