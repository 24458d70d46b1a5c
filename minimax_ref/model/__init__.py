"""The model's math, read in this order: `decoder` (the decoder layer and the text model), `norm`, `attention`
(with `rope` and `cache`), `msa`, `moe`, `mlp`, `linear`; then `vision` (the vision tower and projector),
`parallel` (tensor-parallel layers and the `World`), `config` (the typed config) and `finite` (refusing non-finite
logits). Nothing here records, intervenes or compiles: `research.trace` and `golden` attach from outside, and the
fast twins live in `fast/`."""
