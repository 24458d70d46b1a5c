"""Golden entries and their operands: `Entry` (one op at one layer and phase), packed linears and fused gate-up
operands as the checkpoint stores them, their decoding, and the paged KV views of a step's cache."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..errors import InputError
from ..weights.checkpoint import DENSE, MXFP8, NVFP4, Checkpoint


def checkpoint_of(model) -> Checkpoint:
    """The checkpoint `model` was loaded from, to read packed operands: its folder, or the synthetic preset that
    regenerates the same tensors."""
    from ..weights.checkpoint import open_checkpoint

    if model.ckpt_path is not None:
        return open_checkpoint(model.ckpt_path)
    spec = getattr(model, "synthetic", None)
    if spec is None:
        raise InputError("golden: the model has neither a checkpoint folder (ckpt_path) nor a synthetic preset; "
                         "load it with load_model(path) or load_synthetic(preset)")
    from ..weights.synthetic import SyntheticCheckpoint

    return SyntheticCheckpoint(spec["preset"], spec["fmt"], experts=spec["experts"], layers=spec["layers"],
                               overrides=spec["overrides"], seed=spec["seed"], device=model.device)


@dataclass
class Entry:
    """One golden file: an op at a layer in a phase."""

    op: str
    layer: int
    phase: str
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    params: dict = field(default_factory=dict)
    roles: dict[str, str] = field(default_factory=dict)

    shared: dict[str, str] = field(default_factory=dict)
    tag: str = ""  # which instance, when a layer holds several (mxfp8_linear: the linear's path in the layer)

    def put(self, name: str, t: torch.Tensor, role: str, shared: str | None = None) -> None:
        """Record tensor `name` (a copy: captured activations may be views of buffers the forward reuses);
        `shared`: its key in the layer's weights file (stored once per bundle; packed operands are fresh tensors,
        read from the checkpoint, and are not copied)."""
        t = t.detach()
        self.tensors[name] = (t if shared is not None else t.clone()).contiguous().cpu()
        self.roles[name] = role
        if shared is not None:
            self.shared[name] = shared

    @property
    def file(self) -> str:
        tag = f".{self.tag}" if self.tag else ""
        return f"{self.op}/layer{self.layer:03d}_{self.phase}{tag}.safetensors"


def put_linear(e: Entry, ck: Checkpoint, prefix: str, key: str) -> str:
    """Put linear `prefix`'s packed operands into `e` under `key.*`, stored once per bundle under
    `prefix.*` (the same canonical leaves); returns the linear's format."""
    ops, fmt = linear_operands(ck, prefix, key)
    for name, t in ops.items():
        e.put(name, t, "weight", shared=prefix + name[len(key):])
    return fmt


def put_fused(e: Entry, gate: str, up: str, key: str, fmt: str, prefix: str | None) -> None:
    """Put the fused gate-up operand `key.*` (`fuse_gate_up`) of `e`'s operands `gate.*`, `up.*`; stored once per
    bundle under `prefix.*` when given (model-driven bundles), else in the entry's file."""
    for name, t in fuse_gate_up(e.tensors, gate, up, key, fmt).items():
        e.put(name, t, "weight", shared=None if prefix is None else prefix + name[len(key):])


