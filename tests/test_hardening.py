"""Every failure a new user hit ends in one clear error (or works), never a traceback or garbage.

Each test reproduces one reported failure through the public entry points (the CLI's `main`, the
`minimax-ref` program, `load_model`) and checks the message names the culprit and the exit status.
"""

from __future__ import annotations

import importlib
import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from minimax_ref.cli.main import main
from minimax_ref.errors import CheckpointError, ConfigError
from minimax_ref.model.config import parse_model_config
from minimax_ref.weights.checkpoint import open_checkpoint
from minimax_ref.weights.loader import load_model
from minimax_ref.weights.synth import build_config


def run(args, capsys):
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def _copy(src, tmp_path, name="ck"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def _edit_config(path, fn):
    raw = json.loads((path / "config.json").read_text())
    fn(raw)
    (path / "config.json").write_text(json.dumps(raw))


def _poke(path, name, fn):
    """Apply fn to tensor `name` in its shard, in place (the shard keeps its other tensors)."""
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = path / index["weight_map"][name]
    tensors = load_file(str(shard))
    tensors[name] = fn(tensors[name].clone())
    save_file(tensors, str(shard), metadata={"format": "pt"})


def _one_error_line(err: str) -> str:
    assert "Traceback" not in err, err
    assert err.startswith("error:"), err
    return err


# ------------------------------------------------------------------------------------------ item 6, 5b: config


@pytest.mark.parametrize("field,value,needle", [
    ("num_attention_heads", None, "num_attention_heads"),
    ("num_attention_heads", "four", "num_attention_heads='four'"),
    ("num_attention_heads", 0, "num_attention_heads=0"),
    ("rope_theta", "abc", "rope_theta='abc'"),
    ("head_dim", "x", "head_dim='x'"),
    ("rms_norm_eps", -1, "rms_norm_eps"),
    ("rms_norm_eps", 0, "rms_norm_eps"),
    ("rope_theta", -5.0, "rope_theta"),
    ("vocab_size", True, "vocab_size"),
    ("num_local_experts", "16", "num_local_experts"),
    ("quantization_config", "nvfp4", "quantization_config"),
])
def test_mistyped_config_field_is_one_error_line(tiny_nvfp4, tmp_path, capsys, field, value, needle):
    ck = _copy(tiny_nvfp4, tmp_path)

    def edit(raw):
        (raw if field == "quantization_config" else raw["text_config"])[field] = value

    _edit_config(ck, edit)
    code, _, err = run(["generate", "--ckpt-path", str(ck), "--prompt", "hi", "--max-new-tokens", "2"], capsys)
    assert code == 2
    assert needle in _one_error_line(err) and len(err.strip().splitlines()) == 1


def test_integral_float_config_value_is_accepted():
    raw = build_config("tiny")
    raw["text_config"]["hidden_size"] = 128.0
    assert parse_model_config(raw).text.hidden_size == 128


# ------------------------------------------------------------------------------------------ item 5a, 11: values


def test_nan_in_a_bf16_weight_is_refused_naming_the_tensor(tiny_nvfp4, tmp_path, capsys):
    ck = _copy(tiny_nvfp4, tmp_path)
    name = "language_model.model.layers.0.post_attention_layernorm.weight"
    lm_head = "language_model.lm_head.weight"

    def nan(t):
        t.view(-1)[3] = float("nan")
        return t

    def inf(t):
        t[1, 2] = float("-inf")
        return t

    _poke(ck, name, nan)
    _poke(ck, lm_head, inf)
    with pytest.raises(CheckpointError) as e:
        load_model(ck, dtype=torch.float32)
    assert "non-finite" in str(e.value) and (name in str(e.value) or lm_head in str(e.value))
    code, _, err = run(["generate", "--ckpt-path", str(ck), "--prompt", "hi", "--max-new-tokens", "2"], capsys)
    assert code == 2 and "non-finite" in _one_error_line(err)
    # inspect reads the values by default and lists both tensors; --quick checks headers only
    code, out, _ = run(["inspect", str(ck), "--output-format", "json"], capsys)
    problems = json.loads(out)["problems"]
    assert code == 1 and any(name in p and "[3]" in p for p in problems)
    assert any(lm_head in p and "[1, 2]" in p for p in problems)
    code, out, _ = run(["inspect", str(ck), "--quick", "--output-format", "json"], capsys)
    assert code == 0 and json.loads(out)["problems"] == []


@pytest.mark.parametrize("what", ["nan", "inf", "negative"])
def test_inspect_checks_scales_by_default(tiny_nvfp4, tmp_path, capsys, what):
    ck = _copy(tiny_nvfp4, tmp_path)
    c = open_checkpoint(ck)
    prefix = next(p for p, f in c.formats.items() if f.fmt == "nvfp4")
    name = c.formats[prefix].scale_2
    value = {"nan": math.nan, "inf": math.inf, "negative": -1.0}[what]
    _poke(ck, name, lambda t: torch.full_like(t, value))
    with pytest.raises(CheckpointError):  # what generate refuses ...
        load_model(ck, dtype=torch.float32)
    code, out, _ = run(["inspect", str(ck)], capsys)  # ... inspect reports
    assert code == 1 and name in out and "problems    0" not in out


# ------------------------------------------------------------------------------------------ item 7: plan


def _plan_args(tmp_path, preset, tp, gib, *extra):
    (tmp_path / "config.json").write_text(json.dumps(build_config(preset, "nvfp4")))
    return ["plan", "--ckpt-path", str(tmp_path), "--tp", str(tp), "--gpu-memory", str(gib), "--max-model-len",
            "4096", *extra]


def test_plan_refuses_a_tp_the_loader_refuses(tmp_path, capsys):
    code, out, err = run(_plan_args(tmp_path, "pruned-80", 3, 141), capsys)  # 64 heads over 3 cards
    assert code == 1 and "num_attention_heads=64 does not divide by 3" in err and "runs         NO" in out
    code, out, _ = run(_plan_args(tmp_path, "pruned-80", 3, 141, "--output-format", "json"), capsys)
    plan = json.loads(out)
    assert code == 1 and plan["runs"] is False and any("num_attention_heads" in p for p in plan["problems"])
    # the same rule set as the loader: a split the loader accepts is accepted
    code, out, _ = run(_plan_args(tmp_path, "pruned-80", 2, 141), capsys)
    assert code == 0 and "runs         yes" in out


def test_plan_refuses_weights_larger_than_the_card(tmp_path, capsys):
    code, _, err = run(_plan_args(tmp_path, "pruned-80", 1, 24), capsys)  # ~150 GiB of weights on a 24 GiB card
    assert code == 1 and "weights need" in err and "per card" in err


def test_plan_split_rules_are_the_loaders(tiny_nvfp4):
    """plan and the loader share parallel.tp_split_problems: the loader's refusal lists the same problems."""
    from minimax_ref.model.parallel import World, check_tp_split, tp_split_problems
    from minimax_ref.research.plan import plan_memory

    ck = open_checkpoint(tiny_nvfp4)
    with pytest.raises(ConfigError) as e:
        check_tp_split(ck, 3, False)
    formats = {p: (spec, ck.formats[p].fmt) for p, spec in ck.linears.items()}
    problems = tp_split_problems(ck.config, formats, 3, False)
    assert problems and all(p in str(e.value) for p in problems)
    plan = plan_memory(ck.config, tp=3, gpu_memory_gib=80, max_model_len=1024, ckpt_dir=tiny_nvfp4)
    assert not plan["runs"] and all(any(p in q for q in plan["problems"]) for p in problems)
    assert World.single().size == 1


# ------------------------------------------------------------------------------------------ item 9: synth


def test_synth_refuses_a_non_empty_out(tmp_path, capsys):
    out = tmp_path / "real"
    out.mkdir()
    (out / "config.json").write_text("{}")
    code, _, err = run(["synth", "--preset", "tiny", "--out", str(out)], capsys)
    assert code == 2 and "not empty" in _one_error_line(err)
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]


