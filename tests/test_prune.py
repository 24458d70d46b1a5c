"""`minimax-ref prune`: selection by routed weight mass / frequency, the byte-level pruned checkpoint,
and its logits against the source with the dropped experts masked out of routing."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open

from minimax_ref.cli.main import main
from minimax_ref.errors import InputError
from minimax_ref.research.trace import Trace
from minimax_ref.weights.loader import load_model
from minimax_ref.weights.prune import check_keep, choose_experts, expert_scores, write_pruned

E, K, KEEP = 16, 4, 8  # the tiny preset: 16 experts, top-4
MOE_LAYERS = (1, 2, 3)
EXPERT = re.compile(r"^(.*\.block_sparse_moe\.experts\.)(\d+)(\..+)$")


@pytest.fixture(scope="module")
def src(tiny_nvfp4):
    return tiny_nvfp4


@pytest.fixture(scope="module")
def calib_ids():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (80, 33, 57)]


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory, calib_ids):
    path = tmp_path_factory.mktemp("calib") / "calib.jsonl"
    path.write_text("".join(json.dumps({"input_ids": ids, "completion_start": 1}) + "\n" for ids in calib_ids))
    return path


@pytest.fixture(scope="module")
def pruned(src, calib_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("pruned") / "out"
    rc = main(["prune", "--ckpt-path", str(src), "--keep", str(KEEP), "--calibration", str(calib_file),
               "--out", str(out), "--dtype", "float32", "--prefill-chunk", "40", "--batch-size", "2"])
    assert rc == 0
    return out


@pytest.fixture(scope="module")
def src_model(src):
    return load_model(src, dtype=torch.float32)


def _tensors(path) -> dict[str, bytes]:
    """Every tensor of a checkpoint folder as its raw bytes (read with safe_open, never decoded)."""
    index = json.loads((path / "model.safetensors.index.json").read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(path / shard), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                out[name] = (t.dtype, tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return out


def test_kept_and_untouched_tensors_are_byte_identical(src, pruned):
    kept = {int(L): ids for L, ids in json.loads((pruned / "pruning.json").read_text())["kept"].items()}
    a, b = _tensors(src), _tensors(pruned)
    expected = {}
    for name, value in a.items():
        m = EXPERT.match(name)
        layer = int(name.split(".layers.")[1].split(".")[0]) if ".layers." in name else None
        if m and layer in kept:
            e = int(m.group(2))
            if e in kept[layer]:
                expected[f"{m.group(1)}{kept[layer].index(e)}{m.group(3)}"] = value
        elif name.endswith(("block_sparse_moe.gate.weight", "block_sparse_moe.e_score_correction_bias")):
            dtype, shape, raw = value
            row = len(raw) // shape[0]
            rows = b"".join(raw[r * row:(r + 1) * row] for r in kept[layer])
            expected[name] = (dtype, (KEEP, *shape[1:]), rows)
        else:
            expected[name] = value
    assert set(b) == set(expected)
    for name in expected:
        assert b[name] == expected[name], name


def test_router_rows_are_the_kept_rows(src, pruned):
    kept = json.loads((pruned / "pruning.json").read_text())["kept"]
    name = "language_model.model.layers.2.block_sparse_moe.gate.weight"
    bias = "language_model.model.layers.2.block_sparse_moe.e_score_correction_bias"
    ws, wp = {}, {}
    for path, store in ((src, ws), (pruned, wp)):
        index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
        for n in (name, bias):
            with safe_open(str(path / index[n]), framework="pt") as f:
                store[n] = f.get_tensor(n)
    assert torch.equal(wp[name], ws[name][kept["2"]]) and torch.equal(wp[bias], ws[bias][kept["2"]])


def test_config_diff_is_num_local_experts_only(src, pruned):
    a = (src / "config.json").read_text().splitlines()
    b = (pruned / "config.json").read_text().splitlines()
    diff = [(x, y) for x, y in zip(a, b) if x != y]
    assert len(a) == len(b) and len(diff) == 1
    assert "num_local_experts" in diff[0][0] and diff[0][1].strip() == f'"num_local_experts": {KEEP},'
    ra, rb = json.loads("\n".join(a)), json.loads("\n".join(b))
    assert list(ra) == list(rb)  # key order kept
    rb["text_config"]["num_local_experts"] = E
    assert ra == rb  # quantization_config (naming experts that are gone) untouched


def test_pruning_record_index_and_other_files(src, pruned):
    rec = json.loads((pruned / "pruning.json").read_text())
    assert rec["source_num_experts"] == E and rec["method"] == "weight"
    assert sorted(rec["kept"]) == [str(L) for L in MOE_LAYERS]
    for ids in rec["kept"].values():
        assert ids == sorted(ids) and len(set(ids)) == KEEP and all(0 <= i < E for i in ids)
    index = json.loads((pruned / "model.safetensors.index.json").read_text())
    sizes = 0
    for shard in set(index["weight_map"].values()):
        with safe_open(str(pruned / shard), framework="pt") as f:
            assert all(index["weight_map"][n] == shard for n in f.keys())
            sizes += sum(f.get_tensor(n).numel() * f.get_tensor(n).element_size() for n in f.keys())
    assert index["metadata"]["total_size"] == sizes
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        assert (pruned / name).read_bytes() == (src / name).read_bytes()


def test_pruned_logits_equal_masked_source(pruned, src_model):
    kept = json.loads((pruned / "pruning.json").read_text())["kept"]
    model = load_model(pruned, dtype=torch.float32)
    assert model.text.num_local_experts == KEEP
    ids = torch.randint(0, 1000, (2, 100), generator=torch.Generator().manual_seed(3))
    t_src, t_pruned = Trace(layers=set()), Trace(layers=set())
    try:
        for L in MOE_LAYERS:
            mask = torch.zeros(E, dtype=torch.bool)
            mask[kept[str(L)]] = True
            src_model.layers[L].block_sparse_moe.gate.expert_mask = mask
        with torch.no_grad():
            want = src_model(ids, trace=t_src)
    finally:
        for L in MOE_LAYERS:
            src_model.layers[L].block_sparse_moe.gate.expert_mask = None
    with torch.no_grad():
        got = model(ids, trace=t_pruned)
        unmasked = src_model(ids)
    for L in MOE_LAYERS:  # the same experts chosen, under their new numbers
        renumber = torch.tensor(kept[str(L)])
        assert torch.equal(renumber[t_pruned.routing[L].expert_ids], t_src.routing[L].expert_ids)
    # Not bit-equal: the router matmul has another shape ([8, H] vs [16, H]), so routing weights
    # can differ in the last bit; everything downstream is the same computation.
    assert torch.allclose(got, want, rtol=0, atol=1e-5), float((got - want).abs().max())
    assert not torch.allclose(got, unmasked, atol=1e-3)  # pruning changed the model


def test_selection_matches_independent_routing_mass(src, src_model, calib_ids, pruned):
    """Weight mass tallied here from full forwards' Trace (no cache, one trace at a time)."""
    mass = {L: torch.zeros(E, dtype=torch.float64) for L in MOE_LAYERS}
    counts = {L: torch.zeros(E, dtype=torch.float64) for L in MOE_LAYERS}
    with torch.no_grad():
        for ids in calib_ids:
            tr = Trace(layers=set())
            src_model(torch.tensor([ids]), trace=tr)
            for L in MOE_LAYERS:
                r = tr.routing[L]
                for t in range(r.expert_ids.shape[0]):
                    for j in range(K):
                        mass[L][int(r.expert_ids[t, j])] += float(r.weights[t, j])
                        counts[L][int(r.expert_ids[t, j])] += 1
    got = expert_scores(src_model, calib_ids, "weight", batch_size=2, prefill_chunk=40)
    freq = expert_scores(src_model, calib_ids, "frequency", batch_size=3, prefill_chunk=2048)
    kept = json.loads((pruned / "pruning.json").read_text())["kept"]
    tokens = sum(len(i) for i in calib_ids)
    for L in MOE_LAYERS:
        assert torch.allclose(got[L], mass[L], atol=1e-4)
        assert torch.equal(freq[L], counts[L]) and float(freq[L].sum()) == tokens * K
        ranked = sorted(range(E), key=lambda e: (-float(mass[L][e]), e))
        assert kept[str(L)] == sorted(ranked[:KEEP])


