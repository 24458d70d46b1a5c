"""Greedy decode steps launched before the host has read the previous step's tokens (`FastPaths.overlap_steps`).

`generation.decoding.Scheduler` reads each step's tokens on the host (a synchronisation), then builds the next
step's inputs there and launches it: between two steps the GPU waits for the read, the host's bookkeeping, the input
copies and the graph's launch. `OverlapScheduler` keeps the device one step ahead where every request is greedy: a
step's tokens are its logits' argmax on the device, which the next step takes as its ids without a host round trip;
the positions are known on the host in advance (every running row advances by one a step). The host reads step t's
tokens (a copy into pinned memory, waited on by an event) while step t + 1 runs, then emits them, as the plain loop
does, finishing requests at stop tokens and lengths.

What it changes: nothing in any request's tokens (the same ids at the same positions; a row's result does not depend
on the other rows'); a request that finishes at step t has had step t + 1 computed for it, which is discarded (its
cache row is rewritten before it is read, as for any freed slot). When a slot is free and a request waits, the loop
reads the step in flight, admits (prefills) as the plain loop does, and starts a new chain. A job with a sampled
(non-greedy) request runs the plain loop: its draws come from host generators.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..generation.decoding import Scheduler


@dataclass
class _Launched:
    """A step in flight: which request held each slot when it was launched, its tokens on the device [S] and their
    host copy (pinned on CUDA) with the event that completes it."""

    requests: tuple[int | None, ...]
    tokens: torch.Tensor
    host: torch.Tensor
    done: torch.cuda.Event | None


class OverlapScheduler(Scheduler):
    """`Scheduler` whose greedy decode steps are chained on the device (module docstring)."""

    def run(self):
        if not all(p.greedy for p in self.job.sampling):
            return super().run()
        while True:
            self.admit()
            if all(i is None for i in self.running):
                return self.seqs, self.stats
            ids = [0 if i is None else self.seqs[i].generated[-1] for i in self.running]
            self.since = time.perf_counter()
            flight = self.launch(torch.tensor(ids, device=self.model.device), ahead=0)
            while True:
                # the next step on the device tokens, unless every row in flight ends with it (its length)
                ahead = None
                if any(i is not None and self.running[s] == i
                       and len(self.seqs[i].generated) + 1 < self.job.max_new_tokens[i]
                       for s, i in enumerate(flight.requests)):
                    ahead = self.launch(flight.tokens, ahead=1)
                self.collect(flight)
                if ahead is None:
                    break
                flight = ahead
                if self.waiting and any(i is None for i in self.running):
                    self.collect(flight)  # drain, then admit and start a new chain
                    break

    def launch(self, ids: torch.Tensor, ahead: int) -> _Launched:
        """Launch the step of every slot with these ids [S] (on the device); `ahead` 1 when the step in flight has
        not been emitted yet (each running row's position is then one further than the host has recorded)."""
        requests = tuple(self.running)
        device = self.model.device
        positions = torch.tensor([0 if i is None else self.committed(i) + ahead for i in requests])
        if device.type == "cuda":  # a pageable copy would wait for the step in flight
            positions = positions.pin_memory().to(device, non_blocking=True)
        logits = self.job.choosable(self.model.step(ids[:, None], positions[:, None], self.cache)[:, 0])
        tokens = logits.argmax(-1)  # before the next step overwrites the captured logits
        if device.type == "cuda":
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        else:
            host, done = tokens, None
        return _Launched(requests, tokens, host, done)

    def collect(self, step: _Launched) -> None:
        """Wait for `step`'s tokens on the host and emit them to the requests still in their slots (a request that
        finished at an earlier step gets nothing more), timing it as `Scheduler.step` does: the first step of a
        chain from its launch (its warm-up when it is the first step of all), each later one from the previous."""
        if step.done is not None:
            step.done.synchronize()
        tokens = step.host.tolist()
        before = self.stats.generated_tokens
        for s, i in enumerate(step.requests):
            if i is not None and self.running[s] == i:
                self.emit(s, [tokens[s]])
        now = time.perf_counter()
        self.stats.count_step(now - self.since, self.stats.generated_tokens - before)
        self.since = now


__all__ = ["OverlapScheduler"]
