"""Golden bundles as a kernel team uses them: `--synthetic-weights` exports, the numerics contract in the
manifest (tolerances, layouts, versions, hashes), packed weights stored once, and the test API
(`golden.load`, `golden.compare`, `golden.parametrize`, `--replay` error sizes)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from minimax_ref import golden
from minimax_ref.cli import main
from minimax_ref.errors import InputError
from minimax_ref.loader import load_model, load_synthetic

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
    from minimax_ref.synthetic import SyntheticCheckpoint

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
        assert {"formula", "accumulation", "rounding", "layouts", "tolerance"} <= set(c), op
        assert set(c["tolerance"]) == {"float32", "bfloat16"}
        # words, not the engine's internal function names
        assert not re.search(r"\b(msa|moe|quant|linear|norm|attention)\.[a-z_]+\(", json.dumps(c)), op
    assert "-1" in manifest["contracts"]["indexer"]["formula"]
    assert "clamp" in manifest["contracts"]["moe"]["formula"]
    assert "ascending expert id" in manifest["contracts"]["moe"]["accumulation"]
    assert "low nibble" in manifest["contracts"]["nvfp4_linear"]["layouts"]["w1.*, w2.*"]
    assert "block_table" in manifest["contracts"]["msa"]["layouts"]["paged"]
    assert manifest["producer"]["torch"] == torch.__version__
    assert manifest["producer"]["minimax_ref"]


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
                assert tol == {"exact": True}
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


def test_weights_are_stored_once(manifest, bundle):
    stored = [(m["stored"]["file"], m["stored"]["key"]) for e in manifest["entries"]
              for m in e["tensors"].values() if "stored" in m]
    assert len(stored) > len(set(stored))  # several phases and ops share the same operands
    for e in manifest["entries"]:
        with safe_open(str(bundle / e["file"]), framework="pt") as f:
            assert not any(e["tensors"][n]["role"] == "weight" for n in f.keys()), e["file"]
    per_layer = {w["layer"]: w["file"] for w in manifest["weights_files"]}
    for file, key in set(stored):
        assert file in per_layer.values()
        with safe_open(str(bundle / file), framework="pt") as f:
            assert key in f.keys()
    # moe at layer 1 in every phase points at the same bytes
    moe = [e for e in manifest["entries"] if e["op"] == "moe" and e["layer"] == 1]
    assert len(moe) == 3
    keys = [{n: m["stored"]["key"] for n, m in e["tensors"].items() if "stored" in m} for e in moe]
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
    y = e.outputs["y"].clone()
    i = int(y.abs().argmax())
    y.view(-1)[i] = torch.nextafter(y.view(-1)[i], torch.tensor(float("inf")))
    one_ulp = golden.compare(e, {"y": y})
    want = e.outputs["y"].view(-1)[i]
    assert one_ulp.ok and [r["name"] for r in one_ulp.rows] == ["y"]
    assert one_ulp.rows[0]["max_ulps"] == 1.0
    assert one_ulp.rows[0]["max_abs"] == pytest.approx(float(y.view(-1)[i] - want))
    tol = e.tolerance["y"]["float32"]
    y.view(-1)[i] = want + 2 * (tol["atol"] + tol["rtol"] * abs(float(want)))
    bad = golden.compare(e, {"y": y})
    assert not bad.ok and bad.rows[0]["bad"] == 1 and "OUT OF TOLERANCE" in str(bad)
    assert golden.compare(e, {"y": y}, kernel_dtype="bfloat16").ok  # within the looser bf16 tolerance


def test_compare_integer_outputs_are_exact(bundle):
    e = next(iter(golden.load(bundle, ops=["indexer"])))
    blocks = e.outputs["blocks"].clone()
    blocks.view(-1)[0] += 1
    r = golden.compare(e, {"blocks": blocks})
    assert not r.ok and r.rows[0]["max_abs"] == 1.0


def test_compare_bad_calls_are_input_errors(bundle):
    e = next(iter(golden.load(bundle, ops=["nvfp4_linear"])))
    with pytest.raises(InputError, match="no output named 'z'"):
        golden.compare(e, {"z": e.outputs["y"]})
    with pytest.raises(InputError, match="differs from the reference"):
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
            assert golden.compare(e, {"y": y}).ok, str(golden.compare(e, {"y": y}))
            swapped = ((w & 0xF) << 4) | (w >> 4)  # the other nibble order
            y_bad = torch.from_numpy(gemm(x, swapped, s, g).astype("float32")).to(e.outputs["y"].dtype)
            assert not golden.compare(e, {"y": y_bad}).ok


def test_the_bf16_accumulator_scaling_kernel_needs_the_bf16_tolerance(bf16_bundle):
    """The reference rounds bf16(e2m1 * s * ws2); scaling the fp32 accumulator instead is not bit-exact but is
    within the stated bf16 tolerance."""
    np_gemm = _example_module()
    diffs = []
    for e in golden.load(bf16_bundle, ops=["nvfp4_linear"]):
        t = e.inputs
        y = np_gemm.gemm_bf16(t["x"].float().numpy(), t["w1.weight"].numpy(),
                              t["w1.weight_scale"].view(torch.uint8).numpy(), float(t["w1.weight_scale_2"]))
        r = golden.compare(e, {"y": torch.from_numpy(y.astype("float32")).bfloat16()})
        assert r.ok, str(r)
        diffs.append(r.rows[0]["max_abs"])
    assert max(diffs) > 0


def test_example_runs_against_a_bundle(bundle, tmp_path):
    env = dict(os.environ, MINIMAX_REF_GOLDEN_BUNDLE=str(bundle))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(EXAMPLE)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    n = sum(1 for e in golden.load(bundle, ops=["nvfp4_linear"]))
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
