"""Export a trained `MiniMaxM3` to the release's on-disk format, with the engine's encoders.

Formats follow the release (and `minimax_ref.weights.synth --format nvfp4`): routed experts NVFP4 in the
ModelOpt spelling (w1 and w3 of an expert share one `weight_scale_2`, from the larger amax of the two,
as ModelOpt exports them; `input_scale` = calibrated activation amax / (6 * 448)), every other text
linear MXFP8 with `weight_scale_inv`, LM head, embeddings, norms, vision tower and projector bf16,
router weight and selection bias fp32. `config.json` carries the ModelOpt `MIXED_PRECISION`
`quantization_config` that `synth` writes. The tensor names come from `checkpoint.tensor_table`, the
engine's one name table, so what is written is what `load_model` reads.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from minimax_ref.generation import chat
from minimax_ref.model.config import parse_model_config
from minimax_ref.weights.checkpoint import LinearSpec, tensor_table
from minimax_ref.weights.quant import quantize_mxfp8, quantize_nvfp4
from minimax_ref.weights.synth import build_config, linear_format, quantization_config

#: ModelOpt's activation global scale: amax(X) / (6 * 448) (E2M1 max times E4M3 max).
NVFP4_SCALE_DIVISOR = 6.0 * 448.0
SHARD = "model-00001-of-00001.safetensors"


def raw_config(text: Mapping[str, Any], vision: Mapping[str, Any] | None, special_ids: Mapping[str, int],
               fmt: str = "nvfp4") -> dict[str, Any]:
    """The raw-form `config.json` (the release's spelling, as `synth.build_config` writes it) with the
    given text-config keys (`sparse_*` keys go to `sparse_attention_config`), the vision config
    replacing the preset's, the tokenizer's special ids, and `quantization_config` for `fmt`."""
    raw = build_config("tiny-vl" if vision is not None else "tiny", "bf16", special_ids=dict(special_ids),
                       overrides=dict(text))
    if vision is not None:
        raw["vision_config"] = {**raw["vision_config"], **vision}
    raw["projector_hidden_size"] = raw["text_config"]["hidden_size"]
    if fmt != "bf16":
        raw["quantization_config"] = quantization_config(parse_model_config(raw), fmt)
    return raw


def _weight(model: nn.Module, spec: LinearSpec) -> torch.Tensor:
    """The fp32 [out, in] weight a release linear holds (one expert's slice of a stacked tensor)."""
    module = model.get_submodule(spec.module)
    if spec.expert is None:
        return module.weight.detach().float().cpu()
    return getattr(module, spec.leaf)[spec.expert].detach().float().cpu()


def encode_linear(prefix: str, w: torch.Tensor, fmt: str, *, global_amax: float | None = None,
                  input_scale: float | None = None) -> dict[str, torch.Tensor]:
    """The release tensors of one linear `prefix` with weight `w` [out, in] stored as `fmt`:
    bf16 `weight`; MXFP8 `weight` + `weight_scale_inv` (E8M0 bytes); NVFP4 (ModelOpt) `weight`
    (packed uint8) + `weight_scale` (E4M3) + `weight_scale_2` (fp32 scalar, from `global_amax` when
    given) + `input_scale` (fp32 scalar; 1.0 when None, the value the engine assumes when absent)."""
    if fmt == "bf16":
        return {prefix + ".weight": w.bfloat16().contiguous()}
    if fmt == "mxfp8":
        q, s = quantize_mxfp8(w)
        return {prefix + ".weight": q, prefix + ".weight_scale_inv": s}
    if fmt != "nvfp4":
        raise ValueError(f"unknown format {fmt!r}")
    packed, scale, scale_2 = quantize_nvfp4(w, global_amax=global_amax)
    return {prefix + ".weight": packed, prefix + ".weight_scale": scale,
            prefix + ".weight_scale_2": scale_2.reshape(()).float(),
            prefix + ".input_scale": torch.tensor(1.0 if input_scale is None else input_scale, dtype=torch.float32)}


def nvfp4_pair_amax(model: nn.Module, spec: LinearSpec) -> float | None:
    """The shared global amax of an expert's w1/w3 (max of both), None for other linears."""
    if spec.expert is None or spec.leaf not in ("w1", "w3"):
        return None
    experts = model.get_submodule(spec.module)
    return max(float(experts.w1[spec.expert].detach().abs().max()), float(experts.w3[spec.expert].detach().abs().max()))


def state_tensors(model: nn.Module, raw: dict[str, Any], fmt: str = "nvfp4",
                  input_scales: Mapping[tuple[str, str, int], float] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, by release name. `input_scales[(experts module, leaf, expert)]`
    are the calibrated NVFP4 activation scales (1.0 where missing)."""
    cfg = parse_model_config(raw)
    linears, plain = tensor_table(cfg)
    out: dict[str, torch.Tensor] = {}
    for spec in plain.values():
        t = model.get_parameter(spec.module).detach().cpu()
        out[spec.name] = (t.float() if spec.family == "router" else t.bfloat16()).contiguous()
    for prefix, spec in linears.items():
        f = linear_format(spec, fmt)
        scale = None
        if f == "nvfp4" and input_scales is not None and spec.expert is not None:
            scale = input_scales.get((spec.module, spec.leaf, spec.expert))
        out.update(encode_linear(prefix, _weight(model, spec), f, global_amax=nvfp4_pair_amax(model, spec)
                                 if f == "nvfp4" else None, input_scale=scale))
    return out


def write_checkpoint(model: nn.Module, raw: dict[str, Any], out_dir: str | Path, tokenizer_dir: str | Path, *,
                     fmt: str = "nvfp4", input_scales: Mapping[tuple[str, str, int], float] | None = None,
                     preprocessor: Mapping[str, Any] | None = None, extra_files: Mapping[str, Any] | None = None,
                     keep: Mapping[str, torch.Tensor] | None = None) -> Path:
    """Write the checkpoint folder: config.json, one shard + model.safetensors.index.json,
    generation_config.json, the tokenizer files of `tokenizer_dir` with `chat.CHAT_TEMPLATE` as
    chat_template.jinja, preprocessor_config.json, and `extra_files` (name -> JSON value). An existing
    folder's shards are replaced. `keep`: stored tensors written as they are instead of encoded from the
    model (a frozen part keeps its bytes: `stored_tensors`), each the name, dtype and shape of one the
    export writes."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = state_tensors(model, raw, fmt, input_scales)
    wrong = [name for name, t in (keep or {}).items()
             if name not in tensors or (t.dtype, t.shape) != (tensors[name].dtype, tensors[name].shape)]
    if wrong:
        raise ValueError(f"{len(wrong)} kept tensors are not ones this export writes with that dtype and shape, "
                         f"e.g. {wrong[:3]}: keep the stored tensors of a checkpoint of the same model")
    tensors.update(keep or {})
    for old in out.glob("model-*.safetensors"):
        old.unlink()
    save_file(tensors, str(out / SHARD), metadata={"format": "pt"})
    (out / SHARD).chmod(0o644)  # safetensors writes 0600; the folder is meant to be shipped and shared
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": {name: SHARD for name in sorted(tensors)}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(raw, indent=2, ensure_ascii=False) + "\n")
    text = raw["text_config"]
    gen = {"bos_token_id": text.get("bos_token_id"), "eos_token_id": [text["eos_token_id"]], "do_sample": True,
           "temperature": 1.0, "top_p": 0.95, "top_k": 40, "transformers_version": "5.23.0"}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(Path(tokenizer_dir) / name, out / name)
    # The project's template, which renders exactly what the release's renders (whatever the tokenizer
    # folder shipped): a checkpoint trained on the release format is prompted in it.
    (out / "chat_template.jinja").write_text(chat.CHAT_TEMPLATE, encoding="utf-8")
    if preprocessor is not None:
        (out / "preprocessor_config.json").write_text(json.dumps(dict(preprocessor), indent=2) + "\n")
    for name, value in (extra_files or {}).items():
        (out / name).write_text(json.dumps(value, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return out


def stored_tensors(ckpt_dir: str | Path, prefix: str) -> dict[str, torch.Tensor]:
    """The tensors of an exported checkpoint whose names start with `prefix`, as stored (packed codes and scales,
    not decoded): what `write_checkpoint(keep=...)` writes again unchanged. Encoding decoded weights again is not
    byte-idempotent (NVFP4's weight_scale_2 is recomputed from the decoded amax, MXFP8 can take another block scale
    for the same values), so a part that did not train keeps its bytes this way."""
    folder = Path(ckpt_dir)
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        with safe_open(str(folder / shard), "pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys() if name.startswith(prefix)})
    return out


def folder_bytes(path: str | Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())
