"""The fast paths: twins of the reference modules that compute the same functions faster (static-shape,
synchronisation-free decode steps, fused packed matmuls, compiled decoder layers, CUDA graphs), installed on a built
model by one call, `apply(model, FastPaths(...))`, and removed by `apply(model, FastPaths())`.

The reference modules never import this package; `load_model(fast=...)` imports it only when a fast path is asked for,
and a drafter loaded for a fast model takes the model's paths (`MiniMaxM3.share_paths`). Modules: `paths` (the
switches and their named `PRESETS`), `model` (the model twin and `apply`), `attention`, `moe`, `packed` (the twins),
`compiled` (the compiled decoder layer), `prefill` (prefill's fused elementwise kernels), `launch` (launch
configurations, as data), `graph` (a decode step captured in a CUDA graph), `overlap` (greedy steps launched ahead of
the host), `segments` (offloaded steps split at their synchronisation points), `drafter` (the DSpark drafter's twin),
and the Triton kernels: `grouped` (packed products of a few dozen rows), `gemv` (packed products from reordered
weights), `mma_gemv` (packed products of up to 32 rows, each lane decoding its tensor-core fragments; Gluon),
`prefill_experts` (prefill's routed experts from their packed stacks), `attention_kernel` (block-sparse
attention of prefill and decode steps), `selection_kernel` (MSA block scores).
"""

from importlib import import_module

# The names below are imported on first use: importing this package (which `fast.paths`, the CLI's flags, does)
# must not import the kernels, whose Triton and inductor imports take seconds.
_HOMES = {"FastMiniMaxM3": "model", "apply": "model", "paths_of": "model", "Kernels": "packed",
          **dict.fromkeys(["FUSED_ROWS", "CACHE_BUCKET", "PRESETS", "REFERENCE", "SYNC_FREE_TOKENS", "FastPaths"],
                          "paths")}


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f".{_HOMES[name]}", __name__), name)


__all__ = ["FastPaths", "PRESETS", "REFERENCE", "apply", "paths_of", "FastMiniMaxM3", "Kernels", "FUSED_ROWS",
           "CACHE_BUCKET", "SYNC_FREE_TOKENS"]
