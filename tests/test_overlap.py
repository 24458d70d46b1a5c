"""`FastPaths.overlap_steps` (`fast.overlap.OverlapScheduler`): greedy decode steps chained on the device.

Contract under test: the same tokens, finish reasons and counts as the plain loop (`Scheduler`) on the same model,
for prompts of mixed lengths, mixed `max_new_tokens`, stop tokens, more requests than slots (refills), and a job
with a sampled request (which runs the plain loop); the steps are chained (launched before the host read the last
ones). On a CPU the chain is synchronous; the GPU run of the same tests checks the pinned copies and events.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from minimax_ref.fast import FastPaths, apply
from minimax_ref.fast.overlap import OverlapScheduler
from minimax_ref.generation.decoding import Scheduler, generate_ids
from minimax_ref.generation.sampling import SamplingParams
from minimax_ref.weights.loader import load_model

GREEDY = SamplingParams(temperature=0)
# the chain on a CPU (synchronous), and on CUDA with CUDA graphs, pinned copies and events (`-m gpu`)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _prompts(*lengths: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(sum(lengths))
    return [torch.randint(0, 1000, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module", params=DEVICES)
def model(request, spec_ckpt):
    device = request.param
    m = load_model(spec_ckpt, dtype=torch.float32 if device == "cpu" else torch.bfloat16, device=device,
                   max_batch_size=3)
    apply(m, replace(FastPaths.of("on"), overlap_steps=True))
    return m


def _run(model, overlap: bool, prompts, **kw):
    """(each request's tokens and finish reason, the stats, how many steps were launched on a step in flight)."""
    model.fast = replace(model.fast, overlap_steps=overlap)
    assert model.decode_scheduler is (OverlapScheduler if overlap else Scheduler)
    launched = []
    launch = OverlapScheduler.launch

    def counted(self, ids, ahead):
        launched.append(ahead)
        return launch(self, ids, ahead=ahead)

    OverlapScheduler.launch = counted
    try:
        seqs, stats = generate_ids(model, prompts, **kw)
    finally:
        OverlapScheduler.launch = launch
    return [(s.generated, s.finish_reason) for s in seqs], stats, sum(launched)


def test_chained_steps_give_the_plain_loops_tokens(model):
    prompts = _prompts(30, 12, 50, 7, 21, 3)
    stop = 5  # a request may meet it or not; the lengths end the others
    kw = {"max_new_tokens": [9, 1, 14, 6, 11, 4], "sampling": GREEDY, "stop_ids": [stop]}
    want, plain_stats, _ = _run(model, False, prompts, **kw)
    got, stats, chained = _run(model, True, prompts, **kw)
    assert got == want
    assert chained > 0 and stats.generated_tokens == plain_stats.generated_tokens
    assert stats.decode_steps >= plain_stats.decode_steps  # a refill drains the chain; never fewer steps


def test_stop_tokens_end_requests_in_the_chain(model):
    """A stop token found one step late: the extra step's token is dropped, the request ends as the plain loop's."""
    prompts = _prompts(9, 17, 25)
    free, _, _ = _run(model, False, prompts, max_new_tokens=12, sampling=GREEDY)
    stop = free[1][0][3]  # the second request's fourth token
    kw = {"max_new_tokens": 12, "sampling": GREEDY, "stop_ids": [stop]}
    want, _, _ = _run(model, False, prompts, **kw)
    got, _, chained = _run(model, True, prompts, **kw)
    assert got == want and chained > 0
    assert want[1][1] == "stop" and len(want[1][0]) <= 4


def test_a_sampled_request_runs_the_plain_loop(model):
    prompts = _prompts(11, 13)
    kw = {"max_new_tokens": 6, "sampling": [GREEDY, SamplingParams(temperature=0.8, top_k=20)], "seed": 3}
    want, _, _ = _run(model, False, prompts, **kw)
    got, _, chained = _run(model, True, prompts, **kw)
    assert got == want and chained == 0
