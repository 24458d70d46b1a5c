"""Config parsing, the checkpoint reader, validation errors and the synthetic writer."""

from __future__ import annotations

import dataclasses
import json
import shutil
import struct

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from minimax_ref.cli.main import main
from minimax_ref.errors import CheckpointError, ConfigError
from minimax_ref.model.config import load_model_config, parse_model_config
from minimax_ref.weights.checkpoint import check_scales, open_checkpoint
from minimax_ref.weights.loader import load_model
from minimax_ref.weights.synth import build_config, plan_tensors, write_checkpoint

LAYER1 = "language_model.model.layers.1."


def _copy(src, tmp_path, name="ck"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def _shard_of(path, name):
    return json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][name]


def _rewrite(path, name, fn):
    """Apply fn(dict of the shard's tensors) to the shard holding `name`, in place."""
    shard = path / _shard_of(path, name)
    tensors = load_file(str(shard))
    fn(tensors)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index = json.loads((path / "model.safetensors.index.json").read_text())
    for n in list(index["weight_map"]):
        if index["weight_map"][n] == shard.name and n not in tensors:
            del index["weight_map"][n]
    for n in tensors:
        index["weight_map"][n] = shard.name
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


# ------------------------------------------------------------------ config


def test_raw_and_transformers_flat_config_parse_the_same():
    from transformers.models.minimax_m3_vl import MiniMaxM3VLConfig

    raw = build_config("tiny-vl", "bf16")
    flat = MiniMaxM3VLConfig(**{k: raw[k] for k in ("text_config", "vision_config")}).to_dict()
    assert "layer_types" in flat["text_config"] and "sparse_attention_config" not in flat["text_config"]
    a, b = parse_model_config(raw), parse_model_config(flat)
    # transformers fills in its class defaults for bos/eos; everything else must agree
    assert dataclasses.replace(a.text, bos_token_id=None, eos_token_id=()) == \
        dataclasses.replace(b.text, bos_token_id=None, eos_token_id=())
    assert a.vision == b.vision
    assert a.text.sparse_layers == (False, True, True, True) and a.text.moe_layers == (False, True, True, True)


@pytest.mark.parametrize("field,value", [
    ("sparse_score_type", "mean"), ("rope_scaling", {"type": "yarn"}), ("attention_output_gate", True),
    ("swiglu_beta", 2.0), ("scoring_func", "softmax"), ("sparse_num_index_heads", 1), ("qk_norm_type", "shared"),
])
def test_unsupported_config_values_are_rejected_by_name(field, value):
    raw = build_config("tiny", "bf16", overrides={field: value})
    with pytest.raises(ConfigError) as e:
        parse_model_config(raw)
    assert field.replace("sparse_num_index_heads", "sparse_num_index_heads") in str(e.value)
    assert repr(value) in str(e.value) or str(value) in str(e.value)


def test_layer_schedule_comes_from_frequency_lists():
    raw = build_config("tiny", "bf16")
    raw["text_config"]["moe_layer_freq"] = [0, 1, 0, 1]
    raw["text_config"]["sparse_attention_config"]["sparse_attention_freq"] = [0, 0, 1, 1]
    raw["text_config"]["sparse_attention_config"]["sparse_disable_index_value"] = [0, 0, 1, 1]
    t = parse_model_config(raw).text
    assert t.moe_layers == (False, True, False, True) and t.sparse_layers == (False, False, True, True)


def test_absent_routed_scaling_factor_is_the_release_value_as_in_transformers(ckpt_factory, tmp_path):
    from tests.oracle import hf_text_model, relative_max_error

    ck = _copy(ckpt_factory("tiny", "nvfp4"), tmp_path)
    cfg = json.loads((ck / "config.json").read_text())
    del cfg["text_config"]["routed_scaling_factor"]
    (ck / "config.json").write_text(json.dumps(cfg))
    model = load_model(ck, dtype=torch.float32)
    assert model.config.text.routed_scaling_factor == 2.0  # model.md's release value
    ids = torch.randint(0, model.config.text.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # transformers, given the same config without the field, computes the same logits
        assert relative_max_error(model(ids), hf_text_model(model)(ids).logits) < 1e-4


def test_rotary_dim_disagreeing_with_partial_rotary_factor_names_both():
    raw = build_config("tiny", "bf16")
    head_dim = raw["text_config"]["head_dim"]
    raw["text_config"].update(rotary_dim=head_dim // 2, partial_rotary_factor=1.0)
    with pytest.raises(ConfigError, match=r"rotary_dim=.* disagrees with partial_rotary_factor=1\.0"):
        parse_model_config(raw)
    raw["text_config"]["partial_rotary_factor"] = 0.5  # agreeing: accepted
    assert parse_model_config(raw).text.rotary_dim == head_dim // 2


def test_image_token_compression_must_agree_with_the_vision_config():
    raw = build_config("tiny-vl", "bf16")
    parse_model_config(raw)
    raw["img_token_compression_config"]["spatial_merge_size"] = 3
    with pytest.raises(ConfigError, match=r"img_token_compression_config.spatial_merge_size=3 disagrees with "
                                          r"vision_config.spatial_merge_size=2"):
        parse_model_config(raw)


def test_missing_required_fields_are_named_together():
    raw = build_config("tiny", "bf16")
    del raw["text_config"]["num_hidden_layers"], raw["text_config"]["num_attention_heads"]
    with pytest.raises(ConfigError, match="num_hidden_layers.*num_attention_heads"):
        parse_model_config(raw)
    with pytest.raises(ConfigError, match="no text model: neither a 'text_config' object"):
        parse_model_config({"model_type": "minimax_m3_vl", "vision_config": raw.get("vision_config")})


def test_default_cache_length_is_capped_by_max_position_embeddings(ckpt_factory, tmp_path):
    ck = _copy(ckpt_factory("tiny", "nvfp4"), tmp_path)
    cfg = json.loads((ck / "config.json").read_text())
    cfg["text_config"]["max_position_embeddings"] = 96
    (ck / "config.json").write_text(json.dumps(cfg))
    assert load_model(ck, dtype=torch.float32).max_seq_len == 96  # the default 4096, capped
    assert load_model(ck, dtype=torch.float32, max_seq_len=64).max_seq_len == 64
    with pytest.raises(ConfigError, match="max_seq_len .*--max-model-len.*=200 exceeds the model's "
                                          "max_position_embeddings=96"):
        load_model(ck, dtype=torch.float32, max_seq_len=200)


def _hf_quant_config(ck, quantization: dict) -> None:
    """ModelOpt's layout: the quantization config under "quantization", beside a producer."""
    (ck / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt", "version": "0.37"},
                                                         "quantization": quantization}))


