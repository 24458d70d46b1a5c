"""Reading checkpoints in the release's on-disk format (spec `checkpoint.md`).

A checkpoint folder holds `config.json`, `model.safetensors.index.json` (or one
`model.safetensors`), the shards, and tokenizer files. This module

* opens the shards lazily (`safe_open`; tensors and slices are read only when asked for);
* owns the one name table from release tensor names to the engine's module names (`tensor_table`);
* detects each linear's format (BF16, MXFP8, NVFP4 in the ModelOpt or compressed-tensors spelling)
  from the tensors present and cross-checks it with `quantization_config`;
* validates presence, shape and dtype of every tensor and reports all problems in one
  `CheckpointError`;
* decodes a linear, optionally a row or column (K) slice of it, slicing the packed bytes and their
  scales together before decoding (tensor parallelism reads only its part of each shard).

Pickle formats are refused: they can execute code when loaded.
"""

from __future__ import annotations

import fnmatch
import json
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import CheckpointError, ConfigError, QuantFormatError
from ..model.config import HF_QUANT_CONFIG, ModelConfig, load_model_config
from .quant import dequant_mxfp8, dequant_nvfp4

TEXT_PREFIX = "language_model.model."
LM_HEAD = "language_model.lm_head.weight"
VISION_PREFIX = "vision_tower.vision_model."
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")

FLOAT_DTYPES = ("BF16", "F16", "F32")
# Stored dtypes whose values `Checkpoint.read` checks for NaN / Inf (the quantized formats' NaN codes are the
# decoders' to refuse, quant.py).
NONFINITE_DTYPES = ("BF16", "F16", "F32", "F64")
NONFINITE_CHUNK = 1 << 24  # elements tested at a time, so the temporary mask stays small next to a large tensor


def nonfinite(t: torch.Tensor) -> tuple[int, list[int] | None]:
    """(count, index of the first) of the NaN / Inf elements of floating tensor `t`; (0, None) when all are finite.

    Tested in chunks of `NONFINITE_CHUNK` elements of the flattened tensor (a [200064, 6144] embedding would
    otherwise need a 1.2 GB mask); the index is a multi-dimensional index into `t`."""
    flat = t.reshape(-1)
    count, first = 0, None
    for start in range(0, flat.numel(), NONFINITE_CHUNK):
        bad = ~torch.isfinite(flat[start:start + NONFINITE_CHUNK])
        n = int(bad.sum())
        if n and first is None:
            pos = start + int(bad.nonzero()[0, 0])
            first = list(torch.unravel_index(torch.tensor(pos), t.shape)) if t.ndim else []
            first = [int(i) for i in first]
        count += n
    return count, first
NVFP4, MXFP8, DENSE = "nvfp4", "mxfp8", "bf16"
# Every tensor name a linear's prefix may carry, in any of the formats and spellings `_linear_format` accepts.
LINEAR_SUFFIXES = (".weight", ".weight_packed", ".weight_scale", ".weight_scale_2", ".weight_scale_inv",
                   ".weight_global_scale", ".input_scale", ".input_global_scale")

# Families, for summaries and format expectations (checkpoint.md, "Formats per module family").
FAMILIES = ("embedding", "lm_head", "norm", "attention", "indexer", "dense_mlp", "shared_expert",
            "routed_expert", "router", "vision", "projector")


@dataclass(frozen=True)
class LinearSpec:
    """A linear layer of the release: tensor prefix (without `.weight`), shape, and where it goes."""

    prefix: str
    out_features: int
    in_features: int
    family: str
    module: str  # engine module path, e.g. "layers.3.self_attn.q_proj" or "layers.3.block_sparse_moe.experts"
    leaf: str | None = None  # "w1" / "w2" / "w3" for routed experts
    expert: int | None = None


@dataclass(frozen=True)
class TensorSpec:
    """A plain (never quantized) tensor: embedding, norm, router, vision weights, biases."""

    name: str
    shape: tuple[int, ...]
    family: str
    module: str  # engine parameter path
    dtypes: tuple[str, ...] = FLOAT_DTYPES


@dataclass
class LinearFormat:
    """How one linear is stored: `fmt` in {"bf16", "mxfp8", "nvfp4"} and the tensor names used."""

    fmt: str
    weight: str
    scale: str | None = None
    scale_2: str | None = None  # NVFP4 per-tensor global (ModelOpt meaning: multiply)
    input_scale: str | None = None
    compressed_tensors: bool = False  # global scales stored as reciprocals


