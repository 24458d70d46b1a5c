"""Operations one decode step issues, by layer and by operator: a CPU-measurable proxy for kernel count.

    python benchmarks/decode_ops.py --preset tiny --fast on           # the fast paths
    python benchmarks/decode_ops.py --preset tiny --fast off          # the readable reference
    python benchmarks/decode_ops.py --preset release --layers 4 --experts 16 --fast on

At batch 1 a decode step on a GPU is bound by how many kernels it runs, not by bytes, until the step
has only a few kernels per layer (BENCHMARKS.md: 1.7 % of the HBM roofline at the real shapes). Every
non-view ATen operation that reaches a backend is a kernel launch on a GPU (some launch more), so
counting them on a CPU tells where the launches are without a GPU. Counted with a
`TorchDispatchMode` during one decode step after a prefill past the MSA threshold and two warm-up
steps; view operations (no kernel) are left out. `host_syncs` counts `aten::_local_scalar_dense`
(`.item()`, `.tolist()`, `if tensor:`), each a device-to-host synchronisation on a GPU; with the fast
paths the one left is the embedding's token-id check, which is skipped under CUDA-graph capture.
Compiled regions (`fast="fused"`, `fast="compiled"`, `decode="compile"`) cannot run under a dispatch mode, so
they are not counted here: `profile_decode.py` counts the kernels of a compiled step on a GPU.

Prints one JSON object: ops per step, per layer (with its kind), outside the layers, the most
frequent operators, and host synchronisations.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import torch
from common import add_fast_flag
from torch.utils._python_dispatch import TorchDispatchMode

from minimax_ref.weights.loader import load_synthetic


class OpCounter(TorchDispatchMode):
    """Counts non-view ATen operations under the label `where` (set by the layer hooks)."""

    def __init__(self) -> None:
        super().__init__()
        self.where = "outside layers"
        self.by_where: Counter[str] = Counter()
        self.by_op: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not getattr(func, "is_view", False):
            name = func.overloadpacket.__name__
            self.by_where[self.where] += 1
            self.by_op[name] += 1
        return func(*args, **(kwargs or {}))


def count_decode_step(model, prompt_len: int, warmup: int = 2) -> dict:
    """Prefill `prompt_len` tokens, run `warmup` decode steps, then count the ops of one more."""
    cache = model.new_cache(1, prompt_len + warmup + 2)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, min(1000, model.text.vocab_size), (1, prompt_len), generator=gen).to(model.device)
    counter = OpCounter()
    kinds = []
    hooks = []
    for i, layer in enumerate(model.layers):
        sparse = bool(model.text.sparse_layers[i]) if model.text.sparse_layers else False
        kinds.append(("msa" if sparse else "attn") + ("+moe" if hasattr(layer, "block_sparse_moe") else "+mlp"))
        hooks.append(layer.register_forward_pre_hook(lambda _m, _a, i=i: setattr(counter, "where", f"layer {i}")))
        hooks.append(layer.register_forward_hook(lambda _m, _a, _o: setattr(counter, "where", "outside layers")))
    with torch.no_grad():
        model(ids, positions=torch.arange(prompt_len, device=model.device)[None], cache=cache)
        pos = prompt_len
        for _ in range(warmup):
            model(ids[:, :1], positions=torch.tensor([[pos]], device=model.device), cache=cache)
            pos += 1
        with counter:
            model(ids[:, :1], positions=torch.tensor([[pos]], device=model.device), cache=cache)
    for h in hooks:
        h.remove()
    layers = [{"layer": i, "kind": kinds[i], "ops": counter.by_where[f"layer {i}"]} for i in range(len(kinds))]
    return {"ops_per_step": sum(counter.by_where.values()), "layers": layers,
            "outside_layers": counter.by_where["outside layers"],
            "host_syncs": counter.by_op["_local_scalar_dense"],
            "top_ops": dict(counter.by_op.most_common(15))}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny", help="synth preset (default: tiny)")
    p.add_argument("--format", default="nvfp4", choices=["nvfp4", "mxfp8", "bf16"])
    p.add_argument("--weights", default="packed", choices=["packed", "dequant"])
    add_fast_flag(p, ["off", "on"], "on")
    p.add_argument("--layers", type=int, default=None, help="layers (default: the preset's)")
    p.add_argument("--experts", type=int, default=None, help="routed experts (default: the preset's)")
    p.add_argument("--prompt-len", type=int, default=300, help="past the tiny preset's MSA threshold (default: 300)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args(argv)
    model = load_synthetic(args.preset, format=args.format, layers=args.layers, experts=args.experts,
                           dtype=getattr(torch, args.dtype), weights=args.weights, fast=args.fast)
    out = {"benchmark": "decode_ops", "params": vars(args), "torch": torch.__version__,
           **count_decode_step(model, args.prompt_len)}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
