"""The compiled decoder layer of decode steps (`FastPaths.compile_layers`), saved across processes where torch can,
and what it needs: `materialize`, the operator that bounds inductor's recomputation, the norm twin that uses it, and
`top_k`, the top-k of compiled steps.

Inductor fuses an elementwise chain into every consumer and recomputes it there; for the queries after norm and
RoPE, the softmax probabilities, the SwiGLU output or a norm that multiplies every weight row, that means once per
key or per weight row. The packed matmuls need that inlining (their decoded weight must never be stored), so it is
bounded where it costs: the fast twins pass those values through `materialize`, which stores them once in a
compiled region and is the identity elsewhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import os
import sys
from pathlib import Path

import torch
from torch import nn

from ..model.norm import RMSNorm
from .launch import ReductionConfigs, fixed_reductions, inductor_options
from .packed import FUSED_INDUCTOR_OPTIONS
from .prefill import fused_rms_norm

# The fused matmul's options (a packed weight's decoding stays inside the matmul that reads it, the bf16 roundings
# kept), with coordinate-descent tuning of each Triton kernel's block sizes and warps (along one axis at a time:
# trying every diagonal move too makes a compile take many minutes).
# Inductor's static launcher is off: a kernel it launches comes back from the graph cache without the mark that its
# launch configuration was found by coordinate descent, so a new process would tune it again (seconds per kernel);
# launched by Triton's own launcher, a cached kernel reads its tuned configuration from the autotuning cache. The
# launcher's cost does not matter here: a decode step replays from a CUDA graph.
# Inductor's halving of a reduction's block after compiling it is off: coordinate descent searches that block
# anyway, and on a cached kernel torch 2.11 and 2.12 still add the halved configuration, benchmark it against the
# tuned one and, when it wins, tune the kernel again from it in every new process.
LAYER_INDUCTOR_OPTIONS = {**FUSED_INDUCTOR_OPTIONS, "coordinate_descent_tuning": True,
                          "use_static_cuda_launcher": False, "dynamic_scale_rblock": False}


@torch.library.custom_op("minimax_ref::materialize", mutates_args=())
def _materialize(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_materialize.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def materialize(x: torch.Tensor) -> torch.Tensor:
    """`x`. Inside a compiled region, x computed once and stored (an opaque operator, which inductor lowers to
    storing x: `register_materialize_lowering`), so its consumers read it instead of recomputing it."""
    return _materialize(x) if torch.compiler.is_compiling() else x


# Rows up to which inductor compiles a sort into one Triton kernel (its persistent sort); longer rows fall back to ATen
SORT_ROWS = 512


def top_k(values: torch.Tensor, k: int, by_sort: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of `values` along the last dimension and their indices: `torch.topk`, its slots in no stated
    order inside a compiled region (nothing there reads it) and in decreasing order elsewhere. `by_sort`
    (`FastPaths.sort_topk`), in a compiled region with rows of at most `SORT_ROWS`: a stable descending sort cut at k,
    which inductor compiles into one Triton kernel with the elementwise ops that produce `values` fused into it, where
    `torch.topk` is an ATen kernel of its own; the same k values, ties to the lower index (torch.topk's are
    implementation-defined), in decreasing order."""
    compiling = torch.compiler.is_compiling()
    if by_sort and compiling and values.shape[-1] <= SORT_ROWS:
        v, i = torch.sort(values, dim=-1, descending=True, stable=True)
        return v[..., :k], i[..., :k]
    found = values.topk(k, dim=-1, sorted=not compiling)
    return found.values, found.indices


def register_materialize_lowering() -> None:
    """Have inductor lower `materialize` to x's buffer itself: the producer's kernel stores x and the consumers read
    it, instead of storing it and then copying it through the operator (a device-to-device copy per use). Same
    values. Registered once per process, in inductor's table of lowerings."""
    from torch._inductor.lowering import lowerings, register_lowering

    op = torch.ops.minimax_ref.materialize.default
    if getattr(lowerings.get(op), "stores_once", False):
        return

    def store_once(x):
        x.realize()
        return x

    # replaces the fallback (the operator's own copy) inductor records for the operator when it first meets it
    register_lowering(op, type_promotion_kind=None)(store_once)
    lowerings[op].stores_once = True