def tensor_table(cfg: ModelConfig) -> tuple[dict[str, LinearSpec], dict[str, TensorSpec]]:
    """The release's tensor names for `cfg`: linears by prefix, plain tensors by full name."""
    t = cfg.text
    H, D = t.hidden_size, t.head_dim
    linears: dict[str, LinearSpec] = {}
    plain: dict[str, TensorSpec] = {}

    def lin(prefix: str, out: int, inp: int, family: str, module: str, leaf=None, expert=None) -> None:
        linears[prefix] = LinearSpec(prefix, out, inp, family, module, leaf, expert)

    def ten(name: str, shape: tuple[int, ...], family: str, module: str, dtypes=FLOAT_DTYPES) -> None:
        plain[name] = TensorSpec(name, shape, family, module, dtypes)

    ten(TEXT_PREFIX + "embed_tokens.weight", (t.vocab_size, H), "embedding", "embed_tokens.weight")
    ten(TEXT_PREFIX + "norm.weight", (H,), "norm", "norm.weight")
    if not t.tie_word_embeddings:
        lin(LM_HEAD[: -len(".weight")], t.vocab_size, H, "lm_head", "lm_head")
    for L in range(t.num_hidden_layers):
        p, m = f"{TEXT_PREFIX}layers.{L}.", f"layers.{L}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            ten(f"{p}{norm}.weight", (H,), "norm", f"{m}{norm}.weight")
        a, am = p + "self_attn.", m + "self_attn."
        lin(a + "q_proj", t.num_attention_heads * D, H, "attention", am + "q_proj")
        lin(a + "k_proj", t.num_key_value_heads * D, H, "attention", am + "k_proj")
        lin(a + "v_proj", t.num_key_value_heads * D, H, "attention", am + "v_proj")
        lin(a + "o_proj", H, t.num_attention_heads * D, "attention", am + "o_proj")
        ten(a + "q_norm.weight", (D,), "norm", am + "q_norm.weight")
        ten(a + "k_norm.weight", (D,), "norm", am + "k_norm.weight")
        if t.sparse_layers[L]:
            Di = t.sparse.index_head_dim
            lin(a + "index_q_proj", t.sparse.index_heads * Di, H, "indexer", am + "index_q_proj")
            lin(a + "index_k_proj", Di, H, "indexer", am + "index_k_proj")
            ten(a + "index_q_norm.weight", (Di,), "norm", am + "index_q_norm.weight")
            ten(a + "index_k_norm.weight", (Di,), "norm", am + "index_k_norm.weight")
        if t.moe_layers[L]:
            b, bm = p + "block_sparse_moe.", m + "block_sparse_moe."
            E = t.num_local_experts
            ten(b + "gate.weight", (E, H), "router", bm + "gate.weight")
            if t.use_routing_bias:
                ten(b + "e_score_correction_bias", (E,), "router", bm + "gate.e_score_correction_bias")
            if t.n_shared_experts:
                S = t.shared_intermediate_size
                s, sm = b + "shared_experts.", bm + "shared_experts."
                lin(s + "gate_proj", S, H, "shared_expert", sm + "gate_proj")
                lin(s + "up_proj", S, H, "shared_expert", sm + "up_proj")
                lin(s + "down_proj", H, S, "shared_expert", sm + "down_proj")
            I = t.intermediate_size  # noqa: E741
            for e in range(E):
                x = f"{b}experts.{e}."
                lin(x + "w1", I, H, "routed_expert", bm + "experts", "w1", e)
                lin(x + "w3", I, H, "routed_expert", bm + "experts", "w3", e)
                lin(x + "w2", H, I, "routed_expert", bm + "experts", "w2", e)
        else:
            F = t.dense_intermediate_size
            lin(p + "mlp.gate_proj", F, H, "dense_mlp", m + "mlp.gate_proj")
            lin(p + "mlp.up_proj", F, H, "dense_mlp", m + "mlp.up_proj")
            lin(p + "mlp.down_proj", H, F, "dense_mlp", m + "mlp.down_proj")
    if cfg.vision is not None:
        v = cfg.vision
        W, P = v.hidden_size, v.patch_size
        ten(VISION_PREFIX + "embeddings.patch_embedding.weight",
            (W, v.num_channels, v.temporal_patch_size, P, P), "vision",
            "vision_tower.embeddings.patch_embedding.weight")
        for suffix in ("weight", "bias"):
            ten(f"{VISION_PREFIX}pre_layrnorm.{suffix}", (W,), "vision", f"vision_tower.pre_layrnorm.{suffix}")
        for i in range(v.num_hidden_layers):
            p, m = f"{VISION_PREFIX}encoder.layers.{i}.", f"vision_tower.encoder.layers.{i}."
            for ln in ("layer_norm1", "layer_norm2"):
                for suffix in ("weight", "bias"):
                    ten(f"{p}{ln}.{suffix}", (W,), "vision", f"{m}{ln}.{suffix}")
            for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
                ten(f"{p}self_attn.{proj}.weight", (W, W), "vision", f"{m}self_attn.{proj}.weight")
                ten(f"{p}self_attn.{proj}.bias", (W,), "vision", f"{m}self_attn.{proj}.bias")
            ten(f"{p}mlp.fc1.weight", (v.intermediate_size, W), "vision", f"{m}mlp.fc1.weight")
            ten(f"{p}mlp.fc1.bias", (v.intermediate_size,), "vision", f"{m}mlp.fc1.bias")
            ten(f"{p}mlp.fc2.weight", (W, v.intermediate_size), "vision", f"{m}mlp.fc2.weight")
            ten(f"{p}mlp.fc2.bias", (W,), "vision", f"{m}mlp.fc2.bias")
        Hp = cfg.projector_hidden_size
        merged = t.hidden_size * v.spatial_merge_size**2
        for src, dst, shape in (
            ("multi_modal_projector.linear_1", "projector.linear_1", (Hp, W)),
            ("multi_modal_projector.linear_2", "projector.linear_2", (t.hidden_size, Hp)),
            ("patch_merge_mlp.linear_1", "projector.merge_linear_1", (Hp, merged)),
            ("patch_merge_mlp.linear_2", "projector.merge_linear_2", (t.hidden_size, Hp)),
        ):
            ten(src + ".weight", shape, "projector", dst + ".weight")
            ten(src + ".bias", (shape[0],), "projector", dst + ".bias")
    return linears, plain


# ----------------------------------------------------------------------------------------------
# quantization_config


