"""A decode step of a fast preset, captured in a CUDA graph, against the reference engine (the GPU tests of the
grouped and GEMV kernels)."""

from __future__ import annotations

import torch

from minimax_ref.fast import apply
from minimax_ref.fast.graph import GraphStep
from minimax_ref.model.moe import Router
from minimax_ref.research.trace import Trace
from minimax_ref.weights.loader import load_model

# A token whose router ranks its k-th and (k+1)-th expert closer than this (in choice score: sigmoid plus bias) in
# some layer is at a routing tie: bf16 rounding of the router's input moves these scores by up to ~5e-3 on the tiny
# model (its bf16 reference against its fp32 one), so two correct computations may pick different experts there and
# its logits differ by far more than rounding.
TIE_MARGIN = 1e-2


def routing_margins(model, trace: Trace) -> torch.Tensor:
    """[N] fp32: each traced token's smallest gap, over the MoE layers, between its k-th and (k+1)-th choice score."""
    margins = None
    for layer_id, routing in sorted(trace.routing.items()):
        router = next(m for m in model.layers[layer_id].modules() if isinstance(m, Router))
        choice = torch.sigmoid(routing.logits.float())
        if router.e_score_correction_bias is not None:
            choice = choice + router.e_score_correction_bias.float().to(choice.device)
        top = choice.topk(router.top_k + 1, dim=-1).values
        gap = top[:, router.top_k - 1] - top[:, router.top_k]
        margins = gap if margins is None else torch.minimum(margins, gap)
    return margins


def captured_step_error(ckpt, preset: str, batch: int, switch: str | type) -> float:
    """The relative error of the logits of one decode step of `batch` sequences (8 prompt tokens each, bf16, packed
    weights on CUDA) under `preset`, replayed from a CUDA graph, against the reference engine's, over the sequences
    whose step is not at a routing tie (`TIE_MARGIN`; at least half of them must not be). `switch`: an attribute some
    module must have non-zero under the preset, or a module type the preset must install (the path under test is
    on)."""
    model = load_model(ckpt, dtype=torch.bfloat16, weights="packed", device="cuda")
    ids = torch.randint(0, 1000, (batch, 12), generator=torch.Generator().manual_seed(0)).cuda()
    pos = torch.full((batch, 1), 8, device="cuda")

    def prefilled():
        cache = model.new_cache(batch, 32)
        with torch.no_grad():
            model(ids[:, :8], positions=torch.arange(8, device="cuda").expand(batch, -1), cache=cache)
        return cache

    cache = prefilled()
    trace = Trace()
    with torch.no_grad(), trace.attached(model):
        want = model(ids[:, 8:9], positions=pos, cache=cache)[:, -1]
    away = routing_margins(model, trace) >= TIE_MARGIN if trace.routing else torch.ones(batch, dtype=torch.bool)
    assert int(away.sum()) * 2 >= batch, f"{batch - int(away.sum())} of {batch} steps at a routing tie"
    apply(model, preset)
    assert any(isinstance(m, switch) if isinstance(switch, type) else getattr(m, switch, 0)
               for m in model.modules()), f"{preset}: no module has {switch}"
    cache = prefilled()
    with torch.no_grad():
        got = GraphStep(model, cache, ids[:, 8:9], pos).step(ids[:, 8:9], pos).clone()
    apply(model, False)
    got, want = got.float()[away.to(got.device)], want.float()[away.to(want.device)]
    return float((got - want).norm() / want.norm())
