"""Synthetic checkpoints in the release's exact on-disk format, with random weights.

`minimax-ref synth --preset NAME --format {bf16,mxfp8,nvfp4} --out DIR` writes a complete folder:
raw-form `config.json` (with `quantization_config` for quantized formats), the safetensors shards
and `model.safetensors.index.json`, `generation_config.json`, and a small byte-level BPE tokenizer
carrying the release's special tokens.

Presets: `tiny` (CPU tests: 4 layers = 1 dense + 3 MSA/MoE, MSA blocks of 16 with top-4 so sparsity
engages past 64 tokens), `tiny-vl` (tiny + a small vision tower), `release` and `pruned-80` (the
real shapes; tensors are generated and written one at a time, so memory stays bounded by one shard).

Weights are random but not degenerate (decided here, see weights.md): linear weights
N(0, 1/in_features) (output projections scaled by 1/2), norm offsets N(0, 0.1^2), router rows with
std 2/sqrt(H) so sigmoid scores spread, selection bias N(0, 0.01^2). Every tensor is generated from
its own seed (seed, name), so a preset's files are byte-identical for a given seed.
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ConfigError
from ..model.config import ModelConfig, parse_drafter_config, parse_model_config
from ..outdir import check_new_folder, staged_folder
from ..progress import Progress
from .checkpoint import LM_HEAD, TEXT_PREFIX, LinearSpec, TensorSpec, tensor_table
from .quant import quantize_mxfp8, quantize_nvfp4

FORMATS = ("bf16", "mxfp8", "nvfp4")
# ModelOpt's activation global scale is amax(X) / (6 * 448); synthetic checkpoints assume
# activations of magnitude up to ~4 after the norms (decided here).
SYNTH_INPUT_SCALE = 4.0 / (6 * 448)


@dataclass(frozen=True)
class Preset:
    text: dict
    vision: dict | None = None
    tokenizer_vocab: int = 1024
    shard_bytes: int = 2 << 30


def _text_config(vocab: int, hidden: int, layers: int, n_dense: int, heads: int, kv: int, head_dim: int,
                 rotary: int, expert_inter: int, shared_inter: int, dense_inter: int, experts: int, top_k: int,
                 index_dim: int, block: int, topk_blocks: int, max_pos: int) -> dict:
    freq = [0] * n_dense + [1] * (layers - n_dense)
    return {
        "architectures": ["MiniMaxM3SparseForCausalLM"],
        "model_type": "minimax_m3_vl_text",
        "vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
        "intermediate_size": expert_inter, "shared_intermediate_size": shared_inter,
        "dense_intermediate_size": dense_inter, "max_position_embeddings": max_pos,
        "rms_norm_eps": 1e-6, "use_gemma_norm": True, "use_qk_norm": True, "qk_norm_type": "per_head",
        "attention_output_gate": False, "rope_theta": 5000000.0, "rotary_dim": rotary,
        "partial_rotary_factor": rotary / head_dim, "hidden_act": "swigluoai", "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0, "num_local_experts": experts, "num_experts_per_tok": top_k,
        "n_shared_experts": 1, "scoring_func": "sigmoid", "use_routing_bias": True,
        "routed_scaling_factor": 2.0, "moe_layer_freq": freq, "tie_word_embeddings": False,
        "num_mtp_modules": 0,
        "sparse_attention_config": {
            "use_sparse_attention": True, "sparse_index_dim": index_dim, "sparse_num_index_heads": kv,
            "sparse_topk_blocks": topk_blocks, "sparse_block_size": block, "sparse_score_type": "max",
            "sparse_init_block": 0, "sparse_local_block": 1, "sparse_attention_freq": freq,
            "sparse_disable_index_value": freq,
        },
    }


_TINY_VISION = {"model_type": "clip_vision_model", "hidden_size": 64, "intermediate_size": 128,
                "num_hidden_layers": 2, "num_attention_heads": 4, "patch_size": 14, "num_channels": 3,
                "image_size": 2016, "position_embedding_type": "rope", "rope_mode": "3d", "rope_theta": 10000.0,
                "hidden_act": "gelu", "layer_norm_eps": 1e-5, "temporal_patch_size": 2,
                "spatial_merge_size": 2, "projection_dim": 128}
_RELEASE_VISION = {"model_type": "clip_vision_model", "hidden_size": 1280, "intermediate_size": 5120,
                   "num_hidden_layers": 32, "num_attention_heads": 16, "patch_size": 14, "num_channels": 3,
                   "image_size": 2016, "position_embedding_type": "rope", "rope_mode": "3d",
                   "rope_theta": 10000.0, "hidden_act": "gelu", "layer_norm_eps": 1e-5,
                   "temporal_patch_size": 2, "spatial_merge_size": 2, "projection_dim": 6144}

PRESETS: dict[str, Preset] = {
    "tiny": Preset(_text_config(1024, 128, 4, 1, 8, 2, 32, 16, 64, 64, 256, 16, 4, 32, 16, 4, 4096),
                   tokenizer_vocab=1024, shard_bytes=1 << 20),
    "tiny-vl": Preset(_text_config(1024, 128, 4, 1, 8, 2, 32, 16, 64, 64, 256, 16, 4, 32, 16, 4, 4096),
                      vision=_TINY_VISION, tokenizer_vocab=1024, shard_bytes=1 << 20),
    # The release-width tokenizers cover all 200,064 ids (unused ones as <|reserved_N|>): random weights sample
    # from the whole vocabulary, and every sampled id must decode.
    "release": Preset(_text_config(200064, 6144, 60, 3, 64, 4, 128, 64, 3072, 3072, 12288, 128, 4, 128, 128, 16,
                                   1048576), vision=_RELEASE_VISION, tokenizer_vocab=200064, shard_bytes=4 << 30),
    "pruned-80": Preset(_text_config(200064, 6144, 60, 3, 64, 4, 128, 64, 3072, 3072, 12288, 80, 4, 128, 128, 16,
                                     1048576), vision=_RELEASE_VISION, tokenizer_vocab=200064, shard_bytes=4 << 30),
}


def build_config(preset: str, fmt: str = "bf16", experts: int | None = None, layers: int | None = None,
                 special_ids: dict[str, int] | None = None, overrides: dict | None = None) -> dict:
    """The raw-form config.json of a preset (quantization_config included for quantized formats).

    `overrides` replaces text_config keys; keys of `sparse_attention_config` (`sparse_*`) go there, and a
    `vision_config` dict updates the vision tower's config (presets with one).
    """
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    if fmt not in FORMATS:
        raise ConfigError(f"unknown format {fmt!r}; choose one of {list(FORMATS)}")
    p = PRESETS[preset]
    text = json.loads(json.dumps(p.text))
    if experts is not None:
        text["num_local_experts"] = experts
    if layers is not None:
        n_dense = text["moe_layer_freq"].count(0)
        if layers < 1:
            raise ConfigError(f"--layers {layers} must be >= 1")
        freq = ([0] * min(n_dense, layers) + [1] * max(0, layers - n_dense))[:layers]
        text["num_hidden_layers"] = layers
        text["moe_layer_freq"] = freq
        for key in ("sparse_attention_freq", "sparse_disable_index_value"):
            text["sparse_attention_config"][key] = freq
    overrides = dict(overrides or {})
    vision = None if p.vision is None else {**p.vision, **overrides.pop("vision_config", {})}
    for key, value in overrides.items():
        if key.startswith("sparse_"):
            text["sparse_attention_config"][key] = value
        else:
            text[key] = value
    # checked once the overrides are in: an override may lower num_experts_per_tok to fit `experts`
    if experts is not None and experts < text["num_experts_per_tok"]:
        raise ConfigError(f"--experts {experts} is fewer than num_experts_per_tok={text['num_experts_per_tok']}")
    sid = special_ids or {}
    if "turn_end" in sid:
        text["eos_token_id"] = sid["turn_end"]
    if "bod" in sid:
        text["bos_token_id"] = sid["bod"]
    raw: dict = {
        "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
        "model_type": "minimax_m3_vl",
        "torch_dtype": "bfloat16",
        "text_config": text,
        "projector_hidden_size": text["hidden_size"],
        "projector_hidden_act": "gelu",
        "multimodal_projector_bias": True,
        "vision_feature_layer": -1,
        "vision_feature_select_strategy": "full",
        "process_image_mode": "dynamic_res",
        "img_token_compression_config": {"image_token_compression_method": "patch_merge",
                                         "spatial_merge_size": (vision or {}).get("spatial_merge_size", 2),
                                         "temporal_patch_size": (vision or {}).get("temporal_patch_size", 2)},
    }
    if "image" in sid:
        raw["image_token_index"] = sid["image"]
    if "video" in sid:
        raw["video_token_index"] = sid["video"]
    if vision is not None:
        raw["vision_config"] = vision
    if fmt != "bf16":
        from ..model.parallel import unstorable_linears

        cfg = parse_model_config(raw)
        linears, _ = tensor_table(cfg)
        problems = unstorable_linears({prefix: (spec, linear_format(spec, fmt)) for prefix, spec in linears.items()})
        if problems:
            raise ConfigError(f"--format {fmt} cannot store this model (use --format bf16, or sizes that are "
                              "multiples of the groups): " + "; ".join(problems))
        raw["quantization_config"] = _quantization_config(cfg, fmt)
    return raw


def linear_format(spec: LinearSpec, fmt: str) -> str:
    """On-disk format of a linear in a checkpoint of `fmt` (checkpoint.md, "Formats per module family")."""
    if fmt == "bf16" or spec.family == "lm_head":
        return "bf16"
    if fmt == "nvfp4" and spec.family == "routed_expert":
        return "nvfp4"
    return "mxfp8"


def _quantization_config(cfg: ModelConfig, fmt: str) -> dict:
    linears, _ = tensor_table(cfg)
    if fmt == "mxfp8":
        return {"quant_method": "mxfp8", "weight_block_size": [1, 32], "activation_scheme": "dynamic",
                "modules_to_not_convert": ["language_model.lm_head", "*block_sparse_moe.gate", "vision_tower*",
                                           "multi_modal_projector*", "patch_merge_mlp*"]}
    layers = {}
    for prefix, spec in linears.items():
        f = linear_format(spec, fmt)
        if f == "nvfp4":
            layers[prefix] = {"quant_algo": "NVFP4", "group_size": 16}
        elif f == "mxfp8":
            layers[prefix] = {"quant_algo": "MXFP8"}
    return {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None,
            "producer": {"name": "minimax-ref synth", "version": "0.1.0"},
            "exclude_modules": ["language_model.lm_head", "*block_sparse_moe.gate", "vision_tower*",
                                "multi_modal_projector*", "patch_merge_mlp*"],
            "quantized_layers": layers}


def quantization_config(cfg: ModelConfig, fmt: str) -> dict:
    """The `quantization_config` block of a `fmt` ("mxfp8" or "nvfp4") checkpoint of `cfg`, as the
    synthetic checkpoints write it (public for exporters such as examples/nano)."""
    return _quantization_config(cfg, fmt)


def _gen(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) & 0x7FFF_FFFF_FFFF)


def _randn(shape: tuple[int, ...], std: float, seed: int, name: str) -> torch.Tensor:
    return torch.randn(shape, generator=_gen(seed, name)) * std


def _plain_tensor(spec: TensorSpec, seed: int, H: int) -> torch.Tensor:
    name, shape = spec.name, spec.shape
    if spec.family == "router":
        if name.endswith("e_score_correction_bias"):
            return _randn(shape, 0.01, seed, name).float()
        return _randn(shape, 2.0 / H**0.5, seed, name).float()  # the release stores the router in fp32
    if spec.family == "embedding":
        return _randn(shape, 1.0, seed, name).bfloat16()
    if spec.family == "norm":
        return _randn(shape, 0.1, seed, name).bfloat16()
    if name.endswith("bias"):
        return _randn(shape, 0.02, seed, name).bfloat16()
    if "layer_norm" in name or "layrnorm" in name:  # vision LayerNorm weights sit around 1
        return (1.0 + _randn(shape, 0.1, seed, name)).bfloat16()
    fan_in = 1
    for d in shape[1:]:
        fan_in *= d
    return _randn(shape, fan_in**-0.5, seed, name).bfloat16()


def _linear_std(spec: LinearSpec) -> float:
    std = spec.in_features**-0.5
    if spec.prefix.endswith(("o_proj", "down_proj", "w2")):
        std *= 0.5  # keep the residual stream from growing layer over layer
    return std


def _linear_weight(spec: LinearSpec, seed: int) -> torch.Tensor:
    return _randn((spec.out_features, spec.in_features), _linear_std(spec), seed, spec.prefix)


def _linear_tensors(spec: LinearSpec, fmt: str, seed: int, linears: dict[str, LinearSpec]) -> dict[str, torch.Tensor]:
    w = _linear_weight(spec, seed)
    f = linear_format(spec, fmt)
    p = spec.prefix
    if f == "bf16":
        return {p + ".weight": w.bfloat16()}
    if f == "mxfp8":
        q, s = quantize_mxfp8(w)
        return {p + ".weight": q, p + ".weight_scale_inv": s}
    # ModelOpt writes max(amax(w1), amax(w3)) to both gate and up (one global scale per expert pair).
    amax = None
    if spec.leaf in ("w1", "w3"):
        other = linears[p[: -2] + ("w3" if spec.leaf == "w1" else "w1")]
        amax = max(w.abs().max().item(), _linear_weight(other, seed).abs().max().item())
    packed, scale, scale_2 = quantize_nvfp4(w, global_amax=amax)
    return {p + ".weight": packed, p + ".weight_scale": scale, p + ".weight_scale_2": scale_2.reshape(()),
            p + ".input_scale": torch.tensor(SYNTH_INPUT_SCALE, dtype=torch.float32)}


def iter_tensors(cfg: ModelConfig, fmt: str, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a synthetic checkpoint, generated one at a time in a stable order."""
    linears, plain = tensor_table(cfg)
    H = cfg.text.hidden_size
    for spec in plain.values():
        yield spec.name, _plain_tensor(spec, seed, H)
    for spec in linears.values():
        yield from _linear_tensors(spec, fmt, seed, linears).items()


