"""`load_model`: checkpoint folder -> ready `MiniMaxM3` module in eval mode.

The model is built on the meta device (no memory), then every parameter is replaced by the tensor
read from the checkpoint. With `weights="dequant"` (default) quantized linears are decoded exactly
to fp32 and cast to the compute dtype ("dequant-on-load"). With `weights="packed"` they stay packed
on the target device (`packed.PackedWeight`: the stored bytes and block scales, memory = the packed
size) and are decoded at use to the same bits. Norm weights and the router stay fp32 (they are used
in fp32 whatever the compute dtype). Decode problems (NaN scales, E8M0 code 255) are collected over
the whole checkpoint and raised together, in both modes.

`load_synthetic` materialises a checkpoint of a `synth` preset directly in device memory
(synthetic.py: random values in the real formats), through the same code, so real-size runs need no
checkpoint on disk.

Under tensor parallelism (parallel.py) each module declares which part of the checkpoint's tensor it
holds and the loader reads only that part from the shards: packed NVFP4/MXFP8 bytes are sliced
together with their block scales and decoded after slicing, never before.

With `offload="cpu" | "disk"` (offload.py) the weights are loaded group by group through `load_weights(select=...)`,
each part to where the device map puts it: the device, or host memory / disk, from where it is streamed.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

from ..errors import CheckpointError, ConfigError, QuantFormatError
from ..model.config import RuntimeConfig
from ..model.decoder import MiniMaxM3, Numerics
from ..model.linear import ACT_QUANT_MODES
from ..model.parallel import World, check_tp_split
from ..progress import Progress
from .checkpoint import DENSE, NVFP4, Checkpoint, _nbytes, open_checkpoint, placed
from .packed import PackedWeight, check_packed, model_nbytes, read_packed

WEIGHT_MODES = ("dequant", "packed")

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def resolve_device(device: str | torch.device) -> torch.device:
    """`device` as a torch.device, refused with a ConfigError when this machine cannot run it."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device={device!r} is not a torch device ({e})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device={device!r}: CUDA is not available here (this torch build or machine has no "
                              "GPU); use device='cpu'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"device={device!r}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    return dev


def resolve_dtype(dtype: torch.dtype | str | None, device: str | torch.device | None = None) -> torch.dtype:
    """`dtype` as a torch.dtype; "auto" (or None) is bfloat16 on a GPU and float32 on a CPU (where bfloat16
    matmuls and gathers run far slower than float32 on most processors). The one rule for `--dtype auto` and
    `load_model` / `load_synthetic`'s default."""
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device is not None and torch.device(device).type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16):
            raise ConfigError(f"dtype={dtype}: choose torch.float32 or torch.bfloat16")
        return dtype
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r}: choose one of {sorted(DTYPES) + ['auto']}")
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


# a routed expert's gate and up projections: they read the same input (their stacks are allocated together)
GATE_UP = ("w1", "w3")


def _pairs_gate_up(ck: Checkpoint, spec, planned: set[str]) -> bool:
    """Whether the routed expert linear `spec` (gate or up, the first of its layer read) and its sibling get one
    allocation: the sibling is read in this call (`planned`: prefixes) in the same packed format and shape."""
    if spec.leaf not in GATE_UP:
        return False
    sibling = spec.prefix[: -len(spec.leaf)] + GATE_UP[1 - GATE_UP.index(spec.leaf)]
    other = ck.linears.get(sibling)
    return (sibling in planned and other is not None and ck.formats[sibling].fmt == ck.formats[spec.prefix].fmt
            and (other.out_features, other.in_features) == (spec.out_features, spec.in_features))


