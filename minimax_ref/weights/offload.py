"""Offloading: a model larger than the GPU, its packed weights kept in host memory or on disk and streamed to the GPU
layer by layer as the forward reaches them (`load_model(..., weights="packed", offload="cpu" | "disk",
gpu_memory=GiB)`, `--offload` / `--gpu-memory` on the CLI).

Plan first, then stream. The device map comes from `device_map.propose_device_map` (the rule `minimax-ref plan
--offload` prints): each decoder layer is two units, its "layer" part (norms, attention, indexer, shared expert or dense
MLP) and its routed expert stacks; the embedding, final norm, LM head, routers and vision tower always stay on the GPU.
Units that do not fit `gpu_memory` (after a reserve for activations and the KV cache) stream:

* a streamed layer part is copied whole to the GPU before its layer runs and dropped when the next streamed layer part
  is fetched (so hooks that read a module's weights right after its forward, as golden's do, see them); the next
  streamed layer part is prefetched on a side CUDA stream while the current layer runs (on a CPU, fetched one layer
  ahead);
* a streamed expert stack moves only the chosen experts' rows: the router runs first (it is resident), then the rows
  of the distinct chosen experts (packed bytes, block scales and global scales together, in runs of consecutive ids)
  are copied into one GPU staging stack of the layer's full shape, at their own places, so `moe.Experts` and its fast
  twin run unchanged on it (they read only the chosen rows; rows left from another layer are finite weights that the
  fast path's dense branch multiplies by 0); the module holds the staging stacks until the next streamed stack is
  fetched, then its meta placeholders again. With prefetch (below) the rows of the experts predicted for a stack are
  copied ahead, and after its router only the chosen experts not among them (the misses).

Prefetch of expert rows (pre-gating; `OffloadConfig.prefetch`, by default on for the "cpu" store on a CUDA device,
where the copies run asynchronously; off on a CPU and for the "disk" store, where a copy blocks the host and little
overlaps, so the second staging stack would cost memory for nothing; where the budget holds one staging stack but not
two, the default loads without it and says so). Decided here:
* what predicts: at a streamed stack's synchronisation point (the host reads its router's choice), the next streamed
  stack of the step (layer order) is predicted by its own router (resident) applied to the tokens the synchronising
  stack runs on: the residual stream leaving that layer's attention, normed by its post-attention norm (the one
  state every path has there: the reference hook's `x`, the segments' `flat`); the residual stream drifts little
  from layer to layer, and this needs no state the steps do not already have. The first streamed stack of a step
  has nothing before it to predict it (the previous step's states are another token's) and copies all its rows
  after its router;
* when the host reads it: with the choice, in one transfer (`enter_experts`: ids and prediction concatenated, one
  `tolist`), so prefetch adds no synchronisation, only the router's product and top-k on the compute stream;
* where the rows go: two staging sets, the streamed stacks alternating between them in layer order (each stack always
  the same set: CUDA graphs replay on recorded addresses), so the rows copied ahead for the next stack never
  overwrite those the current stack's experts read; the device map reserves the second set
  (`propose_device_map(expert_stages=2)`, so `--gpu-memory` still holds); without prefetch one set, as before;
* what the experts read: only the chosen rows (the gather path), or every row with the unchosen ones multiplied by 0
  (the dense branch): a predicted row that was not chosen is a real, finite row of the stack, so outputs do not
  depend on the prediction (tests/test_offload.py checks a prediction that is always wrong);
* rows copied ahead serve only the next stack entered (a step that stops before it discards them), and
  `Streamer.stats` counts, per stack entered, the chosen rows, hits (copied ahead), misses and rows copied ahead
  (hits + misses = chosen; `benchmarks/offload.py` prints the hit rate per step).

Weights stay packed everywhere: what moves is the stored NVFP4 / MXFP8 bytes, decoded on the GPU by the same decoder,
so an offloaded model's logits and greedy tokens equal the resident `weights="packed"` model's bit for bit (the
streamed copies are byte copies; tests/test_offload.py checks it on NVFP4 + MXFP8 checkpoints).

Where the weights sit (decided here; weights.md "Offload"): "cpu" keeps the streamed tensors in host memory (pinned
when the compute device is a GPU, so copies run at the PCIe rate and asynchronously); "disk" writes them once, at load,
in accelerate's offload format (one raw `.dat` file per tensor and an `index.json`, `accelerate.utils.offload_weight`;
float8 tensors written as their bytes) into `offload_folder`, and maps the files into memory, so a step reads from disk
only the pages of the rows it copies. Loading goes group by group (the always-resident tensors, then one decoder layer
at a time, `loader.load_weights(select=...)`), each part read straight to where it lives, so host memory holds one
layer at a time beyond the "cpu" store.

accelerate (the `offload` extra) supplies the hook mechanism (`ModelHook`, `add_hook_to_module`: the streaming runs in
hooks installed from outside, the reference modules are unchanged), `set_module_tensor_to_device` (moving a loaded
tensor out of a module) and the disk format. What it does not fit, and the adapters written here instead:
`infer_auto_device_map` sizes modules by their parameters (the meta model holds decoded shapes, not packed bytes) and
knows nothing of routing (an expert stack costs k/E of its bytes per token, a layer part all of them), so the map is
`device_map.propose_device_map`; `AlignDevicesHook` moves every tensor of a module at each call, while an expert stack
must move only the rows the router chose, after the router ran, and the next layer must be prefetched, so the hooks are
`LayerHook` and `ExpertsHook` over one `Streamer`; `load_offloaded_weight` reads a whole tensor into memory, while a
step reads a few rows, so the disk store maps the files (`DiskStore`).

Fast paths (chosen at load; `fast.apply` is not to be called again on an offloaded model). A streamed unit
synchronises with the host (a streamed stack reads the router's choice; a streamed layer part is fetched by its hook),
so no decode step is one compiled graph per layer or one CUDA graph; `segment_steps` cuts the steps at those points
instead (`fast.segments.SegmentedLayers`): a layer whose layer part streams runs eagerly with the preset's fast twins;
a layer whose expert stack alone streams runs as two pieces, up to its router and after it, around the copy of the
chosen rows; every other layer is one piece. The pieces between two synchronisation points form a segment, run
compiled when the preset compiles layers ("compiled", what `--fast auto` takes on CUDA from 1 GiB of checkpoint)
and, with the preset's `graph` switch on CUDA, captured in a CUDA graph per cache and step shape and replayed (the
staging stacks keep their addresses, so a graph reads the rows copied before its replay; the whole-step `graph`
switch itself is turned off).
Logits and tokens are those of the resident packed model cut into the same pieces, bit for bit (a replayed CUDA
graph: to fp32 rounding, its library calls may take other algorithms inside a capture); with "compiled", the fully
compiled resident model's to fp32 rounding (a split layer is two compiled graphs, not one).

What overlaps what, on a GPU. A streamed layer part is copied on a side stream, issued when the streamed layer part
before it is entered, so its copy overlaps all the compute from there to its own layer (the segments between
included). A streamed stack's chosen rows are known only once its own router has run (the choice of layer L is a
function of layer L's post-attention residual), so at that point the host waits for the segment ending with the
router (the GPU drains), issues the misses' copies on the compute stream, and then the segment starting with the
experts, which waits for them: the misses overlap nothing but the side stream's copies. The rows predicted for the
next streamed stack are issued on the side stream right after, so their copy overlaps the current stack's experts,
its shared expert and every layer up to the next stack's router (the misses of the current stack are queued first
and share the link with them). A step therefore costs about the compute, plus the misses' copies (all the chosen rows
of the step's first streamed stack), plus one host round trip per streamed stack; rows copied ahead and not chosen
cost link time, hidden while the compute is longer than them. The segments cut the compute (compiled, replayed pieces
instead of eager launches). From the "disk" store (pageable memory) a copy blocks the host, so there prefetch moves
the rows earlier but overlaps little.

Limits: one process (TP=1), `weights="packed"`; a layer whose layer part streams runs uncompiled and outside CUDA
graphs.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import shutil
import sys
import tempfile
import weakref
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..errors import ConfigError
from ..model.cache import kv_bytes_per_token
from ..model.moe import route
from .device_map import GIB, OFFLOAD_MODES, DeviceMap, default_prefetch, id_runs, propose_staged_map, unit_of
from .footprint import DEFAULT_ACTIVATION_RESERVE_GIB, offload_units

EXTRA_HINT = "pip install 'minimax-ref[offload]' (or: pip install 'accelerate>=1.0')"


def require_accelerate():
    """The `accelerate` modules offloading uses, or a ConfigError naming the extra that installs them."""
    try:
        import accelerate.hooks
        import accelerate.utils
    except ImportError:
        raise ConfigError(f"offloading (--offload cpu|disk) needs the accelerate package: {EXTRA_HINT}") from None
    return accelerate


@dataclass(frozen=True)
class OffloadConfig:
    """How to offload: `mode` "cpu" or "disk" ("none": not at all), the GPU budget `gpu_memory_gib` (everything the
    model takes on the GPU: resident weights, staging buffers, and the reserve), the disk store's `folder` (default: a
    new folder under the cache folder, removed with the model), `reserve_gib` kept for activations on top of the KV
    cache of the runtime's `max_batch_size` (one when chosen per call: it then fits what is left) x `max_seq_len`,
    `share_streamed_experts` (synthetic weights only: every streamed expert stack reads the host stacks of the
    first streamed one, so a release-width model whose experts exceed host memory can run; the bytes moved per step
    are the same), and `prefetch`: copy the next streamed stack's predicted experts' rows ahead (module docstring;
    the device map then reserves a second staging stack; outputs are the same either way); None (default):
    `device_map.default_prefetch`'s."""

    mode: str = "none"
    gpu_memory_gib: float | None = None
    folder: Path | None = None
    reserve_gib: float = DEFAULT_ACTIVATION_RESERVE_GIB
    share_streamed_experts: bool = False
    prefetch: bool | None = None

    @classmethod
    def of(cls, offload: str | OffloadConfig | None, gpu_memory: float | None = None,
           folder: str | Path | None = None) -> OffloadConfig | None:
        """`load_model`'s arguments as a config (None for no offloading), checked."""
        if isinstance(offload, OffloadConfig):
            cfg = offload
        else:
            offload = offload or "none"
            if offload not in OFFLOAD_MODES:
                raise ConfigError(f"offload={offload!r}: choose one of {list(OFFLOAD_MODES)}")
            cfg = cls(offload, gpu_memory, None if folder is None else Path(folder))
        if cfg.mode == "none":
            if gpu_memory is not None or folder is not None:
                raise ConfigError("gpu_memory / offload_folder (--gpu-memory, --offload-folder) need offload='cpu' or "
                                  "'disk' (--offload)")
            return None
        if cfg.mode not in OFFLOAD_MODES:
            raise ConfigError(f"offload mode {cfg.mode!r}: choose one of {list(OFFLOAD_MODES)}")
        if cfg.gpu_memory_gib is None or not cfg.gpu_memory_gib > 0:
            raise ConfigError(f"offload={cfg.mode!r} needs gpu_memory (--gpu-memory GIB), the GPU memory the model "
                              f"may take, > 0 (got {cfg.gpu_memory_gib!r})")
        if cfg.folder is not None and cfg.mode != "disk":
            raise ConfigError("offload_folder (--offload-folder) is for offload='disk'")
        if cfg.reserve_gib < 0:
            raise ConfigError(f"offload reserve_gib={cfg.reserve_gib}: must be >= 0")
        return cfg