def test_hf_quant_config_alone_describes_the_quantization(tiny_nvfp4, tmp_path):
    ck = _copy(tiny_nvfp4, tmp_path)
    cfg = json.loads((ck / "config.json").read_text())
    quant = cfg.pop("quantization_config")
    (ck / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="config.json has no quantization_config"):
        open_checkpoint(ck)
    _hf_quant_config(ck, {k: v for k, v in quant.items() if k != "quant_method"})
    a = load_model(ck, dtype=torch.float32)
    b = load_model(tiny_nvfp4, dtype=torch.float32)
    ids = torch.arange(1, 30)[None]
    with torch.no_grad():
        assert torch.equal(a(ids), b(ids))


def test_hf_quant_config_disagreeing_with_config_json_is_reported(tiny_nvfp4, tmp_path):
    ck = _copy(tiny_nvfp4, tmp_path)
    quant = json.loads((ck / "config.json").read_text())["quantization_config"]
    _hf_quant_config(ck, dict(quant))  # the same: accepted
    open_checkpoint(ck)
    layers = dict(quant["quantized_layers"])
    layers[LAYER1 + "self_attn.q_proj"] = {"quant_algo": "NVFP4", "group_size": 16}
    _hf_quant_config(ck, {**quant, "quantized_layers": layers, "quant_algo": "NVFP4"})
    with pytest.raises(CheckpointError) as e:  # a checkpoint problem, listed with the others
        open_checkpoint(ck)
    msg = str(e.value)
    assert "hf_quant_config.json" in msg and "quant_algo ('MIXED_PRECISION' in config.json, 'NVFP4' here)" in msg
    assert "quantized_layers (1 entries differ" in msg and LAYER1 + "self_attn.q_proj" in msg
    with pytest.raises(ConfigError) as e:  # the config alone (generate and plan read it first): one error, all keys
        load_model_config(ck)
    assert "quant_algo ('MIXED_PRECISION'" in str(e.value) and "quantized_layers (1 entries" in str(e.value)


def test_inspect_lists_every_hf_quant_config_problem_with_the_others(tiny_nvfp4, tmp_path, capsys):
    """`inspect` of a folder whose hf_quant_config.json disagrees with config.json on two keys and holds a key no
    ModelOpt config has, with a tensor missing besides: every problem listed together (one line each, exit 1),
    not the first disagreement alone as an error."""
    ck = _copy(tiny_nvfp4, tmp_path)
    quant = json.loads((ck / "config.json").read_text())["quantization_config"]
    layers = dict(quant["quantized_layers"])
    layers[LAYER1 + "self_attn.q_proj"] = {"quant_algo": "NVFP4", "group_size": 16}
    _hf_quant_config(ck, {**quant, "quantized_layers": layers, "quant_algo": "NVFP4", "calibration": "mse"})
    missing = LAYER1 + "self_attn.k_norm.weight"
    _rewrite(ck, missing, lambda t: t.pop(missing))
    assert main(["inspect", str(ck), "--quick", "--output-format", "json"]) == 1
    problems = json.loads(capsys.readouterr().out)["problems"]
    hf = str(ck / "hf_quant_config.json")
    assert sum(p.startswith(hf) for p in problems) == 3, problems
    assert any("quant_algo ('MIXED_PRECISION' in config.json, 'NVFP4' here)" in p for p in problems)
    assert any("quantized_layers (1 entries differ" in p and LAYER1 + "self_attn.q_proj" in p for p in problems)
    assert any("unknown keys ['calibration']" in p for p in problems)
    assert any(missing in p for p in problems)
    with pytest.raises(CheckpointError) as e:  # loading refuses with the same list
        open_checkpoint(ck)
    assert len(e.value.problems) == len(problems)


