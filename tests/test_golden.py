"""`minimax-ref golden`: bundles captured from a real forward replay bit-exactly, carry the
checkpoint's packed bytes and consistent paged-KV views, and bad requests name the culprit."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from golden_example import numpy_ops
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from minimax_ref import golden
from minimax_ref.cli.main import main
from minimax_ref.errors import InputError
from minimax_ref.golden import OPS, entry_tensors, export_golden, parse_layers, parse_ops, replay_bundle
from minimax_ref.golden.bundle import ref_files
from minimax_ref.golden.contract import sha256
from minimax_ref.weights.loader import load_model

PAGE = 8
LONG, SHORT = 120, 37  # the long prompt is past the tiny preset's 4 x 16-token MSA budget


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (LONG, SHORT)]


@pytest.fixture(scope="module")
def model(tiny_nvfp4):
    return load_model(tiny_nvfp4, dtype=torch.float32)


@pytest.fixture(scope="module")
def bundle(model, prompts, tmp_path_factory):
    out = tmp_path_factory.mktemp("golden") / "fp32"
    export_golden(model, prompts, out, decode_steps=2, page_size=PAGE, seed=3)
    return out


@pytest.fixture(scope="module")
def manifest(bundle):
    return json.loads((bundle / "manifest.json").read_text())


def test_replay_is_bit_exact_for_every_op(bundle, manifest):
    results = replay_bundle(bundle)
    bad = [r for r in results if not r["ok"]]
    assert not bad, bad
    assert {e["op"] for e in manifest["entries"]} == set(OPS)
    # the forward's phases, and the norm ops' edge entries (norm_edges): one per norm op
    assert {e["phase"] for e in manifest["entries"]} == {"prefill", "decode0", "decode1", "edge"}
    assert sorted(e["op"] for e in manifest["entries"] if e["phase"] == "edge") == ["final_norm", "qk_norm_rope",
                                                                                      "rmsnorm"]
    for e in manifest["entries"]:  # every output is checked, and every paged view
        checks = {r["check"] for r in results if r["file"] == e["file"]}
        outputs = {n for n, t in e["tensors"].items() if t["role"] == "output"}
        assert outputs <= checks, (e["file"], outputs - checks)
        if "block_table" in e["tensors"]:
            paged = {n.replace("_pages", "").replace("index_k", "ik") for n in e["tensors"] if n.endswith("_pages")}
            assert {f"paged.{n}" for n in paged | outputs} <= checks, (e["file"], checks)


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_replay_is_bit_exact_for_one_short_prompt(ckpt_factory, fmt, tmp_path):
    # one row: the decode steps' products are matrix-vector ones, whose CPU rounding depends on the weights'
    # alignment; the loaded parameters and the replayed inputs must both sit in the allocator's aligned memory
    model = load_model(ckpt_factory("tiny", fmt), dtype=torch.float32)
    out = tmp_path / "one"
    export_golden(model, [[5, 9]], out, decode_steps=2, page_size=PAGE, seed=3)
    bad = [r for r in replay_bundle(out) if not r["ok"]]
    assert not bad, bad


def test_loaded_parameters_have_their_own_aligned_memory(model):
    for name, p in model.named_parameters():
        assert p.data_ptr() % 64 == 0, name


def test_replay_detects_a_changed_output(bundle, manifest, tmp_path):
    copy = tmp_path / "b"
    shutil.copytree(bundle, copy)
    changed = []
    for op, name in (("moe", "y"), ("msa", "o"), ("nvfp4_linear", "y"), ("indexer", "blocks")):
        entry = next(e for e in manifest["entries"] if e["op"] == op and e["phase"] == "decode0")
        path = copy / entry["file"]
        t = load_file(str(path))
        flat = t[name].view(-1)
        if flat.is_floating_point():
            flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=flat.dtype))  # one ulp
        else:
            flat[0] += 1
        save_file(t, str(path))
        changed.append((entry, name))
    reduced = dict(manifest, entries=[e for e, _ in changed])  # replay only the changed files
    (copy / "manifest.json").write_text(json.dumps(reduced))
    with pytest.raises(InputError, match=r"4 files differ from the manifest's sha256"):  # damage is named as such
        replay_bundle(copy)
    # a bundle whose outputs another engine wrote (its manifest describes them): the numbers are what differs
    reduced = dict(reduced, entries=[dict(e, sha256=sha256(copy / e["file"])) for e, _ in changed])
    (copy / "manifest.json").write_text(json.dumps(reduced))
    bad = {(r["file"], r["check"]) for r in replay_bundle(copy) if not r["ok"]}
    assert {(e["file"], name) for e, name in changed} <= bad


def test_manifest_describes_files(bundle, manifest, tiny_nvfp4, prompts):
    assert manifest["numerics"] == {"dtype": "float32", "act_quant": "none", "kv_cache_dtype": "auto",
                                    "kv_scale": 1.0}
    assert manifest["seeds"]["page_permutation"] == 3 and manifest["page_size"] == PAGE
    assert [p["input_ids"] for p in manifest["prompts"]] == prompts
    assert all(len(d) == 2 for d in manifest["decoded_token_ids"])
    assert "recompute" not in manifest  # the files are the contract: no pointers into the engine's source
    for e in manifest["entries"]:
        with safe_open(str(bundle / e["file"]), framework="pt") as f:
            own = {n for n, m in e["tensors"].items() if "stored" not in m}
            assert set(f.keys()) == own
            for name, meta in e["tensors"].items():
                if "stored" in meta:  # packed operands: in the layer's weights file, once per bundle
                    assert meta["role"] == "weight"
                    for file in ref_files(meta["stored"]):
                        assert re.fullmatch(rf"weights/layer{e['layer']:03d}(_decode\d+)?\.safetensors", file), file
                    t = entry_tensors(bundle, {"file": e["file"], "tensors": {name: meta}})[name]
                else:
                    t = f.get_tensor(name)
                assert list(t.shape) == meta["shape"] and str(t.dtype) == "torch." + meta["dtype"]
    layers_of = {op: sorted({e["layer"] for e in manifest["entries"] if e["op"] == op}) for op in OPS}
    assert layers_of["attention"] == [0] and layers_of["msa"] == layers_of["moe"] == [1, 2, 3]
    assert layers_of["rmsnorm"] == layers_of["mxfp8_linear"] == [0, 1, 2, 3]


def test_packed_operands_are_the_checkpoint_bytes(bundle, manifest, tiny_nvfp4):
    index = json.loads((tiny_nvfp4 / "model.safetensors.index.json").read_text())["weight_map"]

    def raw(name):
        with safe_open(str(tiny_nvfp4 / index[name]), framework="pt") as f:
            return f.get_tensor(name)

    e = next(e for e in manifest["entries"] if e["op"] == "nvfp4_linear" and e["layer"] == 2)
    t = entry_tensors(bundle, e)
    prefix = f"language_model.model.layers.2.block_sparse_moe.experts.{e['params']['expert']}.w1"
    assert t["w1.weight"].dtype == torch.uint8 and torch.equal(t["w1.weight"], raw(prefix + ".weight"))
    assert torch.equal(t["w1.weight_scale"].view(torch.uint8), raw(prefix + ".weight_scale").view(torch.uint8))
    assert torch.equal(t["w1.weight_scale_2"], raw(prefix + ".weight_scale_2").reshape(()))
    # the expert most tokens chose, and exactly its tokens
    r = load_file(str(bundle / e["file"].replace("nvfp4_linear", "router")))
    counts = torch.bincount(r["expert_ids"].flatten(), minlength=16)
    assert e["params"]["expert"] == int(torch.nonzero(counts == counts.max())[0])
    assert e["params"]["tokens"] == (r["expert_ids"] == e["params"]["expert"]).any(-1).nonzero().flatten().tolist()
    m = next(x for x in manifest["entries"] if x["op"] == "mxfp8_linear" and x["layer"] == 0)
    assert m["params"]["linear"].endswith("self_attn.q_proj")
    tm = entry_tensors(bundle, m)
    assert torch.equal(tm["w.weight_scale"], raw(m["params"]["linear"] + ".weight_scale_inv"))


def test_paged_views_rebuild_the_cache(bundle, manifest, prompts):
    """Rebuilt here from the block table, independently of golden.from_pages."""
    e = next(e for e in manifest["entries"] if e["op"] == "msa" and e["layer"] == 3 and e["phase"] == "decode1")
    t = load_file(str(bundle / e["file"]))
    seq = t["seq_lens"].tolist()
    assert seq == [LONG + 2, SHORT + 2]
    table = t["block_table"]
    used = table[table >= 0]
    assert len(set(used.tolist())) == used.numel() == sum(-(-n // PAGE) for n in seq)  # each page once
    assert t["k_pages"].shape[0] == used.numel() + len(seq)  # and a spare page per row, no row's
    assert bool((table[1] == -1).any())  # the short row's table ends early
    for b, n in enumerate(seq):
        for p in range(n):
            page, slot = int(table[b, p // PAGE]), p % PAGE
            assert torch.equal(t["k_pages"][page, slot], t["k"][b, p])
            assert torch.equal(t["v_pages"][page, slot], t["v"][b, p])
            assert torch.equal(t["index_k_pages"][page, slot], t["ik"][b, p])
    # MSA is sparse for the long row: fewer blocks than the causal ones
    assert int((t["blocks"][0] >= 0).sum(-1).max()) == 4 < -(-(LONG + 2) // 16)


def test_bf16_emulated_fp8_cache_bundle(tiny_nvfp4, prompts, tmp_path):
    model = load_model(tiny_nvfp4, dtype=torch.bfloat16, act_quant="emulate", kv_cache_dtype="fp8")
    out = tmp_path / "bf16"
    m = export_golden(model, prompts, out, layers=[0, 2], decode_steps=1, page_size=16)
    assert m["numerics"] == {"dtype": "bfloat16", "act_quant": "emulate", "kv_cache_dtype": "fp8", "kv_scale": 1.0}
    results = replay_bundle(out)
    assert results and all(r["ok"] for r in results), [r for r in results if not r["ok"]]
    assert any(r["check"] == "x_hat" for r in results)
    e = next(e for e in m["entries"] if e["op"] == "msa")
    assert e["tensors"]["k_pages"]["dtype"] == "float8_e4m3fn"
    np_ops = numpy_ops()  # the numpy example, with its own activation fake-quant and bf16 roundings, passes
    for entry in golden.load(out):
        r = golden.compare(entry, np_ops.run(entry))
        assert r.ok, str(r)


def test_cli_export_and_replay(capsys, tiny_nvfp4, tmp_path):
    out = tmp_path / "cli"
    assert main(["golden", "--ckpt-path", str(tiny_nvfp4), "--prompt", "Hello golden world", "--ops",
                 "rmsnorm,router", "--layers", "1-2", "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["ops"] == ["rmsnorm", "router"] and summary["layers"] == [1, 2]
    assert main(["golden", "--replay", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["mismatches"] == []


@pytest.mark.parametrize("argv, why", [
    (["--ops", "rmsnorm,flash"], r"unknown op 'flash'"),
    (["--layers", "7"], r"layer 7 is outside \[0, 4\)"),
    (["--ops", "moe", "--layers", "0"], r"--ops moe: no chosen layer computes it"),
])
def test_bad_requests_name_the_culprit(capsys, tiny_nvfp4, tmp_path, argv, why):
    rc = main(["golden", "--ckpt-path", str(tiny_nvfp4), "--prompt", "hi there", "--out", str(tmp_path / "o"), *argv])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and re.search(why, err), err


def test_bad_ops_and_layers_are_input_errors():
    with pytest.raises(InputError, match="unknown op 'flash'"):
        parse_ops("rmsnorm,flash")
    with pytest.raises(InputError, match=r"layer 9 is outside \[0, 4\)"):
        parse_layers("1,9", 4)
    assert parse_ops(None) == (list(OPS), False) and parse_layers("0,2-3", 4) == [0, 2, 3]