def check_offload(cfg: OffloadConfig, *, weights: str, tp_size: int, expert_parallel: bool, fast,
                  synthetic: bool) -> None:
    """Refuse what offloading does not run, before any weight is read (ConfigError, each naming the fix)."""
    if tp_size > 1 or expert_parallel:
        raise ConfigError(f"--offload {cfg.mode} runs in one process (TP=1); this run has {tp_size} tensor-parallel "
                          "ranks: drop torchrun / --expert-parallel, or drop --offload")
    if weights != "packed":
        raise ConfigError(f"--offload {cfg.mode} streams the packed NVFP4 / MXFP8 bytes: use --weights packed "
                          "(weights='packed'); dequantized weights would move 2-4x the bytes")
    if cfg.share_streamed_experts and not synthetic:
        raise ConfigError("share_streamed_experts is for synthetic weights only (every streamed expert stack would "
                          "read another layer's experts)")


# ---------------------------------------------------------------------------------------------- stores


class HostStore(dict):
    """The "cpu" store: tensor name -> host tensor (pinned when `pin`, so copies to a GPU run asynchronously)."""

    def __init__(self, pin: bool):
        super().__init__()
        self.pin = pin

    def put(self, name: str, t: torch.Tensor) -> None:
        self[name] = t.pin_memory() if self.pin else t


