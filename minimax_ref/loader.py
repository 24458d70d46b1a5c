"""`load_model`: checkpoint folder -> ready `MiniMaxM3` module in eval mode.

The model is built on the meta device (no memory), then every parameter is replaced by the tensor
decoded from the checkpoint ("dequant-on-load"): quantized linears are decoded exactly to fp32 on
the target device and then cast to the compute dtype. Norm weights and the router stay fp32
(they are used in fp32 whatever the compute dtype). Decode problems (NaN scales, E8M0 code 255)
are collected over the whole checkpoint and raised together.

Under tensor parallelism (parallel.py) each module declares which part of the checkpoint's tensor it
holds and the loader reads only that part from the shards: packed NVFP4/MXFP8 bytes are sliced
together with their block scales and decoded after slicing, never before.
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
from .parallel import World, check_tp_split
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


def _part_bytes(ck: Checkpoint, names: tuple[str | None, ...], shape: tuple[int, ...],
                rows: slice | None, cols: slice | None) -> int:
    """Bytes read for the [rows, cols] part of a [N, K] weight stored as the tensors `names` (data
    and block scales shrink with the slice; vectors and per-tensor scalars are read whole)."""
    N, K = shape[0], shape[1] if len(shape) > 1 else 1
    n = N if rows is None else rows.stop - rows.start
    k = K if cols is None else cols.stop - cols.start
    total = 0
    for name in names:
        if name is None:
            continue
        nb = _nb(ck, name)
        total += nb if len(ck.tensors[name].shape) < 2 else nb * n * k // (N * K)
    return total


def _plan(model: MiniMaxM3, ck: Checkpoint) -> tuple[list, list, int]:
    """What this rank reads: plain tensors as (spec, rows), linears as (spec, rows, cols), and the
    bytes that makes. The parts come from the modules (`rows` / `cols` of the parallel layers,
    `Experts.local_experts` / `slices`): at TP=1 everything, otherwise this rank's slices."""
    plain, linears, nbytes = [], [], 0
    for spec in ck.plain.values():
        owner = _module(model, spec.module.rpartition(".")[0]) if "." in spec.module else model
        rows = getattr(owner, "rows", None)  # only the vocabulary-parallel embedding splits a plain tensor
        plain.append((spec, rows))
        nbytes += _part_bytes(ck, (spec.name,), ck.tensors[spec.name].shape, rows, None)
    for prefix, spec in ck.linears.items():
        if spec.expert is None:
            lin = _module(model, spec.module)
            rows, cols = lin.rows, lin.cols
        else:
            experts = _module(model, spec.module)
            if spec.expert not in experts.local_experts:
                continue  # expert-parallel: another rank holds this expert
            rows, cols = experts.slices(spec.leaf)
        linears.append((spec, rows, cols))
        f = ck.formats[prefix]
        nbytes += _part_bytes(ck, (f.weight, f.scale, f.scale_2, f.input_scale),
                              (spec.out_features, spec.in_features), rows, cols)
    return plain, linears, nbytes


def load_weights(model: MiniMaxM3, ck: Checkpoint, *, device: torch.device, dtype: torch.dtype,
                 emulate: bool) -> dict[str, int]:
    """Decode into `model` the part of every tensor of `ck` that the model holds (all of it with one
    process; this rank's slices under tensor parallelism, read from the shards without reading the
    rest). Returns the bytes read from disk per module family."""
    problems: list[str] = []
    plain, linears, total = _plan(model, ck)
    bar = Progress(f"loading {ck.path.name}", total)
    read: dict[str, int] = {}

    def account(family: str, n: int) -> None:
        read[family] = read.get(family, 0) + n
        bar.update(n)

    # plain tensors
    for spec, rows in plain:
        t = ck.read(spec.name, rows=rows).to(device)
        keep_fp32 = spec.family in ("norm", "router")
        _set(model, spec.module, t.float() if keep_fp32 else t.to(dtype))
        account(spec.family, t.numel() * t.element_size())
    if ck.config.text.tie_word_embeddings:
        model.lm_head._parameters["weight"] = model.embed_tokens.weight

    # linears; routed experts are stacked per layer into [E_local, out, in]
    stacks: dict[tuple[str, str], torch.Tensor] = {}
    expert_scales: dict[tuple[str, str], torch.Tensor] = {}
    for spec, rows, cols in linears:
        prefix = spec.prefix
        f = ck.formats[prefix]
        try:
            w = ck.read_linear(prefix, rows=rows, cols=cols)
        except CheckpointError as e:
            problems.append(str(e))
            continue
        account(spec.family, _part_bytes(ck, (f.weight, f.scale, f.scale_2, f.input_scale),
                                         (spec.out_features, spec.in_features), rows, cols))
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
        experts = _module(model, spec.module)
        if key not in stacks:
            stacks[key] = torch.empty((len(experts.local_experts), *w.shape), dtype=dtype, device=device)
            expert_scales[key] = torch.ones(len(experts.local_experts), dtype=torch.float32, device=device)
            experts.act_format = act_format
            experts.emulate_act_quant = emulate and act_format is not None
        local = spec.expert - experts.local_experts.start
        stacks[key][local] = w
        if f.fmt == NVFP4:
            expert_scales[key][local] = ck.input_scale(prefix).to(device)
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


