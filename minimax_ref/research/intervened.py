"""Interventions during generation, and expert masks from files and flags.

`intervened(model, interventions)` is the model as generation sees it under edits: every forward that generation runs
(each prefill chunk into the KV cache, each decode step, each speculative verify step) carries the interventions, so
the keys and values written to the cache are those of the edited model and each generated token is the edited model's
choice. `mr.generate(..., interventions=...)` and the `--expert-mask` / `--drop-experts` flags of `generate`, `score`
and `eval` go through it.

What applies: `expert_mask`, `expert_scale`, and `residual` / `attention_residual` given as functions (each is called
on the stream of every forward, [B, t, H] for a chunk of t positions: it must act position by position, like adding a
steering vector). What is refused (InputError): `residual` / `attention_residual` given as tensors and `msa_blocks`:
they fix the shape of one forward, and generation runs many.

Fast paths: a forward with interventions carries a trace, so a fast model runs its layers eagerly (no compiled layers,
no CUDA-graph replay; `fast.model.FastMiniMaxM3.compiles_step`) and its attention takes the reference core where
hooks are attached. The tokens are the reference's under the same edits.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import InputError
from .records import read_json
from .trace import Interventions, Trace

if TYPE_CHECKING:
    from ..model.config import TextConfig
    from ..model.decoder import MiniMaxM3


def check_for_generation(interventions: Interventions) -> None:
    """Refuse the edits that hold one forward's tensors (they cannot apply to the many forwards of a generation)."""
    if not isinstance(interventions, Interventions):
        raise InputError(f"interventions: expected a minimax_ref.Interventions, got {type(interventions).__name__}")
    for name in ("residual", "attention_residual"):
        fixed = sorted(L for L, edit in getattr(interventions, name).items() if not callable(edit))
        if fixed:
            raise InputError(f"interventions.{name}[{fixed[0]}] is a tensor: it replaces the stream of one forward, "
                             "and generation runs one forward per prefill chunk and decode step; give a function of "
                             "the stream (e.g. lambda h: h + v) to edit every forward")
    if interventions.msa_blocks:
        L = sorted(interventions.msa_blocks)[0]
        raise InputError(f"interventions.msa_blocks[{L}]: a forced block selection names the blocks of one forward's "
                         "queries; generation cannot take it (score the full sequence with model(ids, "
                         "interventions=...) or mr.score(..., trace=Trace(interventions=...)) instead)")