class DiskStore(dict):
    """The "disk" store: tensor name -> a host tensor mapped onto its file in `folder` (accelerate's offload format:
    `NAME.dat` raw bytes plus `index.json`; float8 tensors are written as uint8 bytes and viewed back). Reading a slice
    reads only its pages (copy-on-write mapping: nothing is ever written back)."""

    def __init__(self, folder: Path):
        super().__init__()
        self.folder = folder
        self.index: dict[str, dict] = {}

    def put(self, name: str, t: torch.Tensor) -> None:
        from accelerate.utils import offload_weight

        dtype = t.dtype
        raw = t.view(torch.uint8) if dtype.itemsize == 1 and dtype not in (torch.uint8, torch.int8) else t
        self.index.update(offload_weight(raw.cpu(), name, str(self.folder), index={}))
        self.index[name]["torch_dtype"] = str(dtype).removeprefix("torch.")
        self[name] = self._map(name)

    def _map(self, name: str) -> torch.Tensor:
        import numpy as np

        info = self.index[name]
        shape = tuple(info["shape"])
        np_dtype = "int16" if info["dtype"] == "bfloat16" else info["dtype"]
        mm = np.memmap(self.folder / f"{name}.dat", dtype=np_dtype, mode="c", shape=shape or (1,))
        t = torch.from_numpy(mm)
        t = t.view(getattr(torch, info["torch_dtype"]))
        return t.reshape(shape)

    def save_index(self) -> None:
        from accelerate.utils import save_offload_index

        save_offload_index(self.index, str(self.folder))


# ---------------------------------------------------------------------------------------------- streaming