class QuantScheme:
    """What `quantization_config` says about each linear: expected algorithm ("NVFP4", "MXFP8"),
    None (unquantized), or "any" (the config does not decide; the tensors do)."""

    MODELOPT_KEYS = {"quant_method", "quant_algo", "kv_cache_quant_algo", "exclude_modules", "quantized_layers",
                     "producer", "group_size", "config_groups", "ignore", "kv_cache_scheme", "format",
                     "quantization_status", "global_compression_ratio", "sparsity_config", "transform_config",
                     "version", "kv_cache_quant_method"}
    CT_KEYS = {"quant_method", "config_groups", "ignore", "format", "quantization_status",
               "global_compression_ratio", "kv_cache_scheme", "sparsity_config", "transform_config", "version",
               "producer"}
    MXFP8_KEYS = {"quant_method", "weight_block_size", "fmt", "activation_scheme", "modules_to_not_convert",
                  "ignored_layers", "ignore", "exclude_modules"}

    def __init__(self, qc: dict | None, where: str = "quantization_config"):
        self.qc = qc
        self.where = where
        self.method = None if qc is None else qc.get("quant_method")
        if qc is None:
            return
        if not isinstance(qc, dict):
            raise ConfigError(f"{where}: expected an object, got {qc!r}")
        allowed = {"modelopt": self.MODELOPT_KEYS, "compressed-tensors": self.CT_KEYS,
                   "mxfp8": self.MXFP8_KEYS, "fp8": self.MXFP8_KEYS}.get(self.method)
        if allowed is None:
            raise ConfigError(f"{where}: unsupported quant_method={self.method!r} "
                              "(supported: modelopt, compressed-tensors, mxfp8)")
        unknown = sorted(set(qc) - allowed)
        if unknown:
            raise ConfigError(f"{where}: unknown keys {unknown} for quant_method={self.method!r}")
        if self.method == "modelopt":
            algo = qc.get("quant_algo")
            if algo not in ("MIXED_PRECISION", "NVFP4", "MXFP8", None):
                raise ConfigError(f"{where}: unsupported quant_algo={algo!r}")
            for name, entry in (qc.get("quantized_layers") or {}).items():
                a = entry.get("quant_algo") if isinstance(entry, dict) else None
                if a not in ("NVFP4", "MXFP8"):
                    raise ConfigError(f"{where}: quantized_layers[{name!r}] has unsupported quant_algo={a!r}")
        if self.method == "fp8" or (self.method == "mxfp8" and "weight_block_size" in qc):
            bs = qc.get("weight_block_size")
            if bs not in ([1, 32], (1, 32)):
                raise ConfigError(f"{where}: weight_block_size={bs!r}: only [1, 32] (MXFP8) is supported")
        self._groups = []
        for gname, group in (qc.get("config_groups") or {}).items():
            w = (group or {}).get("weights") or {}
            bits, gs = w.get("num_bits"), w.get("group_size")
            algo = {(4, 16): "NVFP4", (8, 32): "MXFP8"}.get((bits, gs))
            if algo is None:
                raise ConfigError(f"{where}: config_groups[{gname!r}] weights num_bits={bits!r} "
                                  f"group_size={gs!r}: only 4/16 (NVFP4) and 8/32 (MXFP8) are supported")
            self._groups.append((algo, list(group.get("targets") or [])))

    @staticmethod
    def _matches(name: str, patterns: list[str]) -> bool:
        for pat in patterns:
            if pat.startswith("re:"):
                if re.match(pat[3:], name):
                    return True
            elif pat == "Linear" or fnmatch.fnmatch(name, pat) or name == pat or name.endswith("." + pat):
                return True
        return False

    def expected(self, prefix: str) -> str | None:
        qc = self.qc
        if qc is None:
            return None
        excluded = list(qc.get("exclude_modules") or []) + list(qc.get("ignore") or []) + list(
            qc.get("modules_to_not_convert") or []) + list(qc.get("ignored_layers") or [])
        short = prefix[len("language_model."):] if prefix.startswith("language_model.") else prefix
        if self._matches(prefix, excluded) or self._matches(short, excluded):
            return None
        if self.method == "modelopt" and qc.get("quantized_layers") is not None:
            layers = qc["quantized_layers"]
            entry = layers.get(prefix) or layers.get(short)
            if entry is not None:
                return entry["quant_algo"]
            if not self._groups:
                return None
        if self._groups:
            for algo, targets in self._groups:
                if self._matches(prefix, targets) or self._matches(short, targets):
                    return algo
            return None
        if self.method == "modelopt" and qc.get("quant_algo") in ("NVFP4", "MXFP8"):
            return qc["quant_algo"]
        if self.method in ("mxfp8", "fp8"):
            return "any"  # single-algorithm MXFP8: each linear is MXFP8 or kept in BF16
        return None


# ----------------------------------------------------------------------------------------------
# the reader


@dataclass
class TensorInfo:
    shard: str
    dtype: str
    shape: tuple[int, ...]