class IntervenedModel:
    """`model` with `interventions` on every forward (module docstring); every other attribute is the model's.

    `model(...)` forwards with the interventions (a trace given by the caller gets them too); `step` and
    `step_with_hidden` are the model's, forwarding with them (never replayed from a captured graph)."""

    def __init__(self, model: MiniMaxM3, interventions: Interventions):
        check_for_generation(interventions)
        interventions.check(model)
        self.model = model
        self.interventions = interventions

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def __call__(self, input_ids: torch.Tensor, *, trace: Trace | None = None, **kwargs: Any) -> torch.Tensor:
        if trace is None:
            trace = Trace(layers=set())
        elif trace.interventions is not None and trace.interventions is not self.interventions:
            raise InputError("a trace with interventions of its own reached a model run under other interventions")
        trace.interventions = self.interventions
        return self.model(input_ids, trace=trace, **kwargs)

    def step(self, ids: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        """`MiniMaxM3.step` under the interventions: logits fp32 [B, T, V]."""
        return self(ids, positions=positions, cache=cache)

    def step_with_hidden(self, ids: torch.Tensor, positions: torch.Tensor, cache,
                         layers: Iterable[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """`MiniMaxM3.step_with_hidden` under the interventions: (logits, {layer: residual stream [B, T, H]})."""
        layers = sorted(set(layers))
        trace = Trace(layers=set(layers))
        logits = self(ids, positions=positions, cache=cache, trace=trace)
        return logits, {L: trace.hidden_states[L] for L in layers}


def intervened(model: MiniMaxM3, interventions: Interventions | None) -> MiniMaxM3 | IntervenedModel:
    """The model generation runs: `model` itself without interventions, else an `IntervenedModel`."""
    if interventions is None:
        return model
    return IntervenedModel(model, interventions)


# ---------------------------------------------------------------------------------------------- expert masks


def masks_from_kept(kept: Mapping[int, Iterable[int]], num_experts: int) -> dict[int, torch.Tensor]:
    """bool [num_experts] masks per layer, True at the kept expert ids (what a checkpoint pruned to those experts
    routes to: `Interventions.expert_mask`)."""
    masks = {}
    for L, ids in kept.items():
        ids = list(ids)
        bad = [e for e in ids if not isinstance(e, int) or isinstance(e, bool) or not 0 <= e < num_experts]
        if bad:
            raise InputError(f"layer {L}: expert ids {bad[:5]} are not in [0, {num_experts})")
        twice = sorted({e for e in ids if ids.count(e) > 1})
        if twice:
            raise InputError(f"layer {L}: expert ids {twice[:5]} are listed more than once")
        mask = torch.zeros(num_experts, dtype=torch.bool)
        mask[ids] = True
        masks[L] = mask
    return masks


def read_expert_mask(path: str | Path, num_experts: int) -> dict[int, torch.Tensor]:
    """The masks of an `--expert-mask` file: a `pruning.json` as `minimax-ref prune` writes it (`{"kept": {"L":
    [ids]}, "source_num_experts": E, ...}`), or an object `{"L": [kept ids]}`. A pruning.json written for a model
    of another expert count is refused (the mask applies to the checkpoint that was pruned, not to the pruned one)."""
    path = Path(path)
    raw = read_json(path, flag="--expert-mask")
    if not isinstance(raw, dict):
        raise InputError(f"--expert-mask {path}: expected a JSON object, got {type(raw).__name__}")
    kept = raw.get("kept", raw)
    source = raw.get("source_num_experts")
    if source is not None and (isinstance(source, bool) or not isinstance(source, int)):
        raise InputError(f"--expert-mask {path}: source_num_experts={source!r} must be an integer")
    if source is not None and source != num_experts:
        raise InputError(f"--expert-mask {path}: the file keeps experts of a {source}-expert model, this checkpoint "
                         f"has {num_experts} per layer (apply the mask to the checkpoint that was pruned)")
    if not isinstance(kept, dict) or not kept:
        raise InputError(f"--expert-mask {path}: expected 'kept': {{layer: [expert ids]}}")
    out = {}
    for key, ids in kept.items():
        try:
            L = int(key)
        except ValueError:
            raise InputError(f"--expert-mask {path}: {key!r} is not a layer index") from None
        if L in out:
            raise InputError(f"--expert-mask {path}: layer {L} is given twice ({key!r})")
        if not isinstance(ids, list):
            raise InputError(f"--expert-mask {path}: layer {key}: expected a list of kept expert ids, got {ids!r}")
        try:
            out.update(masks_from_kept({L: ids}, num_experts))
        except InputError as e:
            raise InputError(f"--expert-mask {path}: {e}") from None
    return out


def parse_drop(spec: str, num_experts: int) -> tuple[int, list[int]]:
    """One `--drop-experts LAYER:E[,E...]` value -> (layer, dropped expert ids)."""
    layer, sep, ids = spec.partition(":")
    try:
        if not sep:
            raise ValueError
        L = int(layer)
        dropped = [int(e) for e in ids.split(",") if e.strip()]
    except ValueError:
        raise InputError(f"--drop-experts {spec!r}: expected LAYER:EXPERT[,EXPERT...], e.g. 3:5,7") from None
    if not dropped:
        raise InputError(f"--drop-experts {spec!r}: name at least one expert")
    twice = sorted({e for e in dropped if dropped.count(e) > 1})
    if twice:
        raise InputError(f"--drop-experts {spec!r}: expert ids {twice} are named more than once")
    bad = [e for e in dropped if not 0 <= e < num_experts]
    if bad:
        raise InputError(f"--drop-experts {spec!r}: expert ids {bad} are not in [0, {num_experts})")
    return L, dropped


def interventions_from_args(args: argparse.Namespace, text: TextConfig) -> Interventions | None:
    """The `Interventions` the flags ask for (None without any), checked against the model's config `text`
    (layers, expert counts, enough experts left for top-k)."""
    mask_file, drops = getattr(args, "expert_mask", None), getattr(args, "drop_experts", None)
    if mask_file is None and not drops:
        return None
    E = text.num_local_experts
    masks = read_expert_mask(mask_file, E) if mask_file is not None else {}
    for spec in drops or ():
        L, dropped = parse_drop(spec, E)
        mask = masks.get(L, torch.ones(E, dtype=torch.bool)).clone()
        mask[dropped] = False
        masks[L] = mask
    n = text.num_hidden_layers
    for L, mask in masks.items():
        what = "--drop-experts" if mask_file is None else "--expert-mask / --drop-experts"
        if not 0 <= L < n or not text.moe_layers[L]:
            moe = [i for i in range(n) if text.moe_layers[i]]
            raise InputError(f"{what}: layer {L} is not an MoE layer of this model (MoE layers: {moe})")
        if int(mask.sum()) < text.num_experts_per_tok:
            raise InputError(f"{what}: layer {L} keeps {int(mask.sum())} experts; routing chooses "
                             f"{text.num_experts_per_tok} per token")
    return Interventions(expert_mask=masks)


def cli_interventions(args: argparse.Namespace, model: MiniMaxM3 | None = None) -> Interventions | None:
    """The flags' interventions for `model`; without a model, checked against the checkpoint's config.json before
    anything loads (synthetic weights are checked once built). None without the flags."""
    if getattr(args, "expert_mask", None) is None and not getattr(args, "drop_experts", None):
        return None
    if model is not None:
        return interventions_from_args(args, model.text)
    if getattr(args, "synthetic_weights", None) is not None:
        return None
    from ..model.config import load_model_config
    from ..weights.embedded import default_checkpoint

    return interventions_from_args(args, load_model_config(args.ckpt_path or default_checkpoint()).text)
