"""The shipped default checkpoint (minimax_ref/default_checkpoint, the trained nano model): it loads and
validates in the release's format, and passes the seed's checks through the CLI (greedy, CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from minimax_ref.cli.main import main
from minimax_ref.model.config import load_model_config
from minimax_ref.weights.checkpoint import MXFP8, NVFP4, open_checkpoint
from minimax_ref.weights.embedded import DEFAULT_CHECKPOINT, default_checkpoint

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "examples" / "nano" / "tools.json"


def generate(capsys, *args: str) -> dict:
    """`minimax-ref generate` on the default checkpoint (no --ckpt-path), greedy, JSON result."""
    assert main(["generate", "--temperature", "0", "--output-format", "json", *args]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_shipped_checkpoint_is_release_format_and_small():
    path = default_checkpoint()
    assert path == DEFAULT_CHECKPOINT
    ck = open_checkpoint(path)  # validates headers, names, shapes and scales; raises on any problem
    assert ck.problems == []
    fmts = {name: f.fmt for name, f in ck.formats.items()}
    assert {f for n, f in fmts.items() if ".experts." in n} == {NVFP4}  # routed experts NVFP4, as released
    assert {f for n, f in fmts.items() if "self_attn" in n or "shared_experts" in n} == {MXFP8}
    cfg = load_model_config(path)
    assert cfg.vision is not None and cfg.text.has_moe and any(cfg.text.sparse_layers)
    assert (path / "dspark" / "config.json").is_file()
    total = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    assert total <= 31 * 10**6, f"the shipped checkpoint grew to {total / 1e6:.1f} MB"
    run = json.loads((path / "nano_run.json").read_text(encoding="utf-8"))
    assert "Lisbon" not in run["heldout"]["cities"]  # the check city is a training city; copying is measured apart


def test_seed_check_arithmetic_with_reasoning(capsys):
    out = generate(capsys, "--chat", "--prompt", "What is 17*23?", "--max-new-tokens", "400")
    assert out["finish_reason"] == "stop"
    assert out["content"].strip() == "391"
    assert "17*23" in out["reasoning"] and "391" in out["reasoning"]
    assert "<mm:think>" not in out["content"] and "</mm:think>" not in out["content"]


def test_seed_check_weather_tool_call(capsys):
    out = generate(capsys, "--chat", "--tools", str(TOOLS), "--prompt",
                   "What's the weather in Lisbon for the next 3 days?")
    assert out["errors"] == []
    assert [c["name"] for c in out["tool_calls"]] == ["get_weather"]
    assert out["tool_calls"][0]["arguments"]["city"] == "Lisbon"


def test_seed_check_image_of_427(capsys, tmp_path):
    sys.path.insert(0, str(ROOT))
    from examples.nano.data import seed_image_spec

    image = tmp_path / "427.png"
    seed_image_spec().render().save(image)
    out = generate(capsys, "--chat", "--image", str(image), "--prompt", "What number is this?")
    assert out["content"].strip() == "427"


def test_main_job_runs_on_the_default_without_writing_a_cache(tmp_path):
    env = {"MINIMAX_REF_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, "-m", "minimax_ref.cli", "generate", "--chat", "--prompt", "Hello, MiniMax",
           "--max-new-tokens", "40", "--output-format", "json", "--seed", "0"]
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["content"].strip()
    assert list(tmp_path.iterdir()) == []


def test_streamed_text_splits_reasoning_and_drops_the_stop_token(capsys):
    # the CLI's defaults (no --max-new-tokens, --dtype auto = float32 on a CPU), greedy, streamed text
    assert main(["generate", "--chat", "--temperature", "0", "--prompt", "What is 17*23?"]) == 0
    out = capsys.readouterr().out
    lines = out.rstrip("\n").splitlines()
    assert lines[-1] == "391"  # the answer on its own line after the reasoning
    assert "17*23" in lines[0]
    assert "[e~[" not in out and "</mm:think>" not in out


def test_dtype_auto_is_float32_on_cpu_and_bfloat16_on_gpu():
    import torch

    from minimax_ref.weights.loader import resolve_dtype

    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16
