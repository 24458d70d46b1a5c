"""The offload device map (decided here; weights.md "Offload"): which parts of the model stay on the GPU and which
stream from host memory or disk (`--offload cpu|disk`), and the bytes a step moves. One rule, used by the loader
(offload.py, `device_map_for`) and printed by `minimax-ref plan --offload` (research/plan.py, which sizes the units
from the checkpoint: `footprint.offload_units`).

Each decoder layer is two units (`OffloadUnit`), its layer part and its routed expert stacks; the embedding, final
norm, LM head, routers and vision tower are always resident (`unit_of`). `propose_device_map` keeps every layer part
before any expert stack (a layer part saves all its bytes per step, an expert stack about k/E of them), in layer order,
first fit, after reserving the staging buffers. Bytes moved per step at batch B (`DeviceMap.bytes_per_step`): every
streamed layer part plus, per streamed stack, `E (1 - (1 - k/E)^B)` experts' bytes (`expected_distinct_experts`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ConfigError

GIB = 1 << 30
OFFLOAD_MODES = ("none", "cpu", "disk")


def unit_of(path: str) -> tuple[str, int | None]:
    """The offload unit of the tensor or module at engine path `path` ("layers.3.self_attn.q_proj", ...):
    ("experts", L) for the routed expert stacks of decoder layer L, ("layer", L) for the rest of layer L except its
    router, ("resident", None) for what always stays on the GPU: the embedding, final norm and LM head (every token
    needs them), every router (small, and it must run before the experts' weights are fetched: the choice decides
    which experts move), the experts' per-expert NVFP4 `input_scale` vectors, and the vision tower and projector."""
    if not path.startswith("layers."):
        return "resident", None
    parts = path.split(".")
    layer = int(parts[1])
    if len(parts) > 3 and parts[2] == "block_sparse_moe":
        if parts[3] == "gate":
            return "resident", None
        if parts[3] == "experts":
            return ("resident", None) if len(parts) > 4 and parts[4].endswith("_input_scale") else ("experts", layer)
    return "layer", layer


@dataclass(frozen=True)
class OffloadUnit:
    """What streams as one piece: `kind` "layer" (decoder layer `layer` without its router and routed experts:
    norms, attention, indexer, shared expert or dense MLP) or "experts" (its routed expert stacks, of which a step
    moves only the chosen experts' rows). `nbytes`: bytes in GPU memory (packed linears at their packed size, other
    tensors in the compute dtype, norms in fp32); `num_experts`: experts in an "experts" stack (0 otherwise)."""

    name: str
    kind: str
    layer: int
    nbytes: int
    num_experts: int = 0

    @property
    def expert_bytes(self) -> float:
        """Bytes of one expert's rows of the stacks (w1, w2, w3 with their scales)."""
        return self.nbytes / self.num_experts if self.num_experts else 0.0


def id_runs(ids: list[int]) -> list[tuple[int, int]]:
    """Sorted distinct ids as half-open runs of consecutive ids: [0, 1, 2, 5, 7, 8] -> [(0, 3), (5, 6), (7, 9)] (the
    streamer copies one run of experts at a time; the plan prints layer ranges)."""
    runs: list[tuple[int, int]] = []
    for i in ids:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def fmt_bytes(n: float, up: bool = False) -> str:
    """A byte count for messages: GiB with 3 decimals from 1 GiB up, else MiB with 1; rounded down, or up with `up`
    (a minimum shown rounded up is enough)."""
    unit, name, digits = (GIB, "GiB", 1000) if n >= GIB else (2**20, "MiB", 10)
    v = (math.ceil if up else math.floor)(n / unit * digits) / digits
    return f"{v:.{len(str(digits)) - 1}f} {name}"


