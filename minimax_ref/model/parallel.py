"""Tensor parallelism over `torch.distributed` (spec `checkpoint.md`, "Tensor parallel slicing").

The layers below are what the model is built from at every TP size; with one process (`World.single()`)
they are plain linears and embeddings and never communicate. With N ranks each rank holds a slice of
every split weight, the residual stream is replicated, and every collective of a forward is here:

* `RowParallelLinear` (attention `o_proj`, dense-MLP `down_proj`) sums the ranks' partial outputs:
  one fp32 all-reduce per attention block and per dense-MLP block;
* `MoE.forward` (moe.py) adds the routed experts' fp32 partial sum and the shared expert's partial
  output, then all-reduces once per MoE block;
* `VocabParallelEmbedding` sums the ranks' lookups (each token's row lives on one rank; the others
  add zeros), and `MiniMaxM3.logits` gathers the column-parallel LM head's vocabulary slices so
  that every rank holds the same full fp32 logits and samples the same token.

Loading adds one collective (`World.agree`): all ranks confirm they loaded, or all raise together.

How the weights are split (decided in checkpoint.md):

| weight | split |
|---|---|
| q_proj, index_q_proj | rows by head; the index heads follow their kv head |
| k_proj, v_proj | rows by kv head; with more ranks than kv heads, replicated: rank r holds r // (TP/kv) |
| o_proj | columns by query head |
| index_k_proj, norms, router, selection bias, vision | replicated |
| dense / shared gate_proj, up_proj | rows; down_proj columns |
| routed experts | TP mode: w1/w3 rows, w2 columns (I/TP); expert-parallel: whole experts, E/TP per rank |
| embed_tokens, lm_head | vocabulary rows |

Every rank reads only its slices from the shards (`Linear.rows` / `Linear.cols` tell the loader
which part of the checkpoint's tensor a module holds). A `World` is passed explicitly to every
module that splits; there is no module-level distributed state.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError, MiniMaxRefError
from .linear import Linear

if TYPE_CHECKING:
    from ..weights.checkpoint import Checkpoint, LinearSpec
    from .config import ModelConfig

QUANT_GROUP = {"nvfp4": 16, "mxfp8": 32}  # elements per block scale along K


class RankFailedError(MiniMaxRefError):
    """Another rank of the tensor-parallel group failed (its message is quoted)."""


@dataclass(frozen=True, eq=False)
class World:
    """The tensor-parallel group one rank belongs to.

    rank, size: this rank's index in `group` and the group's size. group: the process group the
    collectives run on (None for one process). device: where the collectives' own small tensors
    (error flags) live: the rank's GPU for NCCL, the CPU for gloo.
    """

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @classmethod
    def single(cls) -> World:
        """One process: every split is the whole dimension and every collective is the identity."""
        return cls()

    @classmethod
    def from_group(cls, group: dist.ProcessGroup, device: torch.device | str | None = None) -> World:
        """This process's place in `group` (torch.distributed must be initialised).

        device: the rank's device for NCCL groups; default: the current CUDA device.
        """
        dev = torch.device("cpu")
        if dist.get_backend(group) == "nccl":
            dev = torch.device(device or f"cuda:{torch.cuda.current_device()}")
        return cls(dist.get_rank(group), dist.get_world_size(group), group, dev)

    @classmethod
    def of(cls, tp: World | dist.ProcessGroup | None, device: torch.device | str | None = None) -> World:
        """`load_model`'s `tp` argument as a World: None -> one process, a process group -> its World."""
        if tp is None:
            return cls.single()
        if isinstance(tp, World):
            return tp
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError("tp: a process group was given but torch.distributed is not initialised "
                              "(call torch.distributed.init_process_group first, or pass tp=None)")
        return cls.from_group(tp, device)

    # ---- how dimensions split

    def split(self, n: int, what: str) -> slice:
        """This rank's contiguous part [rank*n/size, (rank+1)*n/size) of a dimension of size `n`."""
        if n % self.size:
            raise ConfigError(f"{what}={n} does not split evenly over {self.size} tensor-parallel ranks")
        step = n // self.size
        return slice(self.rank * step, (self.rank + 1) * step)

    def kv_heads(self, n_kv: int) -> range:
        """The kv heads this rank holds: an even share when size <= n_kv; otherwise one head,
        replicated over size / n_kv ranks (rank r holds kv head r // (size / n_kv))."""
        if self.size <= n_kv:
            s = self.split(n_kv, "num_key_value_heads")
            return range(s.start, s.stop)
        if self.size % n_kv:
            raise ConfigError(f"num_key_value_heads={n_kv}: {self.size} tensor-parallel ranks are not a "
                              "multiple of it, so the kv heads cannot be replicated evenly")
        head = self.rank // (self.size // n_kv)
        return range(head, head + 1)

    # ---- collectives (identity for one process)

    def all_reduce_fp32(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks, accumulated in fp32 and returned in `x`'s dtype.

        The sum is fp32 so that it adds no rounding per rank (a bf16 sum would). A bf16 partial output still
        carries its own product's rounding: in bf16, TP=N differs from TP=1 by those roundings (README).
        """
        if self.size == 1:
            return x
        y = x.float()  # a copy when x is not fp32; an fp32 x is summed in place (callers own it)
        dist.all_reduce(y, group=self.group)
        return y.to(x.dtype)

    def all_reduce_exact(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks in its own dtype, in place. Only for sums where at most one rank
        contributes a nonzero value per element (the vocabulary-parallel embedding): those are exact."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """The ranks' tensors `x` concatenated along `dim` in rank order (bitwise copies)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast_object(self, obj: object, src: int = 0) -> object:
        """`obj` of rank `src` (group rank), on every rank (picklable objects)."""
        if self.size == 1:
            return obj
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, src), group=self.group,
                                   device=self.device)
        return box[0]

    def gather_objects(self, obj: object) -> list[object]:
        """Every rank's `obj` (picklable), in rank order, on every rank."""
        if self.size == 1:
            return [obj]
        out: list[object] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def agree(self, error: BaseException | None, what: str) -> None:
        """Collective: every rank learns whether any rank failed at `what`.

        Call on every rank, with the exception this rank caught (or None). If all succeeded this
        returns; otherwise the failing ranks re-raise their own error and the others raise
        `RankFailedError` quoting the first failing rank's message, so no rank is left waiting in a
        later collective for a rank that has given up.
        """
        if self.size == 1:
            if error is not None:
                raise error
            return
        failed = torch.zeros(self.size, dtype=torch.int32, device=self.device)
        failed[self.rank] = int(error is not None)
        dist.all_reduce(failed, group=self.group)
        bad = failed.nonzero().flatten().tolist()
        if not bad:
            return
        messages: list[str | None] = [None] * self.size
        mine = None if error is None else f"{type(error).__name__}: {error}"
        dist.all_gather_object(messages, mine, group=self.group)
        if error is not None:
            raise error
        raise RankFailedError(f"tensor-parallel rank {bad[0]} (failed ranks: {bad}) failed while {what}: "
                              f"{messages[bad[0]]}")


