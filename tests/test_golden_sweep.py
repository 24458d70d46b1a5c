"""`golden --op OP --sweep`: several shapes (odd, ragged, single rows) and seeds in one bundle, a kernel test
parametrized over it; MoE operands as kernels take them (stacked [E, ...], routing padded to blocks) without a byte
stored twice; every file of a bundle with the manifest's permissions."""

from __future__ import annotations

import atexit
import importlib.util
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from golden_example import check_manifest
from safetensors import safe_open

from minimax_ref import golden
from minimax_ref.cli.main import main
from minimax_ref.golden.single_ops import SWEEP_SEEDS, SWEEPS

EXAMPLE = Path(__file__).parents[1] / "examples" / "kernel_test"
_spec = importlib.util.spec_from_file_location("numpy_ops_sweep", EXAMPLE / "numpy_ops.py")
NP = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(NP)

# Exported when the module is collected, so that `golden.parametrize` can list their entries, as a user's suite does.
SWEEP = Path(tempfile.mkdtemp(prefix="golden-sweep-"))
atexit.register(shutil.rmtree, SWEEP, True)
golden.export_op("nvfp4_linear", SWEEP / "nvfp4", sweep=True, seed=5)
golden.export_op("msa_decode", SWEEP / "msa", sweep=True, page_size=32)


@golden.parametrize(SWEEP / "nvfp4")
def test_a_gemm_over_the_sweep(golden_entry):
    t = golden_entry.inputs
    w = NP.nvfp4_weight(t["w1.weight"].numpy(), t["w1.weight_scale"].view(torch.uint8).numpy(),
                        float(t["w1.weight_scale_2"]))
    y = torch.from_numpy(t["x"].double().numpy() @ w.T.astype(np.float64)).float()
    r = golden.compare(golden_entry, {"y": y})
    assert r.ok, str(r)


@golden.parametrize(SWEEP / "msa")
def test_msa_decode_over_the_sweep(golden_entry):
    r = golden.compare(golden_entry, NP.run(golden_entry))
    assert r.ok, str(r)