def expected_distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected number of distinct experts chosen by `tokens` tokens that each choose `top_k` of `num_experts`,
    when every token's choice is uniform and independent: `E * (1 - (1 - k/E)^tokens)` (an expert is missed by one
    token with probability C(E-1, k) / C(E, k) = (E - k) / E). Real routing is skewed, so it moves fewer."""
    if num_experts <= 0 or tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


@dataclass(frozen=True)
class DeviceMap:
    """Which units stay on the GPU (`resident`) and which stream (`streamed`), with the GPU bytes each use takes.

    resident_bytes: the always-resident tensors (`unit_of`) plus the resident units. staging_bytes: GPU buffers of
    the streamed units: two of the largest streamed layer units (the one running and the next, prefetched) and
    `expert_stages` layers' full expert stacks (the chosen experts' rows are copied into one, at their places, so
    the expert code runs unchanged; with prefetch a second one takes the next streamed stack's predicted rows while
    the first is read). reserve_bytes: activations and KV cache. gpu_bytes = the three: what the run needs at most,
    within budget_bytes."""

    units: tuple[OffloadUnit, ...]
    resident: tuple[str, ...]
    streamed: tuple[str, ...]
    resident_bytes: int
    staging_bytes: int
    reserve_bytes: int
    budget_bytes: int

    @property
    def gpu_bytes(self) -> int:
        return self.resident_bytes + self.staging_bytes + self.reserve_bytes

    def streamed_units(self) -> list[OffloadUnit]:
        names = set(self.streamed)
        return [u for u in self.units if u.name in names]

    def bytes_per_step(self, tokens: int, top_k: int) -> float:
        """Host-to-device bytes of one forward over `tokens` tokens (a decode step of batch B: tokens = B): every
        streamed layer unit whole, and from each streamed expert stack the expected distinct chosen experts
        (`expected_distinct_experts`) times the bytes of one expert."""
        total = 0.0
        for u in self.streamed_units():
            if u.kind == "layer":
                total += u.nbytes
            else:
                total += expected_distinct_experts(u.num_experts, top_k, tokens) * u.expert_bytes
        return total


def propose_device_map(units: list[OffloadUnit], always_bytes: int, budget_bytes: int,
                       reserve_bytes: int, expert_stages: int = 1) -> DeviceMap:
    """The device map for a GPU budget (decided here; weights.md "Offload").

    Everything is resident when it all fits. Otherwise units are made resident by the bytes they save per step for
    each byte they hold: a layer unit saves all its bytes every step, an expert stack only the chosen experts' share
    (k / E at batch 1), so every layer unit comes before any expert stack; within a kind, in layer order (first fit).
    Staging is reserved first: `expert_stages` layers' expert stacks when any stack streams (2 when the rows of the
    next streamed stack are copied ahead, offload.py), and two of the largest layer units (running + prefetched) when
    any layer unit streams. Raises ConfigError naming the smallest budget that runs when
    the always-resident tensors, the reserve and the staging buffers do not fit."""
    layers = [u for u in units if u.kind == "layer"]
    experts = [u for u in units if u.kind == "experts"]
    everything = always_bytes + reserve_bytes + sum(u.nbytes for u in units)
    if everything <= budget_bytes:
        return DeviceMap(tuple(units), tuple(u.name for u in units), (), always_bytes + sum(u.nbytes for u in units),
                         0, reserve_bytes, budget_bytes)
    exp_stage = expert_stages * max((u.nbytes for u in experts), default=0)
    sum_layers = sum(u.nbytes for u in layers)
    layer_stage = min(2 * max((u.nbytes for u in layers), default=0), sum_layers)
    minimum = always_bytes + reserve_bytes + exp_stage + layer_stage
    if budget_bytes < minimum:
        raise ConfigError(f"--gpu-memory {fmt_bytes(budget_bytes)} is less than the {fmt_bytes(minimum, up=True)} "
                          f"this model needs with offloading: {fmt_bytes(always_bytes)} always on the GPU "
                          f"(embedding, LM head, norms, routers), {fmt_bytes(reserve_bytes)} reserve (activations and "
                          f"KV cache) and {fmt_bytes(exp_stage + layer_stage)} of staging buffers for streamed layers "
                          "and experts")
    avail = budget_bytes - always_bytes - reserve_bytes
    resident: list[OffloadUnit] = []
    if avail >= sum_layers + exp_stage:  # every layer unit fits: expert stacks fill what is left
        resident += layers
        avail -= sum_layers + exp_stage
        staging = exp_stage
        candidates = experts
    else:
        avail -= exp_stage + layer_stage
        staging = exp_stage + layer_stage
        candidates = layers
    for u in candidates:
        if u.nbytes <= avail:
            resident.append(u)
            avail -= u.nbytes
    kept = {u.name for u in resident}
    return DeviceMap(tuple(units), tuple(u.name for u in units if u.name in kept),
                     tuple(u.name for u in units if u.name not in kept),
                     always_bytes + sum(u.nbytes for u in resident), staging, reserve_bytes, budget_bytes)


def default_prefetch(mode: str, cuda: bool) -> bool | None:
    """Expert-row prefetch when not asked for either way (decided here; offload.py): None, "where its second staging
    stack fits", for the "cpu" store on a CUDA device, whose pinned copies run asynchronously; False on a CPU and for
    the "disk" store, where a copy blocks the host and overlaps little."""
    return None if mode == "cpu" and cuda else False


def propose_staged_map(units: list[OffloadUnit], always_bytes: int, budget_bytes: int, reserve_bytes: int,
                       prefetch: bool | None) -> tuple[DeviceMap, bool]:
    """`propose_device_map` with prefetch's second expert staging stack (`prefetch` True), without it (False), or with
    it where it fits and else without (None: `default_prefetch`'s). Returns the map and whether it has the stack."""
    if prefetch is None:
        try:
            return propose_device_map(units, always_bytes, budget_bytes, reserve_bytes, expert_stages=2), True
        except ConfigError:
            prefetch = False
    return propose_device_map(units, always_bytes, budget_bytes, reserve_bytes, 2 if prefetch else 1), prefetch


__all__ = ["GIB", "OFFLOAD_MODES", "DeviceMap", "OffloadUnit", "default_prefetch", "expected_distinct_experts",
           "fmt_bytes", "id_runs", "propose_device_map", "propose_staged_map", "unit_of"]