def _plan(model: MiniMaxM3, ck: Checkpoint, select=None) -> tuple[list, list, int]:
    """What this rank reads: plain tensors as (spec, rows), linears as (spec, rows, cols), and the
    bytes that makes. The parts come from the modules (`rows` / `cols` of the parallel layers,
    `Experts.local_experts` / `slices`): at TP=1 everything, otherwise this rank's slices. `select`
    (a predicate on the engine module path, `spec.module`) keeps only some tensors (None: all)."""
    plain, linears, nbytes = [], [], 0
    for spec in ck.plain.values():
        if select is not None and not select(spec.module):
            continue
        owner = _module(model, spec.module.rpartition(".")[0]) if "." in spec.module else model
        rows = getattr(owner, "rows", None)  # only the vocabulary-parallel embedding splits a plain tensor
        plain.append((spec, rows))
        nbytes += _part_bytes(ck, (spec.name,), ck.tensors[spec.name].shape, rows, None)
    for prefix, spec in ck.linears.items():
        if select is not None and not select(spec.module):
            continue
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
                 weights: str = "dequant", validate: bool = True, select=None) -> dict[str, int]:
    """Load into `model` the part of every tensor of `ck` that the model holds (all of it with one
    process; this rank's slices under tensor parallelism, read from the shards without reading the
    rest). Returns the bytes read from disk per module family.

    weights: "dequant" decodes quantized linears now; "packed" keeps them as `PackedWeight`s (checked
    with the decoder's checks when `validate`, which synthetic checkpoints skip: they are valid by
    construction). select: a predicate on engine module paths (`spec.module`): load only those tensors,
    leaving the rest as they are (offload.py loads a model group by group, each group to where it lives;
    a layer's routed experts must be selected together, since they are stacked)."""
    problems: list[str] = []
    plain, linears, total = _plan(model, ck, select)
    planned = {spec.prefix for spec, _, _ in linears}
    bar = Progress(f"loading {ck.path.name}", total)
    read: dict[str, int] = {}

    def account(family: str, n: int) -> None:
        read[family] = read.get(family, 0) + n
        bar.update(n)

    # plain tensors
    for spec, rows in plain:
        t = ck.read(spec.name, rows=rows)
        keep_fp32 = spec.family in ("norm", "router")
        _set(model, spec.module, placed(t, device, torch.float32 if keep_fp32 else dtype))
        account(spec.family, t.numel() * t.element_size())
    if ck.config.text.tie_word_embeddings and (select is None or select("embed_tokens.weight")):
        model.lm_head._parameters["weight"] = model.embed_tokens.weight

    # linears; routed experts are stacked per layer into [E_local, out, in] (decoded or packed)
    stacks: dict[tuple[str, str], torch.Tensor | PackedWeight] = {}
    expert_scales: dict[tuple[str, str], torch.Tensor] = {}
    for spec, rows, cols in linears:
        prefix = spec.prefix
        f = ck.formats[prefix]
        packed = weights == "packed" and f.fmt != DENSE
        try:
            if packed:
                parts = [t.to(device) if t is not None else None for t in read_packed(ck, prefix, rows, cols)[1:]]
                if validate:
                    try:
                        check_packed(f.fmt, *parts, name=f.weight)
                    except QuantFormatError as e:
                        raise CheckpointError(f"{ck.path}: {e}") from None
            else:
                w = placed(ck.read_linear(prefix, rows=rows, cols=cols), device, dtype)
        except CheckpointError as e:
            problems.append(str(e))
            continue
        account(spec.family, _part_bytes(ck, (f.weight, f.scale, f.scale_2, f.input_scale),
                                         (spec.out_features, spec.in_features), rows, cols))
        if spec.expert is None:
            lin = _module(model, spec.module)
            if packed:
                lin.set_packed(PackedWeight(f.fmt, *parts, dtype=dtype))
            else:
                _set(model, spec.module + ".weight", w)
            if f.fmt == NVFP4 and (lin.emulate_act_quant or f.input_scale is not None):
                try:
                    lin.input_scale = ck.input_scale(prefix).to(device)
                except CheckpointError as e:
                    problems.append(str(e))
            continue
        key = (spec.module, spec.leaf)
        experts = _module(model, spec.module)
        local = spec.expert - experts.local_experts.start
        if key not in stacks:
            n_local = len(experts.local_experts)
            if packed and _pairs_gate_up(ck, spec, planned):
                # a layer's gate and up stacks are one allocation, gate's entries then up's, so that a kernel can
                # read both as one stack of 2 E entries (`fast.joint.JointStack`); each stays contiguous
                pair = [None if t is None else torch.empty((2, n_local, *t.shape), dtype=t.dtype, device=device)
                        for t in parts]
                for i, leaf in enumerate(GATE_UP):
                    stacks[spec.module, leaf] = PackedWeight(f.fmt, *(None if b is None else b[i] for b in pair),
                                                             dtype=dtype)
                    expert_scales[spec.module, leaf] = torch.ones(n_local, dtype=torch.float32, device=device)
            elif packed:  # empty packed stacks of this rank's experts, filled expert by expert
                stacks[key] = PackedWeight(f.fmt, *(None if t is None else torch.empty(
                    (n_local, *t.shape), dtype=t.dtype, device=device) for t in parts), dtype=dtype)
            else:
                stacks[key] = torch.empty((n_local, *w.shape), dtype=dtype, device=device)
            expert_scales.setdefault(key, torch.ones(n_local, dtype=torch.float32, device=device))
        stack = stacks[key]
        if isinstance(stack, PackedWeight) != packed or (packed and stack.fmt != f.fmt):
            problems.append(f"{prefix}: stored {f.fmt}, unlike the other experts of its layer")
            continue
        if packed:
            for buf, t in zip((stack.weight, stack.weight_scale, stack.weight_scale_2), parts):
                if t is not None:
                    buf[local] = t
        else:
            stack[local] = w
        if f.fmt == NVFP4 and (experts.emulate_act_quant or f.input_scale is not None):
            try:
                expert_scales[key][local] = ck.input_scale(prefix).to(device)
            except CheckpointError as e:
                problems.append(str(e))
    bar.close()
    if problems:
        raise CheckpointError(f"{ck.path}: {len(problems)} tensors cannot be decoded", problems)
    for (module, leaf), stacked in stacks.items():
        experts = _module(model, module)
        if isinstance(stacked, PackedWeight):
            del experts._parameters[leaf]  # the decoded parameter's slot: the packed stack takes its name
            setattr(experts, leaf, stacked)
        else:
            _set(model, f"{module}.{leaf}", stacked)
        setattr(experts, f"{leaf}_input_scale", expert_scales[(module, leaf)])

    missing = [n for n, p in model.named_parameters() if p.is_meta and (select is None or select(n))]
    if missing:
        raise CheckpointError(f"{ck.path}: parameters left without weights", missing)
    return read


