"""Typed configuration, parsed once from a checkpoint's `config.json`.

Two spellings of the same model are accepted (spec `model.md`, "Configuration"):

* the raw release form: `text_config.sparse_attention_config` with `sparse_*` keys and the
  per-layer frequency lists `sparse_attention_freq` / `moe_layer_freq`;
* the flat form written by `transformers` >= 5: `layer_types` ("minimax_m3_sparse" /
  "full_attention"), `mlp_layer_types` ("sparse" / "dense"), `index_*` keys and
  `rope_parameters`.

A text-only config (no `text_config` nesting) is read as the text model itself. Values the engine
does not implement are rejected with a `ConfigError` naming the field and the value. Runtime
settings (sequence length, batch size, KV-cache dtype) live in `RuntimeConfig`, not here.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ..errors import ConfigError, InputError

SPARSE_LAYER = "minimax_m3_sparse"
DENSE_LAYER = "full_attention"
#: The KV cache's length when none is given (`RuntimeConfig.max_seq_len`), capped by the model's position limit.
DEFAULT_MAX_SEQ_LEN = 4096


_REQUIRED = object()


def _int(d: dict, key: str, where: str, default: Any = _REQUIRED, minimum: int | None = 1) -> int:
    """Integer field `key` of `d` (null or absent: `default`), at least `minimum`, or a ConfigError naming it.

    JSON integers only (an integral float such as 128.0 is accepted; booleans and strings are not):
    int("4") would quietly accept a quoted number and int(None) fail with a TypeError naming nothing.
    """
    value = d.get(key)
    if value is None:
        if default is _REQUIRED:
            problem = "is missing" if key not in d else "is null"
            raise ConfigError(f"{where}: required field {key!r} {problem}; it must be an integer")
        value = default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where}: {key}={value!r} must be an integer")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{where}: {key}={value!r} must be >= {minimum}")
    return value


def _float(d: dict, key: str, where: str, default: float, *, positive: bool = False) -> float:
    """Finite number field `key` of `d` (null or absent: `default`), > 0 when `positive`, or a ConfigError
    naming it: a negative rms_norm_eps or a NaN theta would run and print garbage instead of failing."""
    value = d.get(key)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where}: {key}={value!r} must be a number")
    value = float(value)
    if not math.isfinite(value) or (positive and value <= 0):
        raise ConfigError(f"{where}: {key}={value!r} must be a finite number{' > 0' if positive else ''}")
    return value


def _bool(d: dict, key: str, where: str, default: bool) -> bool:
    value = d.get(key)
    if value is None:
        return default
    if not isinstance(value, bool) and value not in (0, 1):
        raise ConfigError(f"{where}: {key}={value!r} must be true or false")
    return bool(value)


def _require(condition: bool, where: str, field_name: str, value: Any, why: str) -> None:
    if not condition:
        raise ConfigError(f"{where}: unsupported {field_name}={value!r}: {why}")


@dataclass(frozen=True)
class SparseAttentionConfig:
    """MiniMax Sparse Attention geometry (lightning indexer + block selection)."""

    index_heads: int = 4
    index_head_dim: int = 128
    block_size: int = 128
    topk_blocks: int = 16
    local_blocks: int = 1
    init_blocks: int = 0
    score_type: str = "max"


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int  # one routed expert
    shared_intermediate_size: int
    dense_intermediate_size: int
    num_local_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    routed_scaling_factor: float
    use_routing_bias: bool
    rms_norm_eps: float
    rope_theta: float
    rotary_dim: int
    max_position_embeddings: int
    swiglu_alpha: float
    swiglu_limit: float
    tie_word_embeddings: bool
    sparse_layers: tuple[bool, ...]  # per layer: MSA (with an indexer) or dense attention
    moe_layers: tuple[bool, ...]  # per layer: MoE block or dense MLP
    sparse: SparseAttentionConfig
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def has_moe(self) -> bool:
        return any(self.moe_layers)

    def layer_kind(self, layer: int) -> str:
        attn = "msa" if self.sparse_layers[layer] else "dense-attn"
        ffn = "moe" if self.moe_layers[layer] else "dense-mlp"
        return f"{attn}+{ffn}"


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int = 1280
    intermediate_size: int = 5120
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    num_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    layer_norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def patch_row_size(self) -> int:
        """Values per pixel row fed to the patch embedding: C * T * P * P (1176 in the release)."""
        return self.num_channels * self.temporal_patch_size * self.patch_size**2


@dataclass(frozen=True)
class ModelConfig:
    """Everything `config.json` says about the model (text, optional vision, quantization)."""

    text: TextConfig
    vision: VisionConfig | None
    image_token_id: int | None
    video_token_id: int | None
    projector_hidden_size: int
    quantization: dict | None  # the raw `quantization_config`, interpreted by checkpoint.py
    raw: dict = field(repr=False, compare=False, default_factory=dict)

    def __repr__(self) -> str:
        # short: the per-layer lists as counts, the quantization config (hundreds of per-module entries in the
        # release) as its method and size; `raw` and the full fields stay available as attributes
        t = self.text
        scalars = ", ".join(f"{f}={getattr(t, f)!r}" for f in t.__dataclass_fields__
                            if f not in ("sparse_layers", "moe_layers", "sparse"))
        text = (f"TextConfig({scalars}, sparse_layers={sum(t.sparse_layers)}/{len(t.sparse_layers)}, "
                f"moe_layers={sum(t.moe_layers)}/{len(t.moe_layers)}, sparse={t.sparse!r})")
        quant = None
        if isinstance(self.quantization, dict):
            quant = "{" + ", ".join(f"{k!r}: <{len(v)} entries>" if isinstance(v, (list, dict)) else f"{k!r}: {v!r}"
                                    for k, v in self.quantization.items()) + "}"
        return (f"ModelConfig(text={text}, vision={self.vision!r}, image_token_id={self.image_token_id!r}, "
                f"video_token_id={self.video_token_id!r}, projector_hidden_size={self.projector_hidden_size!r}, "
                f"quantization={quant})")

    @property
    def merged_hidden_size(self) -> int:
        assert self.vision is not None
        return self.text.hidden_size * self.vision.spatial_merge_size**2


@dataclass(frozen=True)
class DrafterConfig:
    """The DSpark drafter of `dspark/config.json` (spec `dspark.md`)."""

    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    block_size: int
    noise_token_id: int
    markov_rank: int
    target_layer_ids: tuple[int, ...]
    sliding_window: int
    enable_confidence_head: bool
    confidence_head_with_markov: bool
    rms_norm_eps: float
    rope_theta: float
    rotary_dim: int
    swiglu_alpha: float
    swiglu_limit: float
    quantization: dict | None


@dataclass(frozen=True)
class RuntimeConfig:
    """Settings chosen when loading, not stored in the checkpoint.

    max_seq_len: longest sequence (prompt + generated) the KV cache holds; default None: 4096
        (`DEFAULT_MAX_SEQ_LEN`), or the model's `max_position_embeddings` where that is smaller
        (`resolved`). A value given above `max_position_embeddings` is refused when the model loads.
    max_batch_size: sequences decoded together; default None: chosen per call from the memory left
        (`generation.sizing`).
    kv_cache_dtype: "auto" (the compute dtype) or "fp8" (float8_e4m3fn, saturating, scale 1.0).
    max_images_per_prompt: images one prompt may carry; default 1 (the seed's deployment).
    attention_chunk_elements: the largest temporary one attention query chunk may create, in
        elements (default 2**24: 64 MiB in fp32); queries are chunked so memory is linear in context.
    """

    max_seq_len: int | None = None
    max_batch_size: int | None = None
    kv_cache_dtype: str = "auto"
    max_images_per_prompt: int = 1
    attention_chunk_elements: int = 1 << 24

    def __post_init__(self) -> None:
        if self.max_seq_len is not None and self.max_seq_len < 1:
            raise ConfigError(f"runtime setting max_seq_len={self.max_seq_len!r} must be >= 1")
        if self.max_batch_size is not None and self.max_batch_size < 1:
            raise ConfigError(f"runtime setting max_batch_size={self.max_batch_size!r} must be >= 1")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ConfigError(
                f"runtime setting kv_cache_dtype={self.kv_cache_dtype!r}: choose 'auto' or 'fp8'"
            )
        if self.attention_chunk_elements < 1:
            raise ConfigError(
                f"runtime setting attention_chunk_elements={self.attention_chunk_elements!r} must be >= 1")
        if self.max_images_per_prompt < 0:
            raise ConfigError(
                f"runtime setting max_images_per_prompt={self.max_images_per_prompt!r} must be >= 0"
            )

    def resolved(self, max_position_embeddings: int,
                 flag: str = "max_seq_len (--max-model-len on the command line)") -> RuntimeConfig:
        """These settings for a model of `max_position_embeddings`: max_seq_len given (None: the default, capped
        by the model's limit). A given max_seq_len above the limit is a ConfigError naming `flag` (the setting as
        the caller spelled it, e.g. the CLI's --max-model-len)."""
        if self.max_seq_len is None:
            return replace(self, max_seq_len=min(DEFAULT_MAX_SEQ_LEN, max_position_embeddings))
        if self.max_seq_len > max_position_embeddings:
            raise ConfigError(f"{flag}={self.max_seq_len} exceeds the model's max_position_embeddings="
                              f"{max_position_embeddings} (config.json): give {flag} "
                              f"{max_position_embeddings} or less")
        return self

    @classmethod
    def from_kwargs(cls, where: str = "load_model", **kwargs: Any) -> RuntimeConfig:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ConfigError(
                f"{where}: unknown runtime setting(s) {unknown}; known: {sorted(names)}"
            )
        return cls(**kwargs)


# ----------------------------------------------------------------------------------------------
# parsing


def _freq_list(values: Any, n_layers: int, where: str, name: str) -> tuple[bool, ...]:
    if not isinstance(values, (list, tuple)):
        raise ConfigError(f"{where}: {name} must be a list of 0/1 per layer, got {values!r}")
    if len(values) != n_layers:
        raise ConfigError(
            f"{where}: {name} has {len(values)} entries but num_hidden_layers={n_layers}"
        )
    out = []
    for v in values:
        if v not in (0, 1, True, False):
            raise ConfigError(f"{where}: {name} entries must be 0 or 1, got {v!r}")
        out.append(bool(v))
    return tuple(out)


def _type_list(values: Any, n_layers: int, where: str, name: str, yes: str, no: str) -> tuple[bool, ...]:
    if not isinstance(values, (list, tuple)) or len(values) != n_layers:
        raise ConfigError(
            f"{where}: {name} must list one entry per layer ({n_layers}), got {values!r}"
        )
    out = []
    for v in values:
        if v not in (yes, no):
            raise ConfigError(f"{where}: {name} entry {v!r} is not one of {yes!r}, {no!r}")
        out.append(v == yes)
    return tuple(out)


# The text model's fields without a default: a config lacking them describes no model.
TEXT_REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")


def parse_text_config(tc: dict, where: str = "config.json text_config") -> TextConfig:
    """Parse the text model's config from either the raw release form or the transformers form."""
    if not isinstance(tc, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(tc).__name__}")
    absent = [key for key in TEXT_REQUIRED if tc.get(key) is None]
    if len(absent) > 1:  # all of them in one message (one alone gets _int's)
        raise ConfigError(f"{where}: required fields {absent} are missing or null; each must be an integer")
    n_layers = _int(tc, "num_hidden_layers", where)
    hidden = _int(tc, "hidden_size", where)
    n_heads = _int(tc, "num_attention_heads", where)
    vocab = _int(tc, "vocab_size", where)

    n_kv = _int(tc, "num_key_value_heads", where, n_heads)
    head_dim = _int(tc, "head_dim", where, hidden // n_heads)
    _require(n_heads % n_kv == 0, where, "num_key_value_heads", n_kv,
             f"must divide num_attention_heads={n_heads}")

    # --- activation / norm features this engine implements exactly one way
    act = tc.get("hidden_act", "swigluoai")
    # transformers rewrites hidden_act to "silu" while computing SwiGLU-OAI inline.
    _require(act in ("swigluoai", "silu"), where, "hidden_act", act, "only 'swigluoai' is implemented")
    beta = tc.get("swiglu_beta", 1.0)
    _require(beta in (None, 1, 1.0), where, "swiglu_beta", beta, "only 1.0 is implemented")
    _require(tc.get("use_gemma_norm", True) is True, where, "use_gemma_norm",
             tc.get("use_gemma_norm"), "only Gemma (1 + w) RMSNorm is implemented")
    qk_norm = tc.get("qk_norm_type", "per_head")
    _require(qk_norm == "per_head", where, "qk_norm_type", qk_norm, "only 'per_head' is implemented")
    _require(tc.get("use_qk_norm", True) is True, where, "use_qk_norm", tc.get("use_qk_norm"),
             "q/k norms are always applied by this model family")
    gate = tc.get("attention_output_gate", False)
    _require(not gate, where, "attention_output_gate", gate, "the output gate is not implemented")
    scoring = tc.get("scoring_func", "sigmoid")
    _require(scoring == "sigmoid", where, "scoring_func", scoring, "only 'sigmoid' routing is implemented")
    n_shared = _int(tc, "n_shared_experts", where, 1, minimum=0)
    _require(n_shared in (0, 1), where, "n_shared_experts", n_shared, "0 or 1 shared expert supported")
    for bad in ("rope_scaling",):
        if tc.get(bad):
            raise ConfigError(f"{where}: unsupported {bad}={tc[bad]!r}: RoPE scaling is not implemented")

    # --- RoPE: top-level keys (raw form) or rope_parameters (transformers form)
    rope_params = tc.get("rope_parameters") or {}
    if not isinstance(rope_params, dict):
        raise ConfigError(f"{where}: rope_parameters must be an object, got {rope_params!r}")
    rope_type = rope_params.get("rope_type", rope_params.get("type", "default"))
    _require(rope_type == "default", where, "rope_parameters.rope_type", rope_type,
             "only plain RoPE is implemented (no scaling)")
    if rope_params.get("rope_theta") is not None:
        theta = _float(rope_params, "rope_theta", f"{where} rope_parameters", 5_000_000.0, positive=True)
    else:
        theta = _float(tc, "rope_theta", where, 5_000_000.0, positive=True)
    partial = rope_params.get("partial_rotary_factor", tc.get("partial_rotary_factor"))
    from_partial = None if partial is None else int(
        head_dim * _float({"partial_rotary_factor": partial}, "partial_rotary_factor", where, 0.5, positive=True))
    if "rotary_dim" in tc and tc["rotary_dim"] is not None:
        rotary_dim = _int(tc, "rotary_dim", where)
        if from_partial is not None and from_partial != rotary_dim:
            raise ConfigError(f"{where}: rotary_dim={rotary_dim} disagrees with partial_rotary_factor={partial} "
                              f"(head_dim={head_dim} x {partial} = {from_partial} rotated channels): give one, or "
                              "make them agree")
    elif from_partial is not None:
        rotary_dim = from_partial
    else:
        rotary_dim = head_dim // 2
    _require(0 < rotary_dim <= head_dim and rotary_dim % 2 == 0, where, "rotary_dim", rotary_dim,
             f"must be even and in (0, head_dim={head_dim}]")

    # --- layer schedule
    sac = tc.get("sparse_attention_config") or {}
    if not isinstance(sac, dict):
        raise ConfigError(f"{where}: sparse_attention_config must be an object or null")
    if tc.get("layer_types") is not None:
        sparse_layers = _type_list(tc["layer_types"], n_layers, where, "layer_types",
                                   SPARSE_LAYER, DENSE_LAYER)
    elif sac.get("sparse_attention_freq") is not None and sac.get("use_sparse_attention", True):
        sparse_layers = _freq_list(sac["sparse_attention_freq"], n_layers, where,
                                   "sparse_attention_config.sparse_attention_freq")
    else:
        sparse_layers = (False,) * n_layers
    if tc.get("mlp_layer_types") is not None:
        moe_layers = _type_list(tc["mlp_layer_types"], n_layers, where, "mlp_layer_types",
                                "sparse", "dense")
    elif tc.get("moe_layer_freq") is not None:
        moe_layers = _freq_list(tc["moe_layer_freq"], n_layers, where, "moe_layer_freq")
    else:
        moe_layers = (True,) * n_layers
    if "sparse_disable_index_value" in sac:
        div = _freq_list(sac["sparse_disable_index_value"], n_layers, where,
                         "sparse_attention_config.sparse_disable_index_value")
        bad = [i for i, (s, d) in enumerate(zip(sparse_layers, div)) if s and not d]
        if bad:
            raise ConfigError(
                f"{where}: sparse_attention_config.sparse_disable_index_value is 0 on sparse layers "
                f"{bad[:8]}: the index-value path is not implemented (the release disables it)"
            )

    def sparse_key(flat: str, legacy: str, default: Any) -> Any:
        if tc.get(flat) is not None:
            return tc[flat]
        if sac.get(legacy) is not None:
            return sac[legacy]
        return default

    def sparse_int(flat: str, legacy: str, default: int) -> int:
        name = flat if tc.get(flat) is not None else f"sparse_attention_config.{legacy}"
        return _int({name: sparse_key(flat, legacy, default)}, name, where, minimum=None)

    sparse = SparseAttentionConfig(
        index_heads=sparse_int("index_n_heads", "sparse_num_index_heads", n_kv),
        index_head_dim=sparse_int("index_head_dim", "sparse_index_dim", head_dim),
        block_size=sparse_int("index_block_size", "sparse_block_size", 128),
        topk_blocks=sparse_int("index_topk_blocks", "sparse_topk_blocks", 16),
        local_blocks=sparse_int("index_local_blocks", "sparse_local_block", 1),
        init_blocks=sparse_int("index_init_blocks", "sparse_init_block", 0),
        score_type=str(sparse_key("index_score_type", "sparse_score_type", "max")),
    )
    if any(sparse_layers):
        _require(sparse.score_type == "max", where, "sparse_score_type", sparse.score_type,
                 "only 'max' block pooling is implemented")
        _require(sparse.index_heads == n_kv, where, "sparse_num_index_heads", sparse.index_heads,
                 f"index heads must equal num_key_value_heads={n_kv} (one selection per kv head)")
        _require(sparse.block_size >= 1, where, "sparse_block_size", sparse.block_size, "must be >= 1")
        _require(sparse.topk_blocks >= 1, where, "sparse_topk_blocks", sparse.topk_blocks, "must be >= 1")
        _require(sparse.local_blocks >= 0, where, "sparse_local_block", sparse.local_blocks, "must be >= 0")
        _require(sparse.init_blocks >= 0, where, "sparse_init_block", sparse.init_blocks, "must be >= 0")
        _require(sparse.local_blocks + sparse.init_blocks <= sparse.topk_blocks, where,
                 "sparse_local_block", sparse.local_blocks,
                 f"forced blocks (local + init) exceed sparse_topk_blocks={sparse.topk_blocks}")
        _require(rotary_dim <= sparse.index_head_dim and sparse.index_head_dim % 2 == 0, where,
                 "sparse_index_dim", sparse.index_head_dim, f"must be even and >= rotary_dim={rotary_dim}")

    n_experts = _int(tc, "num_local_experts", where, tc.get("num_experts", 0) or 0, minimum=0)
    top_k = _int(tc, "num_experts_per_tok", where, 4)
    if any(moe_layers):
        _require(n_experts >= 1, where, "num_local_experts", n_experts, "MoE layers need experts")
        _require(1 <= top_k <= n_experts, where, "num_experts_per_tok", top_k,
                 f"must be in [1, num_local_experts={n_experts}]")

    eos = tc.get("eos_token_id")
    eos_list = [] if eos is None else eos if isinstance(eos, list) else [eos]
    eos_ids = tuple(_int({"eos_token_id": e}, "eos_token_id", where, minimum=0) for e in eos_list)
    bos = None if tc.get("bos_token_id") is None else _int(tc, "bos_token_id", where, minimum=0)
    inter = _int(tc, "intermediate_size", where, 3072)
    return TextConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        intermediate_size=inter,
        shared_intermediate_size=_int(tc, "shared_intermediate_size", where, inter),
        dense_intermediate_size=_int(tc, "dense_intermediate_size", where, 4 * inter),
        num_local_experts=n_experts,
        num_experts_per_tok=top_k,
        n_shared_experts=n_shared,
        routed_scaling_factor=_float(tc, "routed_scaling_factor", where, 2.0, positive=True),
        use_routing_bias=_bool(tc, "use_routing_bias", where, True),
        rms_norm_eps=_float(tc, "rms_norm_eps", where, 1e-6, positive=True),
        rope_theta=theta,
        rotary_dim=rotary_dim,
        max_position_embeddings=_int(tc, "max_position_embeddings", where, 1 << 20),
        swiglu_alpha=_float(tc, "swiglu_alpha", where, 1.702),
        swiglu_limit=_float(tc, "swiglu_limit", where, 7.0, positive=True),
        tie_word_embeddings=_bool(tc, "tie_word_embeddings", where, False),
        sparse_layers=sparse_layers,
        moe_layers=moe_layers,
        sparse=sparse,
        bos_token_id=bos,
        eos_token_id=eos_ids,
    )


def parse_vision_config(vc: dict, where: str = "config.json vision_config") -> VisionConfig:
    if not isinstance(vc, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(vc).__name__}")
    rope = vc.get("rope_parameters") or {}
    act = vc.get("hidden_act", "gelu")
    _require(act in ("gelu",), where, "hidden_act", act, "the vision MLP implements erf GELU only")
    pos = vc.get("position_embedding_type", "rope")
    _require(pos == "rope", where, "position_embedding_type", pos, "only 3-D RoPE is implemented")
    rope_mode = vc.get("rope_mode", "3d")
    _require(rope_mode == "3d", where, "rope_mode", rope_mode, "only '3d' axial RoPE is implemented")
    if not isinstance(rope, dict):
        raise ConfigError(f"{where}: rope_parameters must be an object, got {rope!r}")
    cfg = VisionConfig(
        hidden_size=_int(vc, "hidden_size", where, 1280),
        intermediate_size=_int(vc, "intermediate_size", where, 5120),
        num_hidden_layers=_int(vc, "num_hidden_layers", where, 32),
        num_attention_heads=_int(vc, "num_attention_heads", where, 16),
        num_channels=_int(vc, "num_channels", where, 3),
        patch_size=_int(vc, "patch_size", where, 14),
        temporal_patch_size=_int(vc, "temporal_patch_size", where, 2),
        spatial_merge_size=_int(vc, "spatial_merge_size", where, 2),
        layer_norm_eps=_float(vc, "layer_norm_eps", where, 1e-5, positive=True),
        rope_theta=(_float(rope, "rope_theta", f"{where} rope_parameters", 10000.0, positive=True)
                    if rope.get("rope_theta") is not None else _float(vc, "rope_theta", where, 10000.0, positive=True)),
    )
    _require(cfg.hidden_size % cfg.num_attention_heads == 0, where, "num_attention_heads",
             cfg.num_attention_heads, f"must divide hidden_size={cfg.hidden_size}")
    return cfg


def parse_model_config(raw: dict, where: str = "config.json") -> ModelConfig:
    """Parse a whole `config.json` (VL wrapper with text_config/vision_config, or text-only)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a JSON object at the top level")
    model_type = raw.get("model_type")
    known = (None, "minimax_m3_vl", "minimax_m3_vl_text", "minimax_m3")
    _require(model_type in known, where, "model_type", model_type,
             "this engine runs the minimax_m3_vl family only")
    if "text_config" in raw:
        text = parse_text_config(raw["text_config"], f"{where} text_config")
        vision = (
            parse_vision_config(raw["vision_config"], f"{where} vision_config")
            if raw.get("vision_config")
            else None
        )
    else:
        if all(raw.get(key) is None for key in TEXT_REQUIRED):
            raise ConfigError(f"{where}: no text model: neither a 'text_config' object (the release's layout) nor "
                              f"the text model's fields {list(TEXT_REQUIRED)} at the top level")
        text = parse_text_config(raw, where)
        vision = None
    compression = raw.get("img_token_compression_config")
    if vision is not None and isinstance(compression, dict):  # the release repeats the merge in both places
        for key, ours in (("spatial_merge_size", vision.spatial_merge_size),
                          ("temporal_patch_size", vision.temporal_patch_size)):
            if compression.get(key) is not None and compression[key] != ours:
                raise ConfigError(f"{where}: img_token_compression_config.{key}={compression[key]!r} disagrees "
                                  f"with vision_config.{key}={ours}: they must be equal")
    quant = raw.get("quantization_config")
    quant_where = f"{where} quantization_config"
    if quant is None and isinstance(raw.get("text_config"), dict):
        quant = raw["text_config"].get("quantization_config")
        quant_where = f"{where} text_config.quantization_config"
    if quant is not None and not isinstance(quant, dict):
        raise ConfigError(f"{quant_where}: expected an object (or null for an unquantized checkpoint), got {quant!r}")
    for key in ("image_token_index", "image_token_id", "video_token_index", "video_token_id"):
        if raw.get(key) is not None:
            _int(raw, key, where, minimum=0)
    return ModelConfig(
        text=text,
        vision=vision,
        image_token_id=raw.get("image_token_index", raw.get("image_token_id")),
        video_token_id=raw.get("video_token_index", raw.get("video_token_id")),
        projector_hidden_size=_int(raw, "projector_hidden_size", where, text.hidden_size),
        quantization=quant,
        raw=raw,
    )


def parse_drafter_config(raw: dict, target: TextConfig, where: str = "dspark/config.json") -> DrafterConfig:
    """Parse `dspark/config.json`; keys under `text_config` win, top-level copies must agree."""
    tc = dict(raw.get("text_config") or {})
    for key, value in raw.items():
        if key in ("text_config",):
            continue
        if key in tc and tc[key] != value and key not in ("architectures", "model_type"):
            raise ConfigError(
                f"{where}: {key} is {tc[key]!r} under text_config but {value!r} at the top level"
            )
        tc.setdefault(key, value)
    need = ["num_hidden_layers", "hidden_size", "dspark_block_size", "dspark_target_layer_ids"]
    missing = [k for k in need if k not in tc]
    if missing:
        raise ConfigError(f"{where}: required field(s) {missing} missing")
    if tc.get("sparse_attention_config"):
        raise ConfigError(f"{where}: sparse_attention_config must be null for a DSpark drafter")
    ids = tc["dspark_target_layer_ids"]
    if not isinstance(ids, list) or not ids:
        raise ConfigError(f"{where}: dspark_target_layer_ids={ids!r} must be a non-empty list of layer indices (the "
                          "target layers whose hidden states the drafter reads)")
    layer_ids = tuple(_int({"dspark_target_layer_ids": i}, "dspark_target_layer_ids", where, minimum=0) for i in ids)
    bad = [i for i in layer_ids if not 0 <= i < target.num_hidden_layers]
    if bad:
        raise ConfigError(
            f"{where}: dspark_target_layer_ids {bad} outside the target's "
            f"{target.num_hidden_layers} layers"
        )
    head_type = tc.get("dspark_markov_head_type", "vanilla")
    _require(head_type == "vanilla", where, "dspark_markov_head_type", head_type,
             "only the 'vanilla' Markov head is implemented")
    hidden = _int(tc, "hidden_size", where)
    _require(hidden == target.hidden_size, where, "hidden_size", hidden,
             f"must equal the target's hidden_size={target.hidden_size}")
    vocab = _int(tc, "vocab_size", where, target.vocab_size)
    _require(vocab == target.vocab_size, where, "vocab_size", vocab,
             f"must equal the target's vocab_size={target.vocab_size}")
    return DrafterConfig(
        num_hidden_layers=_int(tc, "num_hidden_layers", where),
        hidden_size=hidden,
        vocab_size=vocab,
        num_attention_heads=_int(tc, "num_attention_heads", where, target.num_attention_heads),
        num_key_value_heads=_int(tc, "num_key_value_heads", where, target.num_key_value_heads),
        head_dim=_int(tc, "head_dim", where, target.head_dim),
        intermediate_size=_int(tc, "dspark_ffn_hidden_size", where,
                               _int(tc, "dense_intermediate_size", where, target.dense_intermediate_size)),
        block_size=_int(tc, "dspark_block_size", where),
        noise_token_id=_int(tc, "dspark_noise_token_id", where, 200058, minimum=0),
        markov_rank=_int(tc, "dspark_markov_rank", where, 256),
        target_layer_ids=layer_ids,
        sliding_window=_int(tc, "sliding_window", where, 4096),
        enable_confidence_head=bool(tc.get("enable_confidence_head", False)),
        confidence_head_with_markov=bool(tc.get("confidence_head_with_markov", True)),
        rms_norm_eps=_float(tc, "rms_norm_eps", where, target.rms_norm_eps, positive=True),
        rope_theta=_float(tc, "rope_theta", where, target.rope_theta, positive=True),
        rotary_dim=_int(tc, "rotary_dim", where, target.rotary_dim),
        swiglu_alpha=_float(tc, "swiglu_alpha", where, target.swiglu_alpha),
        swiglu_limit=_float(tc, "swiglu_limit", where, target.swiglu_limit, positive=True),
        quantization=tc.get("quantization_config"),
    )


def read_json(path: Path, what: str) -> dict:
    """Read a JSON file with an error that names it when it is missing or malformed."""
    if not path.is_file():
        raise ConfigError(f"{path}: {what} not found")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: {what} is not valid JSON ({e})") from None


HF_QUANT_CONFIG = "hf_quant_config.json"
# The keys of a ModelOpt quantization config that decide which linear is stored in which format.
_DECIDING_KEYS = ("quant_algo", "quantized_layers", "exclude_modules", "group_size")


def load_model_config(ckpt_dir: str | Path, problems: list[str] | None = None) -> ModelConfig:
    """The checkpoint folder's `config.json`, with the quantization config of `hf_quant_config.json` (ModelOpt's
    copy) where the folder has one (`with_hf_quant_config`).

    problems: where given, what is wrong with `hf_quant_config.json` (each disagreement with config.json its own
    line, `hf_quant_config_problems`) is appended to it instead of raised, so that a caller collecting a
    checkpoint's problems (`checkpoint.open_checkpoint`, hence `inspect`) reports them with the others."""
    path = Path(ckpt_dir) / "config.json"
    cfg = parse_model_config(read_json(path, "config.json"), str(path))
    hf_quant = Path(ckpt_dir) / HF_QUANT_CONFIG
    if hf_quant.is_file():
        if problems is None:
            return with_hf_quant_config(cfg, read_json(hf_quant, HF_QUANT_CONFIG), str(hf_quant))
        try:
            raw = read_json(hf_quant, HF_QUANT_CONFIG)
        except ConfigError as e:
            problems.append(str(e))
            return cfg
        cfg, found = hf_quant_config_problems(cfg, raw, str(hf_quant))
        problems.extend(found)
    return cfg


def with_hf_quant_config(cfg: ModelConfig, raw: Any, where: str) -> ModelConfig:
    """`cfg` with ModelOpt's `hf_quant_config.json` (`raw`: {"producer": ..., "quantization": {...}}) read: its
    `quantization` object (quant_method "modelopt" unless it names one) is the quantization config where
    config.json has none; where config.json has a ModelOpt one too, every key that decides a linear's format
    (`_DECIDING_KEYS`) present in both must agree, or a ConfigError lists each disagreement (decided here: a
    config.json of another quant_method, e.g. compressed-tensors, is taken as it is)."""
    cfg, bad, differ = _read_hf_quant(cfg, raw, where)
    if bad:
        raise ConfigError(bad)
    if differ:
        raise ConfigError(f"{where}: {_DISAGREES} {'; '.join(differ)}{_SAME_CHECKPOINT}")
    return cfg


_DISAGREES = "its quantization disagrees with config.json's quantization_config on"
_SAME_CHECKPOINT = ": the two files must describe the same checkpoint"


def hf_quant_config_problems(cfg: ModelConfig, raw: Any, where: str) -> tuple[ModelConfig, list[str]]:
    """`with_hf_quant_config`, returning what is wrong instead of raising it: (`cfg`, with the file's quantization
    where config.json has none; the problems, each deciding key that disagrees with config.json on its own line
    naming the key and both values). With problems, `cfg` keeps config.json's quantization config."""
    cfg, bad, differ = _read_hf_quant(cfg, raw, where)
    return cfg, ([bad] if bad else []) + [f"{where}: {_DISAGREES} {d}{_SAME_CHECKPOINT}" for d in differ]


def _read_hf_quant(cfg: ModelConfig, raw: Any, where: str) -> tuple[ModelConfig, str | None, list[str]]:
    """(cfg as `with_hf_quant_config` returns it, the file's layout problem or None, the disagreeing keys as
    "key (what differs)")."""
    q = raw.get("quantization") if isinstance(raw, dict) else None
    if not isinstance(q, dict):
        return cfg, (f"{where}: expected an object with a 'quantization' object (ModelOpt's layout), got "
                     f"{type(q).__name__ if isinstance(raw, dict) else type(raw).__name__}"), []
    q = {"quant_method": raw.get("quant_method", "modelopt"), **q}
    if cfg.quantization is None:
        return replace(cfg, quantization=q), None, []
    if cfg.quantization.get("quant_method") != "modelopt" or q["quant_method"] != "modelopt":
        return cfg, None, []
    differ = []
    for key in _DECIDING_KEYS:
        a, b = cfg.quantization.get(key), q.get(key)
        if key in cfg.quantization and key in q and a != b:
            if isinstance(a, dict) and isinstance(b, dict):
                names = sorted(n for n in set(a) | set(b) if a.get(n) != b.get(n))
                differ.append(f"{key} ({len(names)} entries differ, e.g. {names[:3]})")
            else:
                differ.append(f"{key} ({a!r} in config.json, {b!r} here)")
    return cfg, None, differ


def check_layer_ids(layers: Iterable, n: int, what: str) -> None:
    """Refuse (InputError, naming the argument `what`) entries of `layers` that are not layer indices 0..n-1."""
    bad = [L for L in layers if isinstance(L, bool) or not isinstance(L, int) or not 0 <= L < n]
    if bad:
        raise InputError(f"{what}: {bad[:5]} are not layer indices of this model (0..{n - 1})")