def activation_codes(x: torch.Tensor, fmt: str, input_scale: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The quantized GEMM input a W4A4 / W8A8 kernel takes for the activation x (the `emulate` path's x_hat in
    codes): `codes` and `scale` (contract.ACT_CODES_LAYOUT), {} for a bf16 linear."""
    from ..weights.quant import quantize_activation_nvfp4, quantize_mxfp8

    if fmt == NVFP4:
        codes, scale = quantize_activation_nvfp4(x, input_scale if input_scale is not None else 1.0)
    elif fmt == MXFP8:
        codes, scale = quantize_mxfp8(x)
    else:
        return {}
    return {"codes": codes, "scale": scale}


def put_activation_codes(e: Entry, name: str, x: torch.Tensor, fmt: str, input_scale: torch.Tensor | None) -> None:
    """Put `{name}_codes` and `{name}_scale` (`activation_codes`) as inputs of `e`."""
    for part, t in activation_codes(x, fmt, input_scale).items():
        e.put(f"{name}_{part}", t, "input")


def linear_operands(ck: Checkpoint, prefix: str, key: str) -> tuple[dict[str, torch.Tensor], str]:
    """A linear's stored tensors under canonical names `{key}.weight/.weight_scale/.weight_scale_2/
    .input_scale` (global scales in the ModelOpt meaning), and its format."""
    f = ck.formats[prefix]
    out = {f"{key}.weight": ck.read(f.weight)}
    if f.fmt == MXFP8:
        out[f"{key}.weight_scale"] = ck.read(f.scale)
    elif f.fmt == NVFP4:
        g = ck.read_scalar(f.scale_2)
        out[f"{key}.weight_scale"] = ck.read(f.scale)
        out[f"{key}.weight_scale_2"] = 1.0 / g if f.compressed_tensors else g
        out[f"{key}.input_scale"] = ck.input_scale(prefix).reshape(())
    return out, f.fmt


def decode_operand(t: dict[str, torch.Tensor], key: str, fmt: str, dtype: torch.dtype) -> torch.Tensor:
    """The weight of packed operand `key` decoded exactly to fp32, then cast to `dtype` (the loader's rule)."""
    from ..weights.quant import dequant_mxfp8, dequant_nvfp4

    if fmt == NVFP4:
        w = dequant_nvfp4(t[f"{key}.weight"], t[f"{key}.weight_scale"], t[f"{key}.weight_scale_2"], name=key)
    elif fmt == MXFP8:
        w = dequant_mxfp8(t[f"{key}.weight"], t[f"{key}.weight_scale"], name=key)
    else:
        w = t[f"{key}.weight"].float()
    return w.to(dtype)


def fuse_gate_up(t: dict[str, torch.Tensor], gate: str, up: str, key: str, fmt: str) -> dict[str, torch.Tensor]:
    """The fused gate-up operand `key.*` of packed operands `gate.*` [I, K] and `up.*` [I, K], as vLLM's
    `w13_*` and CUTLASS grouped GEMMs take it: `key.weight` [2I, ...] = gate rows then up rows (concatenated
    along N, not interleaved), `key.weight_scale` likewise; NVFP4 global scales cannot be shared when they
    differ, so `key.weight_scale_2` and `key.input_scale` are fp32 [2]: entry 0 applies to rows [0, I) (gate),
    entry 1 to rows [I, 2I) (up) (vLLM's `w13_weight_scale_2 [E, 2]` order)."""
    out = {f"{key}.weight": torch.cat([t[f"{gate}.weight"], t[f"{up}.weight"]])}
    if fmt in (NVFP4, MXFP8):
        out[f"{key}.weight_scale"] = torch.cat([t[f"{gate}.weight_scale"], t[f"{up}.weight_scale"]])
    for leaf in ("weight_scale_2", "input_scale"):
        if fmt == NVFP4 and f"{gate}.{leaf}" in t:
            out[f"{key}.{leaf}"] = torch.stack([t[f"{gate}.{leaf}"].reshape(()).float(),
                                                t[f"{up}.{leaf}"].reshape(()).float()])
    return out


def decode_fused(t: dict[str, torch.Tensor], key: str, fmt: str, dtype: torch.dtype) -> torch.Tensor:
    """The fused gate-up weight `key` [2I, K] decoded as `decode_operand` decodes each half (NVFP4: row half j
    with weight_scale_2[j])."""
    if fmt != NVFP4:
        return decode_operand(t, key, fmt, dtype)
    n = t[f"{key}.weight"].shape[0] // 2
    halves = []
    for j, rows in enumerate((slice(0, n), slice(n, 2 * n))):
        half = {f"{key}.weight": t[f"{key}.weight"][rows], f"{key}.weight_scale": t[f"{key}.weight_scale"][rows],
                f"{key}.weight_scale_2": t[f"{key}.weight_scale_2"][j]}
        halves.append(decode_operand(half, key, fmt, dtype))
    return torch.cat(halves)


def quantized_input(x: torch.Tensor, fmt: str, t: dict[str, torch.Tensor], key: str, emulate: bool) -> torch.Tensor:
    """The GEMM input of the linear `key` of format `fmt`: x fake-quantized as W4A4 / W8A8 kernels do with
    `emulate` (`linear.emulate_activation_quant`, NVFP4 with the stored input_scale), else x."""
    from ..model.linear import emulate_activation_quant

    if not emulate or fmt == DENSE:
        return x
    return emulate_activation_quant(x, fmt, t.get(f"{key}.input_scale"))


def block_table(seq_lens: Sequence[int], page: int, seed: int) -> torch.Tensor:
    """int32 [B, max_pages]: page ids of each row's tokens (a seeded permutation of 0..P-1), -1 padded."""
    need = [-(-n // page) for n in seq_lens]
    perm = torch.randperm(sum(need), generator=torch.Generator().manual_seed(seed)).to(torch.int32)
    table = torch.full((len(seq_lens), max(need)), -1, dtype=torch.int32)
    start = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[start: start + n]
        start += n
    return table


def to_pages(buf: torch.Tensor, table: torch.Tensor, seq_lens: Sequence[int], page: int) -> torch.Tensor:
    """Cache storage `buf` [B, S, ...] cut into pages [P, page, ...] by `table`; slots past a row's
    length are zero."""
    P = int((table >= 0).sum())
    pages = torch.zeros((P, page, *buf.shape[2:]), dtype=buf.dtype)
    for b, n in enumerate(seq_lens):
        for j in range(-(-n // page)):
            m = min(page, n - j * page)
            pages[int(table[b, j]), :m] = buf[b, j * page: j * page + m].cpu()
    return pages


def from_pages(pages: torch.Tensor, table: torch.Tensor, seq_lens: Sequence[int], length: int,
               dtype: torch.dtype, kv_scale: float) -> torch.Tensor:
    """Rows rebuilt from pages: [B, length, ...] in `dtype`, zero past each row's length."""
    page = pages.shape[1]
    out = torch.zeros((len(seq_lens), length, *pages.shape[2:]), dtype=dtype)
    for b, n in enumerate(seq_lens):
        for p0 in range(0, min(n, length), page):
            m = min(page, n - p0, length - p0)
            blk = pages[int(table[b, p0 // page]), :m]
            out[b, p0: p0 + m] = (blk.float() * kv_scale).to(dtype) if blk.dtype == torch.float8_e4m3fn else blk
    return out
