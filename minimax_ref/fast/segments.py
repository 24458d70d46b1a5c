"""Decode steps split into segments at the layers that synchronise with the host (`SegmentedLayers`): the fast paths
of an offloaded model (weights/offload.py).

A streamed unit of an offloaded model synchronises with the host: a streamed expert stack reads the router's choice
to copy the chosen experts' rows (`Streamer.enter_experts`), and a streamed layer part is fetched by a hook before
its layer runs (`Streamer.enter_layer`). Such a layer can be neither a compiled graph (`fullgraph`: no host
synchronisation inside) nor part of a CUDA graph. `SegmentedLayers` takes the place of the model twin's compiled
layers (`FastMiniMaxM3.compiled`, which `FastMiniMaxM3.hidden` calls once per layer in synchronisation-free decode
steps), so the reference modules and the model twin stay as they are, and splits a step:

* a layer in `eager` (one with a streamed unit: its layer part or its expert stack) runs eagerly (`run_layer`, the
  fast twins), so its hooks stream what it needs;
* each run of consecutive layers between them is a segment: its layers run through `inner` (`CompiledLayers` when
  the paths compile layers, else `run_layer`). With a `recorder` (`cuda_recorder`: CUDA graphs), a segment is
  recorded on its first step of each (cache, step shape, dtype, cache length) and replayed afterwards: the call for
  its first layer copies the step's inputs (residual stream, positions, cos, sin) into the recording's buffers and
  replays the whole segment; the calls for its other layers return the recording's output of that layer, computing
  nothing (each checks that its input is the previous layer's recorded output, else it runs `inner`).

A replay runs the recorded kernels on the copied inputs, so a segmented step computes what the same model computes
running each layer through `inner` or `run_layer` as above (`record_eagerly`, which re-runs the segment at each
replay, lets a CPU test the bookkeeping). What a replay returns is overwritten by the next replay of its recording:
as with `CapturedSteps`, read a step's outputs before the next step. Recordings hold their cache weakly (a
recording is used only while the cache it was recorded on is alive and is the one passed) and share one memory pool.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from .compiled import run_layer

# recorder(fn, device) -> (replay, outputs): `fn()` recorded; `replay()` rewrites `outputs` from the recorded inputs
Recorder = Callable[[Callable[[], list], torch.device], tuple[Callable[[], None], list]]


def resident_segments(num_layers: int, eager: Iterable[int]) -> list[tuple[int, ...]]:
    """The runs of consecutive layers of 0..num_layers-1 not in `eager`, in order."""
    eager = set(eager)
    out, run = [], []
    for i in range(num_layers):
        if i in eager:
            if run:
                out.append(tuple(run))
            run = []
        else:
            run.append(i)
    if run:
        out.append(tuple(run))
    return out


def record_eagerly(fn, device: torch.device) -> tuple[Callable[[], None], list]:
    """A recorder that replays by running `fn` again and copying its outputs into the first call's (a CPU's stand-in
    for a CUDA graph: the same inputs, kernels and outputs, without the capture)."""
    outputs = fn()

    def replay() -> None:
        for out, new in zip(outputs, fn()):
            out.copy_(new)

    return replay, outputs


def cuda_recorder() -> Recorder:
    """A recorder capturing CUDA graphs (`graph.record`), all in one memory pool: the segments of a step replay one
    after another on one stream, and every recording's outputs stay allocated while it is kept."""
    from .graph import record

    pool = torch.cuda.graph_pool_handle()

    def recorder(fn, device: torch.device) -> tuple[Callable[[], None], list]:
        graph, outputs = record(fn, device, pool=pool)
        return graph.replay, outputs

    return recorder


@dataclass(eq=False)
class Recording:
    """One segment recorded on one cache and step shape: `inputs` (x, pos, cos, sin buffers), `outputs` (the residual
    stream after each of its layers), `replay`, and the segment's first layer's cache part, held weakly."""

    layers: tuple[int, ...]
    cache: weakref.ref
    inputs: tuple[torch.Tensor, ...]
    outputs: list[torch.Tensor]
    replay: Callable[[], None]


@dataclass(eq=False)
class _Pending:
    """A segment running for its recording: its inputs, and the layers and cache parts met so far."""

    key: tuple
    segment: tuple[int, ...]
    inputs: tuple[torch.Tensor, ...]
    kv_len: int | None
    layers: list = field(default_factory=list)
    caches: list = field(default_factory=list)
    last: torch.Tensor | None = None


class SegmentedLayers:
    """A step's layers as segments (module docstring): called as `CompiledLayers` is, `(layer, x, pos, cos, sin,
    cache, kv_len) -> x` with `layer.layer` its index; `eager` the layer indices that run eagerly, `inner` what runs
    the others, `recorder` how segments are recorded (None: not at all). `replays` and `recorded` count replays of
    segments and recordings made."""

    def __init__(self, inner, eager: Iterable[int], num_layers: int, recorder: Recorder | None = None):
        self.inner = inner
        self.eager = frozenset(eager)
        self.segments = resident_segments(num_layers, self.eager)
        self.where = {i: (seg, k) for seg in self.segments for k, i in enumerate(seg)}
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
        if self.recorder is None or cache is None:
            return self.inner(layer, x, pos, cos, sin, cache, kv_len)
        seg, k = self.where[i]
        if k == 0:
            self.active = self.pending = None
            key = (seg, id(cache), tuple(x.shape), x.dtype, kv_len)
            rec = self.recordings.get(key)
            if rec is not None and rec.cache() is cache:
                for buf, t in zip(rec.inputs, (x, pos, cos, sin)):
                    buf.copy_(t)
                rec.replay()
                self.replays += 1
                self.active = rec
                return rec.outputs[0]
            # recorded from copies: the step goes on with its own tensors
            self.pending = _Pending(key, seg, tuple(t.clone() for t in (x, pos, cos, sin)), kv_len)
        elif self.active is not None and self.active.layers is seg and x is self.active.outputs[k - 1]:
            return self.active.outputs[k]
        y = self.inner(layer, x, pos, cos, sin, cache, kv_len)
        p = self.pending
        if p is not None and p.segment is seg and len(p.layers) == k and (k == 0 or x is p.last):
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
        """Record segment `p` (run once eagerly this step) on its inputs; drop recordings whose cache is gone."""
        self.recordings = {key: r for key, r in self.recordings.items() if r.cache() is not None}
        xs, ps, cs, ss = p.inputs
        layers, inner, kv_len = list(p.layers), self.inner, p.kv_len
        caches = [weakref.ref(c) for c in p.caches]  # a recording must not keep its cache alive

        def run() -> list[torch.Tensor]:
            h, outs = xs, []
            for layer, c in zip(layers, caches):
                h = inner(layer, h, ps, cs, ss, c(), kv_len)
                outs.append(h)
            return outs

        replay, outputs = self.recorder(run, xs.device)
        self.recordings[p.key] = Recording(p.segment, caches[0], p.inputs, outputs, replay)
        self.recorded += 1


__all__ = ["SegmentedLayers", "Recording", "resident_segments", "record_eagerly", "cuda_recorder"]