@dataclass
class Record:
    """One streamed tensor: `module.leaf` (a parameter when `is_param`, else a buffer), its store `key`, and its
    placeholder on the meta device (what the module holds while the tensor is not on the GPU)."""

    module: nn.Module
    leaf: str
    is_param: bool
    key: str
    meta: torch.Tensor
    # the parameters made for tensors put with `keep` (the placeholder, staging stacks): id -> (tensor, parameter)
    kept: dict = field(default_factory=dict, repr=False)

    def put(self, t: torch.Tensor, keep: bool = False) -> None:
        """Make `t` the module's tensor; `keep`: `t` lives as long as the streamer (the placeholder, a staging stack),
        so the parameter made for it is kept and reused (every streamed stack swaps to and from those every step).
        (`accelerate.utils.set_module_tensor_to_device` does this with dtype casts and, by default, a cache flush per
        tensor; here shape and dtype are known equal, and this runs every step.)"""
        if not self.is_param:
            self.module._buffers[self.leaf] = t
            return
        entry = self.kept.get(id(t)) if keep else None
        if entry is None or entry[0] is not t:
            entry = (t, nn.Parameter(t, requires_grad=False))
            if keep:
                self.kept[id(t)] = entry
        self.module._parameters[self.leaf] = entry[1]


@dataclass
class Unit:
    """A streamed unit of the device map (`device_map.OffloadUnit`) with its tensors."""

    name: str
    kind: str
    layer: int
    records: list[Record]
    num_experts: int = 0


@dataclass
class StreamStats:
    """Bytes copied host -> device: whole layer parts, experts' rows, and how many rows (`expert_rows`: copied ahead
    on a prediction or after the router). Of the distinct chosen experts of every streamed stack entered
    (`chosen_rows`), `hit_rows` were already copied ahead and `miss_rows` were copied after the router;
    `prefetched_rows` counts the rows copied ahead, chosen or not (hits + misses = chosen)."""

    layer_bytes: int = 0
    expert_bytes: int = 0
    expert_rows: int = 0
    chosen_rows: int = 0
    hit_rows: int = 0
    miss_rows: int = 0
    prefetched_rows: int = 0

    @property
    def bytes_moved(self) -> int:
        return self.layer_bytes + self.expert_bytes

    @property
    def hit_rate(self) -> float | None:
        """Hits / chosen rows (None before any streamed stack ran)."""
        return self.hit_rows / self.chosen_rows if self.chosen_rows else None