def test_synth_refuses_a_place_it_cannot_write(tmp_path, capsys):
    """A place where no folder can be created (/proc refuses mkdir even to root) is named as such before any work,
    not as a lack of space."""
    code, _, err = run(["synth", "--preset", "tiny", "--out", "/proc/minimax-ref-out"], capsys)
    assert code == 2 and "cannot create a folder in /proc" in _one_error_line(err)
    assert "choose a writable place" in err


def test_synth_checks_free_space_first(tmp_path, capsys, monkeypatch):
    class Usage:
        free = 1 << 20

    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage)
    code, _, err = run(["synth", "--preset", "tiny", "--out", str(tmp_path / "new")], capsys)
    assert code == 2 and "GiB free" in _one_error_line(err)
    assert not (tmp_path / "new").exists()


def test_synth_disk_full_leaves_nothing_and_says_so(tmp_path, capsys, monkeypatch):
    import errno
    import os

    import minimax_ref.weights.synth as synth

    real = synth.write_safetensors

    def full(path, *a, **kw):
        if "00002" in path.name:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path, *a, **kw)

    monkeypatch.setattr(synth, "write_safetensors", full)
    code, _, err = run(["synth", "--preset", "tiny", "--out", str(tmp_path / "new")], capsys)
    assert code == 2 and "no space left" in _one_error_line(err)
    assert list(tmp_path.iterdir()) == []


def test_synth_shards_follow_the_umask(tmp_path):
    import os

    from minimax_ref.weights.synth import write_checkpoint

    old = os.umask(0o022)
    try:
        out = write_checkpoint(tmp_path / "ck", "tiny", "nvfp4", drafter=True)
    finally:
        os.umask(old)
    files = [*out.glob("*.safetensors"), *(out / "dspark").glob("*.safetensors"), out / "config.json"]
    assert files and all(f.stat().st_mode & 0o777 == 0o644 for f in files)
    assert out.stat().st_mode & 0o777 == 0o755


