"""Decode steps split into segments at the points where they synchronise with the host (`SegmentedLayers`): the fast
paths of an offloaded model (weights/offload.py).

A streamed unit of an offloaded model synchronises with the host: a streamed expert stack reads the router's choice
to copy the chosen experts' rows (`Streamer.enter_experts`), and a streamed layer part is fetched by a hook before
its layer runs (`Streamer.enter_layer`). A layer holding such a point can be neither a compiled graph (`fullgraph`:
no host synchronisation inside) nor inside a CUDA graph. `SegmentedLayers` takes the place of the model twin's
compiled layers (`FastMiniMaxM3.compiled`, which `FastMiniMaxM3.hidden` calls once per layer in
synchronisation-free decode steps), so the reference modules and the model twin stay as they are, and cuts a step
into pieces:

* a layer in `eager` (its layer part streams) is one eager call (`run_layer`, the fast twins): its hooks fetch it;
* a layer in `split` (a MoE layer whose expert stack streams, its layer part resident) is two pieces around its
  synchronisation point: `pre_experts` (attention, the post-attention norm, the router), then `sync(layer, routing,
  flat)` (the host reads the choice and copies the chosen rows; `flat`, the normed tokens the experts run on, also
  predicts the next streamed stack's experts, whose rows the streamer copies ahead), then `post_experts` (the routed
  experts on the staged rows, the shared expert, the residual): `DecoderLayer.forward` and `MoE.forward` in the same
  operations and order;
* every other layer is one piece, the whole layer.

A segment is a maximal run of pieces between synchronisation points and eager layers: e.g. layers 0, 1 and the
`pre_experts` of split layer 2, then that layer's `post_experts` and the `pre_experts` of split layer 3. Its pieces
run compiled when `compiled` is given (whole layers through it, the pieces through `CompiledPieces`, one graph per
kind of layer and shape), else eagerly. With a `recorder` (`cuda_recorder`: CUDA graphs) a segment is recorded on its
first step of each (cache, step shape, dtype, cache length) and replayed afterwards: the call that reaches its first
piece copies the step's inputs into the recording's buffers and replays the whole segment; the later calls within it
return the recording's outputs, computing nothing (each checks that its input is the previous piece's recorded
output, else it runs its piece).

A replay runs the recorded kernels on the copied inputs, so a segmented step computes what the same pieces compute
run one by one, to fp32 rounding where a library call takes another algorithm inside a capture (`record_eagerly`,
which re-runs the segment at each replay, lets a CPU test the bookkeeping bit for bit); split
pieces run eagerly compute what the whole layer computes eagerly, bit for bit. What a replay returns is overwritten by
the next replay of its recording: as with `CapturedSteps`, read a step's outputs before the next step. Recordings
hold their cache weakly (a recording is used only while the cache it was recorded on is alive and is the one passed).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from ..model.moe import Routing
from .compiled import LAYER_INDUCTOR_OPTIONS, run_layer
from .launch import compiled_with_fixed_reductions

# recorder(fn, device) -> (replay, outputs): `fn()` recorded; `replay()` rewrites `outputs` from the recorded inputs
Recorder = Callable[[Callable[[], list], torch.device], tuple[Callable[[], None], list]]


def pre_experts(layer, x, pos, cos, sin, cache, kv_len):
    """A MoE decoder layer up to its synchronisation point: (h, flat, expert ids, weights, router logits), h the
    residual stream after attention [B, T, H], flat its post-attention norm [B*T, H] (`DecoderLayer.forward`,
    `MoE.forward`)."""
    h = layer.attention_residual(x + layer.self_attn(layer.input_layernorm(x), pos, cos, sin, cache, kv_len))
    normed = layer.post_attention_layernorm(h)
    flat = normed.reshape(-1, normed.shape[-1])
    routing = layer.block_sparse_moe.gate(flat)
    return h, flat, routing.expert_ids, routing.weights, routing.logits


def post_experts(layer, h, flat, expert_ids, weights, logits):
    """The rest of the layer after `pre_experts` -> the residual stream [B, T, H]: the routed experts (their own
    forward: under an accelerate hook `_old_forward`, the hook's work being `sync`'s), the shared expert, the
    all-reduce, the residual."""
    moe = layer.block_sparse_moe
    experts = moe.experts
    forward = getattr(experts, "_old_forward", experts.forward)
    y = forward(flat, Routing(expert_ids, weights, logits)) * moe.scaling
    if moe.shared_experts is not None:
        y = y + moe.shared_experts(flat).float()
    y = moe.world.all_reduce_fp32(y)
    return h + y.to(flat.dtype).reshape(h.shape)


class CompiledPieces:
    """`pre_experts` and `post_experts` through `torch.compile` as `CompiledLayers` compiles whole layers (static
    shapes, `fullgraph`, the same inductor options and fixed reductions `reductions`)."""

    def __init__(self, reductions):
        kw = dict(dynamic=False, fullgraph=True, options=dict(LAYER_INDUCTOR_OPTIONS))
        self.pre = compiled_with_fixed_reductions(pre_experts, reductions, **kw)
        self.post = compiled_with_fixed_reductions(post_experts, reductions, **kw)


def resident_segments(num_layers: int, eager: Iterable[int], split: Iterable[int] = ()) -> list[tuple]:
    """The segments of layers 0..num_layers-1, in order: tuples of pieces ("layer", i), ("pre", i), ("post", i)."""
    eager, split = set(eager), set(split)
    out, run = [], []
    for i in range(num_layers):
        if i in eager:
            if run:
                out.append(tuple(run))
            run = []
        elif i in split:
            run.append(("pre", i))
            out.append(tuple(run))
            run = [("post", i)]
        else:
            run.append(("layer", i))
    if run:
        out.append(tuple(run))
    return out


def record_eagerly(fn, device: torch.device) -> tuple[Callable[[], None], list]:
    """A recorder that replays by running `fn` again and copying its outputs into the first call's (a CPU's stand-in
    for a CUDA graph: the same inputs, kernels and outputs, without the capture)."""
    outputs = fn()

    def replay() -> None:
        for out, new in zip(outputs, fn()):
            for o, n in zip(_tensors(out), _tensors(new)):
                o.copy_(n)

    return replay, outputs


def cuda_recorder() -> Recorder:
    """A recorder capturing CUDA graphs (`graph.record`), each in a memory pool of its own, which holds its outputs
    while the recording is kept. Not one shared pool: the allocator frees a pool once its last graph is gone (a cache's
    recordings go with the cache) and refuses to capture into it again; a segment's intermediates are a few of its
    layers' activations at decode-step size."""
    from .graph import record

    def recorder(fn, device: torch.device) -> tuple[Callable[[], None], list]:
        graph, outputs = record(fn, device)
        return graph.replay, outputs

    return recorder