def test_the_sweep_covers_its_shapes_and_seeds():
    entries = golden.load(SWEEP / "nvfp4")
    got = {(tuple(e.params["shape"].values()), e.params["seed"]) for e in entries}
    want = {(tuple(int(d) for d in s.split(",")), seed) for s in SWEEPS["nvfp4_linear"] for seed in range(5, 8)}
    assert got == want and len(entries) == len(SWEEPS["nvfp4_linear"]) * SWEEP_SEEDS
    assert any(m % 2 for m, _, _ in (s for s, _ in got)) and any(n % 128 for _, n, _ in (s for s, _ in got))
    assert any((k // 16) % 2 for _, _, k in (s for s, _ in got))  # an odd number of scale blocks per row
    assert {e.id for e in entries} >= {"nvfp4_linear/layer000_op.7x200x96-s6"}
    same_shape = [e for e in entries if e.params["shape"] == {"M": 7, "N": 200, "K": 96}]
    assert len({bytes(e.inputs["w1.weight"].numpy()) for e in same_shape}) == SWEEP_SEEDS  # the seeds differ
    ctx = [e.params["context"] for e in golden.load(SWEEP / "msa", ops=["msa"])]
    assert [1] in ctx and any(len(set(c)) > 1 for c in ctx)  # a length-1 row, ragged rows
    for path in (SWEEP / "nvfp4", SWEEP / "msa"):
        check_manifest(path)


@pytest.mark.parametrize("op", ["mxfp8_linear", "router", "moe"])
def test_sweep_from_the_cli(capsys, tmp_path, op):
    out = tmp_path / "b"
    assert main(["golden", "--op", op, "--sweep", "--out", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["entries"] == len(SWEEPS[op]) * SWEEP_SEEDS
    for e in golden.load(out):
        r = golden.compare(e, NP.run(e))
        assert r.ok, str(r)
    assert main(["golden", "--replay", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["mismatches"] == []
    assert main(["golden", "--op", op, "--sweep", "--shape", "1,2,3", "--out", str(tmp_path / "c")]) == 2
    assert "--sweep takes the op's own shapes" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ MoE operands


def test_align_block_size_by_hand():
    """vLLM's moe_align_block_size on 3 tokens x top-2 over 4 experts, blocks of 2, worked by hand: pairs (flat
    index t * 2 + k) 0:e2 1:e0 2:e0 3:e2 4:e3 5:e0; expert 0 -> 1 2 5 + pad, expert 1 -> none, expert 2 -> 0 3,
    expert 3 -> 4 + pad (pad value 6 = 3 * 2)."""
    from minimax_ref.golden.operands import align_block_size, grouped_metadata

    ids = torch.tensor([[2, 0], [0, 2], [3, 0]])
    sorted_ids, experts, n = align_block_size(ids, 4, 2)
    assert sorted_ids.tolist() == [1, 2, 5, 6, 0, 3, 4, 6]
    assert experts.tolist() == [0, 0, 2, 3] and n.tolist() == [8]
    tokens, offsets = grouped_metadata(ids, 4)
    assert tokens.tolist() == [0, 1, 2, 0, 1, 2] and offsets.tolist() == [0, 3, 3, 5, 6]


@pytest.fixture(scope="module")
def moe_bundle(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe") / "b"
    golden.export_op("moe", out, shape="13,6,64,32", stacked=True, align_block=4)
    return out


def test_stacked_operands_and_padded_routing(moe_bundle):
    [e] = golden.load(moe_bundle)
    t, E, top_k = e.inputs, 6, e.params["top_k"]
    assert tuple(t["w13.weight"].shape) == (E, 64, 32) and tuple(t["w2.weight_scale_2"].shape) == (E,)
    for x in range(E):
        p = f"experts.{x}."
        assert torch.equal(t["w13.weight"][x], torch.cat([t[p + "w1.weight"], t[p + "w3.weight"]]))
        assert torch.equal(t["w13.weight_scale"][x].view(torch.uint8),
                           torch.cat([t[p + "w1.weight_scale"], t[p + "w3.weight_scale"]]).view(torch.uint8))
        assert t["w13.weight_scale_2"][x].tolist() == [float(t[p + "w1.weight_scale_2"]),
                                                       float(t[p + "w3.weight_scale_2"])]
        assert torch.equal(t["w2.weight"][x], t[p + "w2.weight"])
    ids, _, _ = NP.router(t["x"].numpy(), t["gate_weight"].numpy(), t["bias"].numpy(), top_k)
    assert np.array_equal(t["topk_ids"].numpy(), ids)
    flat = ids.reshape(-1)
    # align.*: rebuilt here from the flat pair list, expert by expert
    want, blocks = [], []
    for x in range(E):
        pairs = [i for i, v in enumerate(flat) if v == x]
        if pairs:
            pad = -len(pairs) % 4
            want += pairs + [flat.size] * pad
            blocks += [x] * ((len(pairs) + pad) // 4)
    assert t["align.sorted_token_ids"].tolist() == want and t["align.expert_ids"].tolist() == blocks
    assert t["align.num_tokens_post_padded"].tolist() == [len(want)]
    off = t["expert_offsets"].tolist()
    for x in range(E):
        assert t["sorted_token_ids"][off[x]:off[x + 1]].tolist() == [i // top_k for i, v in enumerate(flat) if v == x]
    # a grouped GEMM over the stacked operands and the padded routing gives the reference's y
    W13 = [NP.nvfp4_weight(t["w13.weight"][x].numpy(), t["w13.weight_scale"][x].view(torch.uint8).numpy(), 1.0)
           * np.repeat(t["w13.weight_scale_2"][x].numpy(), 32)[:, None] for x in range(E)]
    W2 = [NP.nvfp4_weight(t["w2.weight"][x].numpy(), t["w2.weight_scale"][x].view(torch.uint8).numpy(),
                          float(t["w2.weight_scale_2"][x])) for x in range(E)]
    x_np, weights = t["x"].double().numpy(), t["topk_weights"].double().numpy().reshape(-1)
    y = np.zeros_like(x_np)
    for b, ex in enumerate(t["align.expert_ids"].tolist()):
        rows = [i for i in t["align.sorted_token_ids"][b * 4:(b + 1) * 4].tolist() if i < flat.size]
        gu = x_np[[i // top_k for i in rows]] @ W13[ex].T.astype(np.float64)
        h = NP.swiglu_oai(gu[:, :32], gu[:, 32:], e.params["alpha"], e.params["limit"])
        y[[i // top_k for i in rows]] += (h @ W2[ex].T.astype(np.float64)) * weights[rows, None]
    r = golden.compare(e, {"y": torch.from_numpy(y * e.params["scaling"]).float()})
    assert r.ok, str(r)


def test_no_weight_is_stored_twice(moe_bundle):
    m = json.loads((moe_bundle / "manifest.json").read_text())
    [w] = m["weights_files"]
    with safe_open(str(moe_bundle / w["file"]), framework="pt") as f:
        keys = set(f.keys())
    assert not any("w13" in k for k in keys)  # the fused and stacked operands are joins of the stored ones
    assert keys == {f"experts.{x}.{leaf}.{part}" for x in range(6) for leaf in ("w1", "w2", "w3")
                    for part in ("weight", "weight_scale", "weight_scale_2", "input_scale")}
    stored = json.dumps(m["entries"][0]["tensors"]["w13.weight"]["stored"])
    assert '"cat"' in stored and '"stack"' in stored
    with safe_open(str(moe_bundle / m["entries"][0]["file"]), framework="pt") as f:
        assert not any(m["entries"][0]["tensors"][k]["role"] == "weight" for k in f.keys())
    check_manifest(moe_bundle)


def test_bundle_files_have_the_manifest_permissions(moe_bundle):
    mode = (moe_bundle / "manifest.json").stat().st_mode & 0o777
    files = list(moe_bundle.rglob("*.safetensors"))
    assert len(files) == 2 and all(f.stat().st_mode & 0o777 == mode for f in files)


def test_model_driven_moe_entries_stack_their_used_experts(tmp_path, capsys):
    out = tmp_path / "b"
    assert main(["golden", "--synthetic-weights", "tiny", "--prompt", "stacked experts and padded routing",
                 "--ops", "moe", "--layers", "1", "--decode-steps", "1", "--stacked", "--align-block", "4",
                 "--out", str(out)]) == 0
    capsys.readouterr()
    check_manifest(out)
    for e in golden.load(out):
        t, used = e.inputs, e.params["used_experts"]
        assert tuple(t["w13.weight"].shape)[0] == len(used) and e.params["align_block"] == 4
        for i, x in enumerate(used):
            assert torch.equal(t["w13.weight"][i], t[f"experts.{x}.w13.weight"])
            assert torch.equal(t["w2.weight_scale_2"][i], t[f"experts.{x}.w2.weight_scale_2"])
        flat = t["topk_ids"].reshape(-1).tolist()
        ids = t["align.sorted_token_ids"].tolist()
        for b, local in enumerate(t["align.expert_ids"].tolist()):  # each block's pairs are its expert's
            pairs = [i for i in ids[b * 4:(b + 1) * 4] if i < len(flat)]
            assert pairs and all(flat[i] == used[local] for i in pairs)
        assert sorted(i for i in ids if i < len(flat)) == list(range(len(flat)))  # every pair once
        r = golden.compare(e, NP.run(e))
        assert r.ok, str(r)
    assert main(["golden", "--replay", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["mismatches"] == []
    assert main(["golden", "--synthetic-weights", "tiny", "--prompt", "x", "--ops", "router", "--stacked",
                 "--out", str(tmp_path / "c")]) == 2
    assert "add moe to --ops" in capsys.readouterr().err