def test_synth_streams_large_tensors(tmp_path, monkeypatch):
    """Large tensors are generated and written in row blocks: the peak of live tensors stays a fraction of the
    output (the pruned-80 preset's embedding and LM head are 2.4 GB each), and the bytes are iter_tensors'."""
    from memory import PeakMemory

    import minimax_ref.weights.synth as synth
    from minimax_ref.model.config import parse_model_config as parse

    monkeypatch.setattr(synth, "STREAM_ELEMENTS", 1 << 15)
    over = {"vocab_size": 8192}  # embedding and LM head [8192, 128]: 1 M elements, 4 MiB each in fp32
    with PeakMemory() as mem:
        out = synth.write_checkpoint(tmp_path / "ck", "tiny", "bf16", overrides=over, shard_bytes=64 << 20)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    assert mem.peak < size / 8, (mem.peak, size)
    written = {}
    for f in out.glob("*.safetensors"):
        written.update(load_file(str(f)))
    cfg = parse(json.loads((out / "config.json").read_text()))
    expected = dict(synth.iter_tensors(cfg, "bf16", 0))
    assert written.keys() == expected.keys()
    assert all(torch.equal(written[k], v) for k, v in expected.items())


# ------------------------------------------------------------------------------------------ item 3: --input-file


def test_input_file_bad_fields_are_reported_per_line_and_the_rest_runs(tiny_nvfp4, tmp_path, capsys):
    lines = [{"prompt": "first", "id": "a"},
             {"prompt": "x", "temperature": "hot"},
             {"prompt": "x", "temperature": None},
             {"prompt": "x", "seed": "x"},
             {"prompt": "x", "max_new_tokens": -1},
             {"prompt": "x", "top_k": 1.5},
             {"prompt": "x", "thinking": "maybe"},
             {"prompt": 7},
             {"prompt": "last", "id": "b"}]
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    code, out, err = run(["generate", "--ckpt-path", str(tiny_nvfp4), "--input-file", str(path), "--output-format",
                          "json", "--max-new-tokens", "2", "--temperature", "0"], capsys)
    assert code == 1 and "Traceback" not in err
    rows = [json.loads(x) for x in out.splitlines()]
    by_line = {r["line"]: r for r in rows[:-1]}  # each result names its line; the summary comes last
    assert sorted(by_line) == list(range(1, 10)) and rows[-1]["summary"]["failed"] == 7
    assert by_line[1]["id"] == "a" and by_line[9]["id"] == "b"
    for n, needle in ((2, "temperature='hot'"), (3, "temperature=None"), (4, "seed='x'"), (5, "max_new_tokens=-1"),
                      (6, "top_k=1.5"), (7, "thinking"), (8, "'prompt'")):
        assert f"{path}:{n}: " in err and needle in by_line[n]["error"], (n, by_line[n])
    assert len(by_line[1]["token_ids"]) == 2 and len(by_line[9]["token_ids"]) == 2


def test_input_file_dev_null_says_empty(tiny_nvfp4, capsys):
    code, out, err = run(["generate", "--ckpt-path", str(tiny_nvfp4), "--input-file", "/dev/null"], capsys)
    assert code == 0 and out == "" and "no requests" in err


def test_input_file_missing_is_one_error(capsys, tmp_path):
    code, _, err = run(["generate", "--input-file", str(tmp_path / "nope.jsonl")], capsys)
    assert code == 2 and "no such file" in _one_error_line(err)


# ------------------------------------------------------------------------------------------ item 12: wide vocabulary


def test_release_width_synthetic_tokenizer_decodes_every_id(tmp_path, monkeypatch):
    from minimax_ref.cli.model_args import synthetic_tokenizer_dir
    from minimax_ref.generation.tokenizer import load_tokenizer
    from minimax_ref.weights.synth import PRESETS

    monkeypatch.setenv("MINIMAX_REF_CACHE", str(tmp_path))
    vocab = PRESETS["release"].text["vocab_size"]
    assert PRESETS["release"].tokenizer_vocab == vocab == PRESETS["pruned-80"].tokenizer_vocab
    tok = load_tokenizer(synthetic_tokenizer_dir(vocab))
    assert tok.vocab_size == vocab
    text = tok.decode([186844, 0, vocab - 1, 4096])
    assert "<|reserved_" in text
    assert all(vocab - 16 <= v < vocab for v in tok.special_ids.as_dict().values() if v is not None)


def test_wide_vocabulary_synthetic_run_decodes_its_output(tmp_path, monkeypatch, capsys):
    """`--synthetic-weights` with a 200K vocabulary (tiny widths otherwise) samples ids far above 4,096 and
    must decode them all."""
    import dataclasses

    from minimax_ref.weights import synth

    monkeypatch.setenv("MINIMAX_REF_CACHE", str(tmp_path))
    tiny = synth.PRESETS["tiny"]
    wide = dataclasses.replace(tiny, text={**tiny.text, "vocab_size": 200064})
    monkeypatch.setitem(synth.PRESETS, "tiny-wide", wide)
    code, out, err = run(["generate", "--synthetic-weights", "tiny-wide", "--synthetic-format", "bf16",
                          "--prompt", "Hello", "--max-new-tokens", "8", "--temperature", "1.0", "--top-k", "0",
                          "--seed", "1", "--output-format", "json"], capsys)
    assert code == 0, err
    ids = json.loads(out)["token_ids"]
    assert len(ids) == 8 and max(ids) >= 4096  # uniform-ish sampling over 200K ids