def _nb(ck: Checkpoint, name: str) -> int:
    return _nbytes(ck.tensors[name])


def load_model(path: str | Path | None = None, *, device: str | torch.device = "cpu",
               dtype: torch.dtype | str | None = None, act_quant: str = "none", weights: str = "dequant",
               tp=None, expert_parallel: bool = False, fast: bool | str | dict | None = False,
               synthetic: str | None = None, offload="none", gpu_memory: float | None = None,
               offload_folder: str | Path | None = None, **runtime) -> MiniMaxM3:
    """Load a checkpoint folder into a ready `MiniMaxM3` in eval mode.

    device: where weights live and compute runs. dtype: torch.float32 (the golden mode: every weight
    and op in fp32), torch.bfloat16, or None / "auto" (default: `resolve_dtype`'s rule, the CLI's `--dtype auto`:
    bfloat16 on a CUDA device, float32 on a CPU, where bfloat16 runs far slower). act_quant: "none" (weight-only)
    or "emulate" (fake-quantize the inputs of NVFP4/MXFP8 linears as W4A4/W8A8 kernels do). weights: "dequant"
    (decode once at load) or "packed" (keep NVFP4/MXFP8 tensors packed on the device and decode at use: memory is the
    packed size, outputs are bit-identical to "dequant"). fast: fast paths (`minimax_ref.fast.FastPaths.of`:
    False/None/"off" = the reference, which never imports `minimax_ref.fast`; True = "on"; a preset's name of
    `minimax_ref.fast.paths.PRESETS`, a dict of switches or a `FastPaths`; "auto" = the CLI's `--fast auto`, chosen
    once the weights are loaded by `fast.paths.auto_preset`: "compiled" on CUDA for models whose weights take at
    least `AUTO_COMPILE_MIN_BYTES` on the device, "on" for smaller ones, the reference on a CPU (an offloaded model:
    chosen before the load, by its checkpoint's bytes; its steps then run as segments, `fast.segments`);
    `model.fast_preset` names what was chosen; `minimax_ref.fast.apply(model, ...)` changes them later).
    runtime: `RuntimeConfig`
    fields (max_seq_len, max_batch_size, kv_cache_dtype, max_images_per_prompt, attention_chunk_elements),
    kept on `model.runtime`.

    tp: tensor parallelism: a torch.distributed process group (or a `parallel.World`); None for one
    process. Every rank of the group calls load_model with the same arguments; each reads only its
    slices of the shards (`model.load_stats["bytes_read"]` is this rank's). A checkpoint that cannot
    be split is refused with a ConfigError before any weight is read; if any rank fails to load,
    every rank raises (the failing rank its own error, the others `parallel.RankFailedError`).
    expert_parallel: with tp, hold whole routed experts (E / TP per rank) instead of a slice of each.

    offload: "none" (default), "cpu" or "disk" (or an `offload.OffloadConfig`): weights that do not fit `gpu_memory`
    GiB on `device` stay packed in host memory or in `offload_folder` (default: a new folder under the cache, removed
    with the model) and are streamed to the device layer by layer, only the chosen experts' rows of a routed expert
    stack (offload.py; the device map is `device_map.propose_device_map`'s). Needs weights="packed", one process and the
    `offload` extra (accelerate); the outputs are the resident packed model's, bit for bit.

    path None: the embedded default checkpoint (`embedded.default_checkpoint`; `load_tokenizer(None)` is its
    tokenizer).
    synthetic: instead of `path` (pass None), a `synth` preset materialised in device memory:
    `load_model(None, synthetic="pruned-80", format="nvfp4", layers=..., experts=..., seed=...)` is
    `load_synthetic("pruned-80", ...)` (whose keyword arguments it takes).
    """
    if synthetic is not None:
        if path is not None:
            raise ConfigError("load_model: give a checkpoint path or synthetic=PRESET, not both")
        return load_synthetic(synthetic, device=device, dtype=dtype, act_quant=act_quant, weights=weights, tp=tp,
                              expert_parallel=expert_parallel, fast=fast, offload=offload, gpu_memory=gpu_memory,
                              offload_folder=offload_folder, **runtime)
    if path is None:  # the embedded default, as the CLI without --ckpt-path
        from .embedded import default_checkpoint

        path = default_checkpoint()
    resolve_device(device)
    world = World.of(tp, device)
    offload = _offload_config(offload, gpu_memory, offload_folder)

    def build() -> MiniMaxM3:
        ck = open_checkpoint(Path(path))  # headers only
        return _load(ck, world, expert_parallel, torch.device(device), dtype, act_quant, weights, fast, runtime,
                     validate=True, offload=offload)

    return _on_every_rank(world, build, f"loading {path}")


