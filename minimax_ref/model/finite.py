"""Refusing non-finite logits, and finding the layer where the NaN / Inf first appeared.

`MiniMaxM3.forward` passes its logits through `finite_logits`: one `isfinite().all()` over the logits (a
reduction and one host read per forward; the fast model's sync-free decode steps skip it, `fast.model`).
Finite logits are returned untouched; otherwise the forward is re-run recording every layer's output, and a
`NumericsError` names the first layer whose output holds a NaN or Inf (or the embeddings, or the final norm and LM
head when every layer is finite). Greedy decoding would otherwise print
garbage and exit 0, sampling would fail inside torch, and `score` would write NaN into its JSON.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import NumericsError
from .config import TextConfig


def _finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())


def first_nonfinite_stage(embeddings: torch.Tensor, layer_outputs: dict[int, torch.Tensor],
                          layer_kinds: list[str]) -> str:
    """Where non-finite values first appear: "the input embeddings", "layer L (kind)" for the lowest layer index
    whose output [B, T, H] is non-finite, or "the final norm / LM head" when the embeddings and every layer are
    finite. `layer_outputs` maps each layer index to its output; `layer_kinds[L]` describes layer L."""
    if not _finite(embeddings):
        return "the input embeddings (embed_tokens, or the inputs_embeds given)"
    for layer in sorted(layer_outputs):
        if not _finite(layer_outputs[layer]):
            return f"layer {layer} ({layer_kinds[layer]})"
    return "the final norm / LM head"


def finite_logits(model, logits: torch.Tensor, embeddings: torch.Tensor,
                  rerun: Callable[[], dict[int, torch.Tensor]]) -> torch.Tensor:
    """`logits` [B, T, V] when every value is finite; otherwise a NumericsError naming where the NaN / Inf first
    appeared.

    model: the `MiniMaxM3` whose forward made them. embeddings: the forward's input to the first layer [B, T, H].
    rerun(): runs the decoder layers again on the same inputs (same positions, same cache slots, so re-running
    overwrites what the first run wrote with the same values) and returns every layer's output by layer index;
    called only on failure.
    """
    if _finite(logits):
        return logits
    with torch.no_grad():
        outputs = rerun()
    text: TextConfig = model.text
    kinds = [text.layer_kind(i) for i in range(text.num_hidden_layers)]
    where = first_nonfinite_stage(embeddings, outputs, kinds)
    bad = int((~torch.isfinite(logits)).sum())
    raise NumericsError(f"the forward produced {bad} non-finite logit(s) (NaN or Inf); they first appear in the "
                        f"output of {where}. Damaged weights or config values are the usual cause: check the "
                        "checkpoint with `minimax-ref inspect`")