class StoredNorm(RMSNorm):
    """A decoder layer's input or post-attention norm whose output is stored once when compiled (`materialize`):
    fused into a matmul with one row per program, its mean over the hidden size was recomputed for every output
    row. Same function as `RMSNorm`. In prefill calls with `prefill_fusion`, one compiled kernel (`fast.prefill`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.paths.prefill_fusion and x.shape[1] > self.paths.sync_free_tokens:
            return fused_rms_norm(x, self.weight, self.eps)
        return materialize(super().forward(x))


def use_compile_cache() -> Path:
    """Keep what compiling produces across processes, in the cache folder (`embedded.cache_dir()`/compile) unless
    TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR name another: inductor's graph, AOT and autotuning caches, Triton's
    kernels and the saved compiled layers (`CompiledLayers`, in layers/). Inductor keys each entry by the traced graph
    (the model's shapes), the compile options (the preset), torch's version and the GPU, so a later process with the
    same model and preset loads its compiled steps instead of compiling them. TORCHINDUCTOR_CACHE_DIR at inductor's
    own default counts as not named: importing inductor (the fast kernels' `triton_op`s do) sets it there. Returns the
    folder."""
    from ..weights.embedded import cache_dir

    named = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if named and os.path.abspath(named) != os.path.abspath(_inductor_default_cache()):
        folder = Path(named)
    else:
        folder = cache_dir() / "compile"
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    os.environ.setdefault("TRITON_CACHE_DIR", str(folder / "triton"))
    _pin_ptxas()
    return folder


def _pin_ptxas() -> None:
    """Name Triton's own ptxas in TRITON_PTXAS_PATH unless the user named one, before inductor starts its compile
    workers (they inherit the environment). Triton keys each kernel in its cache by the ptxas version; a worker
    without the variable sets it to the ptxas torch ships (another CUDA release than Triton's on torch 2.11), so the
    kernels a worker built were keyed where no later process, compiling in its main process, looked for them."""
    if os.environ.get("TRITON_PTXAS_PATH"):
        return
    try:
        from triton import knobs

        os.environ["TRITON_PTXAS_PATH"] = knobs.nvidia.ptxas.path
    except (ImportError, AttributeError, RuntimeError):  # no Triton, one without knobs, or without its ptxas
        pass


def _inductor_default_cache() -> str:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return default_cache_dir()


def run_layer(layer, x, pos, cos, sin, cache, kv_len):
    """One decoder layer's forward (what `CompiledLayers` compiles)."""
    return layer(x, pos, cos, sin, cache, kv_len)


def saves_compiled_layers() -> bool:
    """Whether this torch saves a compiled function with its guards and loads it in another process without
    tracing it again (`torch.compile(...).aot_compile`, `torch.compiler.load_compiled_function`)."""
    return hasattr(torch.compiler, "load_compiled_function") and hasattr(torch._dynamo.config, "enable_aot_compile")


def _aot_enabled():
    # dynamo attaches `aot_compile` to compiled functions only with this flag (off by default before torch 2.13)
    return torch._dynamo.config.patch(enable_aot_compile=True)


@contextlib.contextmanager
def _settings_kept_on_error():
    """Puts inductor's, dynamo's and functorch's settings back if the block raises: a saved graph that fails to load
    can leave settings of its own behind, and the graphs compiled next then fail."""
    configs = (torch._inductor.config, torch._dynamo.config, torch._functorch.config)
    kept = [config.get_config_copy() for config in configs]
    try:
        yield
    except BaseException:
        for config, values in zip(configs, kept):
            for name, value in values.items():
                if getattr(config, name) != value:
                    setattr(config, name, value)
        raise


def _load(path: Path, options: dict):
    """A saved compiled layer (`load_compiled_function`) under the inductor `options` it was compiled with (the
    kernels a load brings in are then made as a compile here makes them: one made with the static launcher that the
    layers' options turn off fails a later compile's check), the compiler's settings kept if it fails."""
    with _settings_kept_on_error(), torch._inductor.config.patch(options), _aot_enabled(), path.open("rb") as f:
        return torch.compiler.load_compiled_function(f)


def code_version() -> str:
    """A digest of the package's Python sources: a saved compiled layer is the code it traced, so another version of
    the code never loads it (a loaded function's guards see its inputs, not the source)."""
    h = hashlib.sha256()
    root = Path(__file__).resolve().parent.parent
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def describe(value) -> object:
    """What a compiled layer's graph depends on in an argument: a tensor's shape, strides, dtype and device type, a
    dataclass's fields, a module's kind (its submodules' classes, its parameters' and buffers' shapes and dtypes), a
    plain value itself."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.stride(), str(value.dtype), value.device.type)
    if isinstance(value, nn.Module):
        return ("module", tuple((name, type(m).__name__) for name, m in value.named_modules()),
                tuple((name, tuple(t.shape), str(t.dtype)) for name, t in
                      [*value.named_parameters(), *value.named_buffers()]))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__name__, tuple((f.name, describe(getattr(value, f.name)))
                                            for f in dataclasses.fields(value)))
    return repr(value)


class CompiledLayers:
    """`run_layer` through `torch.compile`, for decode steps.

    The layer is an argument and reads no per-layer constant on this path (its cache part comes in as tensors,
    `KVCache.layer`), so every layer of a kind passes the same guards and shares one compiled graph: one per (kind
    of layer, batch size, cache length, dtype). Static shapes (`dynamic=False`) and `fullgraph`: no graph break, so
    no host synchronisation hides in the step. The large reductions launch with their kind's configuration in
    `reductions` (`launch.FixedReductions`; None: tuned like the other kernels). Compiled on first use.

    With `folder` (the compile cache's `layers/`) and a torch that saves compiled functions
    (`saves_compiled_layers`), each graph is compiled ahead of its call (`aot_compile`) and saved there under a
    digest of everything it depends on (`describe` of the call's arguments, the fast paths, the reductions, the
    package's sources, torch, triton and the device); a later process loads it instead of tracing the layer again.
    A layer takes the first graph of its digest whose guards pass it (another kind of layer with the same
    description gets a graph of its own beside it). Where saving is not supported, or compiling ahead fails, the
    layers compile as above."""

    def __init__(self, reductions: ReductionConfigs | None, folder: Path | None = None, paths: object = None):
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        register_materialize_lowering()
        self.reductions = reductions
        self.options = dict(LAYER_INDUCTOR_OPTIONS)  # inductor's, for compiling and for loading saved graphs
        if reductions is not None:
            self.options.update(inductor_options(reductions))
        self.folder = folder if folder is not None and saves_compiled_layers() else None
        # torch 2.11 and 2.12 attach `aot_compile` to a compiled function only if the flag is on when it is wrapped
        with _aot_enabled() if self.folder is not None else contextlib.nullcontext():
            self.compiled = torch.compile(run_layer, dynamic=False, fullgraph=True, options=self.options)
        self.context = repr((paths, reductions, torch.__version__, _triton_version()))
        self.graphs: dict[str, list] = {}  # digest -> the graphs saved under it, in the order they were made
        self.chosen: dict[tuple[int, str], object] = {}  # (id of a layer, digest) -> the graph its guards pass
        self.layer_kinds: dict[int, str] = {}  # id of a layer -> a digest of `describe(layer)`

    def compiling(self):
        return fixed_reductions(self.reductions) if self.reductions is not None else contextlib.nullcontext()

    def run(self, *args):
        with self.compiling():
            return self.compiled(*args)

    def __call__(self, layer, *rest):
        if self.folder is None:
            return self.run(layer, *rest)
        digest = self.digest(layer, rest)
        graph = self.chosen.get((id(layer), digest))
        if graph is not None:
            return graph(layer, *rest)
        for graph in self.saved(digest):
            check = getattr(graph, "guard_check", None)  # without it, the call itself checks them (and raises)
            if check is None or check(layer, *rest):
                return self.first_call(graph, digest, layer, rest)
        graph = self.compile_ahead(digest, (layer, *rest))
        if graph is None:
            return self.run(layer, *rest)
        return self.first_call(graph, digest, layer, rest)

    def first_call(self, graph, digest: str, layer, rest: tuple):
        """A saved graph's first call for `layer`, then its choice for it; a graph that fails there (a torch that
        saves what it cannot run) turns saving off, and the layers compile in this process."""
        try:
            out = graph(layer, *rest)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:
            reason = str(e).splitlines()[0] if str(e) else ""
            print(f"[fast] a saved compiled layer failed ({type(e).__name__}: {reason}); compiling the layers in "
                  "this process only", file=sys.stderr)
            self.folder = None
            return self.run(layer, *rest)
        self.chosen[(id(layer), digest)] = graph
        return out

    def digest(self, layer, rest: tuple) -> str:
        kind = self.layer_kinds.get(id(layer))
        if kind is None:  # a layer's description is long and never changes: hashed once
            kind = self.layer_kinds[id(layer)] = hashlib.sha256(repr(describe(layer)).encode()).hexdigest()
        text = repr((kind, [describe(a) for a in rest], self.context, _device_name(rest[0].device), _code_version()))
        return hashlib.sha256(text.encode()).hexdigest()[:24]

    def saved(self, digest: str) -> list:
        """The graphs saved under `digest`: this process's, else loaded from the folder (unreadable ones skipped)."""
        if digest not in self.graphs:
            graphs = []
            for path in sorted(self.folder.glob(f"{digest}-*.aot"), key=lambda p: int(p.stem.rsplit("-", 1)[1])):
                try:
                    graphs.append(_load(path, self.options))
                except Exception as e:  # written by another torch, or cut short: compiled again beside it
                    print(f"[fast] skipping saved layer graph {path.name}: {type(e).__name__}: {e}", file=sys.stderr)
            self.graphs[digest] = graphs
        return self.graphs[digest]

    def compile_ahead(self, digest: str, args: tuple):
        """A graph for `args` compiled ahead and saved as the digest's next file; None where this torch cannot
        (then this object compiles as plain `torch.compile` from here on)."""
        try:
            with self.compiling(), _aot_enabled():
                graph = self.compiled.aot_compile((args, {}))
        except Exception as e:
            print(f"[fast] compiled layers are not saved across processes here ({type(e).__name__}: "
                  f"{str(e).splitlines()[0] if str(e) else ''}); compiling them in this process only",
                  file=sys.stderr)
            self.folder = None
            return None
        graphs = self.graphs.setdefault(digest, [])
        graphs.append(graph)
        tmp = self.folder / f".{digest}-{os.getpid()}.tmp"
        try:  # written whole, then renamed: a process reading the folder never sees half a file
            self.folder.mkdir(parents=True, exist_ok=True)
            with _aot_enabled():
                graph.save_compiled_function(str(tmp))
        except Exception as e:
            tmp.unlink(missing_ok=True)
            print(f"[fast] could not save a compiled layer in {self.folder} ({type(e).__name__}: {e}); it is used in "
                  "this process only", file=sys.stderr)
            return graph
        # loaded back before it is kept: torch can save guards it cannot load (an unread module attribute holding a
        # dtype is saved as missing, and so is every tensor's dtype), and a later process must not find such a file
        try:
            _load(tmp, self.options)
        except Exception as e:
            tmp.unlink(missing_ok=True)
            print(f"[fast] a compiled layer saved here does not load back ({type(e).__name__}: "
                  f"{str(e).splitlines()[0] if str(e) else ''}); it is used in this process only", file=sys.stderr)
            return graph
        tmp.replace(self.folder / f"{digest}-{len(graphs) - 1}.aot")
        return graph


@functools.lru_cache(maxsize=1)
def _code_version() -> str:
    return code_version()


@functools.cache
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__