def load_synthetic(preset: str, *, format: str = "nvfp4", experts: int | None = None, layers: int | None = None,
                   overrides: dict | None = None, seed: int = 0, device: str | torch.device = "cpu",
                   dtype: torch.dtype | str | None = None, act_quant: str = "none", weights: str = "packed",
                   tp=None, expert_parallel: bool = False, fast: bool | str | dict | None = False,
                   offload="none", gpu_memory: float | None = None, offload_folder: str | Path | None = None,
                   **runtime) -> MiniMaxM3:
    """A model of `synth` preset `preset` ("tiny", "tiny-vl", "release", "pruned-80") with random weights
    in checkpoint format `format` ("nvfp4": NVFP4 experts + MXFP8 elsewhere, "mxfp8", "bf16"),
    materialised directly on `device` (synthetic.py) and loaded exactly as a checkpoint folder would be:
    same formats, same tensor-parallel slicing (each rank generates only what it holds), `weights`
    "packed" (default here) or "dequant". experts / layers / overrides change the preset's config as
    `minimax-ref synth --experts/--layers` do (e.g. the release's widths with a few layers on one GPU).
    The values are deterministic for a seed and device type, and identical across TP sizes, so a TP run
    can be compared with a TP=1 run. Other arguments as `load_model`.
    """
    from .synthetic import SyntheticCheckpoint

    resolve_device(device)
    world = World.of(tp, device)
    offload = _offload_config(offload, gpu_memory, offload_folder)

    def build() -> MiniMaxM3:
        ck = SyntheticCheckpoint(preset, format, experts=experts, layers=layers, overrides=overrides, seed=seed,
                                 device=device)
        model = _load(ck, world, expert_parallel, torch.device(device), dtype, act_quant, weights, fast, runtime,
                      validate=False, offload=offload)
        # what regenerates the same tensors (golden re-reads the packed operands from it)
        model.synthetic = {"preset": preset, "fmt": format, "experts": experts, "layers": layers,
                           "overrides": overrides, "seed": seed}
        return model

    return _on_every_rank(world, build, f"materialising synthetic {preset}")


