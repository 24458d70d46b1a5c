"""Shared fixtures: small synthetic checkpoints in the release format, written once per session."""

from __future__ import annotations

import os

import pytest
import torch

from minimax_ref.weights.synth import write_checkpoint

# One intra-op thread: the test models are tiny, and on a shared 2-core machine OpenMP barriers
# between busy threads cost far more than a second thread gains (and results stay thread-count
# independent).
torch.set_num_threads(1)


def _interpreter_numpy_compat() -> None:
    """Triton 3.6's interpreter turns a scalar into a Python int with `int(array)`, which NumPy >= 2.4 refuses for
    its one-element arrays (a loop bounded by a kernel argument or program id fails). Take the element instead, for
    this test run (the Triton kernels' tests under `TRITON_INTERPRET=1`)."""
    import triton.runtime.interpreter as interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "numpy_compat", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.numpy_compat = True
    interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    try:
        import triton  # noqa: F401
    except ImportError:
        pass
    else:
        _interpreter_numpy_compat()


def pytest_collection_modifyitems(config, items):
    run_slow = os.environ.get("MINIMAX_REF_SLOW") == "1"
    has_gpu = torch.cuda.is_available()
    for item in items:
        if "slow" in item.keywords and not run_slow:
            item.add_marker(pytest.mark.skip(reason="slow test: set MINIMAX_REF_SLOW=1 to run"))
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


def _skip_reason(report) -> str:
    """A skipped test's reason as `-rs` shows it, without the "Skipped: " prefix."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ").strip()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Skipped tests, one line per reason ("N skipped: reason"), most frequent first. pyproject's addopts reports
    failures, errors and xfail/xpass with -r as usual but not each skip's location: in a fresh clone (no ../shared,
    no CUDA, no triton) that list runs to dozens of lines with a handful of reasons. `-rs` still lists them."""
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped or {"s", "S"} & set(getattr(terminalreporter, "reportchars", "")):
        return
    counts: dict[str, int] = {}
    for report in skipped:
        reason = _skip_reason(report)
        counts[reason] = counts.get(reason, 0) + 1
    terminalreporter.write_sep("=", f"{len(skipped)} skipped, by reason")
    for reason, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        terminalreporter.write_line(f"{n} skipped: {reason}")


@pytest.fixture(scope="session")
def ckpt_factory(tmp_path_factory):
    """write(preset, fmt, **kw) -> path, cached per argument set for the whole session."""
    cache: dict = {}

    def write(preset: str = "tiny", fmt: str = "bf16", **kw):
        key = (preset, fmt, tuple(sorted((k, repr(v)) for k, v in kw.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{preset}-{fmt}")
            cache[key] = write_checkpoint(out, preset, fmt, **kw)
        return cache[key]

    return write


@pytest.fixture(scope="session")
def tiny_nvfp4(ckpt_factory):
    return ckpt_factory("tiny", "nvfp4")


@pytest.fixture(scope="session")
def tiny_bf16(ckpt_factory):
    return ckpt_factory("tiny", "bf16")


@pytest.fixture(scope="session")
def spec_ckpt(ckpt_factory):
    """The tiny NVFP4 checkpoint with a DSpark drafter in dspark/."""
    return ckpt_factory("tiny", "nvfp4", drafter=True)