@dataclass
class Checkpoint:
    """An opened checkpoint folder: config, tensor headers, linear formats. No weights read yet."""

    path: Path
    config: ModelConfig
    tensors: dict[str, TensorInfo]
    linears: dict[str, LinearSpec]
    plain: dict[str, TensorSpec]
    formats: dict[str, LinearFormat]
    problems: list[str]
    notes: list[str] = field(default_factory=list)
    _handles: dict = field(default_factory=dict, repr=False)

    # ---- raw access
    def _handle(self, shard: str):
        if shard not in self._handles:
            self._handles[shard] = safe_open(str(self.path / shard), framework="pt", device="cpu")
        return self._handles[shard]

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        """Tensor `name` as stored (or its [rows, cols] slice: only that part is read)."""
        info = self.tensors.get(name)
        if info is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} is not in the checkpoint")
        try:
            h = self._handle(info.shard)
            if rows is None and cols is None:
                t = h.get_tensor(name)
            else:
                sl = h.get_slice(name)
                r = rows or slice(None)
                t = sl[r, cols] if cols is not None else sl[r]
        except Exception as e:  # safetensors raises its own types for truncated or corrupt files
            raise CheckpointError(f"{self.path / info.shard}: cannot read tensor {name!r}: {e}") from None
        if info.dtype == "F8_E8M0":
            t = t.view(torch.uint8)
        if t.is_floating_point() and info.dtype in NONFINITE_DTYPES:
            count, first = nonfinite(t)
            if count:
                # a slice's index is relative to the slice: shift it back so that it names the element of the stored
                # tensor the user can look up (tensor parallelism reads each rank's rows / columns)
                read = []
                for dim, what, sl in ((0, "rows", rows), (1, "columns", cols)):
                    if sl is not None and dim < len(info.shape):
                        r = range(*sl.indices(info.shape[dim]))
                        first[dim] += r.start
                        read.append(f"{what} {r.start}:{r.stop}")
                part = f" (in the part read: {', '.join(read)})" if read else ""
                raise CheckpointError(f"{self.path / info.shard}: tensor {name!r} holds {count} non-finite value(s) "
                                      f"(NaN or Inf){part}, first at index {first}: the file is damaged or was "
                                      "exported wrongly; re-download or re-export it")
        return t

    def read_scalar(self, name: str) -> torch.Tensor:
        return self.read(name).float().reshape(())

    # ---- linears
    def read_linear(self, prefix: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        """Decode linear `prefix` (or the [rows, cols] slice of its [out, in] weight) to fp32.

        Packed data is sliced before decoding: NVFP4 K-slices read `K/2` bytes and `K/16` scales,
        MXFP8 K-slices `K/32` scales; `cols` must be aligned to the format's group (16 or 32).
        """
        f = self.formats[prefix]
        if f.fmt == DENSE:
            return self.read(f.weight, rows, cols).float()
        group = 16 if f.fmt == NVFP4 else 32
        if cols is not None:
            start, stop = cols.start or 0, cols.stop
            if start % group or (stop is not None and stop % group):
                raise CheckpointError(f"{prefix}: column slice {start}:{stop} is not aligned to the "
                                      f"{f.fmt} group of {group}")
        try:
            if f.fmt == NVFP4:
                bcols = None if cols is None else slice((cols.start or 0) // 2, None if cols.stop is None
                                                        else cols.stop // 2)
                scols = None if cols is None else slice((cols.start or 0) // 16, None if cols.stop is None
                                                        else cols.stop // 16)
                packed = self.read(f.weight, rows, bcols)
                scale = self.read(f.scale, rows, scols)
                g = self.read_scalar(f.scale_2)
                if f.compressed_tensors:
                    g = 1.0 / g
                return dequant_nvfp4(packed, scale, g, name=f.weight)
            scols = None if cols is None else slice((cols.start or 0) // 32, None if cols.stop is None
                                                    else cols.stop // 32)
            return dequant_mxfp8(self.read(f.weight, rows, cols), self.read(f.scale, rows, scols), name=f.weight)
        except QuantFormatError as e:
            raise CheckpointError(f"{self.path}: {e}") from None

    def input_scale(self, prefix: str) -> torch.Tensor | None:
        """NVFP4 activation global scale (ModelOpt meaning), None for other formats. Raises for an NVFP4 linear
        without one (weight-only exports load, `open_checkpoint` notes them): never a silent 1.0."""
        f = self.formats[prefix]
        if f.fmt != NVFP4:
            return None
        if f.input_scale is None:
            raise CheckpointError(f"{self.path}: NVFP4 linear {prefix} has no input_scale (tensor "
                                  f"{prefix}.input_scale): the activation quantization (--act-quant emulate, golden "
                                  "bundles) needs it; re-export the checkpoint with it (1.0 if the "
                                  "activations were not calibrated)")
        s = self.read_scalar(f.input_scale)
        return 1.0 / s if f.compressed_tensors else s

    def family_formats(self) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for prefix, spec in self.linears.items():
            if prefix in self.formats:
                out.setdefault(spec.family, set()).add(self.formats[prefix].fmt)
        for spec in self.plain.values():
            if spec.name in self.tensors:
                out.setdefault(spec.family, set()).add(self.tensors[spec.name].dtype.lower())
        return out

    def family_bytes(self) -> dict[str, int]:
        """Bytes on disk per module family (the linears' scales included)."""
        owner: dict[str, str] = {}
        for prefix, spec in self.linears.items():
            f = self.formats.get(prefix)
            if f:
                for n in (f.weight, f.scale, f.scale_2, f.input_scale):
                    if n:
                        owner[n] = spec.family
        for spec in self.plain.values():
            owner[spec.name] = spec.family
        out: dict[str, int] = {}
        for name, info in self.tensors.items():
            fam = owner.get(name, "other")
            out[fam] = out.get(fam, 0) + _nbytes(info)
        return out

    def close(self) -> None:
        self._handles.clear()


_DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
                "F8_E8M0": 1, "I32": 4, "I64": 8, "BOOL": 1, "U16": 2, "I16": 2, "U32": 4}


def _nbytes(info: TensorInfo) -> int:
    n = 1
    for d in info.shape:
        n *= d
    return n * _DTYPE_BYTES.get(info.dtype, 1)


def _read_header(path: Path) -> dict:
    """The JSON header of a safetensors file, checked against the file size (truncation) and for the shape of each
    tensor entry. Raises `ValueError` with a message for the user (what is wrong with the file; no raw parser
    error) when the file cannot be a whole safetensors file."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise ValueError(f"the file has {size} bytes, too few for a safetensors header (truncated, or not a "
                             "safetensors file)")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise ValueError(f"the safetensors header length ({n} bytes) exceeds the file size ({size} bytes) "
                             "(damaged, truncated, or not a safetensors file)")
        try:
            header = json.loads(fh.read(n))
        except ValueError:  # JSONDecodeError, UnicodeDecodeError
            raise ValueError("the safetensors header is not valid JSON (damaged or not a safetensors file)") from None
    if not isinstance(header, dict):
        raise ValueError("the safetensors header is not a JSON object (damaged or not a safetensors file)")
    end = 0
    spans: list[tuple[int, int, str]] = []
    for k, v in header.items():
        if k == "__metadata__":
            continue
        off = v.get("data_offsets") if isinstance(v, dict) else None
        if not (isinstance(v, dict) and isinstance(v.get("dtype"), str) and isinstance(v.get("shape"), list)
                and all(isinstance(d, int) for d in v["shape"]) and isinstance(off, list) and len(off) == 2
                and all(isinstance(o, int) for o in off)):
            raise ValueError(f"the safetensors header's entry {k!r} is not a tensor description (dtype, shape, "
                             "data_offsets) (damaged or not a safetensors file)")
        need = math.prod(v["shape"]) * _DTYPE_BYTES[v["dtype"]] if v["dtype"] in _DTYPE_BYTES else None
        if off[0] < 0 or off[1] < off[0] or (need is not None and off[1] - off[0] != need):
            raise ValueError(f"the safetensors header's entry {k!r} has data_offsets {off} ({off[1] - off[0]} bytes) "
                             f"but {v['dtype']} {v['shape']} needs {need} (a damaged header)")
        spans.append((off[0], off[1], k))
        end = max(end, off[1])
    spans.sort()
    for (_, a_end, a), (b_start, _, b) in zip(spans, spans[1:]):
        if b_start < a_end:
            raise ValueError(f"the safetensors header's entries {a!r} and {b!r} overlap in the file (a damaged "
                             "header)")
    if 8 + n + end > size:
        raise ValueError(f"the file is truncated: its tensors need {8 + n + end} bytes but it has {size}")
    return header


def _linear_format(prefix: str, tensors: dict[str, TensorInfo]) -> LinearFormat | None:
    w = prefix + ".weight"
    if prefix + ".weight_packed" in tensors:
        return LinearFormat(NVFP4, prefix + ".weight_packed", prefix + ".weight_scale",
                            prefix + ".weight_global_scale",
                            prefix + ".input_global_scale" if prefix + ".input_global_scale" in tensors else None,
                            compressed_tensors=True)
    if w not in tensors:
        return None
    dt = tensors[w].dtype
    # a weight of another dtype beside a format's scales was meant in that format: checked as one, its dtype is the
    # problem named (not a dense weight of the wrong shape with unexpected scales)
    odd = dt not in FLOAT_DTYPES and dt not in ("U8", "F8_E4M3")
    if dt == "U8" or (odd and prefix + ".weight_scale_2" in tensors):
        return LinearFormat(NVFP4, w, prefix + ".weight_scale", prefix + ".weight_scale_2",
                            prefix + ".input_scale" if prefix + ".input_scale" in tensors else None)
    if dt == "F8_E4M3" or (odd and (prefix + ".weight_scale_inv" in tensors or prefix + ".weight_scale" in tensors)):
        scale = prefix + ".weight_scale_inv" if prefix + ".weight_scale_inv" in tensors else prefix + ".weight_scale"
        return LinearFormat(MXFP8, w, scale)
    return LinearFormat(DENSE, w)


def _check_plain(spec: TensorSpec, tensors: dict[str, TensorInfo], problems: list[str],
                 unreadable: UnreadableShards | None = None) -> None:
    """Presence, shape and dtype of one plain (never quantized) tensor. A tensor missing because its shard cannot be
    read is left to that shard's problem (`unreadable`)."""
    info = tensors.get(spec.name)
    if info is None:
        if unreadable is not None and unreadable.covers(spec.name):
            return
        problems.append(f"missing tensor {spec.name} ({spec.family}, {list(spec.shape)})")
        return
    if info.shape != spec.shape:
        problems.append(f"{spec.name} in {info.shard}: shape {list(info.shape)}, expected {list(spec.shape)}")
    if info.dtype not in spec.dtypes:
        problems.append(f"{spec.name} in {info.shard}: dtype {info.dtype}, expected {'/'.join(spec.dtypes)}")


def _check_linear(spec: LinearSpec, f: LinearFormat, tensors: dict[str, TensorInfo], problems: list[str],
                  unreadable: UnreadableShards | None = None) -> None:
    """Presence, shape and dtype of the tensors of linear `spec` stored as `f`; a tensor missing because its shard
    cannot be read is left to that shard's problem (`unreadable`)."""
    N, K = spec.out_features, spec.in_features

    def expect(name: str | None, shapes: list[tuple[int, ...]], dtypes: tuple[str, ...]) -> None:
        if name is None:
            return
        info = tensors.get(name)
        if info is None:
            if unreadable is not None and unreadable.covers(name, spec.prefix):
                return
            problems.append(f"missing tensor {name} ({f.fmt} linear {spec.prefix} needs it)")
            return
        if info.shape not in shapes:
            problems.append(f"{name} in {info.shard}: shape {list(info.shape)}, expected "
                            + " or ".join(str(list(s)) for s in shapes))
        if info.dtype not in dtypes:
            problems.append(f"{name} in {info.shard}: dtype {info.dtype}, expected {'/'.join(dtypes)}")

    scalar = [(), (1,)]
    if f.fmt == NVFP4:
        if K % 16:
            problems.append(f"{spec.prefix}: in_features {K} is not a multiple of 16 (NVFP4 group)")
        expect(f.weight, [(N, K // 2)], ("U8",))
        expect(f.scale, [(N, K // 16)], ("F8_E4M3",))
        expect(f.scale_2, scalar, ("F32",))
        expect(f.input_scale, scalar, ("F32",))
    elif f.fmt == MXFP8:
        if K % 32:
            problems.append(f"{spec.prefix}: in_features {K} is not a multiple of 32 (MXFP8 group)")
        expect(f.weight, [(N, K)], ("F8_E4M3",))
        expect(f.scale, [(N, K // 32)], ("U8", "F8_E8M0"))
    else:
        expect(f.weight, [(N, K)], FLOAT_DTYPES)


@dataclass
class UnreadableShards:
    """The shards of a folder that cannot be read (damaged, or named by the index but absent), each with its one
    problem line, and the tensors they would have held. Validation puts a tensor missing for that reason down to its
    shard (`covers`), so that the user reads the shard as the cause, once, instead of each of its tensors as missing
    as if the config were wrong."""

    lines: dict[str, str] = field(default_factory=dict)  # shard file name -> its problem line (names it first)
    names: set[str] = field(default_factory=set)  # the tensors the index maps to those shards
    unindexed: bool = False  # a shard no index describes cannot be read: any tensor missing may have been in it
    covered: set[str] = field(default_factory=set)  # the missing tensors (linears: their prefix) put down to them
    prefixes: set[str] = field(default_factory=set)  # the linear prefixes of `names`

    def add(self, shard: str, line: str, names: list[str] | None) -> None:
        """Shard `shard` cannot be read (`line` says why); `names`: the tensors the index maps to it, None without
        an index."""
        self.lines[shard] = line
        if names is None:
            self.unindexed = True
        else:
            self.names.update(names)
            self.prefixes.update(n.rsplit(".", 1)[0] for n in names)

    def covers(self, name: str, prefix: str | None = None) -> bool:
        """Whether missing tensor `name` (of linear `prefix`, whose other tensors may be spelled differently) is
        explained by an unreadable shard; if so it is counted in `covered`."""
        hit = bool(self.lines) and (self.unindexed or name in self.names
                                    or (prefix is not None and prefix in self.prefixes))
        if hit:
            self.covered.add(prefix or name)
        return hit


def scan_shards(path: Path) -> tuple[dict[str, TensorInfo], list[str]]:
    """Tensor headers of a folder's shards (from `model.safetensors.index.json`, or the lone
    `*.safetensors` files), and the problems found: index entries pointing at missing files,
    unreadable or truncated shards, tensors missing from their shard or absent from the index.
    Raises `CheckpointError` when there are no safetensors at all (naming pickle files if present)."""
    tensors, problems, unreadable = _scan_shards(path)
    return tensors, list(unreadable.lines.values()) + problems


def _scan_shards(path: Path) -> tuple[dict[str, TensorInfo], list[str], UnreadableShards]:
    """`scan_shards`, with the shards that cannot be read kept apart (their lines are not in the problems)."""
    files = sorted(p.name for p in path.glob("*.safetensors"))
    index_path = path / "model.safetensors.index.json"
    if not files and not index_path.exists():
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise CheckpointError(
                f"{path}: only pickle weight files ({', '.join(pickles[:5])}) were found. minimax-ref reads "
                "safetensors only, because loading a pickle can execute arbitrary code; convert the "
                "checkpoint to safetensors first")
        raise CheckpointError(f"{path}: no model.safetensors.index.json and no *.safetensors files")
    problems: list[str] = []
    unreadable = UnreadableShards()
    if index_path.exists():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_path}: not a valid safetensors index ({e})") from None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index_path}: weight_map must be an object {{tensor name: shard file}}, got "
                                  f"{type(weight_map).__name__}; regenerate the index")
        # a shard is a file of this folder: a name with a path in it would read another folder's bytes
        bad = sorted({repr(v) for v in weight_map.values()
                      if not isinstance(v, str) or not v or Path(v).name != v or v in (".", "..")})
        if bad:
            raise CheckpointError(f"{index_path}: weight_map values must be shard file names in this folder, got "
                                  f"{', '.join(bad[:5])}; regenerate the index")
        shards = sorted(set(weight_map.values()))
    else:
        weight_map, shards = None, files
    tensors: dict[str, TensorInfo] = {}
    seen: dict[str, str] = {}  # tensor name -> the first shard that holds it
    for shard in shards:
        sp = path / shard
        users = None if weight_map is None else [n for n, s in weight_map.items() if s == shard]
        if not sp.is_file():
            unreadable.add(shard, f"{shard}: the file does not exist, but {index_path.name} maps {len(users)} "
                                  f"tensors to it (e.g. {users[0]}): copy it into the folder", users)
            continue
        try:
            header = _read_header(sp)
        except (ValueError, OSError) as e:
            held = (f"the {len(users)} tensors {index_path.name} maps to it cannot be read" if users is not None
                    else "its tensors cannot be read")
            unreadable.add(shard, f"{shard}: {e}; {held}: re-download or re-copy this file", users)
            continue
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            if name in seen:  # which copy is meant cannot be known: never one of them in silence
                problems.append(f"tensor {name} is in both {seen[name]} and {shard}: remove the stray copy")
                continue
            seen[name] = shard
            if weight_map is not None and weight_map.get(name) != shard:
                if name not in weight_map:
                    problems.append(f"tensor {name} is in {shard} but not in {index_path.name}")
                else:
                    problems.append(f"tensor {name} is in {shard} but {index_path.name} maps it to "
                                    f"{weight_map[name]}: regenerate the index")
                continue
            tensors[name] = TensorInfo(shard, meta["dtype"], tuple(meta["shape"]))
    for name, shard in (weight_map or {}).items():
        if name not in tensors and shard not in unreadable.lines and name not in seen:
            problems.append(f"tensor {name} is listed in {index_path.name} for {shard} but the shard lacks it")
    return tensors, problems, unreadable


def placed(t: torch.Tensor, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A tensor read from a shard as a parameter on `device` in `dtype`: always its own allocation (one copy, which
    a move or a cast makes anyway). safetensors returns CPU tensors at 8-byte offsets, and CPU BLAS rounds a small
    product differently at different alignments: a parameter left there would give other fp32 bits than the same
    values in torch's 64-byte-aligned memory (a golden bundle's replay, another loader)."""
    return t.to(device=device, dtype=dtype, copy=True)


def _unexpected_why(cfg: ModelConfig, name: str) -> str:
    """Why tensor `name` is not part of the model `cfg` describes: for a layer's MSA indexer or MLP tensors, what the
    config says that layer is (a tensor of the other kind of layer points at the layer schedule)."""
    m = re.search(r"\blayers\.(\d+)\.(self_attn\.index_|block_sparse_moe\.|mlp\.)", name)
    t = cfg.text
    if m is None or int(m.group(1)) >= t.num_hidden_layers:
        return "not part of this model's config"
    layer, kind = int(m.group(1)), m.group(2)
    if kind == "self_attn.index_" and not t.sparse_layers[layer]:
        sac = (cfg.raw.get("text_config") or {}).get("sparse_attention_config") or {}
        if sac.get("use_sparse_attention") is False and any(sac.get("sparse_attention_freq") or []):
            return ("an MSA indexer tensor, but sparse_attention_config.use_sparse_attention is false, which makes "
                    "every layer dense attention: set it true to load the indexers")
        return f"an MSA indexer tensor, but config.json makes layer {layer} a dense-attention layer"
    if kind == "block_sparse_moe." and not t.moe_layers[layer]:
        return f"an MoE tensor, but config.json makes layer {layer} a dense-MLP layer"
    if kind == "mlp." and t.moe_layers[layer]:
        return f"a dense-MLP tensor, but config.json makes layer {layer} an MoE layer"
    return "not part of this model's config"


def open_checkpoint(path: str | Path, *, strict: bool = True) -> Checkpoint:
    """Open and validate a checkpoint folder (headers only: no tensor data is read).

    With `strict` (default) every problem found (missing / extra / misshapen tensors, wrong dtypes,
    formats disagreeing with `quantization_config`, unreadable shards) is raised together as one
    `CheckpointError`; otherwise they are returned in `Checkpoint.problems`.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint folder (it does not exist or is not a directory)")
    # hf_quant_config.json's problems (each disagreement with config.json) are the checkpoint's, listed with the
    # others rather than raised first on their own: `inspect` shows them all at once
    quant_problems: list[str] = []
    cfg = load_model_config(path, quant_problems)
    tensors, problems, unreadable = _scan_shards(path)
    problems[:0] = quant_problems
    notes: list[str] = []

    linears, plain = tensor_table(cfg)
    scheme = _quant_scheme(path, cfg, problems)
    known: set[str] = set()
    formats: dict[str, LinearFormat] = {}
    for prefix, spec in linears.items():
        f = _linear_format(prefix, tensors)
        if f is None:
            # its scales, if present, belong to this linear: the missing weight is the problem, not "unexpected" scales
            known.update(prefix + s for s in LINEAR_SUFFIXES)
            if not unreadable.covers(prefix + ".weight", prefix):
                problems.append(f"missing tensor {prefix}.weight ({spec.family}, [{spec.out_features}, "
                                f"{spec.in_features}])")
            continue
        formats[prefix] = f
        known.update(n for n in (f.weight, f.scale, f.scale_2, f.input_scale) if n)
        _check_linear(spec, f, tensors, problems, unreadable)
        if f.fmt != DENSE:
            if spec.family in ("lm_head",):
                problems.append(f"{prefix} is stored {f.fmt}; the LM head must be unquantized")
        if scheme is None:  # a quantization config that cannot be read decides nothing (its problem is listed)
            continue
        want = scheme.expected(prefix)
        got = {NVFP4: "NVFP4", MXFP8: "MXFP8", DENSE: None}[f.fmt]
        if cfg.quantization is None and got is not None:
            problems.append(f"{prefix} is stored {got} but config.json has no quantization_config")
        elif want != "any" and cfg.quantization is not None and want != got:
            problems.append(f"{prefix} is stored {got or 'unquantized'} but quantization_config says "
                            f"{want or 'unquantized'}")
        elif want == "any" and got == "NVFP4":
            problems.append(f"{prefix} is stored NVFP4 but quantization_config is MXFP8-only")
    for name, spec in plain.items():
        known.add(name)
        _check_plain(spec, tensors, problems, unreadable)
    extra = sorted(n for n in tensors if n not in known)
    mtp = [n for n in extra if ".mtp." in n or n.startswith("mtp.")]
    if mtp:
        notes.append(f"ignored {len(mtp)} multi-token-prediction tensors (mtp.*): not used by this engine")
    # checkpoint.md lists input_scale for every NVFP4 linear, but only activation quantization reads it: a
    # weight-only export loads, and what would read it refuses by name (`Checkpoint.input_scale`)
    no_input_scale = [p for p, f in formats.items() if f.fmt == NVFP4 and f.input_scale is None]
    if no_input_scale:
        notes.append(f"{len(no_input_scale)} NVFP4 linears have no input_scale (first: {no_input_scale[0]}): "
                     "weight-only; --act-quant emulate and golden bundles of these linears refuse them")
    E = cfg.text.num_local_experts
    for n in extra:
        if n in mtp:
            continue
        m = re.search(r"\.experts\.(\d+)\.", n)
        if m and int(m.group(1)) >= E:
            problems.append(f"unexpected tensor {n} in {tensors[n].shard}: expert {m.group(1)} but "
                            f"num_local_experts={E}")
        else:
            problems.append(f"unexpected tensor {n} in {tensors[n].shard} ({_unexpected_why(cfg, n)})")
    # An unreadable shard is the cause of what it held going missing: its line comes first and counts them, and
    # those tensors are not listed one by one (`UnreadableShards.covers`); other problems follow as they are.
    lines = list(unreadable.lines.values())
    if unreadable.unindexed and unreadable.covered:
        n = len(unreadable.covered)
        lines[0] += (f" ({n} tensor{'s' if n != 1 else ''} or linear{'s' if n != 1 else ''} the config needs "
                      f"{'are' if n != 1 else 'is'} in no readable shard)")
    problems[:0] = lines
    ck = Checkpoint(path, cfg, tensors, linears, plain, formats, problems, notes)
    if strict and problems:
        if not lines:
            raise CheckpointError(f"{path}: the checkpoint does not match its config.json "
                                  f"({len(problems)} problems)", problems)
        # the first unreadable shard is the headline, by its full path; every other problem is listed below it
        shard = next(iter(unreadable.lines))
        rest = problems[1:]
        head = f"{path / shard}{lines[0][len(shard):]}"
        if rest:
            head += f"; {len(rest)} other problem{'s' if len(rest) != 1 else ''}:"
        err = CheckpointError(head, rest)
        err.problems = problems  # all of them, the shard's first
        raise err
    return ck


def _quant_scheme(path: Path, cfg: ModelConfig, problems: list[str]) -> QuantScheme | None:
    """The quantization config `cfg` uses, read (None, its problem appended to `problems`, when it cannot be);
    an `hf_quant_config.json` beside a config.json quantization_config (which wins) is checked the same way, so
    that an unknown key or algorithm in either file is a listed problem, not a silent one or a first-and-only
    error."""
    hf = path / HF_QUANT_CONFIG
    hf_q = None
    if hf.is_file():
        try:
            raw = json.loads(hf.read_text(encoding="utf-8"))
            q = raw.get("quantization") if isinstance(raw, dict) else None
            hf_q = {"quant_method": raw.get("quant_method", "modelopt"), **q} if isinstance(q, dict) else None
        except (ValueError, OSError):
            pass  # load_model_config reported the unreadable file
    scheme = None
    try:
        where = f"{hf} quantization" if hf_q == cfg.quantization else f"{path / 'config.json'} quantization_config"
        scheme = QuantScheme(cfg.quantization, where)
    except ConfigError as e:
        problems.append(str(e))
    if hf_q is not None and hf_q != cfg.quantization:
        try:
            QuantScheme(hf_q, f"{hf} quantization")
        except ConfigError as e:
            problems.append(str(e))
    return scheme


def check_values(ck: Checkpoint) -> list[str]:
    """Read every tensor of `ck` and report, naming each tensor, what loading would refuse: NaN / Inf in floating
    tensors (`Checkpoint.read`), E4M3 NaN bytes in MXFP8 weights, and bad scales (`check_scales`). All problems
    are returned together; the files' headers must already be valid (`open_checkpoint`)."""
    problems = []
    global_scales = {n for f in ck.formats.values() for n in (f.scale_2, f.input_scale) if n}  # check_scales' part
    for name, info in ck.tensors.items():
        if info.dtype not in NONFINITE_DTYPES or name in global_scales:
            continue
        try:
            ck.read(name)
        except CheckpointError as e:
            problems.append(str(e).removeprefix(f"{ck.path / info.shard}: "))
    for f in ck.formats.values():
        if f.fmt == MXFP8 and f.weight in ck.tensors:
            nan = (ck.read(f.weight).view(torch.uint8) & 0x7F) == 0x7F
            if bool(nan.any()):
                problems.append(f"{f.weight}: MXFP8 weight holds {int(nan.sum())} E4M3 NaN byte(s) (0x7f/0xff)")
    return problems + check_scales(ck)


def check_scales(ck: Checkpoint) -> list[str]:
    """Read every scale tensor and report non-finite values and E8M0 code 255, naming the tensor."""
    problems = []
    for f in ck.formats.values():
        if f.fmt == MXFP8:
            s = ck.read(f.scale)
            if bool((s == 255).any()):
                problems.append(f"{f.scale}: E8M0 scale code 255 (NaN)")
        elif f.fmt == NVFP4:
            s = ck.read(f.scale).float()
            if not bool(torch.isfinite(s).all()):
                problems.append(f"{f.scale}: non-finite block scale")
            for n in (f.scale_2, f.input_scale):
                if n is not None:
                    try:
                        v = ck.read(n).float()
                    except CheckpointError:  # Checkpoint.read refuses the non-finite ones
                        problems.append(f"{n}: global scale is not finite")
                        continue
                    if not bool(torch.isfinite(v).all()) or bool((v <= 0).any()):
                        problems.append(f"{n}: global scale {v.flatten().tolist()} is not finite and positive")
    return problems