@dataclass
class Streamer:
    """The streamed units of an offloaded model, their store, and the GPU staging buffers (module docstring)."""

    device: torch.device
    store: dict = field(repr=False)
    device_map: DeviceMap = field(repr=False)
    units: dict[str, Unit] = field(repr=False)
    staging: dict[tuple, torch.Tensor] = field(default_factory=dict, repr=False)
    stats: StreamStats = field(default_factory=StreamStats)
    pending: dict[str, tuple[list[torch.Tensor], object]] = field(default_factory=dict, repr=False)
    stream: object = field(default=None, repr=False)
    # the streamed unit of each kind whose weights its module holds now ("layer" / "experts" -> unit name)
    holding: dict[str, str] = field(default_factory=dict, repr=False)
    # copy the next streamed stack's predicted rows ahead (module docstring, "Prefetch of expert rows")
    prefetch: bool = False
    # streamed stack name -> its router (resident), which predicts the stack's experts
    routers: dict = field(default_factory=dict, repr=False)
    # the rows copied ahead for the next stack entered: (stack name, expert ids, event on the side stream or None)
    ahead: tuple | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.device.type == "cuda":
            self.stream = torch.cuda.Stream(self.device)
        self.layer_order = [u.name for u in self.units.values() if u.kind == "layer"]
        stacks = sorted((u for u in self.units.values() if u.kind == "experts"), key=lambda u: u.layer)
        # the stack predicted at a stack's synchronisation point: the next streamed one of the same step
        self.next_stack = {a.name: b.name for a, b in zip(stacks, stacks[1:])}
        # two staging sets when prefetching, stacks alternating between them in layer order, so the rows copied
        # ahead for a stack never overwrite those the stack before it reads; each stack always uses the same set
        # (a CUDA graph replays on the addresses it was recorded with)
        sets = 2 if self.prefetch and len(stacks) > 1 else 1
        self.stage_set = {u.name: i % sets for i, u in enumerate(stacks)}
        # one staging stack per (set, tensor of a stack, shape, dtype): shared by the streamed layers of that shape
        for u in stacks:
            for r in u.records:
                key = self.staging_key(r, self.stage_set[u.name])
                if key not in self.staging:
                    self.staging[key] = torch.zeros(r.meta.shape, dtype=r.meta.dtype, device=self.device)

    @staticmethod
    def staging_key(r: Record, stage_set: int = 0) -> tuple:
        return (stage_set, r.key.rsplit("experts.", 1)[-1], tuple(r.meta.shape), r.meta.dtype)

    # ---- layer parts
    def _copy(self, unit: Unit) -> tuple[list[torch.Tensor], object]:
        """Copies of `unit`'s tensors on the device (on the side stream, with an event to wait on, on a GPU)."""
        out, event = [], None
        ctx = torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()
        with ctx:
            for r in unit.records:
                src = self.store[r.key]
                dst = torch.empty(src.shape, dtype=src.dtype, device=self.device)
                dst.copy_(src, non_blocking=True)
                out.append(dst)
                self.stats.layer_bytes += src.numel() * src.element_size()
            if self.stream is not None:
                event = torch.cuda.Event()
                event.record(self.stream)
        return out, event

    def hold(self, kind: str, name: str | None) -> None:
        """Make `name` the unit of `kind` whose module holds its weights, after dropping the previous one's (its
        records back to the meta placeholders). A unit keeps its weights after it ran, until the next unit of its kind
        is fetched, so code that reads a module's weights right after its forward (golden's forward hooks) sees
        them; at most one unit of each kind is held, as the staging budget counts."""
        previous = self.holding.pop(kind, None)
        if previous is not None and previous != name:
            for r in self.units[previous].records:
                r.put(r.meta, keep=True)
        if name is not None:
            self.holding[kind] = name

    def enter_layer(self, name: str) -> None:
        """Before streamed layer part `name` runs: its tensors on the device (prefetched, or copied now; the layer part
        held before dropped), and the next streamed layer part's copy started."""
        unit = self.units[name]
        self.hold("layer", None)
        tensors, event = self.pending.pop(name, None) or self._copy(unit)
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for t in tensors:
                t.record_stream(current)  # allocated on the side stream, used (and freed) on this one
        for r, t in zip(unit.records, tensors):
            r.put(t)
        self.hold("layer", name)
        order = self.layer_order
        nxt = order[(order.index(name) + 1) % len(order)]
        if nxt != name and nxt not in self.pending:
            self.pending[nxt] = self._copy(self.units[nxt])

    # ---- expert stacks
    def predict(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """The experts stack `name` is predicted to choose for tokens `x` [T, H] (the post-attention-normed stream of
        the layer synchronising now): its own router on `x`, called functionally (hooks on the router, golden's or a
        trace's, see only its real calls). Ids [T, k] on the device; they choose which rows are copied ahead, never
        what the experts compute."""
        g = self.routers[name]
        return route(x, g.weight, g.e_score_correction_bias, g.top_k, g.expert_mask).expert_ids

    def _copy_rows(self, unit: Unit, ids: list[int], ahead: bool) -> object:
        """Copy the rows `ids` (sorted, distinct) of `unit`'s stacks into its staging stacks, on the compute stream,
        or with `ahead` on the side stream after the work queued so far on the compute stream (the set being written
        may still be read there); returns the side stream's event (None on the compute stream or on a CPU)."""
        runs = id_runs(ids)
        rows = len(ids)
        side = ahead and self.stream is not None
        if side:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream) if side else nullcontext():
            for r in unit.records:
                stage, src = self.staging[self.staging_key(r, self.stage_set[unit.name])], self.store[r.key]
                for a, b in runs:
                    stage[a:b].copy_(src[a:b], non_blocking=True)
                self.stats.expert_bytes += rows * src[0].numel() * src.element_size()
            self.stats.expert_rows += rows
            if not side:
                return None
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def enter_experts(self, name: str, expert_ids: torch.Tensor, x: torch.Tensor | None = None) -> None:
        """Before streamed expert stacks `name` run on tokens routed to `expert_ids` (local ids, any shape): the rows
        of the distinct chosen experts not already copied ahead copied into the stack's staging stacks, which the
        module then holds. With prefetch on and `x` (the tokens the experts run on) given, the next streamed stack's
        experts are predicted from `x` (`predict`) and their rows copied ahead, on the side stream."""
        unit = self.units[name]
        self.hold("experts", name)  # the stacks held before point at staging stacks that may be overwritten
        ahead, self.ahead = self.ahead, None  # rows copied ahead serve only the next stack entered
        nxt = self.next_stack.get(name) if self.prefetch and x is not None else None
        ids = expert_ids.reshape(-1)
        n = ids.numel()
        if nxt is not None:
            ids = torch.cat([ids, self.predict(nxt, x).reshape(-1).to(ids.device)])
        host = ids.tolist()  # reads the choice (and the prediction with it) on the host: the one synchronisation
        chosen = sorted(set(host[:n]))
        present, event = (ahead[1], ahead[2]) if ahead is not None and ahead[0] == name else (frozenset(), None)
        misses = [e for e in chosen if e not in present]
        self.stats.chosen_rows += len(chosen)
        self.stats.hit_rows += len(chosen) - len(misses)
        self.stats.miss_rows += len(misses)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        self._copy_rows(unit, misses, ahead=False)
        for r in unit.records:
            r.put(self.staging[self.staging_key(r, self.stage_set[name])], keep=True)
        if nxt is not None:
            predicted = sorted(set(host[n:]))
            self.stats.prefetched_rows += len(predicted)
            self.ahead = (nxt, frozenset(predicted), self._copy_rows(self.units[nxt], predicted, ahead=True))

    @contextmanager
    def present(self) -> Iterator[None]:
        """Every streamed tensor's host copy in its module for the duration (for code that reads weights once, such as
        `fast.apply`'s configuration of packed weights); the meta placeholders again afterwards."""
        self.hold("layer", None)
        self.hold("experts", None)
        for u in self.units.values():
            for r in u.records:
                r.put(self.store[r.key])
        try:
            yield
        finally:
            for u in self.units.values():
                for r in u.records:
                    r.put(r.meta, keep=True)

    def device_bytes(self) -> int:
        """Bytes of the staging stacks (the layer parts' copies come and go)."""
        return sum(t.numel() * t.element_size() for t in self.staging.values())