# Tensors above this many elements are generated and written in row blocks (the release's embedding and LM head:
# 1.2 G elements, 4.9 GB as fp32 before rounding), so writing never holds one whole.
STREAM_ELEMENTS = 1 << 24


def _randn_rows(shape: tuple[int, int], std: float, seed: int, name: str) -> Iterator[torch.Tensor]:
    """`_randn(shape, std, seed, name)` in row blocks of about STREAM_ELEMENTS elements: the same values (one
    generator drawn in order; block sizes are whole rows of a multiple of 16 elements, the CPU sampler's group)."""
    n, k = shape
    g = _gen(seed, name)
    rows = max(1, STREAM_ELEMENTS // k)
    for r0 in range(0, n, rows):
        yield torch.randn((min(rows, n - r0), k), generator=g) * std


def _pieces(cfg: ModelConfig, fmt: str, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """`iter_tensors`, with tensors of more than STREAM_ELEMENTS elements (embedding, bf16 linears) as
    consecutive row blocks of the same name (the same bytes once concatenated)."""
    linears, plain = tensor_table(cfg)
    H = cfg.text.hidden_size
    for spec in plain.values():
        if spec.family == "embedding" and math.prod(spec.shape) > STREAM_ELEMENTS and spec.shape[1] % 16 == 0:
            yield from ((spec.name, b.bfloat16()) for b in _randn_rows(spec.shape, 1.0, seed, spec.name))
        else:
            yield spec.name, _plain_tensor(spec, seed, H)
    for spec in linears.values():
        big = spec.out_features * spec.in_features > STREAM_ELEMENTS and spec.in_features % 16 == 0
        if big and linear_format(spec, fmt) == "bf16":
            yield from ((spec.prefix + ".weight", b.bfloat16())
                        for b in _randn_rows((spec.out_features, spec.in_features), _linear_std(spec), seed,
                                             spec.prefix))
        else:
            yield from _linear_tensors(spec, fmt, seed, linears).items()


def planned_tensors(cfg: ModelConfig, fmt: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, safetensors dtype, shape) of every tensor of a synthetic checkpoint of `fmt`, in `iter_tensors`'
    order, without generating any."""
    linears, plain = tensor_table(cfg)
    out = [(spec.name, "F32" if spec.family == "router" else "BF16", spec.shape) for spec in plain.values()]
    for spec in linears.values():
        p, N, K = spec.prefix, spec.out_features, spec.in_features
        f = linear_format(spec, fmt)
        if f == "bf16":
            out.append((p + ".weight", "BF16", (N, K)))
        elif f == "mxfp8":
            out += [(p + ".weight", "F8_E4M3", (N, K)), (p + ".weight_scale_inv", "U8", (N, K // 32))]
        else:
            out += [(p + ".weight", "U8", (N, K // 2)), (p + ".weight_scale", "F8_E4M3", (N, K // 16)),
                    (p + ".weight_scale_2", "F32", ()), (p + ".input_scale", "F32", ())]
    return out


_ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.uint8: "U8",
              torch.float8_e4m3fn: "F8_E4M3", torch.int32: "I32", torch.int64: "I64"}
_ST_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "U8": 1, "F8_E4M3": 1, "I32": 4, "I64": 8}


def plan_tensors(cfg: ModelConfig, fmt: str) -> tuple[int, int]:
    """(tensor count, bytes) a synthetic checkpoint of `fmt` would have, without generating it."""
    entries = planned_tensors(cfg, fmt)
    return len(entries), sum(math.prod(shape) * _ST_BYTES[dtype] for _, dtype, shape in entries)


def write_safetensors(path: Path, entries: list[tuple[str, str, tuple[int, ...]]],
                      pieces: Iterator[tuple[str, torch.Tensor]], on_bytes=None) -> None:
    """Write a safetensors file (format: 8-byte little-endian header length, JSON header padded with spaces to
    8 bytes, then the tensors' bytes in `entries` order) whose header is made from `entries` before any data
    exists, and whose data is taken from `pieces`: (name, tensor) pairs in the same order, a tensor possibly in
    several consecutive row blocks. Each piece is written and dropped, so memory stays at one piece. The file is
    created with the process's umask like any other file. Raises ValueError when the pieces disagree with the
    entries (a name, dtype or byte count)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape in entries:
        n = math.prod(shape) * _ST_BYTES[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(blob)))
        fh.write(blob)
        for name, dtype, shape in entries:
            need = math.prod(shape) * _ST_BYTES[dtype]
            while need > 0:
                got_name, t = next(pieces)
                if got_name != name or _ST_DTYPES.get(t.dtype) != dtype:
                    raise ValueError(f"write_safetensors: got {got_name} ({t.dtype}), expected {name} ({dtype})")
                data = t.contiguous().reshape(-1).view(torch.uint8).numpy()
                fh.write(data.data)
                need -= data.size
                if on_bytes:
                    on_bytes(data.size)
            if need:
                raise ValueError(f"write_safetensors: {name} got {-need} bytes more than its shape {list(shape)}")


def write_checkpoint(out: str | Path, preset: str = "tiny", fmt: str = "bf16", *, experts: int | None = None,
                     layers: int | None = None, seed: int = 0, shard_bytes: int | None = None,
                     overrides: dict | None = None, progress: bool = False, drafter: bool = False) -> Path:
    """Write a synthetic checkpoint folder and return its path.

    `out` must not exist or be empty, and its disk must have room for the checkpoint (InputError otherwise,
    before anything is written). The folder is written under a temporary name beside `out` and renamed when
    complete, so a failure (a full disk: InputError) leaves nothing behind. Tensors are generated and written
    one at a time (`write_safetensors`): memory stays far below the output's size.
    drafter: also write a DSpark drafter in `dspark/` (`write_drafter`) at the target's shapes.
    """
    from .synth_tokenizer import write_test_tokenizer

    out = Path(out)
    p = PRESETS.get(preset)
    if p is None:
        raise ConfigError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    # the special ids only place tokens; the config's shapes do not depend on them
    cfg = parse_model_config(build_config(preset, fmt, experts, layers, None, overrides))
    if p.tokenizer_vocab > cfg.text.vocab_size:
        raise ConfigError(f"tokenizer vocabulary {p.tokenizer_vocab} exceeds vocab_size {cfg.text.vocab_size}")
    entries = planned_tensors(cfg, fmt)
    total_bytes = sum(math.prod(shape) * _ST_BYTES[dtype] for _, dtype, shape in entries)
    check_new_folder(out, total_bytes)
    with staged_folder(out) as tmp:
        _write_checkpoint_files(tmp, cfg, p, preset, fmt, experts, layers, seed, overrides, entries, total_bytes,
                                shard_bytes or p.shard_bytes, progress, drafter, write_test_tokenizer)
    return out


def write_config(out: str | Path, preset: str = "tiny", fmt: str = "bf16", *, experts: int | None = None,
                 layers: int | None = None, overrides: dict | None = None) -> Path:
    """Write only the `config.json` and `generation_config.json` that `write_checkpoint` would write with these
    arguments (`minimax-ref synth --config-only`): no shards, no tokenizer; enough for `minimax-ref plan`.
    `out` must not exist or be empty (InputError otherwise); returns its path."""
    from ..generation.tokenizer import SPECIAL_TOKEN_TEXTS

    out = Path(out)
    p = PRESETS.get(preset)
    if p is None:
        raise ConfigError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    # the test tokenizer's special tokens take its top ids in SPECIAL_TOKEN_TEXTS' order (synth_tokenizer)
    n_bpe = p.tokenizer_vocab - len(SPECIAL_TOKEN_TEXTS)
    special = {name: n_bpe + i for i, name in enumerate(SPECIAL_TOKEN_TEXTS)}
    raw = build_config(preset, fmt, experts, layers, special, overrides)
    parse_model_config(raw)  # refuses a bad config before anything is written
    check_new_folder(out, 1 << 20)
    with staged_folder(out) as tmp:
        _write_config_files(tmp, raw, special)
    return out


def _write_config_files(out: Path, raw: dict, special: dict[str, int]) -> None:
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    gen = {"bos_token_id": special.get("bod"), "eos_token_id": [special["turn_end"]], "do_sample": True,
           "temperature": 1.0, "top_p": 0.95, "top_k": 40, "transformers_version": "5.23.0"}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def _write_checkpoint_files(out: Path, cfg: ModelConfig, p: Preset, preset: str, fmt: str, experts, layers,
                            seed: int, overrides, entries, total_bytes: int, limit: int, progress: bool,
                            drafter: bool, write_test_tokenizer) -> None:
    special = write_test_tokenizer(out, p.tokenizer_vocab, seed=seed)
    _write_config_files(out, build_config(preset, fmt, experts, layers, special, overrides), special)

    # shards: consecutive runs of tensors up to `limit` bytes (a tensor larger than the limit gets its own)
    shards: list[list] = [[]]
    size = 0
    for entry in entries:
        nb = math.prod(entry[2]) * _ST_BYTES[entry[1]]
        if size and size + nb > limit:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nb
    n = len(shards)
    names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    bar = Progress(f"writing {out.name}", total_bytes) if progress else None
    pieces = _pieces(cfg, fmt, seed)
    for name, shard in zip(names, shards):
        write_safetensors(out / name, shard, pieces, bar.update if bar else None)
    if next(pieces, None) is not None:
        raise ValueError("synth: more tensors were generated than planned")
    if bar:
        bar.close()
    weight_map = {entry[0]: name for name, shard in zip(names, shards) for entry in shard}
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    if drafter:
        write_drafter(out / "dspark", cfg, seed, noise_token_id=special["dspark_noise"], shard_bytes=limit,
                      progress=progress)


def drafter_config_json(target: ModelConfig, *, num_layers: int | None = None, block_size: int | None = None,
                        target_layer_ids: list[int] | None = None, sliding_window: int | None = None,
                        noise_token_id: int | None = None, markov_rank: int | None = None) -> dict:
    """The `dspark/config.json` of a synthetic drafter for `target` (values under `text_config`, the
    release's layout; a few top-level copies, which must agree, as the release has them).

    Defaults (decided here): a target with 60 layers gets the release's drafter (5 layers, block 7,
    target layers [3, 17, 31, 45, 59], window 4096, Markov rank 256); a smaller one the tiny drafter
    (2 layers, block 4, target layers [0, 1, last], window 64 so that it engages in tests, rank 16).
    """
    t = target.text
    release = t.num_hidden_layers >= 60
    n_layers = (5 if release else 2) if num_layers is None else num_layers
    ids = target_layer_ids if target_layer_ids is not None else (
        [3, 17, 31, 45, 59] if release else sorted({0, min(1, t.num_hidden_layers - 1), t.num_hidden_layers - 1}))
    text = {
        "architectures": ["DSparkMiniMaxDraftModel"],
        "num_hidden_layers": n_layers, "hidden_size": t.hidden_size, "vocab_size": t.vocab_size,
        "num_attention_heads": t.num_attention_heads, "num_key_value_heads": t.num_key_value_heads,
        "head_dim": t.head_dim, "dense_intermediate_size": t.dense_intermediate_size,
        "dspark_ffn_hidden_size": t.dense_intermediate_size,
        "dspark_block_size": (7 if release else 4) if block_size is None else block_size,
        # the release's noise id 200058 is vocab_size - 6; synthetic tokenizers pass their own
        "dspark_noise_token_id": t.vocab_size - 6 if noise_token_id is None else noise_token_id,
        "dspark_markov_rank": (256 if release else 16) if markov_rank is None else markov_rank,
        "dspark_markov_head_type": "vanilla",
        "dspark_target_layer_ids": list(ids), "dspark_use_dense_ffn": True, "dspark_hybrid_context_fusion": False,
        "sliding_window": (4096 if release else 64) if sliding_window is None else sliding_window,
        "layer_types": ["sliding_attention"] * n_layers, "moe_layer_freq": [0] * n_layers,
        "sparse_attention_config": None, "enable_confidence_head": True, "confidence_head_with_markov": True,
        "use_gemma_norm": True, "rms_norm_eps": t.rms_norm_eps, "rope_theta": t.rope_theta,
        "rotary_dim": t.rotary_dim, "swiglu_alpha": t.swiglu_alpha, "swiglu_limit": t.swiglu_limit,
        "quantization_config": {"quant_method": "mxfp8", "weight_block_size": [1, 32]},
    }
    raw = {"architectures": ["DSparkMiniMaxDraftModel"], "text_config": text,
           "dspark_block_size": text["dspark_block_size"], "dspark_noise_token_id": text["dspark_noise_token_id"],
           "dspark_target_layer_ids": text["dspark_target_layer_ids"],
           "quantization_config": text["quantization_config"]}
    parse_drafter_config(raw, t, "the synthetic drafter's config")  # values the loader would refuse, refused here
    return raw


def write_drafter(out_dir: str | Path, cfg: ModelConfig, seed: int = 0, *, shard_bytes: int = 2 << 30,
                  progress: bool = False, **config_kw) -> Path:
    """Write a random DSpark drafter for the target `cfg` into `out_dir` (normally `<ckpt>/dspark`) in
    the release layout: `config.json` (`drafter_config_json(cfg, **config_kw)`), the index and
    `model-0000i-of-0000n.safetensors` shards; tensors `language_model.model.dspark.*`, the layers'
    projections MXFP8 (`weight_scale_inv` uint8), `fc`, norms, Markov and confidence heads bf16;
    no embedding, no LM head.

    Random values (decided here, each tensor from its own generator seeded by (seed, name)): linears
    N(0, 1/in) with o_proj / down_proj halved, norm offsets N(0, 0.1^2), markov_w1 N(0, 1) and markov_w2
    N(0, 1/rank) (a bias of about unit size, like the base logits), confidence proj N(0, 1/in), bias 0.
    """
    from ..generation.drafter import drafter_tensor_table

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    raw = drafter_config_json(cfg, **config_kw)
    dcfg = parse_drafter_config(raw, cfg.text)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    linears, plain = drafter_tensor_table(dcfg)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for spec in plain.values():
            name, shape = spec.name, spec.shape
            if spec.family == "norm":
                yield name, _randn(shape, 0.1, seed, name).bfloat16()
            elif name.endswith("markov_w1.weight"):
                yield name, _randn(shape, 1.0, seed, name).bfloat16()
            elif name.endswith("proj.bias"):
                yield name, torch.zeros(shape, dtype=torch.bfloat16)
            else:  # markov_w2 [V, r] and the confidence proj [1, in]: N(0, 1/in)
                yield name, _randn(shape, shape[1] ** -0.5, seed, name).bfloat16()
        for spec in linears.values():
            w = _linear_weight(spec, seed)
            if spec.prefix.endswith(".fc"):
                yield spec.prefix + ".weight", w.bfloat16()
            else:
                q, s = quantize_mxfp8(w)
                yield spec.prefix + ".weight", q
                yield spec.prefix + ".weight_scale_inv", s

    # Shards are written as they fill (memory stays bounded by one shard) under temporary names,
    # renamed once their count is known.
    shard: dict[str, torch.Tensor] = {}
    tmp_names: list[str] = []
    weight_map: dict[str, str] = {}
    size = written = 0

    def flush() -> None:
        nonlocal shard, size
        if shard:
            tmp_names.append(f"shard-{len(tmp_names) + 1:05d}.tmp")
            entries = [(k, _ST_DTYPES[t.dtype], tuple(t.shape)) for k, t in shard.items()]
            write_safetensors(out / tmp_names[-1], entries, iter(shard.items()))
            weight_map.update(dict.fromkeys(shard, tmp_names[-1]))
            shard, size = {}, 0

    total = sum(2 * math.prod(spec.shape) for spec in plain.values()) + sum(
        (2 if spec.prefix.endswith(".fc") else 1 + 1 / 32) * spec.out_features * spec.in_features
        for spec in linears.values())
    bar = Progress(f"writing {out.name}", int(total)) if progress else None
    for name, tensor in tensors():
        nb = tensor.numel() * tensor.element_size()
        if size and size + nb > shard_bytes:
            flush()
        shard[name] = tensor.contiguous()
        size, written = size + nb, written + nb
        if bar:
            bar.update(nb)
    flush()
    if bar:
        bar.close()
    for old in out.glob("model-*.safetensors"):
        old.unlink()
    final = {tmp: f"model-{i + 1:05d}-of-{len(tmp_names):05d}.safetensors" for i, tmp in enumerate(tmp_names)}
    for tmp, fin in final.items():
        (out / tmp).rename(out / fin)
    weight_map = {name: final[tmp] for name, tmp in weight_map.items()}
    index = {"metadata": {"total_size": written}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


__all__ = ["PRESETS", "FORMATS", "build_config", "write_checkpoint", "write_config", "write_drafter",
           "drafter_config_json", "iter_tensors", "plan_tensors",
           "TEXT_PREFIX", "LM_HEAD"]