# ------------------------------------------------------------------ reader and decoding


def _e2m1_reference(packed: np.ndarray) -> np.ndarray:
    """Independent NVFP4 element decode: low nibble = even element, codes via ml_dtypes' float4_e2m1fn."""
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], -1).astype(np.uint8)
    return codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)


def test_reader_decodes_nvfp4_expert_like_an_independent_decode(tiny_nvfp4):
    ck = open_checkpoint(tiny_nvfp4)
    prefix = LAYER1 + "block_sparse_moe.experts.5.w2"
    assert ck.formats[prefix].fmt == "nvfp4"
    with safe_open(str(tiny_nvfp4 / _shard_of(tiny_nvfp4, prefix + ".weight")), "pt") as f:
        packed = f.get_tensor(prefix + ".weight").numpy()
    with safe_open(str(tiny_nvfp4 / _shard_of(tiny_nvfp4, prefix + ".weight_scale")), "pt") as f:
        scale = f.get_tensor(prefix + ".weight_scale").view(torch.uint8).numpy()
    with safe_open(str(tiny_nvfp4 / _shard_of(tiny_nvfp4, prefix + ".weight_scale_2")), "pt") as f:
        g = float(f.get_tensor(prefix + ".weight_scale_2"))
    elems = _e2m1_reference(packed)
    block = scale.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    expected = elems * np.repeat(block * np.float32(g), 16, axis=1)
    got = ck.read_linear(prefix).numpy()
    np.testing.assert_array_equal(got, expected)
    # a K slice (tensor-parallel style) equals the same columns of the full decode
    np.testing.assert_array_equal(ck.read_linear(prefix, cols=slice(32, 64)).numpy(), expected[:, 32:64])


def test_reader_decodes_mxfp8_like_an_independent_decode(ckpt_factory):
    path = ckpt_factory("tiny", "mxfp8")
    ck = open_checkpoint(path)
    prefix = LAYER1 + "self_attn.q_proj"
    assert ck.formats[prefix].fmt == "mxfp8"
    with safe_open(str(path / _shard_of(path, prefix + ".weight")), "pt") as f:
        w = f.get_tensor(prefix + ".weight").view(torch.uint8).numpy()
    with safe_open(str(path / _shard_of(path, prefix + ".weight_scale_inv")), "pt") as f:
        s = f.get_tensor(prefix + ".weight_scale_inv").numpy()
    expected = w.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * np.repeat(
        np.exp2(s.astype(np.float32) - 127), 32, axis=1)
    np.testing.assert_array_equal(ck.read_linear(prefix).numpy(), expected)
    np.testing.assert_array_equal(ck.read_linear(prefix, rows=slice(64, 128)).numpy(), expected[64:128])


def test_bf16_reader_and_family_formats(tiny_bf16, tiny_nvfp4):
    fams = open_checkpoint(tiny_nvfp4).family_formats()
    assert fams["routed_expert"] == {"nvfp4"} and fams["attention"] == {"mxfp8"}
    assert fams["indexer"] == {"mxfp8"} and fams["lm_head"] == {"bf16"} and fams["router"] == {"f32"}
    assert open_checkpoint(tiny_bf16).family_formats()["routed_expert"] == {"bf16"}