# ------------------------------------------------------------------------------------------ item 13: smaller points


def test_several_text_prompts_are_separated(tiny_nvfp4, capsys):
    code, out, _ = run(["generate", "--ckpt-path", str(tiny_nvfp4), "--prompt", "one", "--prompt", "two",
                        "--max-new-tokens", "3", "--temperature", "0"], capsys)
    assert code == 0 and "=== prompt 1 of 2 ===" in out and "=== prompt 2 of 2 ===" in out


@pytest.mark.parametrize("args,needle", [
    (["plan", "--ckpt-path", ".", "--tp", "1", "--gpu-memory", "nan", "--max-model-len", "16"],
     "argument --gpu-memory: nan is not a finite number"),
    (["plan", "--ckpt-path", ".", "--tp", "1", "--gpu-memory", "80", "--max-model-len", "16", "--activation-reserve",
      "inf"], "argument --activation-reserve: inf is not a finite number"),
    (["generate", "--prompt", "hi", "--max-model-len", "-5"], "argument --max-model-len: -5 must be >= 1"),
    (["generate", "--prompt", "hi", "--top-p", "nan"], "argument --top-p: nan is not a finite number"),
    (["golden", "--prompt", "hi", "--out", "x", "--page-size", "0"], "argument --page-size: 0 must be >= 1"),
])
def test_out_of_range_numbers_are_refused_by_the_parser(args, needle, capsys):
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2 and needle in capsys.readouterr().err


def test_bad_combinations_and_paths_name_the_flag(tmp_path, capsys):
    code, _, err = run(["generate", "--interactive", "--output-format", "json"], capsys)
    assert code == 2 and "--interactive prints text" in _one_error_line(err)
    code, _, err = run(["generate", "--prompt", "hi", "--image", str(tmp_path)], capsys)
    assert code == 2 and "a directory, not an image file" in _one_error_line(err)
    code, _, err = run(["prune", "--keep", "8", "--calibration", str(tmp_path / "none.jsonl"), "--out",
                        str(tmp_path / "o")], capsys)
    assert code == 2 and f"--calibration {tmp_path / 'none.jsonl'}: cannot read" in _one_error_line(err)


def test_stop_ids_outside_the_vocabulary_and_untyped_text_are_refused():
    import minimax_ref as mr
    from minimax_ref.errors import InputError

    model, tok = mr.load_model(None, dtype=torch.float32), mr.load_tokenizer(None)
    with pytest.raises(InputError, match=r"stop_ids \[99999\] are outside the vocabulary \[0, 4096\)"):
        mr.generate(model, tok, ["hi"], max_new_tokens=2, stop_ids=[99999])
    with pytest.raises(InputError, match="parse_output: expected the generated text as a string, got NoneType"):
        mr.parse_output(None)


def test_golden_replay_takes_ops(small_bundle, capsys):
    code, out, _ = run(["golden", "--replay", str(small_bundle), "--ops", "rmsnorm"], capsys)
    assert code == 0 and json.loads(out)["checks"] > 0
    code, _, err = run(["golden", "--replay", str(small_bundle), "--ops", "router"], capsys)
    assert code == 2 and "no entry of --ops router in the bundle" in _one_error_line(err)
    code, _, err = run(["golden", "--replay", str(small_bundle), "--ops", "bogus"], capsys)
    assert code == 2 and "unknown op 'bogus'" in _one_error_line(err)


def test_device_mps_is_one_error(capsys):
    code, _, err = run(["generate", "--device", "mps", "--prompt", "hi"], capsys)
    assert code == 2 and "mps" in _one_error_line(err)


def test_fast_compiled_announces_the_compile(capsys, tmp_path):
    code, _, err = run(["generate", "--fast", "compiled", "--ckpt-path", str(tmp_path / "none"), "--prompt", "hi"],
                       capsys)
    assert code == 2 and "torch.compile" in err.splitlines()[0] and err.splitlines()[-1].startswith("error:")


def test_reply_cut_by_max_model_len_is_said(tiny_nvfp4, capsys):
    code, out, err = run(["generate", "--ckpt-path", str(tiny_nvfp4), "--prompt", "a b c d e f g h", "--max-new-tokens",
                          "40", "--max-model-len", "16", "--temperature", "0", "--output-format", "json"], capsys)
    row = json.loads(out)
    assert code == 0 and row["finish_reason"] == "length" and len(row["token_ids"]) < 40
    assert "--max-model-len 16" in err and "note:" in err


