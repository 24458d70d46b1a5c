"""Running `examples/kernel_test` (the numpy implementation of every golden op) over bundles, as a user does."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from minimax_ref.golden.layouts import pattern

ROOT = Path(__file__).parents[1]
EXAMPLE = ROOT / "examples" / "kernel_test"


def numpy_ops():
    """examples/kernel_test/numpy_ops.py as a module: every golden op in plain numpy, from the manifest alone."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("golden_numpy_ops", EXAMPLE / "numpy_ops.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_example(bundles: list[Path], cwd: Path) -> subprocess.CompletedProcess:
    """`MINIMAX_REF_GOLDEN_BUNDLE=a:b python -m pytest examples/kernel_test` in a fresh interpreter."""
    env = dict(os.environ, MINIMAX_REF_GOLDEN_BUNDLE=os.pathsep.join(map(str, bundles)),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(EXAMPLE)],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def check_manifest(path: Path) -> None:
    """Every tensor and parameter of every entry is described under its op, every description covers a tensor of
    the bundle, and no text points into the source (a .py file, the golden package, an engine function)."""
    m = json.loads((path / "manifest.json").read_text())
    text = json.dumps({k: v for k, v in m.items() if k != "entries"})
    assert not re.search(r"\.py\b|golden/|\b(moe|msa|quant|linear|norm|attention)\.[a-z_]+\b|recompute", text), path
    for op, c in m["contracts"].items():
        names = {n for e in m["entries"] if e["op"] == op for n in e["tensors"]}
        params = {n for e in m["entries"] if e["op"] == op for n in e["params"]}
        rxs = {key: [pattern(k.strip()) for k in key.split(",")] for key in c["tensors"]}
        for n in names:
            assert any(rx.fullmatch(n) for r in rxs.values() for rx in r), (path, op, n)
        for key, r in rxs.items():  # nothing absent: each description names a tensor the entries hold
            assert any(rx.fullmatch(n) for rx in r for n in names), (path, op, key)
        assert set(c["params"]) == params, (path, op)
    assert {e["op"] for e in m["entries"]} == set(m["contracts"])
