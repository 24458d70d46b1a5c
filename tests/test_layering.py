"""Two layers, one direction: the reference modules import nothing from the fast path (`minimax_ref.fast`), running
with the fast paths off never imports it, and `fast.apply` installs and removes the twins without changing the
model's parameters."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1] / "minimax_ref"
REFERENCE_MODULES = ("model", "weights.quant", "weights.checkpoint", "weights.loader", "weights.packed",
                     "generation.generate", "generation.speculative", "generation.drafter", "research.trace", "golden")
# what only the fast path may call: the compiled-region switch and its store-once operator
FAST_ONLY = ("is_compiling", "materialize", "_dynamo", "_inductor")


def _trees(module: str) -> list[ast.Module]:
    """The parsed source of `minimax_ref.<module>`: its file, or every file of its package."""
    path = ROOT.joinpath(*module.split("."))
    files = [path.with_suffix(".py")] if path.with_suffix(".py").exists() else sorted(path.glob("*.py"))
    assert files, module
    return [ast.parse(f.read_text()) for f in files]


def _imported(module: str, top_level_only: bool = False) -> set[str]:
    """Dotted names of the `minimax_ref` modules that `minimax_ref.<module>` imports anywhere (module level or in a
    function, TYPE_CHECKING blocks included; only at module level with `top_level_only`), read with `ast`."""
    out = set()
    for node in (n for tree in _trees(module) for n in (tree.body if top_level_only else ast.walk(tree))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("minimax_ref")}
        elif isinstance(node, ast.ImportFrom):
            base = "minimax_ref" if node.level else ""
            target = ".".join(p for p in (base, node.module or "") if p)
            if target.startswith("minimax_ref"):
                out.add(target)
                out |= {f"{target}.{a.name}" for a in node.names}
    return out


def test_reference_modules_import_nothing_from_the_fast_path():
    """Not at all; the loader only inside `_load`, when `load_model(fast=...)` asks for fast paths (its lazy import
    is what the subprocess test below checks)."""
    for module in REFERENCE_MODULES:
        fast = sorted(name for name in _imported(module, top_level_only=module == "weights.loader")
                      if name == "minimax_ref.fast" or name.startswith("minimax_ref.fast."))
        assert not fast, f"minimax_ref.{module} imports {fast}"


def test_reference_modules_have_no_compiled_region_switches():
    for module in REFERENCE_MODULES:
        if module == "weights.loader":  # its one lazy `from .fast import` is checked by the subprocess test below
            continue
        names = {n.attr if isinstance(n, ast.Attribute) else n.id
                 for tree in _trees(module) for n in ast.walk(tree) if isinstance(n, (ast.Attribute, ast.Name))}
        found = [w for w in FAST_ONLY if w in names]
        assert not found, f"minimax_ref.{module} uses {found}"


def test_running_with_fast_off_never_imports_the_fast_package():
    code = """
import sys, torch
import minimax_ref
from minimax_ref.weights.embedded import default_checkpoint
model = minimax_ref.load_model(default_checkpoint(), dtype=torch.float32, fast="off")
cache = model.new_cache(1, 8)
model(torch.tensor([[1, 2, 3]]), cache=cache, positions=torch.arange(3)[None])
model(torch.tensor([[4]]), cache=cache, positions=torch.tensor([[3]]))
model(torch.tensor([[1, 2, 3]]))
loaded = sorted(m for m in sys.modules if m == "minimax_ref.fast" or m.startswith("minimax_ref.fast."))
print("FAST:", loaded)
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "FAST: []" in run.stdout, run.stdout


def test_apply_swaps_classes_and_restores_the_reference(tiny_nvfp4):
    from minimax_ref.fast import REFERENCE, FastPaths, apply, paths_of
    from minimax_ref.model.attention import Attention
    from minimax_ref.model.decoder import MiniMaxM3
    from minimax_ref.model.moe import Experts
    from minimax_ref.weights.loader import load_model
    from minimax_ref.weights.packed import PackedWeight

    model = load_model(tiny_nvfp4, dtype=torch.float32, weights="packed")
    keys = list(model.state_dict())
    classes = {name: type(m) for name, m in model.named_modules()}
    assert paths_of(model) == REFERENCE
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    want = model(ids)

    paths = apply(model, True)
    assert paths == FastPaths.of(True) and paths_of(model) == paths
    assert list(model.state_dict()) == keys  # the twins keep every parameter and buffer name
    swapped = {name for name, m in model.named_modules() if type(m) is not classes[name]}
    assert any(isinstance(model.get_submodule(n), Attention) for n in swapped)
    assert any(isinstance(model.get_submodule(n), Experts) for n in swapped)
    assert any(isinstance(model.get_submodule(n), PackedWeight) for n in swapped)
    assert isinstance(model, MiniMaxM3) and type(model) is not MiniMaxM3
    torch.testing.assert_close(model(ids), want, rtol=1e-4, atol=1e-4)

    apply(model, FastPaths())
    assert {name: type(m) for name, m in model.named_modules()} == classes
    assert not hasattr(model, "fast") and paths_of(model) == REFERENCE
    assert not any(hasattr(m, "paths") for m in model.modules())
    assert torch.equal(model(ids), want)