def test_ctrl_c_during_an_interactive_reply_ends_the_reply(tiny_nvfp4, capsys, monkeypatch):
    import builtins
    import importlib

    gen = importlib.import_module("minimax_ref.generation.generate")

    real, calls = gen.generate, []

    def generate(*a, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(*a, **kw)

    lines = iter(["hello", "again", "/exit"])
    monkeypatch.setattr(gen, "generate", generate)
    monkeypatch.setattr(builtins, "input", lambda prompt="": next(lines))
    code, out, err = run(["generate", "--ckpt-path", str(tiny_nvfp4), "--interactive", "--max-new-tokens", "3",
                          "--temperature", "0"], capsys)
    assert code == 0 and "interrupted" in err and len(calls) == 2


def test_ctrl_c_at_any_moment_exits_130_without_traceback(tiny_nvfp4):
    import signal
    import subprocess
    import sys
    import time

    def default_sigint():  # as from a terminal: a background job of a script would inherit SIGINT ignored
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    # The program as the `minimax-ref` entry point runs it (`sys.exit(main())`), announcing on stderr that the
    # interpreter is up: the delays then count from there, not from a process start that a loaded machine can stretch
    # past the first delay (a Ctrl-C inside interpreter start-up is Python's, before any code of ours runs).
    entry = ("import sys; sys.stderr.write('started\\n'); sys.stderr.flush(); from minimax_ref.cli.main import main; "
             "sys.exit(main())")
    # while importing torch (held back until the import ends: a KeyboardInterrupt inside torch's C++ initialisation
    # would abort the process), importing the rest, loading, waiting at the prompt (stdin stays open)
    for delay in (0.05, 0.15, 0.3, 1.5, 5.0):
        proc = subprocess.Popen([sys.executable, "-c", entry, "generate", "--ckpt-path", str(tiny_nvfp4),
                                 "--interactive"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
        assert proc.stderr.readline() == "started\n"
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)  # stdin still open: closing it first could end the session by EOF before the signal
        _, err = proc.communicate()
        # 130, or a death by SIGINT (which shells report as 130) before Python installs its handler
        assert proc.returncode in (130, -signal.SIGINT) and "Traceback" not in err, (delay, err)


def test_importing_the_cli_does_not_import_torch():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", "import sys, minimax_ref.cli.main; print('torch' in sys.modules)"],
                       capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "False", r.stderr


def test_load_model_none_is_the_embedded_default():
    from minimax_ref.weights.embedded import default_checkpoint

    model = load_model(None, dtype=torch.float32)
    assert model.ckpt_path == default_checkpoint()


def test_load_tokenizer_none_is_the_embedded_default():
    from minimax_ref.generation.tokenizer import load_tokenizer
    from minimax_ref.weights.embedded import default_checkpoint

    assert load_tokenizer(None).path == load_tokenizer(default_checkpoint()).path


def test_numpy_is_a_declared_dependency():
    tomllib = pytest.importorskip("tomllib")
    from pathlib import Path

    deps = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.split(">")[0].split("=")[0].strip() == "numpy" for d in deps)


# ------------------------------------------------------------------------------------------ items 1, 2, 10: torchrun


def _torchrun(command: str, tmp_path, timeout: float = 300):
    """Run a torchrun command line as a user would (`torchrun` or, when it is not on PATH, the same program as
    `python -m torch.distributed.run`), on a free port so that parallel runs do not collide."""
    import os
    import shlex
    import socket
    import subprocess
    import sys
    from pathlib import Path

    argv = shlex.split(command)
    assert argv[0] == "torchrun"
    argv = ([shutil.which("torchrun")] if shutil.which("torchrun") else [sys.executable, "-m",
                                                                         "torch.distributed.run"]) + argv[1:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PET_MASTER_PORT": str(port), "MINIMAX_REF_CACHE": str(tmp_path / "cache")}
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=Path(__file__).parents[1])


def _readme_lines(prefix: str) -> list[str]:
    from pathlib import Path

    text = (Path(__file__).parents[1] / "README.md").read_text()
    return [line.split("  #")[0].strip() for line in text.splitlines() if line.startswith(prefix)]


def test_ci_runs_the_readme_test_command():
    """`.ci/run` runs the README's set-up test command, word for word (its last line), with pytest-xdist's workers
    that the command asks for among the test extras."""
    import re
    from pathlib import Path

    root = Path(__file__).parents[1]
    (command,) = [line for line in _readme_lines("pip install") if "pytest" in line]
    assert (root / ".ci" / "run").read_text().strip().splitlines()[-1] == command
    if " -n " in command:  # (tomllib is not in Python 3.10)
        extras = re.search(r"^test = \[(.*?)^\]", (root / "pyproject.toml").read_text(), re.S | re.M).group(1)
        assert re.search(r'^\s*"pytest-xdist\b', extras, re.M)


def _no_rank_traceback(output: str) -> None:
    # torchrun's own report of a failed worker is its business; no traceback may come from a rank
    assert "examples/generate.py\", line" not in output and "minimax_ref/" not in output, output
    assert "terminate called" not in output and "SIGABRT" not in output and "Signal 6" not in output, output


def test_readme_torchrun_lines_use_an_unambiguous_flag():
    lines = _readme_lines("torchrun ")
    assert lines and all("--nproc-per-node" in line and "--nproc " not in line for line in lines)


def test_readme_cpu_torchrun_line_runs_verbatim(tmp_path):
    (line,) = [x for x in _readme_lines("torchrun ") if "--device" not in x and "DIR" not in x]
    r = _torchrun(line, tmp_path)
    assert r.returncode == 0, r.stderr[:3000]
    assert r.stdout.strip() and "terminate called" not in r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_readme_cuda_torchrun_line_without_cuda_is_one_error(tmp_path):
    from minimax_ref.weights.embedded import default_checkpoint

    line = _readme_lines("torchrun ")[0].replace("DIR", str(default_checkpoint()))
    r = _torchrun(line, tmp_path)
    errors = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert r.returncode != 0 and len(errors) == 1 and "CUDA" in errors[0], r.stderr[-3000:]
    _no_rank_traceback(r.stderr)


@pytest.mark.parametrize("when", ["generate", "load"])
def test_torchrun_with_a_failing_rank_exits_cleanly(tmp_path, when):
    """One rank raises (as a bug or an out-of-memory would); every run: the failing rank's traceback once, the
    other rank one line, non-zero exit, no rank aborting (SIGABRT, `terminate called ...`)."""
    for _ in range(3 if when == "generate" else 1):
        r = _torchrun("torchrun --nproc-per-node 2 tests/tp_failing_rank.py 1 " + when +
                      " -- --prompt Hello --max-new-tokens 2 --temperature 0", tmp_path, timeout=120)
        out = r.stdout + r.stderr
        assert r.returncode != 0
        assert "injected failure on rank 1" in out
        assert "terminate called" not in out and "exitcode  : -6" not in out and "SIGABRT" not in out, out[-3000:]
        if when == "generate":
            assert out.count("[rank 1] Traceback") == 1 and "[rank 0] Traceback" not in out
            assert "[rank 0] error: another tensor-parallel rank failed" in out or "exitcode  : -15" in out


# ------------------------------------------------------------------------------------------ item 5c: non-finite forward


def _poisoned(path, layer: int, value: float = math.nan):
    """The checkpoint's model with one norm weight of `layer` set to `value` in memory (as a damaged weight that
    the loader's check did not see, or a user's own edit)."""
    model = load_model(path, dtype=torch.float32)
    model.layers[layer].post_attention_layernorm.weight.data[5] = value
    return model


def test_forward_names_the_layer_where_nan_first_appears(tiny_nvfp4):
    from minimax_ref.errors import NumericsError

    model = _poisoned(tiny_nvfp4, 2)
    ids = torch.tensor([[1, 2, 3, 4]])
    with pytest.raises(NumericsError, match=r"layer 2 \("):
        model(ids)
    model.layers[2].post_attention_layernorm.weight.data[5] = 0.0
    model.embed_tokens.weight.data[3, 0] = math.inf
    with pytest.raises(NumericsError, match="embeddings"):
        model(ids)
    assert torch.isfinite(model(torch.tensor([[1, 2]]))).all()  # token 3 not used: finite, no error


def test_generation_with_nan_weights_is_an_error_not_garbage(tiny_nvfp4, capsys, monkeypatch):
    import minimax_ref.cli.generate as cli_generate  # run_generate looks load_from_args up there

    real = cli_generate.load_from_args

    def poisoned(args, world=None):
        model, tok, path = real(args, world)
        model.layers[1].post_attention_layernorm.weight.data[5] = math.nan
        return model, tok, path

    monkeypatch.setattr(cli_generate, "load_from_args", poisoned)
    for temperature in ("0", "0.7"):  # greedy printed garbage; sampling failed inside torch
        code, out, err = run(["generate", "--ckpt-path", str(tiny_nvfp4), "--prompt", "hi", "--max-new-tokens", "3",
                              "--temperature", temperature], capsys)
        assert code == 2 and "layer 1" in _one_error_line(err) and out.strip() == ""


def test_score_never_writes_nan_into_json(tiny_nvfp4, tmp_path, capsys, monkeypatch):
    # the module (`import minimax_ref.research.score as score` binds `mr.score`, the public function of the same name)
    score = importlib.import_module("minimax_ref.research.score")

    traces = tmp_path / "traces.jsonl"
    traces.write_text(json.dumps({"prompt": "The weather", "completion": " is fine today"}) + "\n")
    monkeypatch.setattr(score, "load_for_args", lambda path, args: _poisoned(path, 1))
    code, out, err = run(["score", "--ckpt-path", str(tiny_nvfp4), "--traces", str(traces)], capsys)
    assert code == 2 and out == "" and "non-finite" in _one_error_line(err)
    assert score.nonfinite_fields({"a": [1.0, {"b": math.nan}], "c": math.inf, "d": 2}) == ["a[1].b", "c"]


# ------------------------------------------------------------------------------------------ item 8: golden --replay


@pytest.fixture(scope="module")
def small_bundle(tiny_nvfp4, tmp_path_factory):
    out = tmp_path_factory.mktemp("golden") / "b"
    assert main(["golden", "--ckpt-path", str(tiny_nvfp4), "--prompt", "Hello golden", "--ops", "rmsnorm",
                 "--layers", "0", "--out", str(out)]) == 0
    return out


@pytest.mark.parametrize("damage,needle", [
    ("missing file", "is missing"),
    ("truncated file", "cannot be read"),
    ("bad manifest", "not valid JSON"),
    ("manifest without entries", "'entries'"),
    ("missing tensor", "lacks"),
    ("changed byte", "differ from the manifest's sha256"),
])
def test_golden_replay_of_a_damaged_bundle_is_one_error(small_bundle, tmp_path, capsys, damage, needle):
    b = _copy(small_bundle, tmp_path)
    manifest = json.loads((b / "manifest.json").read_text())
    first = b / manifest["entries"][0]["file"]
    if damage == "missing file":
        first.unlink()
    elif damage == "truncated file":
        first.write_bytes(first.read_bytes()[:-7])
    elif damage == "bad manifest":
        (b / "manifest.json").write_text('{"format": ')
    elif damage == "changed byte":
        data = bytearray(first.read_bytes())
        data[-1] ^= 1
        first.write_bytes(bytes(data))
    elif damage == "manifest without entries":
        del manifest["entries"]
        (b / "manifest.json").write_text(json.dumps(manifest))
    else:  # a hand-edited bundle: the file and its sha256 in the manifest both changed
        from minimax_ref.golden.contract import sha256

        tensors = load_file(str(first))
        tensors.pop(sorted(tensors)[0])
        save_file(tensors, str(first))
        manifest["entries"][0]["sha256"] = sha256(first)
        (b / "manifest.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    code, _, err = run(["golden", "--replay", str(b)], capsys)
    assert code == 2 and needle in _one_error_line(err)


# ------------------------------------------------------------------------------------------ docs/robustness.md


def _robustness_rows():
    from pathlib import Path

    text = (Path(__file__).parents[1] / "docs" / "robustness.md").read_text()
    table = text[text.index("## The table"):]
    rows = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if len(cells) == 4 and cells[1].startswith("`minimax-ref "):
            rows.append((cells[1].strip("`"), int(cells[2]), cells[3].replace("\\|", "|")))
    return rows


def test_robustness_table_rows_rerun():
    """The table's rows that need no damaged copy (their folders are the embedded default or none), run again."""
    import shlex
    import subprocess
    import sys

    from minimax_ref.weights.embedded import default_checkpoint

    setup_free = ("$DEFAULT", "/dev/null", "--device mps", "--temperature -1")
    rows = [r for r in _robustness_rows() if any(x in r[0] for x in setup_free)]
    assert len(rows) >= 5
    for command, code, message in rows:
        argv = [sys.executable, "-m", "minimax_ref.cli", *shlex.split(command)[1:]]
        argv = [a.replace("$DEFAULT", str(default_checkpoint())) for a in argv]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        output = (r.stderr + r.stdout).replace(str(default_checkpoint()), "$DEFAULT")
        assert r.returncode == code and message in output, (command, r.returncode, output[-2000:])


# ------------------------------------------------------------------------------------------ item 13: README Python


def test_readme_python_snippet_runs_verbatim_and_answers():
    """The README's Python snippet, as written: the embedded default from Python, and a reply with content
    (max_new_tokens leaves room for the reasoning)."""
    import contextlib
    import io
    from pathlib import Path

    text = (Path(__file__).parents[1] / "README.md").read_text()
    section = text[text.index("## Python"):]
    code = section[section.index("```python") + len("```python"): section.index("```", section.index("```python") + 9)]
    scope: dict = {}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(code, "README.md", "exec"), scope)
    out = scope["out"]
    assert out[0].content.strip() == "391", out[0]
    assert scope["logits"].shape[:2] == (1, 3)


# ------------------------------------------------------------------------------------------ item 9: prune, golden


def _disk_full(*args, **kwargs):
    import errno
    import os

    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_prune_disk_full_leaves_nothing_and_says_so(tiny_nvfp4, tmp_path, capsys, monkeypatch):
    import minimax_ref.weights.prune as prune

    calib = tmp_path / "calib.jsonl"
    calib.write_text(json.dumps({"input_ids": list(range(1, 40)), "completion_start": 1}) + "\n")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    monkeypatch.setattr(prune, "write_shard", _disk_full)
    monkeypatch.setattr(prune.shutil, "copyfile", _disk_full)
    code, _, err = run(["prune", "--ckpt-path", str(tiny_nvfp4), "--keep", "8", "--calibration", str(calib),
                        "--out", str(out_dir / "pruned"), "--dtype", "float32"], capsys)
    assert code == 2 and "no space left" in _one_error_line(err)
    assert list(out_dir.iterdir()) == []


def test_golden_disk_full_leaves_nothing_and_says_so(tiny_nvfp4, tmp_path, capsys, monkeypatch):
    from minimax_ref.golden import bundle

    monkeypatch.setattr(bundle, "save_file", _disk_full)
    code, _, err = run(["golden", "--ckpt-path", str(tiny_nvfp4), "--prompt", "Hello golden", "--ops", "rmsnorm",
                        "--layers", "0", "--out", str(tmp_path / "b")], capsys)
    assert code == 2 and "no space left" in _one_error_line(err)
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_during_the_torch_import_is_held_until_it_ends():
    """A Ctrl-C that arrives while torch is being imported (sent here from an import hook, at the moment torch's
    import starts) is delivered as KeyboardInterrupt once torch is whole, not inside its C++ initialisation."""
    import subprocess
    import sys

    # the child restores Python's Ctrl-C handler: a parent started in the background passes SIGINT down ignored
    code = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
class Interrupt:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None
sys.meta_path.insert(0, Interrupt())
from minimax_ref.cli.main import import_torch_holding_ctrl_c
try:
    import_torch_holding_ctrl_c()
except KeyboardInterrupt:
    print("interrupt after import:", hasattr(sys.modules.get("torch"), "tensor"))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "interrupt after import: True", (r.returncode, r.stderr[-2000:])


# ------------------------------------------------------------------------------------------ index and shard layout


def test_a_tensor_in_two_shards_is_a_problem_with_or_without_an_index(tiny_nvfp4, tmp_path):
    """A stray zeroed copy of a tensor in another shard: without an index the later shard's copy loaded in
    silence (other tokens), with one it was skipped in silence; now a problem naming both shards, either way."""
    ck = _copy(tiny_nvfp4, tmp_path)
    index = json.loads((ck / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(set(index.values()))
    name = next(n for n, s in index.items() if s == shards[0] and n.endswith("q_proj.weight"))
    other = load_file(str(ck / shards[1]))
    other[name] = torch.zeros_like(load_file(str(ck / shards[0]))[name])
    save_file(other, str(ck / shards[1]))
    for with_index in (True, False):
        if not with_index:
            (ck / "model.safetensors.index.json").unlink()
        with pytest.raises(CheckpointError) as e:
            load_model(ck, dtype=torch.float32)
        assert f"tensor {name} is in both {shards[0]} and {shards[1]}" in str(e.value)


@pytest.mark.parametrize("weight_map,needle", [
    ([], "weight_map must be an object"),
    ({"x": None}, "must be shard file names in this folder, got None"),
    ({"x": "../outside.safetensors"}, "got '../outside.safetensors'"),
])
def test_a_malformed_index_is_one_clear_error(tiny_nvfp4, tmp_path, weight_map, needle):
    ck = _copy(tiny_nvfp4, tmp_path)
    raw = json.loads((ck / "model.safetensors.index.json").read_text())
    raw["weight_map"] = weight_map if not isinstance(weight_map, dict) else {**raw["weight_map"], **weight_map}
    (ck / "model.safetensors.index.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="regenerate the index") as e:
        open_checkpoint(ck)
    assert needle in str(e.value)


def test_plan_says_a_checkpoint_that_would_not_load_does_not_run(tiny_nvfp4, tmp_path, capsys):
    """config.json's expert count disagreeing with the shards: `generate` refuses it, so `plan` (which sizes from
    the headers) must not say it runs."""
    ck = _copy(tiny_nvfp4, tmp_path)
    _edit_config(ck, lambda raw: raw.get("text_config", raw).update(num_local_experts=8))
    code, out, _ = run(["plan", "--ckpt-path", str(ck), "--tp", "1", "--gpu-memory", "1", "--max-model-len", "64",
                        "--activation-reserve", "0"], capsys)
    assert code == 1 and "the checkpoint would not load" in out and "expected [8, 128]" in out


def test_plan_lists_each_problem_of_a_checkpoint_that_would_not_load(tiny_nvfp4, tmp_path, capsys):
    """Two unrelated problems (a tensor missing from its shard's header, and a norm of the wrong shape): the plan
    names both, as the loader collects them, not the first alone."""
    from safetensors.torch import load_file, save_file

    ck = _copy(tiny_nvfp4, tmp_path)
    index = json.loads((ck / "model.safetensors.index.json").read_text())["weight_map"]
    norm = next(n for n in index if n.endswith("layers.0.input_layernorm.weight"))
    gone = next(n for n in index if n.endswith("layers.1.post_attention_layernorm.weight"))
    for shard in {index[norm], index[gone]}:
        tensors = load_file(ck / shard)
        if norm in tensors:
            tensors[norm] = tensors[norm][:-1].clone()
        tensors.pop(gone, None)
        save_file(tensors, ck / shard, metadata={"format": "pt"})
    code, _, err = run(["plan", "--ckpt-path", str(ck), "--tp", "1", "--gpu-memory", "1", "--max-model-len", "64",
                        "--activation-reserve", "0"], capsys)
    lines = [line for line in err.splitlines() if line.startswith("error: the checkpoint would not load")]
    assert code == 1 and len(lines) >= 2, err
    assert any(norm in line for line in lines) and any(gone in line for line in lines), err


def test_a_header_whose_offsets_do_not_match_its_tensors_is_named(tiny_nvfp4, tmp_path):
    """data_offsets two bytes short of the tensor's size (the file size still fits): named at the entry, as a
    damaged header, by the header check that `inspect --quick` runs too (it passed before)."""
    import struct

    ck = _copy(tiny_nvfp4, tmp_path)
    shard = sorted(ck.glob("*.safetensors"))[0]
    data = shard.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"][1] -= 2
    raw = json.dumps(header, separators=(",", ":")).encode().ljust(n)  # the same length, space-padded
    shard.write_bytes(data[:8] + raw + data[8 + n:])
    with pytest.raises(CheckpointError, match=f"entry '{name}' has data_offsets .* needs"):
        open_checkpoint(ck)
