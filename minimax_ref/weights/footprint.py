"""The bytes a model's weights take: per tensor group as stored (the shards' headers, or the config), how each is
split over tensor-parallel cards, and at their size in the engine's memory (`loaded_groups`: the loader's dtypes).
`minimax-ref plan` sizes deployments with it, the offload loader its units (`offload_units`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError
from ..model.config import ModelConfig
from .checkpoint import QuantScheme, tensor_table
from .device_map import OffloadUnit, unit_of

DEFAULT_ACTIVATION_RESERVE_GIB = 5.0
NVFP4_SCALARS = 8  # weight_scale_2 + input_scale, fp32 each
_FMT = {"NVFP4": "nvfp4", "MXFP8": "mxfp8", None: "bf16", "any": "mxfp8"}


@dataclass(frozen=True)
class TensorBytes:
    """One tensor group (a linear with its scales, or a plain tensor) and how it is split over cards.

    `split` bytes are divided by `divisor` per card; `replicated` bytes sit on every card. `fmt` is the stored
    format (the tensor-parallel split rules depend on it); `held` the format the bytes are counted in, once
    `loaded_groups` has put them in the engine's memory ("" until then: as stored)."""

    name: str
    family: str
    fmt: str
    split: int
    replicated: int
    divisor: int
    held: str = ""

    def per_card(self) -> float:
        return self.split / self.divisor + self.replicated


def linear_bytes(fmt: str, n: int, k: int) -> tuple[int, int]:
    """(sliceable bytes, replicated scalar bytes) of a linear [n, k] stored in `fmt`."""
    if fmt == "bf16":
        return 2 * n * k, 0
    if fmt == "mxfp8":
        return n * k + n * k // 32, 0
    if fmt == "nvfp4":
        return n * k // 2 + n * k // 16, NVFP4_SCALARS
    raise InputError(f"unknown format {fmt!r}")


def linear_divisor(prefix: str, tp: int, kv_heads: int) -> int:
    """How many ways a linear's bytes are divided at TP `tp` (1 = replicated). Routed experts divide by `tp` either
    way: sliced, or E/tp whole experts per card under expert parallelism (a tp that does not divide E is refused)."""
    leaf = prefix.rsplit(".", 1)[-1]
    if leaf in ("k_proj", "v_proj", "index_q_proj"):
        return min(tp, kv_heads)
    if leaf == "index_k_proj":
        return 1
    return tp  # q_proj, o_proj, dense / shared MLPs, lm_head (vocab rows)


def tensor_groups(cfg: ModelConfig, tp: int, *, ckpt_dir: Path | None = None, expert_parallel: bool = False,
                  split_vision: bool = False) -> tuple[list[TensorBytes], str]:
    """Every weight of the model as `TensorBytes`, and where the sizes came from ("config" or
    "headers": the shards' own headers when `ckpt_dir` holds them)."""
    t = cfg.text
    linears, plain = tensor_table(cfg)
    headers = None
    if ckpt_dir is not None and (any(ckpt_dir.glob("*.safetensors"))):
        from .checkpoint import _nbytes, open_checkpoint

        headers = open_checkpoint(ckpt_dir, strict=False)
    scheme = QuantScheme(cfg.quantization)
    out = []
    for prefix, spec in linears.items():
        div = linear_divisor(prefix, tp, t.num_key_value_heads)
        if headers is not None and prefix in headers.formats:
            f = headers.formats[prefix]
            fmt = f.fmt
            split = sum(_nbytes(headers.tensors[n]) for n in (f.weight, f.scale) if n and n in headers.tensors)
            rep = sum(_nbytes(headers.tensors[n]) for n in (f.scale_2, f.input_scale) if n and n in headers.tensors)
        else:
            fmt = _FMT[scheme.expected(prefix)]
            split, rep = linear_bytes(fmt, spec.out_features, spec.in_features)
        if expert_parallel and spec.family == "routed_expert":
            split, rep = split + rep, 0  # a whole expert, its scalar scales too, lives on one card
        out.append(TensorBytes(prefix, spec.family, fmt, split, rep, div))
    for name, spec in plain.items():
        if headers is not None and name in headers.tensors:
            info = headers.tensors[name]
            size, fmt = _nbytes(info), info.dtype.lower()
        else:
            elem = 4 if spec.family == "router" else 2
            size, fmt = math.prod(spec.shape) * elem, ("f32" if elem == 4 else "bf16")
        if spec.family == "embedding" or (split_vision and spec.family in ("vision", "projector")):
            out.append(TensorBytes(name, spec.family, fmt, size, 0, tp))  # vocab-parallel rows / vLLM's ViT TP
        else:
            out.append(TensorBytes(name, spec.family, fmt, 0, size, 1))
    return out, ("headers" if headers is not None else "config")


