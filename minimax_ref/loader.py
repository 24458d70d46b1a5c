"""`load_model`: checkpoint folder -> ready `MiniMaxM3` module in eval mode.

The model is built on the meta device (no memory), then every parameter is replaced by the tensor
decoded from the checkpoint ("dequant-on-load"): quantized linears are decoded exactly to fp32 on
the target device and then cast to the compute dtype. Norm weights and the router stay fp32
(they are used in fp32 whatever the compute dtype). Decode problems (NaN scales, E8M0 code 255)
are collected over the whole checkpoint and raised together.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

from .checkpoint import NVFP4, Checkpoint, _nbytes, open_checkpoint
from .config import RuntimeConfig
from .errors import CheckpointError, ConfigError
from .linear import ACT_QUANT_MODES
from .model import MiniMaxM3
from .progress import Progress

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16):
            raise ConfigError(f"dtype={dtype}: choose torch.float32 or torch.bfloat16")
        return dtype
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r}: choose one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def _set(model: nn.Module, path: str, tensor: torch.Tensor) -> None:
    """Replace parameter `path` (dotted) of `model` with `tensor`, checking the shape."""
    *mods, leaf = path.split(".")
    m = model
    for part in mods:
        m = getattr(m, part)
    old = getattr(m, leaf)
    if old is not None and tuple(old.shape) != tuple(tensor.shape):
        raise CheckpointError(f"internal: {path} expects shape {tuple(old.shape)}, got {tuple(tensor.shape)}")
    m._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)


def _module(model: nn.Module, path: str) -> nn.Module:
    m = model
    for part in path.split("."):
        m = getattr(m, part)
    return m


def load_weights(model: MiniMaxM3, ck: Checkpoint, *, device: torch.device, dtype: torch.dtype,
                 emulate: bool) -> int:
    """Decode every tensor of `ck` into `model`; returns the bytes read from disk."""
    problems: list[str] = []
    total = sum(ck.family_bytes().values())
    bar = Progress(f"loading {ck.path.name}", total)
    read = 0

    def account(n: int) -> None:
        nonlocal read
        read += n
        bar.update(n)

    # plain tensors
    for spec in ck.plain.values():
        info = ck.tensors[spec.name]
        t = ck.read(spec.name).to(device)
        keep_fp32 = spec.family in ("norm", "router")
        _set(model, spec.module, t.float() if keep_fp32 else t.to(dtype))
        account(t.numel() * t.element_size())
        del info
    if ck.config.text.tie_word_embeddings:
        model.lm_head._parameters["weight"] = model.embed_tokens.weight

    # linears; routed experts are stacked per layer into [E, out, in]
    stacks: dict[tuple[str, str], torch.Tensor] = {}
    expert_scales: dict[tuple[str, str], torch.Tensor] = {}
    for prefix, spec in ck.linears.items():
        f = ck.formats[prefix]
        try:
            w = ck.read_linear(prefix)
        except CheckpointError as e:
            problems.append(str(e))
            continue
        account(sum(_nb(ck, n) for n in (f.weight, f.scale, f.scale_2, f.input_scale) if n))
        w = w.to(device=device, dtype=dtype)
        act_format = f.fmt if f.fmt != "bf16" else None
        if spec.expert is None:
            _set(model, spec.module + ".weight", w)
            lin = _module(model, spec.module)
            lin.act_format = act_format
            lin.emulate_act_quant = emulate and act_format is not None
            if f.fmt == NVFP4:
                lin.input_scale = ck.input_scale(prefix).to(device)
            continue
        key = (spec.module, spec.leaf)
        if key not in stacks:
            E = ck.config.text.num_local_experts
            stacks[key] = torch.empty((E, *w.shape), dtype=dtype, device=device)
            expert_scales[key] = torch.ones(E, dtype=torch.float32, device=device)
            experts = _module(model, spec.module)
            experts.act_format = act_format
            experts.emulate_act_quant = emulate and act_format is not None
        stacks[key][spec.expert] = w
        if f.fmt == NVFP4:
            expert_scales[key][spec.expert] = ck.input_scale(prefix).to(device)
    bar.close()
    if problems:
        raise CheckpointError(f"{ck.path}: {len(problems)} tensors cannot be decoded", problems)
    for (module, leaf), stacked in stacks.items():
        _set(model, f"{module}.{leaf}", stacked)
        setattr(_module(model, module), f"{leaf}_input_scale", expert_scales[(module, leaf)])

    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise CheckpointError(f"{ck.path}: parameters left without weights", missing)
    return read


def _nb(ck: Checkpoint, name: str) -> int:
    return _nbytes(ck.tensors[name])


def load_model(path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype | str = torch.bfloat16,
               act_quant: str = "none", weights: str = "dequant", tp=None, **runtime) -> MiniMaxM3:
    """Load a checkpoint folder into a ready `MiniMaxM3` in eval mode.

    device: where weights live and compute runs. dtype: torch.float32 (the golden mode: every weight
    and op in fp32) or torch.bfloat16. act_quant: "none" (weight-only) or "emulate" (fake-quantize
    the inputs of NVFP4/MXFP8 linears as W4A4/W8A8 kernels do). weights: "dequant" (decode once at
    load). tp: a torch.distributed process group for tensor parallelism, or None.
    runtime: `RuntimeConfig` fields (max_seq_len, max_batch_size, kv_cache_dtype,
    max_images_per_prompt), kept on `model.runtime`.
    """
    dtype = resolve_dtype(dtype)
    if act_quant not in ACT_QUANT_MODES:
        raise ConfigError(f"act_quant={act_quant!r}: choose one of {list(ACT_QUANT_MODES)}")
    if weights != "dequant":
        raise ConfigError(f"weights={weights!r}: this build decodes weights at load; use weights='dequant'")
    if tp is not None:
        raise ConfigError("tp: tensor parallelism is not available in this build; pass tp=None")
    rt = RuntimeConfig.from_kwargs("load_model", **runtime)
    device = torch.device(device)
    t0 = time.perf_counter()
    ck = open_checkpoint(path)
    cfg = ck.config
    if rt.max_seq_len > cfg.text.max_position_embeddings:
        raise ConfigError(f"max_seq_len={rt.max_seq_len} exceeds the model's max_position_embeddings="
                          f"{cfg.text.max_position_embeddings}")
    with torch.device("meta"):
        model = MiniMaxM3(cfg)
    nbytes = load_weights(model, ck, device=device, dtype=dtype, emulate=act_quant == "emulate")
    ck.close()
    model.eval()
    model.runtime = rt
    model.ckpt_path = Path(path)
    model.act_quant = act_quant
    model.compute_dtype = dtype
    model.notes = ck.notes
    model.load_stats = {"bytes_read": nbytes, "seconds": time.perf_counter() - t0}
    return model