def load_model(path: str | Path, *, device: str | torch.device = "cpu",
               dtype: torch.dtype | str = torch.bfloat16, act_quant: str = "none", weights: str = "dequant",
               tp=None, expert_parallel: bool = False, **runtime) -> MiniMaxM3:
    """Load a checkpoint folder into a ready `MiniMaxM3` in eval mode.

    device: where weights live and compute runs. dtype: torch.float32 (the golden mode: every weight
    and op in fp32) or torch.bfloat16. act_quant: "none" (weight-only) or "emulate" (fake-quantize
    the inputs of NVFP4/MXFP8 linears as W4A4/W8A8 kernels do). weights: "dequant" (decode once at
    load). runtime: `RuntimeConfig` fields (max_seq_len, max_batch_size, kv_cache_dtype,
    max_images_per_prompt), kept on `model.runtime`.

    tp: tensor parallelism: a torch.distributed process group (or a `parallel.World`); None for one
    process. Every rank of the group calls load_model with the same arguments; each reads only its
    slices of the shards (`model.load_stats["bytes_read"]` is this rank's). A checkpoint that cannot
    be split is refused with a ConfigError before any weight is read; if any rank fails to load,
    every rank raises (the failing rank its own error, the others `parallel.RankFailedError`).
    expert_parallel: with tp, hold whole routed experts (E / TP per rank) instead of a slice of each.
    """
    world = World.of(tp, device)
    model, error = None, None
    try:
        model = _load(Path(path), world, expert_parallel, torch.device(device), dtype, act_quant, weights,
                      runtime)
    except Exception as e:  # any failure (OOM included) must reach the other ranks before they block
        error = e
    # The ranks' first collective: agree that every rank has its weights, or all raise together.
    world.agree(error, f"loading {path}")
    return model


def _load(path: Path, world: World, expert_parallel: bool, device: torch.device, dtype: torch.dtype | str,
          act_quant: str, weights: str, runtime: dict) -> MiniMaxM3:
    """load_model on one rank, without communication."""
    dtype = resolve_dtype(dtype)
    if act_quant not in ACT_QUANT_MODES:
        raise ConfigError(f"act_quant={act_quant!r}: choose one of {list(ACT_QUANT_MODES)}")
    if weights != "dequant":
        raise ConfigError(f"weights={weights!r}: this build decodes weights at load; use weights='dequant'")
    rt = RuntimeConfig.from_kwargs("load_model", **runtime)
    t0 = time.perf_counter()
    ck = open_checkpoint(path)  # headers only
    cfg = ck.config
    if rt.max_seq_len > cfg.text.max_position_embeddings:
        raise ConfigError(f"max_seq_len={rt.max_seq_len} exceeds the model's max_position_embeddings="
                          f"{cfg.text.max_position_embeddings}")
    check_tp_split(ck, world.size, expert_parallel)  # before any weight is read
    with torch.device("meta"):
        model = MiniMaxM3(cfg, world, expert_parallel)
    by_family = load_weights(model, ck, device=device, dtype=dtype, emulate=act_quant == "emulate")
    ck.close()
    model.eval()
    model.runtime = rt
    for layer in model.layers:
        layer.self_attn.chunk_elements = rt.attention_chunk_elements
    model.ckpt_path = path
    model.act_quant = act_quant
    model.compute_dtype = dtype
    model.notes = ck.notes
    model.load_stats = {"bytes_read": sum(by_family.values()), "bytes_read_by_family": by_family,
                        "checkpoint_bytes": sum(ck.family_bytes().values()),
                        "tp_rank": world.rank, "tp_size": world.size, "expert_parallel": expert_parallel,
                        "seconds": time.perf_counter() - t0}
    return model