def _hooks():
    """The two accelerate hooks (defined lazily: accelerate is imported only when offloading)."""
    from accelerate.hooks import ModelHook

    class LayerHook(ModelHook):
        """On a decoder layer whose layer part streams: fetch before it runs (`Streamer.enter_layer`)."""

        def __init__(self, streamer: Streamer, name: str):
            super().__init__()
            self.streamer, self.name = streamer, name

        def pre_forward(self, module, *args, **kwargs):
            self.streamer.enter_layer(self.name)
            return args, kwargs

    class ExpertsHook(ModelHook):
        """On a streamed `moe.Experts`: called as `experts(x, routing)`, after the router chose; moves the chosen
        rows."""

        def __init__(self, streamer: Streamer, name: str):
            super().__init__()
            self.streamer, self.name = streamer, name

        def pre_forward(self, module, x, routing, *args, **kwargs):
            self.streamer.enter_experts(self.name, routing.expert_ids, x)
            return (x, routing, *args), kwargs

    return LayerHook, ExpertsHook


# ---------------------------------------------------------------------------------------------- loading


def _module(model: nn.Module, path: str) -> nn.Module:
    return model.get_submodule(path) if path else model


def _tensors(model: nn.Module, prefix: str) -> Iterator[tuple[str, nn.Module, str, bool, torch.Tensor]]:
    """(full name, module, leaf, is parameter, tensor) of every tensor under module path `prefix`."""
    root = _module(model, prefix)
    for mname, m in root.named_modules():
        path = f"{prefix}.{mname}" if mname else prefix
        for leaf, t in m._parameters.items():
            if t is not None:
                yield f"{path}.{leaf}", m, leaf, True, t
        for leaf, t in m._buffers.items():
            if t is not None:
                yield f"{path}.{leaf}", m, leaf, False, t


def _placeholders_like(experts: nn.Module, template: nn.Module) -> None:
    """Give `experts` (never loaded: it shares `template`'s host stacks) `template`'s packed stacks as meta
    placeholders of the same formats and shapes."""
    from .packed import PackedWeight

    for leaf in ("w1", "w2", "w3"):
        w = getattr(template, leaf)
        if isinstance(w, PackedWeight):
            del experts._parameters[leaf]
            setattr(experts, leaf, PackedWeight(w.fmt, *(None if t is None else torch.empty(t.shape, dtype=t.dtype,
                                                                                             device="meta")
                                                         for t in (w.weight, w.weight_scale, w.weight_scale_2)),
                                                dtype=w.dtype))


def device_map_for(model: nn.Module, ck, cfg: OffloadConfig, dtype: torch.dtype, runtime,
                   prefetch: bool | None) -> tuple[DeviceMap, bool]:
    """The device map of `model` (built from checkpoint `ck`) for `cfg`: `device_map.propose_staged_map` over
    `footprint.offload_units` (sizes from the shards' headers, or the config for synthetic weights) with a reserve of
    `cfg.reserve_gib` plus the KV cache of `runtime.max_batch_size` sequences (one when it is chosen per call, from
    the memory the device map leaves) of `runtime.max_seq_len` tokens, and `prefetch`'s staging. Returns the map and
    whether it prefetches."""
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    ckpt_dir = None if getattr(ck, "synthetic", False) else Path(ck.path)
    always, units = offload_units(ck.config, dtype_bytes=dtype_bytes, ckpt_dir=ckpt_dir)
    kv = kv_bytes_per_token(ck.config, 1, runtime.kv_cache_dtype, dtype_bytes) * runtime.max_seq_len \
        * (runtime.max_batch_size or 1)
    return propose_staged_map(units, always, int(cfg.gpu_memory_gib * GIB), int(cfg.reserve_gib * GIB) + kv,
                              prefetch)