def _offload_config(offload, gpu_memory, offload_folder):
    """`offload.OffloadConfig.of(...)`, importing offload.py only when offloading is asked for (None: not)."""
    if offload in (None, "none") and gpu_memory is None and offload_folder is None:
        return None
    from .offload import OffloadConfig

    return OffloadConfig.of(offload, gpu_memory, offload_folder)


def _on_every_rank(world: World, build, what: str) -> MiniMaxM3:
    model, error = None, None
    try:
        model = build()
    except Exception as e:  # any failure (OOM included) must reach the other ranks before they block
        error = e
    # The ranks' first collective: agree that every rank has its weights, or all raise together.
    world.agree(error, what)
    return model


def _load(ck: Checkpoint, world: World, expert_parallel: bool, device: torch.device, dtype: torch.dtype | str,
          act_quant: str, weights: str, fast, runtime: dict, validate: bool, offload=None) -> MiniMaxM3:
    """load_model on one rank, without communication."""
    dtype = resolve_dtype(dtype, device)
    if act_quant not in ACT_QUANT_MODES:
        raise ConfigError(f"act_quant={act_quant!r}: choose one of {list(ACT_QUANT_MODES)}")
    if weights not in WEIGHT_MODES:
        raise ConfigError(f"weights={weights!r}: choose one of {list(WEIGHT_MODES)}")
    auto = isinstance(fast, str) and fast == "auto"
    if auto and offload is not None:
        # an offloaded model installs its fast paths while loading: sized by the whole checkpoint it streams from
        from ..fast.paths import auto_preset

        fast, auto = auto_preset(device, sum(ck.family_bytes().values())), False
    elif auto:  # decided once the model's size on the device is known
        fast = None
    # the preset's name (None for a dict of switches or a FastPaths)
    preset = {None: "off", False: "off", True: "on"}.get(fast, fast) if fast is None or isinstance(fast, (bool, str)) \
        else None
    if fast not in (None, False, "off"):
        from ..fast import FastPaths

        fast = FastPaths.of(fast)  # refuses bad switches before any weight is read
    rt = RuntimeConfig.from_kwargs("load_model", **runtime)
    t0 = time.perf_counter()
    cfg = ck.config
    rt = rt.resolved(cfg.text.max_position_embeddings)
    check_tp_split(ck, world.size, expert_parallel)  # before any weight is read
    numerics = Numerics(act_quant, rt.attention_chunk_elements, rt.kv_cache_dtype)
    formats = {spec.module: ck.formats[prefix].fmt for prefix, spec in ck.linears.items()}
    with torch.device("meta"):
        model = MiniMaxM3(cfg, world, expert_parallel, numerics=numerics, formats=formats)
    if offload is not None:  # group by group, each part where the device map puts it (offload.py)
        from .offload import load_offloaded

        by_family = load_offloaded(model, ck, offload, load_weights, device=device, dtype=dtype, weights=weights,
                                   validate=validate, fast=fast, tp_size=world.size, expert_parallel=expert_parallel,
                                   runtime=rt)
        fast = None  # installed by load_offloaded, while the streamed weights are present
    else:
        by_family = load_weights(model, ck, device=device, dtype=dtype, weights=weights, validate=validate)
    ck.close()
    model.eval()
    model.runtime = rt
    if auto and offload is None:
        from ..fast.paths import auto_preset

        preset = fast = auto_preset(device, model_nbytes(model))
    model.fast_preset = preset
    if fast not in (None, False, "off"):
        from ..fast import apply

        apply(model, fast)
    model.ckpt_path = None if getattr(ck, "synthetic", False) else ck.path
    model.weights = weights
    model.compute_dtype = dtype
    model.notes = ck.notes
    model.load_stats = {"bytes_read": sum(by_family.values()), "bytes_read_by_family": by_family,
                        "checkpoint_bytes": sum(ck.family_bytes().values()), "memory_bytes": model_nbytes(model),
                        "tp_rank": world.rank, "tp_size": world.size, "expert_parallel": expert_parallel,
                        "seconds": time.perf_counter() - t0}
    if offload is not None:
        from .offload import offload_stats

        model.load_stats.update(offload_stats(model))
    return model
