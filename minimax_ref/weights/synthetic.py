"""Synthetic checkpoints materialised in device memory: real-size runs with no checkpoint on disk.

`SyntheticCheckpoint(preset, fmt)` presents a `synth` preset (`tiny`, `tiny-vl`, `release`,
`pruned-80`, with the same `--experts` / `--layers` / overrides) as a `Checkpoint`: the same tensor
names, shapes, dtypes and formats as the folder `minimax-ref synth` would write, but every `read` generates
the tensor on the target device instead of reading a shard. The loader then slices, packs or decodes
it exactly as it does a real checkpoint (loader.load_synthetic), so under tensor parallelism each rank
generates only the tensors it holds (each full tensor is generated, then sliced, so that every TP size
sees the same values).

Values (decided here; weights.md). Each tensor comes from its own generator seeded by (seed, name), on
the device (values depend on the device type, as torch's generators do). Magnitudes follow synth.py's
rules: linear weights with standard deviation 1/sqrt(in) (halved for o_proj, down_proj, w2), norm offsets
N(0, 0.1^2), router rows N(0, 4/H) in fp32, selection bias N(0, 0.01^2), embeddings N(0, 1), vision
LayerNorm weights 1 + N(0, 0.1^2). Quantized weights are not quantized Gaussians (that would cost a
float32 pass over 270 B weights) but random packed codes with scales that give the same standard deviation:

* NVFP4: uniformly random bytes (every byte is two valid E2M1 codes; the code values have an RMS of
  `RMS_E2M1`); block scales E4M3 of 448 * U(0.2, 0.6) (ModelOpt's block scale is
  448 * amax(block) / amax(tensor)); `weight_scale_2 = std / (RMS_E2M1 * rms(block scale))`, so the implied
  amax(tensor) = 2688 * weight_scale_2 is about 5 standard deviations; w1 and w3 of an expert share it,
  as in the ModelOpt export; `input_scale` = synth's 4 / 2688.
* MXFP8: uniformly random E4M3 bytes other than the two NaN bytes (RMS `RMS_E4M3`), E8M0 block exponents
  `127 + round(log2(std / (RMS_E4M3 * 1.32))) + U{-1, 0, 1}` (the 1.32 compensates the jitter's
  mean square).
"""

from __future__ import annotations

import math
import zlib
from pathlib import Path

import torch

from ..errors import CheckpointError
from ..model.config import parse_model_config
from .checkpoint import DENSE, MXFP8, NVFP4, Checkpoint, LinearFormat, LinearSpec, TensorInfo, TensorSpec, tensor_table
from .synth import SYNTH_INPUT_SCALE, build_config, linear_format

_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
RMS_E2M1 = float(_E2M1.square().mean().sqrt())  # uniformly random codes (the sign does not matter)
_E4M3_BYTES = torch.arange(256, dtype=torch.int32)
_E4M3_FINITE = _E4M3_BYTES[(_E4M3_BYTES & 0x7F) != 0x7F].to(torch.uint8).view(torch.float8_e4m3fn).float()
RMS_E4M3 = float(_E4M3_FINITE.square().mean().sqrt())
_BLOCK_SCALE_LO, _BLOCK_SCALE_HI = 0.2, 0.6  # NVFP4 block scales: 448 * U(lo, hi)
_BLOCK_SCALE_RMS = 448.0 * math.sqrt((_BLOCK_SCALE_HI**3 - _BLOCK_SCALE_LO**3)
                                     / (3 * (_BLOCK_SCALE_HI - _BLOCK_SCALE_LO)))  # rms of 448 * U(lo, hi)
_E8M0_JITTER_RMS = math.sqrt((0.25 + 1.0 + 4.0) / 3)  # 2^U{-1,0,1}: root mean square of the factor


def _seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) & 0x7FFF_FFFF_FFFF


def linear_std(spec: LinearSpec) -> float:
    """Standard deviation of a synthetic linear's weights (synth.py's rule)."""
    std = spec.in_features**-0.5
    return std * 0.5 if spec.prefix.endswith(("o_proj", "down_proj", "w2")) else std