def load_offloaded(model: nn.Module, ck, cfg: OffloadConfig, load_weights, *, device: torch.device,
                   dtype: torch.dtype, weights: str, validate: bool, fast, tp_size: int = 1,
                   expert_parallel: bool = False, runtime=None) -> dict[str, int]:
    """Load checkpoint `ck` into the meta-built `model` by the device map (`device_map_for`): resident parts onto
    `device`, streamed ones into the store ("cpu" / "disk"), group by group through `load_weights` (the loader's,
    passed in: the loader imports this module, not the reverse); install the fast paths `fast` (a `FastPaths` or
    None) with the streamed weights present, then the streaming hooks. Sets `model.offload` (the `Streamer`: its
    device map, store and `stats`). Returns the bytes read per family."""

    synthetic = bool(getattr(ck, "synthetic", False))
    check_offload(cfg, weights=weights, tp_size=tp_size, expert_parallel=expert_parallel, fast=fast,
                  synthetic=synthetic)
    # a whole step is never captured (streamed layers read the router's choice on the host); the resident segments
    # between streamed layers are, on CUDA (`segment_steps`)
    capture = bool(getattr(fast, "graph", False))
    if capture:
        fast = dataclasses.replace(fast, graph=False)
    accelerate = require_accelerate()
    if cfg.mode == "disk":
        from .embedded import cache_dir

        folder = cfg.folder
        try:
            if folder is None:  # a folder of its own under the cache folder, removed with the store
                (cache_dir() / "offload").mkdir(parents=True, exist_ok=True)
                folder = Path(tempfile.mkdtemp(prefix="run-", dir=cache_dir() / "offload"))
            folder.mkdir(parents=True, exist_ok=True)
            probe = folder / ".minimax-ref-write-test"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise ConfigError(f"--offload-folder {folder or cache_dir() / 'offload'}: cannot write there "
                              f"({e.strerror}); give a writable folder with room for the streamed weights "
                              "(--offload-folder DIR)") from None
        if (folder / "index.json").exists():
            raise ConfigError(f"--offload-folder {folder} already holds an offload index (index.json): give an "
                              "empty or new folder")
        store: dict = DiskStore(folder)
        if cfg.folder is None:
            weakref.finalize(store, shutil.rmtree, folder, True)
    else:
        store = HostStore(pin=device.type == "cuda")
    wanted = cfg.prefetch if cfg.prefetch is not None else default_prefetch(cfg.mode, device.type == "cuda")
    dm, prefetch = device_map_for(model, ck, cfg, dtype, runtime, wanted)
    if wanted is None and not prefetch:
        print(f"[offload] --gpu-memory {cfg.gpu_memory_gib:g} GiB holds one expert staging stack, not the two that "
              "prefetch needs: loading without it (more --gpu-memory keeps it)", file=sys.stderr)
    cfg = dataclasses.replace(cfg, prefetch=prefetch)
    streamed = set(dm.streamed)
    host = torch.device("cpu")
    read: dict[str, int] = {}

    def add(counts: dict[str, int]) -> None:
        for k, v in counts.items():
            read[k] = read.get(k, 0) + v

    def unit_name(path: str) -> str | None:
        kind, layer = unit_of(path)
        return None if kind == "resident" else (f"layers.{layer}" if kind == "layer" else f"layers.{layer}.experts")

    set_tensor = accelerate.utils.set_module_tensor_to_device
    quiet = "clear_cache" in inspect.signature(set_tensor).parameters

    units: dict[str, Unit] = {}
    template: dict[str, str] = {}  # share_streamed_experts: stack-relative name -> the first streamed stack's key
    add(load_weights(model, ck, device=device, dtype=dtype, weights=weights, validate=validate,
                     select=lambda p: unit_of(p)[0] == "resident"))
    for layer in range(len(model.layers)):
        mine = f"layers.{layer}"
        exp_name = f"{mine}.experts"
        shared = cfg.share_streamed_experts and exp_name in streamed and bool(template)

        def in_layer(p: str, streaming: bool, mine=mine, shared=shared) -> bool:
            u = unit_name(p)
            if u is None or not (u == mine or u.startswith(mine + ".")):
                return False
            if shared and u.endswith(".experts"):
                return False  # this layer's streamed experts read the template's host stacks
            return (u in streamed) == streaming

        add(load_weights(model, ck, device=device, dtype=dtype, weights=weights, validate=validate,
                         select=lambda p, f=in_layer: f(p, False)))
        add(load_weights(model, ck, device=host, dtype=dtype, weights=weights, validate=validate,
                         select=lambda p, f=in_layer: f(p, True)))
        for name in (mine, exp_name):
            if name not in streamed:
                continue
            prefix = f"{mine}.block_sparse_moe.experts" if name == exp_name else mine
            share = shared and name == exp_name
            if share:
                _placeholders_like(_module(model, prefix), _module(model, template["__module__"]))
            records = []
            for full, m, leaf, is_param, t in list(_tensors(model, prefix)):
                kind = unit_name(full)
                if kind != name:
                    continue  # the router and the experts' input scales (resident), or the other unit of the layer
                rel = full[len(prefix) + 1:]
                if share:
                    key = template[rel]
                    meta = t
                else:
                    key = full
                    store.put(key, t)
                    meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
                    if cfg.share_streamed_experts and name == exp_name:
                        template[rel] = key
                records.append(Record(m, leaf, is_param, key, meta))
                if not share:
                    set_tensor(m, leaf, "meta", **({"clear_cache": False} if quiet else {}))
            if name == exp_name:
                experts = _module(model, prefix)
                for leaf in ("w1", "w2", "w3"):  # the per-expert input scales stay resident
                    s = getattr(experts, f"{leaf}_input_scale")
                    if s is not None:
                        setattr(experts, f"{leaf}_input_scale", s.to(device))
                    elif share:
                        src = _module(model, template["__module__"])
                        setattr(experts, f"{leaf}_input_scale", getattr(src, f"{leaf}_input_scale"))
                if cfg.share_streamed_experts and "__module__" not in template:
                    template["__module__"] = prefix
            units[name] = Unit(name, "experts" if name == exp_name else "layer", layer, records,
                               model.text.num_local_experts if name == exp_name else 0)
    if isinstance(store, DiskStore):
        store.save_index()
        (store.folder / "device_map.json").write_text(json.dumps(
            {"resident": list(dm.resident), "streamed": list(dm.streamed)}, indent=1))
    routers = {name: model.layers[u.layer].block_sparse_moe.gate for name, u in units.items() if u.kind == "experts"}
    streamer = Streamer(device, store, dm, units, prefetch=cfg.prefetch, routers=routers)
    if fast not in (None, False, "off") and fast.any:
        from ..fast import apply

        with streamer.present():  # the fast packed weights read their scales once, here
            apply(model, fast)
        launch_on_device(model, streamer)
        segment_steps(model, streamer, fast, capture=capture)
    LayerHook, ExpertsHook = _hooks()
    for name, u in units.items():
        if u.kind == "layer":
            accelerate.hooks.add_hook_to_module(model.layers[u.layer], LayerHook(streamer, name))
        else:
            accelerate.hooks.add_hook_to_module(model.layers[u.layer].block_sparse_moe.experts,
                                                ExpertsHook(streamer, name))
    model.offload = streamer
    return read