WEIGHTS_MODES = ("packed", "dequant")


def loaded_groups(cfg: ModelConfig, groups: list[TensorBytes], *, weights: str = "packed",
                  dtype_bytes: int = 2) -> list[TensorBytes]:
    """`groups` at their size in the engine's memory rather than on disk: NVFP4 / MXFP8 linears as stored with
    `weights="packed"`, decoded to the compute dtype (`dtype_bytes` an element, plus NVFP4's fp32 input_scale) with
    `weights="dequant"`; bf16
    linears and plain tensors in the compute dtype; norms and routers in fp32 (as the loader keeps them)."""
    if weights not in WEIGHTS_MODES:
        raise InputError(f"--weights {weights!r}: choose one of {list(WEIGHTS_MODES)}")
    linears, plain = tensor_table(cfg)
    compute = {2: "bf16", 4: "f32"}.get(dtype_bytes, f"{8 * dtype_bytes}-bit")
    out = []
    for g in groups:
        split, rep, held = g.split, g.replicated, g.fmt
        if g.name in plain:
            stored = 4 if g.fmt in ("f32", "float32") else 2
            # the label is what the bytes are counted in: the loader keeps norms and routers in fp32 whatever their
            # stored dtype (weights.md), every other plain tensor in the compute dtype
            held = "f32" if g.family in ("norm", "router") else compute
            scale = 4 if held == "f32" else dtype_bytes
            split, rep = split // stored * scale, rep // stored * scale
        elif g.fmt == "bf16" or weights == "dequant":
            spec = linears[g.name]
            # a decoded NVFP4 linear keeps its fp32 input_scale (activation-quantization emulation needs it)
            scalar = 4 if g.fmt == "nvfp4" else 0  # on every card, or with its expert (expert parallel: rep 0)
            split = spec.out_features * spec.in_features * dtype_bytes + (0 if g.replicated else scalar)
            rep, held = (scalar if g.replicated else 0), compute
        out.append(TensorBytes(g.name, g.family, g.fmt, split, rep, g.divisor, held))
    return out



def offload_units(cfg: ModelConfig, *, dtype_bytes: int = 2, ckpt_dir: Path | None = None
                  ) -> tuple[int, list[OffloadUnit]]:
    """(always-resident bytes, units in layer order) of a TP=1 model, in GPU-memory bytes: packed NVFP4 / MXFP8
    linears at their stored size, bf16 linears and plain tensors in the compute dtype (`dtype_bytes`), norms and
    routers in fp32 (as the loader keeps them). Sizes from `tensor_groups` (the shards' headers when present)."""
    linears, plain = tensor_table(cfg)
    module_of = {p: s.module for p, s in linears.items()} | {n: s.module for n, s in plain.items()}
    groups, _ = tensor_groups(cfg, 1, ckpt_dir=ckpt_dir)
    always = 0
    per_unit: dict[tuple[str, int], int] = {}
    for g in loaded_groups(cfg, groups, weights="packed", dtype_bytes=dtype_bytes):
        size = g.split + g.replicated
        kind, layer = unit_of(module_of[g.name])
        if kind == "resident":
            always += size
        else:
            per_unit[(kind, layer)] = per_unit.get((kind, layer), 0) + size
    E = cfg.text.num_local_experts
    units = [OffloadUnit(f"layers.{L}" if kind == "layer" else f"layers.{L}.experts", kind, L, n,
                         E if kind == "experts" else 0)
             for (kind, L), n in sorted(per_unit.items(), key=lambda kv: (kv[0][1], kv[0][0] == "experts"))]
    return always, units
