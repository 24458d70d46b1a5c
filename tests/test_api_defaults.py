"""Defaults: the Python API's follow the CLI's (one dtype rule, `loader.resolve_dtype`, for `--dtype auto` and
`load_model` / `load_synthetic` without a dtype); the test suite's report of skips (tests/conftest.py)."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import minimax_ref as mr
from minimax_ref.cli import model_args
from minimax_ref.weights import loader


@pytest.fixture
def dtype_calls(monkeypatch):
    """Every `loader.resolve_dtype` call's arguments and result, the function itself still answering."""
    calls = []
    real = loader.resolve_dtype

    def spy(dtype, device=None):
        out = real(dtype, device)
        calls.append((dtype, None if device is None else torch.device(device).type, out))
        return out

    monkeypatch.setattr(loader, "resolve_dtype", spy)
    return calls


def test_load_model_default_dtype_is_the_cli_auto_rule(dtype_calls):
    model = mr.load_model()  # the embedded default, on the CPU
    assert model.compute_dtype == torch.float32
    assert next(p for p in model.parameters() if p.is_floating_point()).dtype == torch.float32
    assert (None, "cpu", torch.float32) in dtype_calls
    assert loader.resolve_dtype(None, "cpu") == torch.float32
    assert loader.resolve_dtype(None, torch.device("cuda", 0)) == torch.bfloat16


def test_load_synthetic_default_dtype_is_float32_on_cpu():
    assert mr.load_model(None, synthetic="tiny", layers=1).compute_dtype == torch.float32


def test_cli_dtype_auto_resolves_through_the_same_function(dtype_calls):
    p = argparse.ArgumentParser()
    model_args.add_model_flags(p)
    args = p.parse_args(["--fast", "off"])
    assert args.dtype == "auto"
    model, _tok, _path = model_args.load_from_args(args)
    assert model.compute_dtype == torch.float32
    assert ("auto", "cpu", torch.float32) in dtype_calls


SKIPPING = """
import pytest

@pytest.mark.skip(reason="needs ../shared")
@pytest.mark.parametrize("i", range(3))
def test_a(i):
    pass

def test_b():
    pytest.skip("needs a CUDA device")

@pytest.mark.skipif(True, reason="needs a CUDA device")
def test_c():
    pass

def test_passes():
    pass

def test_fails():
    assert 1 == 2

@pytest.mark.xfail(reason="known")
def test_xfails():
    assert 0
"""


def _pytest(tmp_path: Path, *args: str) -> str:
    """A pytest run over SKIPPING with the repo's conftest.py and pyproject addopts; its output."""
    repo = Path(__file__).resolve().parent.parent
    shutil.copy(repo / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_skipping.py").write_text(SKIPPING)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c",
                          str(repo / "pyproject.toml"), "--rootdir", str(tmp_path), str(tmp_path), *args],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr  # test_fails
    return run.stdout


def test_skips_are_summarised_one_line_per_reason(tmp_path):
    out = _pytest(tmp_path)
    lines = out.splitlines()
    assert "3 skipped: needs ../shared" in lines
    assert "2 skipped: needs a CUDA device" in lines
    assert sum(" skipped: " in line for line in lines) == 2
    assert not any(line.startswith("SKIPPED") for line in lines)
    # failures, errors and xfails are reported as before
    assert any(line.startswith("FAILED") and "test_fails" in line for line in lines)
    assert any(line.startswith("XFAIL") and "test_xfails" in line for line in lines)
    # -rs asks for every skip's location: pytest's own list, not the grouped one
    out = _pytest(tmp_path, "-rs")
    assert any(line.startswith("SKIPPED") for line in out.splitlines())
    assert "3 skipped: needs ../shared" not in out.splitlines()


def test_generate_defaults_are_the_clis():
    """One set of defaults: `mr.generate`'s are what `minimax-ref generate` uses when no flag is given."""
    import inspect

    from minimax_ref.cli.main import build_parser
    from minimax_ref.generation.chat import DEFAULT_MAX_NEW_TOKENS

    args = build_parser().parse_args(["generate", "--prompt", "x"])
    params = inspect.signature(mr.generate).parameters
    assert params["max_new_tokens"].default == DEFAULT_MAX_NEW_TOKENS == 512 and args.max_new_tokens is None
    for name in ("temperature", "top_p", "top_k", "seed"):
        assert params[name].default == getattr(args, name), name


def test_dir_lists_the_public_api_only():
    names = dir(mr)
    assert set(mr.__all__) <= set(names)
    assert not {"Any", "TYPE_CHECKING", "annotations", "importlib", "sys", "types"} & set(names)
    assert all(not n.startswith("_") or n == "__version__" for n in names)