def test_choose_experts_breaks_ties_by_lower_id():
    scores = torch.tensor([1.0, 3.0, 3.0, 0.0, 3.0, 2.0, 0.0, 0.0], dtype=torch.float64)
    assert choose_experts(scores, 2) == [1, 2]
    assert choose_experts(scores, 4) == [1, 2, 4, 5]
    assert choose_experts(torch.zeros(6, dtype=torch.float64), 3) == [0, 1, 2]


@pytest.mark.parametrize("keep, why", [(17, r"--keep 17 exceeds num_local_experts=16"),
                                       (3, r"--keep 3 is fewer than num_experts_per_tok=4")])
def test_bad_keep_is_an_input_error(capsys, src, calib_file, tmp_path, keep, why):
    with pytest.raises(InputError, match=why):
        check_keep(keep, E, K, "config.json")
    rc = main(["prune", "--ckpt-path", str(src), "--keep", str(keep), "--calibration", str(calib_file),
               "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and re.search(why, err) and "config.json" in err
    assert not (tmp_path / "o").exists()


def test_writer_refuses_non_empty_out_and_uneven_kept(src, tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    keep = {L: list(range(KEEP)) for L in MOE_LAYERS}
    with pytest.raises(InputError, match="not an empty folder"):
        write_pruned(src, tmp_path / "full", keep, "weight")
    with pytest.raises(InputError, match="every MoE layer"):
        write_pruned(src, tmp_path / "o", {1: list(range(8)), 2: list(range(6)), 3: list(range(8))}, "weight")