def launch_on_device(model: nn.Module, streamer: Streamer) -> None:
    """The fast twins of the streamed units were configured while their host copies were present
    (`Streamer.present`), so what `fast.apply` derived from their device is the host's: the grouped kernel's launch
    configuration and K splits, the decode tiles and the sorted-rows kernel's tiles of a streamed packed weight, the
    SM count a streamed layer part's attention splits its keys over. Derive them again for the compute device (a
    weight's other settings come from its values, the same wherever they sit)."""
    from ..fast import grouped, prefill_experts
    from ..fast.attention import FastAttention
    from ..fast.packed import FastPackedWeight

    device = streamer.device
    for u in streamer.units.values():
        if u.kind == "layer":
            for m in model.layers[u.layer].modules():
                if isinstance(m, FastAttention):
                    m.sm_count = grouped.sm_count(device)
        for m in {id(r.module): r.module for r in u.records}.values():
            if not isinstance(m, FastPackedWeight):
                continue
            if m.grouped_tokens:
                entries = m.weight.shape[0] if m.weight.dim() == 3 else 1
                m.grouped_launch = grouped.launch_for(m.fmt, entries, *m.shape[-2:], device)
            if m.decode_tiles is not None:
                m.decode_tiles = grouped.tiles_for(m.fmt, device)
            if m.sorted_tiles is not None:
                m.sorted_tiles = prefill_experts.tiles_for(device)


def segment_steps(model: nn.Module, streamer: Streamer, fast, capture: bool) -> None:
    """Split the decode steps of the fast model `model` (paths `fast` installed) at their host synchronisation points
    (`fast.segments.SegmentedLayers` as `model.compiled`): a layer whose layer part streams runs eagerly; a layer whose
    expert stack alone streams runs as two pieces around `Streamer.enter_experts`; the other layers and pieces run
    compiled when the paths compile layers (else eagerly), and, with `capture` (the paths' `graph` switch) on CUDA,
    each run of pieces between synchronisation points is captured in a CUDA graph per cache and step shape and
    replayed. Nothing to split (left as installed): paths without `moe` and `static_kv` (steps that synchronise
    anyway), and on a CPU paths that do not compile layers."""
    from ..fast.segments import SegmentedLayers, cuda_recorder

    capture = capture and streamer.device.type == "cuda"
    if not (fast.moe and fast.static_kv) or not (fast.compile_layers or capture):
        return
    eager = {u.layer for u in streamer.units.values() if u.kind == "layer"}
    split = {u.layer for u in streamer.units.values() if u.kind == "experts"} - eager

    def sync(layer: nn.Module, routing, x: torch.Tensor) -> None:
        streamer.enter_experts(f"layers.{layer.layer}.experts", routing.expert_ids, x)

    model.compiled = SegmentedLayers(len(model.layers), eager, split, sync, compiled=model.compiled,
                                     recorder=cuda_recorder() if capture else None)


def offload_stats(model: nn.Module) -> dict:
    """What an offloaded model's `load_stats` add: the mode's device map (resident and streamed units), the bytes on
    the device (resident weights and staging stacks) and in the store."""
    s: Streamer = model.offload
    dm = s.device_map
    on_device = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]
                    if t.device.type == s.device.type) + s.device_bytes()
    stored = sum(t.numel() * t.element_size() for t in s.store.values())
    return {"offload": "disk" if isinstance(s.store, DiskStore) else "cpu", "memory_bytes": on_device,
            "offloaded_bytes": stored, "resident_units": list(dm.resident), "streamed_units": list(dm.streamed),
            "planned_gpu_bytes": dm.gpu_bytes, "budget_bytes": dm.budget_bytes}


__all__ = ["OffloadConfig", "Streamer", "StreamStats", "HostStore", "DiskStore", "load_offloaded", "check_offload",
           "device_map_for", "id_runs", "offload_stats", "require_accelerate", "segment_steps",
           "launch_on_device"]