class SyntheticCheckpoint(Checkpoint):
    """A `Checkpoint` whose tensors are generated on `device` when read (see the module docstring).

    preset, fmt ("bf16", "mxfp8", "nvfp4"), experts, layers, overrides: as `synth.build_config`.
    """

    synthetic = True

    def __init__(self, preset: str, fmt: str = "nvfp4", *, experts: int | None = None, layers: int | None = None,
                 overrides: dict | None = None, seed: int = 0, device: str | torch.device = "cpu"):
        raw = build_config(preset, fmt, experts, layers, overrides=overrides)
        cfg = parse_model_config(raw, where=f"synthetic preset {preset!r}")
        linears, plain = tensor_table(cfg)
        tensors: dict[str, TensorInfo] = {}
        formats: dict[str, LinearFormat] = {}
        self._roles: dict[str, tuple] = {}
        where = f"<synthetic {preset} {fmt}>"
        for name, spec in plain.items():
            dtype = "F32" if spec.family == "router" else "BF16"
            tensors[name] = TensorInfo(where, dtype, spec.shape)
            self._roles[name] = ("plain", spec)
        for prefix, spec in linears.items():
            f = linear_format(spec, fmt)
            N, K = spec.out_features, spec.in_features
            names = {"weight": prefix + ".weight"}
            if f == DENSE:
                tensors[names["weight"]] = TensorInfo(where, "BF16", (N, K))
                formats[prefix] = LinearFormat(DENSE, names["weight"])
            elif f == MXFP8:
                names["scale"] = prefix + ".weight_scale_inv"
                tensors[names["weight"]] = TensorInfo(where, "F8_E4M3", (N, K))
                tensors[names["scale"]] = TensorInfo(where, "U8", (N, K // 32))
                formats[prefix] = LinearFormat(MXFP8, names["weight"], names["scale"])
            else:
                names.update(scale=prefix + ".weight_scale", scale_2=prefix + ".weight_scale_2",
                             input_scale=prefix + ".input_scale")
                tensors[names["weight"]] = TensorInfo(where, "U8", (N, K // 2))
                tensors[names["scale"]] = TensorInfo(where, "F8_E4M3", (N, K // 16))
                tensors[names["scale_2"]] = TensorInfo(where, "F32", ())
                tensors[names["input_scale"]] = TensorInfo(where, "F32", ())
                formats[prefix] = LinearFormat(NVFP4, names["weight"], names["scale"], names["scale_2"],
                                               names["input_scale"])
            for role, name in names.items():
                self._roles[name] = (role, spec, f)
        super().__init__(Path(where), cfg, tensors, linears, plain, formats, problems=[],
                         notes=[f"synthetic weights: preset {preset}, format {fmt}, seed {seed}, generated on "
                                f"{torch.device(device)}"])
        self.preset, self.fmt, self.seed, self.device = preset, fmt, seed, torch.device(device)

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        """Tensor `name` (or its [rows, cols] part), generated on the device."""
        if name not in self._roles:
            raise CheckpointError(f"{self.path}: tensor {name!r} is not in the checkpoint")
        t = self._generate(name)
        if rows is not None:
            t = t[rows]
        if cols is not None:
            t = t[:, cols]
        return t.contiguous()

    # ---- generators

    def _gen(self, key: str) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(_seed(self.seed, key))

    def _randn(self, shape, std: float, key: str, dtype=torch.float32) -> torch.Tensor:
        return torch.randn(shape, generator=self._gen(key), device=self.device, dtype=dtype) * std

    def _generate(self, name: str) -> torch.Tensor:
        role = self._roles[name]
        shape = self.tensors[name].shape
        if role[0] == "plain":
            return self._plain(role[1], shape)
        kind, spec, fmt = role
        std = linear_std(spec)
        dev = self.device
        if fmt == DENSE:
            return self._randn(shape, std, name).bfloat16()
        if kind == "weight":
            codes = torch.randint(0, 256, shape, generator=self._gen(name), device=dev, dtype=torch.uint8)
            if fmt == NVFP4:
                return codes  # every byte is two valid E2M1 codes
            nan = (codes & 0x7F) == 0x7F  # 0x7f / 0xff are E4M3's NaN: step to the largest finite byte
            return torch.where(nan, codes - 1, codes).view(torch.float8_e4m3fn)
        if kind == "scale" and fmt == MXFP8:
            base = 127 + round(math.log2(std / (RMS_E4M3 * _E8M0_JITTER_RMS)))
            jitter = torch.randint(-1, 2, shape, generator=self._gen(name), device=dev, dtype=torch.int32)
            return (base + jitter).to(torch.uint8)
        if kind == "scale":  # NVFP4 block scales
            u = torch.rand(shape, generator=self._gen(name), device=dev)
            s = 448.0 * (_BLOCK_SCALE_LO + (_BLOCK_SCALE_HI - _BLOCK_SCALE_LO) * u)
            return s.to(torch.float8_e4m3fn)
        if kind == "scale_2":
            # w1 and w3 of one expert share their global scale (ModelOpt); a 10% spread between tensors
            key = spec.prefix[:-2] + "w13" if spec.leaf in ("w1", "w3") else spec.prefix
            jitter = 0.9 + 0.2 * torch.rand((), generator=self._gen(key + ".weight_scale_2"), device=dev)
            return (std / (RMS_E2M1 * _BLOCK_SCALE_RMS) * jitter).float()
        return torch.tensor(SYNTH_INPUT_SCALE, dtype=torch.float32, device=dev)  # input_scale

    def _plain(self, spec: TensorSpec, shape: tuple[int, ...]) -> torch.Tensor:
        """synth.py's rules for plain tensors (`synth._plain_tensor`), generated on the device."""
        name = spec.name
        if spec.family == "router":
            std = 0.01 if name.endswith("e_score_correction_bias") else 2.0 / self.config.text.hidden_size**0.5
            return self._randn(shape, std, name)
        if spec.family == "embedding":
            return self._randn(shape, 1.0, name, torch.bfloat16)
        if spec.family == "norm":
            return self._randn(shape, 0.1, name).bfloat16()
        if name.endswith("bias"):
            return self._randn(shape, 0.02, name).bfloat16()
        if "layer_norm" in name or "layrnorm" in name:
            return (1.0 + self._randn(shape, 0.1, name)).bfloat16()
        return self._randn(shape, math.prod(shape[1:]) ** -0.5, name, torch.bfloat16)

    def close(self) -> None:
        pass


__all__ = ["SyntheticCheckpoint", "RMS_E2M1", "RMS_E4M3", "linear_std"]
