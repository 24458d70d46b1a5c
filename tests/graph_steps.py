"""A decode step of a fast preset, captured in a CUDA graph, against the reference engine (the GPU tests of the
grouped and GEMV kernels)."""

from __future__ import annotations

import torch

from minimax_ref.fast import apply
from minimax_ref.fast.graph import GraphStep
from minimax_ref.weights.loader import load_model


def captured_step_error(ckpt, preset: str, batch: int, switch: str) -> float:
    """The relative error of the logits of one decode step of `batch` sequences (8 prompt tokens each, bf16, packed
    weights on CUDA) under `preset`, replayed from a CUDA graph, against the reference engine's. `switch`: an
    attribute some module must have non-zero under the preset (the path under test is on)."""
    model = load_model(ckpt, dtype=torch.bfloat16, weights="packed", device="cuda")
    ids = torch.randint(0, 1000, (batch, 12), generator=torch.Generator().manual_seed(0)).cuda()
    pos = torch.full((batch, 1), 8, device="cuda")

    def prefilled():
        cache = model.new_cache(batch, 32)
        with torch.no_grad():
            model(ids[:, :8], positions=torch.arange(8, device="cuda").expand(batch, -1), cache=cache)
        return cache

    cache = prefilled()
    with torch.no_grad():
        want = model(ids[:, 8:9], positions=pos, cache=cache)[:, -1]
    apply(model, preset)
    assert any(getattr(m, switch, 0) for m in model.modules()), f"{preset}: no module has {switch}"
    cache = prefilled()
    with torch.no_grad():
        got = GraphStep(model, cache, ids[:, 8:9], pos).step(ids[:, 8:9], pos).clone()
    apply(model, False)
    return float((got.float() - want.float()).norm() / want.float().norm())