# Messages of the communication libraries when the other end of a collective has gone away.
PEER_FAILURE_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "gloo/transport",
                        "NCCL communicator was aborted", "Timed out", "timed out")


def is_peer_failure(error: BaseException) -> bool:
    """Whether `error` is a collective failing because another rank died or stopped answering (torch's
    distributed error types, or the RuntimeError gloo raises for a closed connection), not a fault of this rank."""
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(error, dist_error):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error) for m in PEER_FAILURE_MARKERS)


# ----------------------------------------------------------------------------------------------
# layers


class ColumnParallelLinear(Linear):
    """A linear holding rows `rows` of the checkpoint's [out, in] weight: it computes this rank's
    slice of the output features (heads, intermediate channels, vocabulary). No communication: the
    next layer consumes the slice (or the caller gathers it)."""

    def __init__(self, in_features: int, rows: slice):
        super().__init__(in_features, rows.stop - rows.start)
        self.rows = rows


class RowParallelLinear(Linear):
    """A linear holding columns `cols` of the checkpoint's [out, in] weight: given this rank's slice
    of the input features it computes a partial output; the full output is the sum over ranks.

    reduce=True: forward returns the full output (one fp32 all-reduce). reduce=False: forward returns
    the partial output and the caller reduces (MoE sums the shared expert's partial output with the
    routed experts' before its single all-reduce).
    """

    def __init__(self, out_features: int, cols: slice, world: World, reduce: bool = True):
        super().__init__(cols.stop - cols.start, out_features)
        self.cols = cols
        self.world = world
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = super().forward(x)
        return self.world.all_reduce_fp32(partial) if self.reduce else partial


