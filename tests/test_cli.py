"""The command line: the embedded default, JSON output, streaming, and clear errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from minimax_ref.cli import main
from minimax_ref.errors import InputError
from minimax_ref.generate import SamplingParams, generate_ids
from minimax_ref.loader import load_model


def run(args, capsys):
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_json_fields(tiny_nvfp4, capsys):
    code, out, _ = run(["generate", "--ckpt-path", str(tiny_nvfp4), "--prompt", "Hello", "--prompt", "A longer one",
                        "--max-new-tokens", "5", "--temperature", "0", "--output-format", "json",
                        "--dtype", "float32"], capsys)
    assert code == 0
    rows = [json.loads(line) for line in out.splitlines()]
    assert len(rows) == 2
    for row in rows:
        for key in ("prompt_token_ids", "token_ids", "text", "reasoning", "content", "tool_calls", "finish_reason",
                    "stats"):
            assert key in row
        assert len(row["token_ids"]) <= 5 and row["finish_reason"] in ("stop", "length")
        assert row["stats"]["decode_tokens_per_s"] > 0


def test_generate_text_streams_and_matches_json(tiny_nvfp4, capsys):
    base = ["generate", "--ckpt-path", str(tiny_nvfp4), "--prompt", "The weather in Lisbon", "--max-new-tokens",
            "8", "--temperature", "0.7", "--seed", "5", "--dtype", "float32"]
    code, text_out, err = run(base, capsys)
    assert code == 0 and "tok/s" in err
    code, json_out, _ = run(base + ["--output-format", "json"], capsys)
    row = json.loads(json_out)
    assert text_out.rstrip("\n") == row["content"]


@pytest.mark.parametrize("flags,needle", [
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--top-p", "1.5"], "top_p"),
    (["--top-k", "-3"], "top_k"),
    (["--prompt", ""], "empty"),
])
def test_bad_sampling_and_prompt_flags(tiny_nvfp4, capsys, flags, needle):
    args = ["generate", "--ckpt-path", str(tiny_nvfp4)] + (["--prompt", "hi"] if "--prompt" not in flags else [])
    code, out, err = run(args + flags, capsys)
    assert code == 2 and needle in err and "Traceback" not in err and err.startswith("error:")


def test_prompt_longer_than_max_model_len(tiny_nvfp4, capsys):
    code, _, err = run(["generate", "--ckpt-path", str(tiny_nvfp4), "--prompt", "word " * 50,
                        "--max-model-len", "16"], capsys)
    assert code == 2 and "maximum sequence length is 16" in err


def test_unknown_flag_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--no-such-flag"])
    assert e.value.code == 2 and "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


def test_missing_checkpoint_folder(tmp_path, capsys):
    code, _, err = run(["generate", "--ckpt-path", str(tmp_path / "nope"), "--prompt", "x"], capsys)
    assert code == 2 and "nope" in err


def test_token_ids_out_of_range(tiny_nvfp4):
    model = load_model(tiny_nvfp4, dtype=torch.float32)
    with pytest.raises(InputError, match=r"token ids \[5000\] outside the vocabulary \[0, 1024\)"):
        generate_ids(model, [[1, 2, 5000]], max_new_tokens=2)
    with pytest.raises(InputError, match="outside the vocabulary"):
        model(torch.tensor([[1, -1]]))
    with pytest.raises(InputError, match="prompt 1 is empty"):
        generate_ids(model, [[1, 2], []], max_new_tokens=2)
    with pytest.raises(InputError, match="temperature"):
        SamplingParams(temperature=-0.5)


def test_embedded_default_is_synthesised_once(tmp_path):
    env = {"MINIMAX_REF_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, "-m", "minimax_ref.cli", "generate", "--prompt", "Hello", "--max-new-tokens", "3",
           "--output-format", "json"]
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stderr
    folder = tmp_path / "default-tiny-nvfp4-seed0"
    assert (folder / "model.safetensors.index.json").is_file()
    stamp = (folder / "config.json").stat().st_mtime_ns
    second = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert second.returncode == 0 and (folder / "config.json").stat().st_mtime_ns == stamp
    assert json.loads(first.stdout)["token_ids"] == json.loads(second.stdout)["token_ids"]