def test_alternative_spellings_load_to_the_same_logits(tiny_nvfp4, tmp_path):
    """compressed-tensors NVFP4 names (reciprocal globals), MXFP8 scales named weight_scale and stored
    as F8_E8M0, and a bf16 selection bias all decode to the same model (up to the reciprocal's
    rounding: 1 / (1 / s) is s within one fp32 ulp)."""
    alt = _copy(tiny_nvfp4, tmp_path, "alt")
    index = json.loads((alt / "model.safetensors.index.json").read_text())
    for shard in sorted(set(index["weight_map"].values())):
        t = load_file(str(alt / shard))
        out = {}
        for name, v in t.items():
            if name.endswith(".weight_scale_inv"):
                out[name.replace("weight_scale_inv", "weight_scale")] = v.view(torch.float8_e8m0fnu)
            elif ".experts." in name and name.endswith(".weight") and v.dtype == torch.uint8:
                out[name.replace(".weight", ".weight_packed")] = v
            elif name.endswith(".weight_scale_2"):
                out[name.replace("weight_scale_2", "weight_global_scale")] = (1.0 / v).reshape(1)
            elif name.endswith(".input_scale"):
                out[name.replace("input_scale", "input_global_scale")] = (1.0 / v).reshape(1)
            elif name.endswith("e_score_correction_bias"):
                out[name] = v.bfloat16()  # routers may be stored bf16; values chosen exact in bf16 below
            else:
                out[name] = v
        save_file(out, str(alt / shard), metadata={"format": "pt"})
        for name in t:
            index["weight_map"].pop(name)
        index["weight_map"].update({n: shard for n in out})
    (alt / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = json.loads((alt / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "mixed-precision",
        "config_groups": {
            "g0": {"targets": ["re:.*experts\\.\\d+\\.w[123]$"],
                   "weights": {"num_bits": 4, "group_size": 16, "type": "float"}},
            "g1": {"targets": ["re:.*(self_attn|mlp|shared_experts)\\.[a-z_]+_proj$"],
                   "weights": {"num_bits": 8, "group_size": 32, "type": "float"}}},
        "ignore": ["language_model.lm_head"]}
    (alt / "config.json").write_text(json.dumps(cfg))
    ck = open_checkpoint(alt)
    assert ck.formats[LAYER1 + "block_sparse_moe.experts.0.w1"].compressed_tensors
    ids = torch.randint(0, 1000, (1, 50), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = load_model(alt, dtype=torch.float32)(ids)
        m = load_model(tiny_nvfp4, dtype=torch.float32)
        for layer in m.layers[1:]:
            bias = layer.block_sparse_moe.gate.e_score_correction_bias
            bias.copy_(bias.bfloat16().float())
        b = m(ids)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ bad input


def _problem(path, *needles):
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(path)
    msg = str(e.value)
    for n in needles:
        assert n in msg, msg
    return e.value


def test_missing_tensor(tiny_nvfp4, tmp_path):
    ck = _copy(tiny_nvfp4, tmp_path)
    name = LAYER1 + "self_attn.k_norm.weight"
    _rewrite(ck, name, lambda t: t.pop(name))
    _problem(ck, "missing tensor", name)


def test_a_missing_quantized_weight_is_one_problem_not_its_scales_as_unexpected(tiny_nvfp4, tmp_path):
    ck = _copy(tiny_nvfp4, tmp_path)
    name = LAYER1 + "self_attn.q_proj.weight"
    _rewrite(ck, name, lambda t: t.pop(name))
    err = _problem(ck, "missing tensor " + name)
    assert not any("unexpected" in p for p in err.problems), err.problems


def test_a_packed_weight_of_another_integer_dtype_names_the_dtype_it_needs(tiny_nvfp4, tmp_path):
    ck = _copy(tiny_nvfp4, tmp_path)
    name = "language_model.model.layers.2.block_sparse_moe.experts.0.w2.weight"

    def as_int8(t):
        t[name] = t[name].view(torch.int8)
    _rewrite(ck, name, as_int8)
    err = _problem(ck, f"{name} in", "dtype I8, expected U8")
    assert len(err.problems) == 1, err.problems


def test_tensors_of_another_layer_schedule_say_what_the_config_makes_the_layer(tiny_bf16, tmp_path):
    """A config whose layer schedule disagrees with the shards (a layer dense in moe_layer_freq, MSA switched off by
    use_sparse_attention=false) names, on each unexpected tensor, what the config makes that layer."""
    ck = _copy(tiny_bf16, tmp_path)
    raw = json.loads((ck / "config.json").read_text())
    raw["text_config"]["moe_layer_freq"] = [0, 0, 1, 1]
    raw["text_config"]["sparse_attention_config"]["use_sparse_attention"] = False
    (ck / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError) as e:
        load_model(ck)
    unexpected = [p for p in e.value.problems if p.startswith("unexpected tensor")]
    moe = [p for p in unexpected if LAYER1 + "block_sparse_moe." in p]
    index = [p for p in unexpected if LAYER1 + "self_attn.index_" in p]
    assert moe and all(p.endswith("(an MoE tensor, but config.json makes layer 1 a dense-MLP layer)") for p in moe)
    assert index and all("use_sparse_attention is false, which makes every layer dense attention" in p
                         for p in index)
    assert len(moe) + len(index) + sum("layers.2." in p or "layers.3." in p for p in unexpected) == len(unexpected)


def test_extra_unknown_tensor_and_ignored_mtp(tiny_nvfp4, tmp_path):
    ck = _copy(tiny_nvfp4, tmp_path)
    name = LAYER1 + "self_attn.q_norm.weight"
    extra = LAYER1 + "self_attn.sink_bias"
    mtp = "language_model.model.mtp.layers.0.enorm.weight"

    def add(t):
        t[extra] = torch.zeros(4, dtype=torch.bfloat16)
        t[mtp] = torch.zeros(128, dtype=torch.bfloat16)

    _rewrite(ck, name, add)
    err = _problem(ck, "unexpected tensor", extra)
    assert not any(mtp in p for p in err.problems), "mtp keys are ignored, not reported"


def test_wrong_shape_and_wrong_dtype_reported_together(tiny_nvfp4, tmp_path):
    ck = _copy(tiny_nvfp4, tmp_path)
    a = LAYER1 + "self_attn.o_proj.weight"
    b = "language_model.model.norm.weight"

    def break_(t):
        t[a] = t[a][:, :-32].contiguous()
    _rewrite(ck, a, break_)

    def break_dtype(t):
        t[b] = t[b].to(torch.float16).to(torch.int16)
    _rewrite(ck, b, break_dtype)
    err = _problem(ck, a, "shape", b, "dtype I16")
    assert len(err.problems) >= 2


def test_truncated_shard(tiny_nvfp4, tmp_path):
    ck = _copy(tiny_nvfp4, tmp_path)
    shard = ck / _shard_of(ck, LAYER1 + "self_attn.q_proj.weight")
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 1000])
    _problem(ck, shard.name, "truncated")


def test_index_points_at_missing_file(tiny_nvfp4, tmp_path):
    ck = _copy(tiny_nvfp4, tmp_path)
    index = json.loads((ck / "model.safetensors.index.json").read_text())
    name = LAYER1 + "self_attn.q_proj.weight"
    index["weight_map"][name] = "model-99999-of-99999.safetensors"
    (ck / "model.safetensors.index.json").write_text(json.dumps(index))
    _problem(ck, "model-99999-of-99999.safetensors", "does not exist")


# ------------------------------------------------------------------ a damaged shard: the cause first, no cascade


def _shards(path):
    """shard file name -> the tensor names the index maps to it, in file order."""
    out: dict[str, list[str]] = {}
    for name, shard in json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].items():
        out.setdefault(shard, []).append(name)
    return dict(sorted(out.items()))