def _tensors(v) -> tuple[torch.Tensor, ...]:
    return v if isinstance(v, tuple) else (v,)


@dataclass(eq=False)
class Recording:
    """One segment recorded on one cache and step shape: `inputs` (its first piece's inputs, then pos, cos, sin),
    `outputs` (each piece's), `replay`, and its first layer's cache part, held weakly."""

    segment: tuple
    cache: weakref.ref
    inputs: tuple[torch.Tensor, ...]
    outputs: list
    replay: Callable[[], None]


@dataclass(eq=False)
class _Pending:
    """A segment running piece by piece for its recording: its inputs, and the layers and cache parts met so far."""

    key: tuple
    segment: tuple
    inputs: tuple[torch.Tensor, ...]
    kv_len: int | None
    layers: list = field(default_factory=list)
    caches: list = field(default_factory=list)
    last: object = None


class SegmentedLayers:
    """A step's layers as pieces and segments (module docstring): called as `CompiledLayers` is, `(layer, x, pos, cos,
    sin, cache, kv_len) -> x` with `layer.layer` its index. `eager`, `split`: layer indices (disjoint); `sync(layer,
    routing, flat)`: the synchronisation point of a split layer, `flat` the normed tokens [T, H] its experts run on
    (None: nothing); `compiled`: the model's `CompiledLayers` (None: every piece eager); `recorder`: how segments are
    recorded (None: not at all). `replays` and `recorded` count replays of segments and recordings made."""

    def __init__(self, num_layers: int, eager: Iterable[int] = (), split: Iterable[int] = (), sync=None,
                 compiled=None, recorder: Recorder | None = None):
        self.eager, self.split = frozenset(eager), frozenset(split)
        if self.eager & self.split:
            raise ValueError(f"layers {sorted(self.eager & self.split)} are both eager and split")
        self.sync = sync
        self.compiled = compiled
        self.layer_fn = compiled or run_layer
        pieces = CompiledPieces(compiled.reductions) if compiled is not None and self.split else None
        self.pre_fn = pieces.pre if pieces is not None else pre_experts
        self.post_fn = pieces.post if pieces is not None else post_experts
        self.segments = resident_segments(num_layers, self.eager, self.split)
        self.where = {p: (seg, k) for seg in self.segments for k, p in enumerate(seg)}
        self.recorder = recorder
        self.recordings: dict[tuple, Recording] = {}
        self.active: Recording | None = None  # the recording replayed for the segment now running
        self.pending: _Pending | None = None
        self.replays = 0
        self.recorded = 0

    def __call__(self, layer, x, pos, cos, sin, cache, kv_len):
        i = layer.layer
        if i in self.eager:
            self.active = self.pending = None
            return run_layer(layer, x, pos, cos, sin, cache, kv_len)
        if i not in self.split:
            return self._piece(("layer", i), layer, x, pos, cos, sin, cache, kv_len)
        pre = self._piece(("pre", i), layer, x, pos, cos, sin, cache, kv_len)
        if self.sync is not None:
            self.sync(layer, Routing(*pre[2:]), pre[1])
        return self._piece(("post", i), layer, pre, pos, cos, sin, cache, kv_len)

    def _run(self, piece: tuple, layer, v, pos, cos, sin, cache, kv_len):
        """One piece on its input `v` (x, or `pre_experts`'s outputs for a "post" piece)."""
        kind = piece[0]
        if kind == "layer":
            return self.layer_fn(layer, v, pos, cos, sin, cache, kv_len)
        if kind == "pre":
            return self.pre_fn(layer, v, pos, cos, sin, cache, kv_len)
        return self.post_fn(layer, *v)

    def _piece(self, piece: tuple, layer, v, pos, cos, sin, cache, kv_len):
        if self.recorder is None or cache is None:
            return self._run(piece, layer, v, pos, cos, sin, cache, kv_len)
        seg, k = self.where[piece]
        if k == 0:
            self.active = self.pending = None
            inputs = (*_tensors(v), pos, cos, sin)
            key = (seg, id(cache), tuple((tuple(t.shape), t.dtype) for t in inputs), kv_len)
            rec = self.recordings.get(key)
            if rec is not None and rec.cache() is cache:
                for buf, t in zip(rec.inputs, inputs):
                    buf.copy_(t)
                rec.replay()
                self.replays += 1
                self.active = rec
                return rec.outputs[0]
            # recorded from copies: the step goes on with its own tensors
            self.pending = _Pending(key, seg, tuple(t.clone() for t in inputs), kv_len)
        elif self.active is not None and self.active.segment is seg and v is self.active.outputs[k - 1]:
            return self.active.outputs[k]
        y = self._run(piece, layer, v, pos, cos, sin, cache, kv_len)
        p = self.pending
        if p is not None and p.segment is seg and len(p.layers) == k and (k == 0 or v is p.last):
            p.layers.append(layer)
            p.caches.append(cache)
            p.last = y
            if k == len(seg) - 1:
                self.pending = None
                self._record(p)
        else:
            self.pending = None
        return y

    def _record(self, p: _Pending) -> None:
        """Record segment `p` (run once piece by piece this step) on its inputs; drop recordings whose cache is
        gone."""
        self.recordings = {key: r for key, r in self.recordings.items() if r.cache() is not None}
        *first, ps, cs, ss = p.inputs
        v0 = tuple(first) if len(first) > 1 else first[0]
        pieces, layers, kv_len = p.segment, list(p.layers), p.kv_len
        caches = [weakref.ref(c) for c in p.caches]  # a recording must not keep its cache alive

        def run() -> list:
            v, outs = v0, []
            for piece, layer, c in zip(pieces, layers, caches):
                v = self._run(piece, layer, v, ps, cs, ss, c(), kv_len)
                outs.append(v)
            return outs

        replay, outputs = self.recorder(run, ps.device)
        self.recordings[p.key] = Recording(p.segment, caches[0], p.inputs, outputs, replay)
        self.recorded += 1


__all__ = ["SegmentedLayers", "CompiledPieces", "Recording", "pre_experts", "post_experts", "resident_segments",
           "record_eagerly", "cuda_recorder"]