class VocabParallelEmbedding(nn.Module):
    """`embed_tokens`: rank r holds vocabulary rows `rows` of the [V, H] table.

    Each rank looks up the tokens in its range (zeros for the others) and the lookups are summed
    over the ranks; a sum with one nonzero term is exact, so no fp32 detour is needed.
    """

    def __init__(self, vocab_size: int, hidden: int, world: World):
        super().__init__()
        self.vocab_size, self.hidden = vocab_size, hidden
        self.world = world
        self.rows = world.split(vocab_size, "vocab_size")
        # torch.empty, not nn.Embedding: its random init would run (and import torch._dynamo) even on meta
        self.weight = nn.Parameter(torch.empty(self.rows.stop - self.rows.start, hidden), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.world.size == 1:
            return F.embedding(ids, self.weight)
        start, stop = self.rows.start, self.rows.stop
        mine = (ids >= start) & (ids < stop)
        x = F.embedding(torch.where(mine, ids - start, 0), self.weight)
        x = x.masked_fill(~mine[..., None], 0)
        return self.world.all_reduce_exact(x)

    def extra_repr(self) -> str:
        return f"vocab={self.vocab_size}, rows={self.rows.start}:{self.rows.stop}, hidden={self.hidden}"


# ----------------------------------------------------------------------------------------------
# validation, before any weight is read


def tp_split_problems(cfg: ModelConfig, linear_formats: Mapping[str, tuple[LinearSpec, str]], size: int,
                      expert_parallel: bool) -> list[str]:
    """Why a model cannot be split over `size` tensor-parallel ranks; [] when it can.

    cfg: the model's config. linear_formats: every linear as prefix -> (its `checkpoint.LinearSpec`, its stored
    format "bf16" / "mxfp8" / "nvfp4"). Head counts, the vocabulary, the intermediate sizes (and the expert count
    when expert-parallel) must divide; the input-column slices of row-parallel linears (o_proj, down_proj, w2)
    must keep whole NVFP4 (16) / MXFP8 (32) groups, because packed bytes and block scales are sliced together
    without decoding. The one rule set: the loader refuses with it (`check_tp_split`), `plan` reports with it.
    """
    if size == 1:
        return []
    t = cfg.text
    problems: list[str] = []

    def divides(n: int, what: str) -> None:
        if n % size:
            problems.append(f"{what}={n} does not divide by {size}")

    divides(t.num_attention_heads, "num_attention_heads")
    kv = t.num_key_value_heads
    if size <= kv:
        divides(kv, "num_key_value_heads")
    elif size % kv:
        problems.append(f"num_key_value_heads={kv}: {size} ranks are not a multiple of it, so the kv heads "
                        "cannot be replicated evenly")
    divides(t.vocab_size, "vocab_size")
    if not all(t.moe_layers):
        divides(t.dense_intermediate_size, "dense_intermediate_size")
    if t.has_moe:
        if t.n_shared_experts:
            divides(t.shared_intermediate_size, "shared_intermediate_size")
        if expert_parallel:
            divides(t.num_local_experts, "num_local_experts (expert parallel)")
        else:
            divides(t.intermediate_size, "intermediate_size (routed experts)")
    if not problems:
        # input columns per rank of each row-parallel linear
        widths = {"o_proj": t.num_attention_heads // size * t.head_dim,
                  "mlp.down_proj": t.dense_intermediate_size // size,
                  "shared_experts.down_proj": t.shared_intermediate_size // size,
                  "w2": None if expert_parallel else t.intermediate_size // size}
        for prefix, (spec, fmt) in linear_formats.items():
            key = spec.leaf or next((k for k in widths if spec.module.endswith(k)), None)
            group, width = QUANT_GROUP.get(fmt), widths.get(key) if key else None
            if group is None or width is None or width % group == 0:
                continue
            _add_once(problems, _columns_problem(prefix, fmt, f"{width} input columns per rank is", group))
    return once_across_layers(problems)


def unstorable_linears(linear_formats: Mapping[str, tuple[LinearSpec, str]]) -> list[str]:
    """The linears whose stored format's block scales do not tile their input columns (NVFP4: K % 16, MXFP8: K % 32),
    so that no checkpoint can hold them in that format, at any tensor parallelism; [] when every one fits.
    linear_formats: prefix -> (its `checkpoint.LinearSpec`, its format "bf16" / "mxfp8" / "nvfp4")."""
    problems: list[str] = []
    for prefix, (spec, fmt) in linear_formats.items():
        group = QUANT_GROUP.get(fmt)
        if group and spec.in_features % group:
            _add_once(problems, _columns_problem(prefix, fmt, f"{spec.in_features} input columns are", group)
                      + ": no checkpoint can hold this linear in that format")
    return once_across_layers(problems)


def _columns_problem(prefix: str, fmt: str, columns: str, group: int) -> str:
    """One linear's input columns that its format's block scales do not tile, every expert of a stack said as one."""
    name = re.sub(r"\.experts\.\d+\.", ".experts.*.", prefix)
    return f"{name} ({fmt}): {columns} not a multiple of the quantization group of {group}"


def _add_once(problems: list[str], problem: str) -> None:
    if problem not in problems:
        problems.append(problem)


def once_across_layers(problems: list[str]) -> list[str]:
    """`problems` with those that differ only in the layer they name said once, naming the layers (one rule broken by
    a module of every layer would otherwise repeat once a layer)."""
    groups: dict[str, list[int]] = {}
    for p in problems:
        key = re.sub(r"\blayers\.\d+\.", "layers.{L}.", p)
        groups.setdefault(key, []).extend(int(m) for m in re.findall(r"\blayers\.(\d+)\.", p))
    out = []
    for key, layers in groups.items():
        layers = sorted(set(layers))
        if len(layers) <= 1:
            out.append(key.replace("layers.{L}.", f"layers.{layers[0]}.") if layers else key)
            continue
        runs = [[layers[0], layers[0]]]
        for n in layers[1:]:
            if n == runs[-1][1] + 1:
                runs[-1][1] = n
            else:
                runs.append([n, n])
        spans = [f"{a}" if a == b else f"{a}-{b}" for a, b in runs]
        out.append(f"{key} (L = layers {', '.join(spans)}: {len(layers)} layers)")
    return out


def tp_split_hint(problems: list[str], expert_parallel: bool) -> str:
    """What to do about `tp_split_problems`: fewer ranks, or expert parallelism when routed experts are at fault."""
    if expert_parallel and any("(expert parallel)" in p for p in problems):
        return "use fewer ranks, or turn expert parallelism off (drop --expert-parallel) to slice every expert"
    routed = any("routed experts" in p or ".experts.*." in p for p in problems)
    return "use fewer ranks" + (" or expert parallelism for the routed experts"
                                if routed and not expert_parallel else "")


def check_tp_split(ck: Checkpoint, size: int, expert_parallel: bool) -> None:
    """Refuse a checkpoint that cannot be split over `size` ranks, listing every reason (`tp_split_problems`).

    `ck` is an opened checkpoint (headers only: call this before reading weights)."""
    formats = {prefix: (spec, ck.formats[prefix].fmt) for prefix, spec in ck.linears.items() if prefix in ck.formats}
    problems = tp_split_problems(ck.config, formats, size, expert_parallel)
    if problems:
        raise ConfigError(f"{ck.path}: cannot split this checkpoint over {size} tensor-parallel ranks; "
                          f"{tp_split_hint(problems, expert_parallel)}:\n" + "\n".join(f"  - {p}" for p in problems))