def _damage(shard, how):
    """Damage one shard file in place as a user's copy gets damaged."""
    data = shard.read_bytes()
    if how == "truncated":  # `truncate -s 50%`
        shard.write_bytes(data[: len(data) // 2])
    elif how == "header-json":  # bytes after the 8-byte length overwritten
        shard.write_bytes(data[:8] + b"XXXX" + data[12:])
    elif how == "header-length":  # the length itself overwritten
        shard.write_bytes(struct.pack("<Q", 2**63 - 1) + data[8:])
    elif how == "header-entry":  # valid JSON of the same length, but not tensor descriptions (was a TypeError)
        (n,) = struct.unpack("<Q", data[:8])
        shard.write_bytes(data[:8] + b'{"a": 1}'.ljust(n) + data[8 + n:])
    elif how == "deleted":
        shard.unlink()
    else:
        raise AssertionError(how)


DAMAGE_CAUSE = {
    "truncated": "the file is truncated: its tensors need",
    "header-json": "the safetensors header is not valid JSON (damaged or not a safetensors file)",
    "header-length": "the safetensors header length (9223372036854775807 bytes) exceeds the file size",
    "header-entry": "the safetensors header's entry 'a' is not a tensor description",
    "deleted": "the file does not exist, but model.safetensors.index.json maps",
}


@pytest.fixture
def damaged(tiny_nvfp4, tmp_path):
    """damaged(how) -> (checkpoint copy, name of its first shard, the tensors that shard held), the shard damaged."""
    def make(how):
        ck = _copy(tiny_nvfp4, tmp_path, how)
        shard, held = next(iter(_shards(ck).items()))
        _damage(ck / shard, how)
        return ck, shard, held
    return make


@pytest.mark.parametrize("how", ["truncated", "header-json", "header-length", "header-entry", "deleted"])
def test_a_damaged_shard_is_the_headline_of_load_model(damaged, how):
    """`mr.load_model` on a damaged shard: the shard (full path) and what is wrong with it come first, with the
    count of the tensors it held; those tensors are not listed as missing, as if the config were wrong."""
    import minimax_ref as mr

    ck, shard, held = damaged(how)
    with pytest.raises(CheckpointError) as e:
        mr.load_model(ck)
    msg = str(e.value)
    assert msg.splitlines()[0].startswith(f"{ck / shard}: {DAMAGE_CAUSE[how]}"), msg
    assert f"{len(held)} tensors" in msg.splitlines()[0], msg
    assert "does not match its config.json" not in msg and "missing tensor" not in msg, msg
    assert "Expecting value" not in msg, msg
    assert len(msg.splitlines()) == 1 and len(e.value.problems) == 1, msg
    assert e.value.problems[0].startswith(f"{shard}: {DAMAGE_CAUSE[how]}"), e.value.problems


@pytest.mark.parametrize("how", ["truncated", "header-json", "header-length"])
def test_a_damaged_shard_is_one_error_line_of_the_cli(damaged, capsys, how):
    ck, shard, held = damaged(how)
    capsys.readouterr()
    assert main(["generate", "--ckpt-path", str(ck), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"error: {ck / shard}: {DAMAGE_CAUSE[how]}"), err
    assert f"the {len(held)} tensors model.safetensors.index.json maps to it cannot be read" in lines[0], err
    assert "re-download" in lines[0] and "does not match its config.json" not in err, err


def test_inspect_of_a_truncated_shard_prints_the_cause_and_the_count(damaged, capsys):
    ck, shard, held = damaged("truncated")
    capsys.readouterr()
    assert main(["inspect", str(ck)]) == 1
    out = capsys.readouterr().out.splitlines()
    at = out.index("problems    1")
    assert out[at + 1].startswith(f"  - {shard}: the file is truncated: its tensors need"), out
    assert f"the {len(held)} tensors" in out[at + 1] and len(out) == at + 2, out  # no cascade below it
    assert not any("missing tensor" in line for line in out), out
    assert main(["inspect", str(ck), "--output-format", "json"]) == 1
    problems = json.loads(capsys.readouterr().out)["problems"]
    assert len(problems) == 1 and problems[0].startswith(f"{shard}: the file is truncated"), problems


def test_problems_besides_a_damaged_shard_are_still_reported(tiny_nvfp4, tmp_path, capsys):
    """A genuinely missing tensor and an unexpected one in the intact shard, and a config mismatch, are listed
    (collected together, as without the damage) below the damaged shard's line."""
    ck = _copy(tiny_nvfp4, tmp_path)
    (first, _), (second, held) = list(_shards(ck).items())[:2]
    gone = next(n for n in held if n.endswith(".weight_scale"))
    extra = LAYER1 + "self_attn.bogus.weight"
    _rewrite(ck, gone, lambda t: (t.pop(gone), t.__setitem__(extra, torch.zeros(2))))
    cfg = json.loads((ck / "config.json").read_text())
    layers = cfg["quantization_config"]["quantized_layers"]
    mxfp8 = next(k for k, v in layers.items() if v["quant_algo"] == "MXFP8" and k + ".weight" in held)
    layers[mxfp8] = {"quant_algo": "NVFP4"}
    (ck / "config.json").write_text(json.dumps(cfg))
    _damage(ck / first, "truncated")
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(ck)
    p = e.value.problems
    assert p[0].startswith(f"{first}: the file is truncated"), p
    assert any(gone in x and "missing tensor" in x for x in p), p
    assert any(extra in x and "unexpected tensor" in x for x in p), p
    assert any(f"{mxfp8} is stored MXFP8 but quantization_config says NVFP4" in x for x in p), p
    assert len(p) == 4, p
    assert str(e.value).splitlines()[0].startswith(f"{ck / first}: the file is truncated")
    assert str(e.value).splitlines()[0].endswith("; 3 other problems:")
    capsys.readouterr()
    assert main(["generate", "--ckpt-path", str(ck), "--prompt", "hi"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 4


def test_a_truncated_lone_shard_without_an_index_counts_what_is_not_found(tiny_nvfp4, tmp_path):
    """No index: which tensors the damaged file held is unknown; those the config needs and no readable shard has
    are counted on its line."""
    ck = _copy(tiny_nvfp4, tmp_path)
    tensors = {}
    for shard in _shards(ck):
        tensors.update(load_file(str(ck / shard)))
        (ck / shard).unlink()
    (ck / "model.safetensors.index.json").unlink()
    save_file(tensors, str(ck / "model.safetensors"), metadata={"format": "pt"})
    _damage(ck / "model.safetensors", "truncated")
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(ck)
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and msg.startswith(f"{ck / 'model.safetensors'}: the file is truncated"), msg
    assert "its tensors cannot be read" in msg and "the config needs are in no readable shard" in msg, msg


def test_pickle_only_folder_is_refused(tmp_path):
    folder = tmp_path / "pickled"
    folder.mkdir()
    torch.save({"w": torch.zeros(2)}, folder / "pytorch_model.bin")
    (folder / "config.json").write_text(json.dumps(build_config("tiny")))
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(folder)
    assert "pytorch_model.bin" in str(e.value) and "pickle" in str(e.value) and "execute" in str(e.value)


def test_unsupported_config_value_in_checkpoint(tiny_nvfp4, tmp_path):
    ck = _copy(tiny_nvfp4, tmp_path)
    cfg = json.loads((ck / "config.json").read_text())
    cfg["text_config"]["scoring_func"] = "softmax"
    (ck / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as e:
        open_checkpoint(ck)
    assert "scoring_func" in str(e.value) and "softmax" in str(e.value)


def test_expert_count_disagreeing_with_config(tiny_nvfp4, tmp_path):
    ck = _copy(tiny_nvfp4, tmp_path)
    cfg = json.loads((ck / "config.json").read_text())
    cfg["text_config"]["num_local_experts"] = 12
    (ck / "config.json").write_text(json.dumps(cfg))
    err = _problem(ck, "expert 12 but num_local_experts=12", "block_sparse_moe.gate.weight")
    assert any("e_score_correction_bias" in p for p in err.problems)


@pytest.mark.parametrize("spelling", ["modelopt", "compressed-tensors"])
def test_an_nvfp4_linear_without_its_input_scale_loads_weight_only(tiny_nvfp4, tmp_path, spelling):
    """Only activation quantization reads an NVFP4 linear's input_scale: without it the checkpoint loads (noted) and
    computes what the complete one does; --act-quant emulate refuses it by name, never with a made-up 1.0. In the
    compressed-tensors spelling the tensor is input_global_scale."""
    ck = _copy(tiny_nvfp4, tmp_path)
    prefix = LAYER1 + "block_sparse_moe.experts.2.w3"
    name = prefix + ".input_scale"
    if spelling == "compressed-tensors":
        def respell(t):
            for n in [n for n in t if n.startswith(prefix + ".")]:
                v = t.pop(n)
                if n.endswith(".weight"):
                    t[prefix + ".weight_packed"] = v
                elif n.endswith(".weight_scale_2"):
                    t[prefix + ".weight_global_scale"] = (1.0 / v).reshape(1)
                elif not n.endswith(".input_scale"):
                    t[n] = v
        _rewrite(ck, prefix + ".weight", respell)
    else:
        _rewrite(ck, name, lambda t: t.pop(name))
    opened = open_checkpoint(ck)
    assert opened.formats[prefix].input_scale is None
    assert any("1 NVFP4 linears have no input_scale" in n and prefix in n for n in opened.notes), opened.notes
    ids = torch.tensor([[1, 5, 9, 14]])
    torch.testing.assert_close(load_model(ck, dtype=torch.float32)(ids),
                               load_model(tiny_nvfp4, dtype=torch.float32)(ids), rtol=0, atol=0)
    with pytest.raises(CheckpointError) as e:
        load_model(ck, dtype=torch.float32, act_quant="emulate")
    assert f"NVFP4 linear {prefix} has no input_scale" in str(e.value)
    with pytest.raises(CheckpointError, match="has no input_scale"):  # never a made-up 1.0 for a caller
        opened.input_scale(prefix)


def test_a_nonfinite_value_in_a_slice_is_named_by_its_index_in_the_whole_tensor(tiny_nvfp4, tmp_path):
    """Tensor parallelism reads each rank's rows (or input columns) of a tensor (`Checkpoint.read` / `read_linear`
    with a slice, as loader.load_weights calls them): a NaN found there is reported at its index in the stored
    tensor, the one a user can look up, not at its index inside the rank's slice."""
    ck = _copy(tiny_nvfp4, tmp_path)
    emb = "language_model.model.embed_tokens.weight"
    head = "language_model.lm_head"  # a bf16 linear: read_linear slices it like a rank does

    def nan(t):
        t[emb] = t[emb].clone()
        t[emb][70, 5] = float("nan")
        t[head + ".weight"] = t[head + ".weight"].clone()
        t[head + ".weight"][9, 45] = float("inf")
    assert _shard_of(ck, emb) == _shard_of(ck, head + ".weight")
    _rewrite(ck, emb, nan)
    c = open_checkpoint(ck)
    with pytest.raises(CheckpointError, match=r"part read: rows 64:128\), first at index \[70, 5\]"):
        c.read(emb, rows=slice(64, 128))  # a rank's vocabulary rows
    with pytest.raises(CheckpointError, match=r"part read: rows 0:64, columns 32:64\), first at index \[9, 45\]"):
        c.read_linear(head, rows=slice(0, 64), cols=slice(32, 64))
    with pytest.raises(CheckpointError, match=r"first at index \[9, 45\]"):
        c.read(head + ".weight")  # the whole tensor: the same index
    with pytest.raises(CheckpointError, match=r"first at index \[70, 5\]"):
        load_model(ck, dtype=torch.float32)


def test_nan_scale_and_e8m0_255_name_the_tensor(tiny_nvfp4, tmp_path):
    ck = _copy(tiny_nvfp4, tmp_path)
    nvfp4 = LAYER1 + "block_sparse_moe.experts.3.w1.weight_scale"
    mx = LAYER1 + "self_attn.v_proj.weight_scale_inv"

    def nan(t):
        s = t[nvfp4].view(torch.uint8).clone()
        s[0, 0] = 0x7F  # E4M3 NaN
        t[nvfp4] = s.view(torch.float8_e4m3fn)
    _rewrite(ck, nvfp4, nan)

    def code255(t):
        t[mx] = t[mx].clone()
        t[mx][1, 1] = 255
    _rewrite(ck, mx, code255)
    problems = check_scales(open_checkpoint(ck))
    assert any(nvfp4 in p for p in problems) and any(mx in p and "255" in p for p in problems)
    with pytest.raises(CheckpointError) as e:
        load_model(ck, dtype=torch.float32)
    assert nvfp4[: -len(".weight_scale")] in str(e.value) and mx[: -len("_scale_inv")] in str(e.value)


def test_quantization_config_disagreement_is_reported(tiny_nvfp4, tmp_path):
    ck = _copy(tiny_nvfp4, tmp_path)
    cfg = json.loads((ck / "config.json").read_text())
    layers = cfg["quantization_config"]["quantized_layers"]
    layers[LAYER1 + "self_attn.q_proj"] = {"quant_algo": "NVFP4", "group_size": 16}
    cfg["quantization_config"]["unexpected_key"] = 1
    missing = LAYER1 + "self_attn.k_norm.weight"
    _rewrite(ck, missing, lambda t: t.pop(missing))
    (ck / "config.json").write_text(json.dumps(cfg))
    # a config that cannot be read is a problem listed with the checkpoint's others, not a first-and-only error
    err = _problem(ck, "unknown keys ['unexpected_key']", f"missing tensor {missing}")
    assert len(err.problems) == 2, err.problems
    shutil.rmtree(ck)
    ck = _copy(tiny_nvfp4, tmp_path)
    del cfg["quantization_config"]["unexpected_key"]
    (ck / "config.json").write_text(json.dumps(cfg))
    _problem(ck, LAYER1 + "self_attn.q_proj is stored MXFP8 but quantization_config says NVFP4")


def test_pruned_build_tolerates_quantized_layers_naming_missing_experts(ckpt_factory):
    # the nvfp4 writer lists only existing experts; add entries for experts that do not exist
    path = ckpt_factory("tiny", "nvfp4", experts=8)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["text_config"]["num_local_experts"] == 8
    open_checkpoint(path)


# ------------------------------------------------------------------ synth


def test_synth_is_deterministic_and_seed_dependent(tmp_path):
    a = write_checkpoint(tmp_path / "a", "tiny", "nvfp4", seed=3)
    b = write_checkpoint(tmp_path / "b", "tiny", "nvfp4", seed=3)
    c = write_checkpoint(tmp_path / "c", "tiny", "nvfp4", seed=4)
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    for f in files:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 1, "the tiny preset spans several shards so the index is exercised"
    assert any((a / f).read_bytes() != (c / f).read_bytes() for f in shards)


def test_synth_experts_below_the_preset_top_k_with_an_override():
    """An override lowering num_experts_per_tok lets `experts` go below the preset's top-k (3 of 3)."""
    raw = build_config("tiny", "bf16", experts=3, overrides={"num_experts_per_tok": 3})
    cfg = parse_model_config(raw)
    assert (cfg.text.num_local_experts, cfg.text.num_experts_per_tok) == (3, 3)
    with pytest.raises(ConfigError, match="--experts 3 is fewer than num_experts_per_tok=4"):
        build_config("tiny", "bf16", experts=3)


def test_synth_refuses_a_format_that_cannot_store_the_shapes(tmp_path):
    """hidden 112 is no whole number of MXFP8 groups (32) and experts of 40 columns none of NVFP4 groups (16): the
    writer refuses up front naming the linears, instead of failing inside the quantizer on the first tensor."""
    overrides = {"hidden_size": 112, "projector_hidden_size": 112, "intermediate_size": 40}
    with pytest.raises(ConfigError) as e:
        write_checkpoint(tmp_path / "ck", "tiny", "nvfp4", overrides=overrides)
    message = str(e.value)
    assert message.startswith("--format nvfp4 cannot store this model")
    assert "self_attn.q_proj (mxfp8): 112 input columns are not a multiple of the quantization group of 32" in message
    assert "experts.*.w2 (nvfp4): 40 input columns are not a multiple of the quantization group of 16" in message
    assert not (tmp_path / "ck").exists()
    assert parse_model_config(build_config("tiny", "bf16", overrides=overrides)).text.hidden_size == 112


def test_release_tensor_count_matches_the_release():
    """The BF16 release has 23,416 tensors (checkpoint.md); the table must produce exactly that."""
    count, nbytes = plan_tensors(parse_model_config(build_config("release", "bf16")), "bf16")
    assert count == 23416
    # the BF16 release's 59 shards hold 854,176,398,808 bytes with the router and bias in fp32; the
    # remaining 6.45 MB are the shards' JSON headers (about 275 bytes per tensor)
    assert 0 < 854_176_398_808 - nbytes < 23416 * 300


def test_synth_weights_are_not_degenerate(tiny_bf16):
    model = load_model(tiny_bf16, dtype=torch.float32)
    assert model.norm.weight.abs().max() > 0.05, "norm offsets are not all zero"
    from minimax_ref.research.trace import Trace

    trace = Trace(layers=set())
    ids = torch.randint(0, 1000, (1, 120), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids, trace=trace)
    used = trace.routing[1].expert_ids.unique().numel()
    assert used >= model.text.num_local_experts // 2, "routing spreads over the experts"
    sel = trace.blocks[1][0, 0, -1]
    assert (sel >= 0).all() and sel.unique().numel() == sel.numel()


def test_synth_release_dry_run_cli(capsys):
    assert main(["synth", "--preset", "pruned-80", "--format", "nvfp4", "--out", "unused", "--dry-run"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tensors"] > 23416 and 150e9 < out["bytes"] < 175e9  # the seed build is 162.90 GB


def test_inspect_cli(tiny_nvfp4, tmp_path, capsys):
    assert main(["inspect", str(tiny_nvfp4)]) == 0
    out = capsys.readouterr().out
    assert "routed_expert  nvfp4" in out and "problems    0" in out and "3 x msa+moe" in out
    ck = _copy(tiny_nvfp4, tmp_path)
    name = LAYER1 + "self_attn.k_norm.weight"
    _rewrite(ck, name, lambda t: t.pop(name))
    assert main(["inspect", str(ck), "--output-format", "json"]) == 1
    assert any(name in p for p in json.loads(capsys.readouterr().out)["problems"])


def test_safetensors_header_reader_rejects_garbage(tmp_path):
    folder = _copy_minimal(tmp_path)
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", 10**9) + b"{}")
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(folder)
    assert "model.safetensors" in str(e.value)


def _copy_minimal(tmp_path):
    folder = tmp_path / "single"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(build_config("tiny")))
    return folder