def test_numerics_and_formats_are_fixed_at_construction(tiny_nvfp4):
    """`MiniMaxM3(config, numerics=, formats=)`: each linear's and expert stack's on-disk format and the activation
    emulation are set as the model is built; the loader passes the checkpoint's, so nothing is written afterwards."""
    import pytest

    from minimax_ref.errors import ConfigError
    from minimax_ref.model.decoder import MiniMaxM3, Numerics
    from minimax_ref.model.linear import Linear
    from minimax_ref.model.moe import Experts
    from minimax_ref.weights.checkpoint import open_checkpoint
    from minimax_ref.weights.loader import load_model

    ck = open_checkpoint(tiny_nvfp4)
    formats = {spec.module: ck.formats[prefix].fmt for prefix, spec in ck.linears.items()}
    with torch.device("meta"):
        built = MiniMaxM3(ck.config, numerics=Numerics("emulate", attention_chunk_elements=1 << 20), formats=formats)
        plain = MiniMaxM3(ck.config)
    ck.close()
    assert built.act_quant == "emulate" and plain.act_quant == "none"
    assert {layer.self_attn.chunk_elements for layer in built.layers} == {1 << 20}
    packed = {name: m.act_format for name, m in built.named_modules() if isinstance(m, (Linear, Experts))
              and m.act_format is not None}
    assert packed and all(formats[name] == fmt for name, fmt in packed.items())
    assert all(m.emulate_act_quant == (m.act_format is not None) for m in built.modules() if hasattr(m, "act_format"))
    assert not any(m.emulate_act_quant for m in plain.modules() if hasattr(m, "act_format"))

    loaded = load_model(tiny_nvfp4, dtype=torch.float32, act_quant="emulate", kv_cache_dtype="fp8")
    assert loaded.numerics == Numerics("emulate", kv_cache_dtype="fp8")
    assert {n: m.act_format for n, m in loaded.named_modules() if hasattr(m, "act_format") and m.act_format} == packed
    assert loaded.new_cache(1, 8).fp8  # the cache's storage defaults to the numerics'
    with pytest.raises(ConfigError, match="act_quant='w4a4'"):
        Numerics("w4a4")
    with pytest.raises(ConfigError, match="kv_cache_dtype='fp4'"):
        Numerics(kv_cache_dtype="fp4")


def test_golden_captures_through_the_trace_not_by_patching():
    """The golden package records the attention cores through `Trace.attention` (and module hooks): it assigns no
    attribute of another module (no monkeypatched `causal_attention` / `msa_attention`)."""
    files = sorted((ROOT / "golden").glob("*.py"))
    assert files
    patched = [ast.unparse(t) for f in files for node in ast.walk(ast.parse(f.read_text()))
               if isinstance(node, (ast.Assign, ast.AugAssign))
               for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
               if isinstance(t, ast.Attribute) and t.attr in ("causal_attention", "msa_attention")]
    assert not patched, patched


# the modules whose forwards are the model's math, and the words of what attaches from outside
MATH_MODULES = ("decoder", "attention", "msa", "moe", "mlp", "norm", "rope", "linear")
RECORDING_WORDS = ("trace", "capture", "record", "intervention", "golden", "capturing", "hook")


def test_reference_forwards_compute_the_math_and_nothing_else():
    """The forwards of the model's modules (and msa.py's functions) name nothing that records, intervenes or
    captures a CUDA graph: `research.trace` and `golden` attach by forward hooks from outside."""
    found = []
    for module in MATH_MODULES:
        tree = ast.parse((ROOT / "model" / f"{module}.py").read_text())
        if module == "decoder":  # the decoder layer; the model's own forward is the public entry taking a trace
            tree = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DecoderLayer")
        funcs = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
                 and (n.name == "forward" or module in ("msa", "rope"))]
        assert funcs, module
        for fn in funcs:
            body = fn.body[1:] if ast.get_docstring(fn) else fn.body
            names = {n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute) else n.arg
                     for stmt in body for n in ast.walk(stmt) if isinstance(n, (ast.Name, ast.Attribute, ast.arg))}
            names |= {a.arg for a in fn.args.args + fn.args.kwonlyargs}
            found += [f"{module}.{fn.name}: {name}" for name in names
                      if any(word in name.lower() for word in RECORDING_WORDS)]
    assert not found, found


def test_the_decoder_layer_reads_as_its_equations():
    tree = ast.parse((ROOT / "model" / "decoder.py").read_text())
    layer = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DecoderLayer")
    forward = next(n for n in layer.body if isinstance(n, ast.FunctionDef) and n.name == "forward")
    body = forward.body[1:]  # below the docstring
    assert body[-1].end_lineno - body[0].lineno + 1 <= 15
