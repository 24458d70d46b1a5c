"""The command line: the embedded default, JSON output, streaming, and clear errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from cli_fakes import capture_generate

from minimax_ref.cli.main import main
from minimax_ref.errors import InputError
from minimax_ref.generation.generate import SamplingParams, generate_ids
from minimax_ref.weights.loader import load_model


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


def test_fast_flag_offers_the_user_presets_in_their_own_words(capsys):
    """`--fast` is auto or a user preset of `fast.paths.PRESETS`, its help made of their descriptions; the finer
    presets (compile, fused) are for benchmarks and tests."""
    from minimax_ref.fast.paths import PRESETS, USER_PRESETS

    assert USER_PRESETS == ("off", "on", "compiled", "gemv-mma")
    with pytest.raises(SystemExit) as e:
        main(["generate", "--help"])
    out = "".join(capsys.readouterr().out.split())  # argparse rewraps the help
    assert e.value.code == 0 and "--fast{auto,off,on,compiled,gemv-mma}" in out
    for name in USER_PRESETS:
        assert f"{name}={''.join(PRESETS[name].description.split())}" in out
    with pytest.raises(SystemExit) as e:
        main(["generate", "--fast", "fused", "--prompt", "x"])
    assert e.value.code == 2 and "invalid choice: 'fused'" in capsys.readouterr().err


def test_missing_checkpoint_folder(tmp_path, capsys):
    code, _, err = run(["generate", "--ckpt-path", str(tmp_path / "nope"), "--prompt", "x"], capsys)
    assert code == 2 and "nope" in err


def test_token_ids_out_of_range(tiny_nvfp4):
    model = load_model(tiny_nvfp4, dtype=torch.float32)
    with pytest.raises(InputError, match=r"token ids \[5000\] outside the vocabulary \[0, 1024\)"):
        generate_ids(model, [[1, 2, 5000]], max_new_tokens=2)
    with pytest.raises(InputError, match="outside the vocabulary"):
        model(torch.tensor([[1, -1]]))
    with pytest.raises(InputError, match=r"prompts\[1\] is empty"):
        generate_ids(model, [[1, 2], []], max_new_tokens=2)
    with pytest.raises(InputError, match="temperature"):
        SamplingParams(temperature=-0.5)




def test_input_file_batch_keeps_order_and_reports_bad_lines(tiny_nvfp4, tmp_path, capsys):
    requests = tmp_path / "requests.jsonl"
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                               "parameters": {"type": "object", "properties": {
                                                   "city": {"type": "string"}, "days": {"type": "integer"}},
                                                   "required": ["city"]}}}]
    requests.write_text("\n".join([
        json.dumps({"id": "a", "prompt": "First", "max_new_tokens": 3, "temperature": 0}),
        '{"prompt": "broken", ',
        json.dumps({"id": "c", "messages": [{"role": "user", "content": "Weather in Genève?"}], "tools": tools,
                    "max_new_tokens": 4, "temperature": 0}),
        json.dumps({"id": "d", "messages": [{"role": "wizard", "content": "x"}]}),
    ]) + "\n")
    code, out, err = run(["generate", "--ckpt-path", str(tiny_nvfp4), "--input-file", str(requests),
                          "--output-format", "json"], capsys)
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 1 and len(rows) == 5
    # bad lines first (checked before the model runs), then results as they complete, each naming its line
    by_line = {row["line"]: row for row in rows[:-1]}
    assert sorted(by_line) == [1, 2, 3, 4]
    assert by_line[1]["id"] == "a" and len(by_line[1]["token_ids"]) == 3 and by_line[1]["stats"]["seconds"] > 0
    assert by_line[2] == {"line": 2, "error": by_line[2]["error"]} and "not valid JSON" in by_line[2]["error"]
    assert by_line[3]["id"] == "c" and isinstance(by_line[3]["text"], str) and len(by_line[3]["token_ids"]) == 4
    assert "wizard" in by_line[4]["error"] and by_line[4]["id"] == "d"  # an error row names its request's id
    assert f"{requests}:2:" in err and f"{requests}:4:" in err
    summary = rows[-1]["summary"]
    assert summary["requests"] == 4 and summary["failed"] == 2 and summary["generated_tokens"] == 7
    # the calls' own figures: one call per kind of line (raw, chat), each with its rates
    assert sorted(c["lines"] for c in summary["calls"]) == [[1], [3]]
    assert all(c["decode_tokens_per_s"] > 0 and "prefill_tokens_per_s" in c for c in summary["calls"])


def test_input_file_chat_only_keys_on_a_raw_prompt_are_refused_per_line(monkeypatch, tmp_path, capsys):
    calls = capture_generate(monkeypatch)
    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join(json.dumps(r) for r in [
        {"id": "x", "prompt": "What is 2+2?", "thinking": "enabled"}, {"prompt": "b", "system": "Be brief."},
        {"prompt": "c"}]) + "\n")
    code, out, err = run(["generate", "--input-file", str(requests), "--output-format", "json"], capsys)
    assert code == 1 and len(calls) == 1 and calls[0]["prompts"] == ["c"]
    assert f"{requests}:1: 'thinking' apply only to chat requests" in err
    assert f"{requests}:2: 'system' apply only to chat requests" in err
    assert json.loads(out.splitlines()[0])["id"] == "x"


def test_input_file_lines_decode_together(tiny_nvfp4, tmp_path, capsys, monkeypatch):
    """Lines that share the call-wide settings run through one continuous batch: as many decode steps as the
    longest line needs, not one run per line; each line's tokens are those it gets alone."""
    from minimax_ref.generation import decoding

    steps = []
    step = decoding.Scheduler.step
    monkeypatch.setattr(decoding.Scheduler, "step", lambda self: steps.append(len(self.running)) or step(self))
    lines = [{"prompt": f"Line {i} says", "max_new_tokens": 3 + i, "temperature": 0.8, "seed": 7 + i}
             for i in range(4)]
    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    base = ["generate", "--ckpt-path", str(tiny_nvfp4), "--output-format", "json", "--dtype", "float32"]
    code, out, _ = run(base + ["--input-file", str(requests)], capsys)
    assert code == 0
    rows = {row["line"]: row for row in map(json.loads, out.splitlines()[:-1])}
    assert len(steps) == 3 + 3 - 1 and set(steps) == {4}  # the longest line's steps, four slots each
    for i, line in enumerate(lines):
        alone = tmp_path / f"alone{i}.jsonl"
        alone.write_text(json.dumps(line) + "\n")
        code, out, _ = run(base + ["--input-file", str(alone)], capsys)
        assert code == 0 and json.loads(out.splitlines()[0])["token_ids"] == rows[i + 1]["token_ids"]


def test_batch_size_and_prefill_chunk_flags_and_the_sizes_chosen(tiny_nvfp4, capsys):
    """Without flags the sizes come from free memory (named in the stats); --max-batch-size 1 decodes the prompts
    one after another and --prefill-chunk 3 prefills in 3-token forwards, with the same greedy tokens."""
    from minimax_ref.generation import sizing

    base = ["generate", "--ckpt-path", str(tiny_nvfp4), "--output-format", "json", "--dtype", "float32",
            "--temperature", "0", "--max-new-tokens", "4", "--prompt", "The first prompt is long", "--prompt", "Two"]
    code, out, _ = run(base, capsys)
    chosen = [json.loads(line) for line in out.splitlines()]
    stats = chosen[0]["stats"]
    assert code == 0 and 1 <= stats["max_batch_size"] <= sizing.BATCH_CAP["cpu"]
    assert stats["prefill_chunk"] >= 16 and stats["decode_steps"] == 3  # both prompts in one batch
    code, out, _ = run(base + ["--max-batch-size", "1", "--prefill-chunk", "3"], capsys)
    small = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and (small[0]["stats"]["max_batch_size"], small[0]["stats"]["prefill_chunk"]) == (1, 3)
    assert small[0]["stats"]["decode_steps"] == 6  # one prompt at a time
    assert [r["token_ids"] for r in small] == [r["token_ids"] for r in chosen]
    with pytest.raises(SystemExit):
        run(base + ["--prefill-chunk", "0"], capsys)
    assert "--prefill-chunk: 0 must be >= 1" in capsys.readouterr().err


def test_input_file_line_too_long_for_the_model_gets_its_own_error(tiny_nvfp4, tmp_path, capsys, monkeypatch):
    """A line whose prompt leaves no room under --max-model-len is reported with its line number before the model
    loads; the other lines still run, together in one call."""
    from minimax_ref.generation import decoding

    runs = []
    run_scheduler = decoding.Scheduler.run
    monkeypatch.setattr(decoding.Scheduler, "run", lambda self: runs.append(len(self.seqs)) or run_scheduler(self))
    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "short", "max_new_tokens": 2}, {"prompt": "word " * 60, "max_new_tokens": 2},
        {"prompt": "also short", "max_new_tokens": 2}]) + "\n")
    code, out, err = run(["generate", "--ckpt-path", str(tiny_nvfp4), "--input-file", str(requests),
                          "--max-model-len", "32", "--output-format", "json"], capsys)
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 1 and rows[0]["line"] == 2 and "maximum sequence length is 32" in rows[0]["error"]
    assert sorted(r["line"] for r in rows[1:-1]) == [1, 3] and runs == [2]
    assert f"{requests}:2: the prompt has" in err


def test_tools_file_with_a_bad_schema(tiny_nvfp4, tmp_path, capsys):
    bad = tmp_path / "tools.json"
    bad.write_text(json.dumps([{"type": "function", "function": {"name": "f", "parameters": "not a schema"}}]))
    code, _, err = run(["generate", "--ckpt-path", str(tiny_nvfp4), "--chat", "--tools", str(bad), "--prompt", "x"],
                       capsys)
    assert code == 2 and "parameters" in err and "Traceback" not in err


def test_interactive_session_with_history_and_reset(tiny_nvfp4):
    cmd = [sys.executable, "-m", "minimax_ref.cli", "generate", "--ckpt-path", str(tiny_nvfp4), "--interactive",
           "--max-new-tokens", "3", "--temperature", "0", "--hide-reasoning"]
    proc = subprocess.run(cmd, input="Hello there\nAnd again\n/reset\nFresh start\n/exit\n", capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "history cleared" in proc.stderr and proc.stdout.count("> ") >= 4
    assert "Traceback" not in proc.stderr


def test_interactive_with_an_image_keeps_it_in_the_first_turn(ckpt_factory, tmp_path):
    from PIL import Image

    png = tmp_path / "red.png"
    Image.new("RGB", (60, 40), (200, 10, 10)).save(png)
    cmd = [sys.executable, "-m", "minimax_ref.cli", "generate", "--ckpt-path", str(ckpt_factory("tiny-vl", "nvfp4")),
           "--interactive", "--image", str(png), "--max-new-tokens", "2", "--temperature", "0"]
    proc = subprocess.run(cmd, input="What is this?\nAnd now?\n/exit\n", capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "error" not in proc.stderr, proc.stderr
    assert proc.stdout.count("> ") == 3


@pytest.mark.parametrize("flags,needle", [
    (["--device", "cuda:7"], "device='cuda:7'"),
    (["--thinking", "enabled"], "--thinking applies only to chat prompts"),
    (["--system", "be brief"], "--system applies only to chat prompts"),
])
def test_more_bad_flags(tiny_nvfp4, capsys, flags, needle):
    if flags[0] == "--device" and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    code, _, err = run(["generate", "--ckpt-path", str(tiny_nvfp4), "--prompt", "hi"] + flags, capsys)
    assert code == 2 and needle in err and "Traceback" not in err


def test_binary_input_files_are_refused_clearly(tiny_nvfp4, tmp_path, capsys):
    blob = tmp_path / "blob.bin"
    blob.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    code, _, err = run(["generate", "--ckpt-path", str(tiny_nvfp4), "--input-file", str(blob)], capsys)
    assert code == 2 and "not UTF-8 text" in err
    code, _, err = run(["generate", "--ckpt-path", str(tiny_nvfp4), "--chat", "--tools", str(blob), "--prompt", "x"],
                       capsys)
    assert code == 2 and "not valid UTF-8 JSON" in err


def test_model_call_rejects_malformed_input_ids(tiny_nvfp4):
    model = load_model(tiny_nvfp4, dtype=torch.float32)
    with pytest.raises(InputError, match="integer token ids"):
        model(torch.randn(1, 3))
    with pytest.raises(InputError, match=r"\[batch, seq\]"):
        model(torch.tensor([1, 2]))
    assert model(torch.tensor([[1, 2, 3]], dtype=torch.int32)).shape == (1, 3, 1024)


def _refuse_loading(monkeypatch):
    """Make loading the model fail loudly: a check that must come first is proven to come before the load."""
    import minimax_ref.cli.generate as cli_generate

    def load(args):
        raise AssertionError("loaded")

    monkeypatch.setattr(cli_generate, "load_from_args", load)


def test_non_utf8_prompt_is_refused_before_loading(monkeypatch, capsys):
    _refuse_loading(monkeypatch)
    # b"caf\xe9" (Latin-1) in argv reaches argparse as "caf\udce9" on POSIX (surrogateescape)
    code, _, err = run(["generate", "--prompt", "ok", "--prompt", "caf\udce9"], capsys)
    assert code == 2 and "Traceback" not in err and len(err.splitlines()) == 1
    assert err.startswith("error: --prompt 2: not UTF-8 text (byte 0xe9 at offset 3): ") and "UTF-8" in err


@pytest.mark.parametrize("flags,needle", [
    (["--prompt", "hi", "--max-new-tokens", "0"], "error: --max-new-tokens 0: must be >= 1"),
    (["--interactive", "--max-new-tokens", "0"], "error: --max-new-tokens 0: must be >= 1"),
])
def test_zero_max_new_tokens_is_refused_before_loading(monkeypatch, capsys, flags, needle):
    _refuse_loading(monkeypatch)
    code, _, err = run(["generate"] + flags, capsys)
    assert code == 2 and err.startswith(needle) and "minimax-ref score" in err and len(err.splitlines()) == 1


def test_input_file_zero_max_new_tokens_is_refused_per_line(monkeypatch, tmp_path, capsys):
    calls = capture_generate(monkeypatch)
    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps({"prompt": "a", "max_new_tokens": 0}) + "\n" + json.dumps({"prompt": "b"}) + "\n")
    code, out, err = run(["generate", "--input-file", str(requests), "--output-format", "json"], capsys)
    assert code == 1 and len(calls) == 1 and calls[0]["prompts"] == ["b"]
    assert f"error: {requests}:1: max_new_tokens=0: must be >= 1" in err and "minimax-ref score" in err
    assert json.loads(out.splitlines()[0])["line"] == 1


def test_input_file_lines_without_max_new_tokens_take_the_flag(monkeypatch, tmp_path, capsys):
    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps({"prompt": "a", "max_new_tokens": 16}) + "\n" + json.dumps({"prompt": "b"}) + "\n")
    for flags, expected in ((["--max-new-tokens", "7"], [16, 7]), ([], [16, 512])):
        calls = capture_generate(monkeypatch)
        code, _, err = run(["generate", "--input-file", str(requests), "--output-format", "json"] + flags, capsys)
        assert code == 0, err
        assert [n for c in calls for n in c["max_new_tokens"]] == expected  # one batched call
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "without 'max_new_tokens' takes --max-new-tokens, itself 512 when not given" in help_text
    assert "also the default of --input-file lines without 'max_new_tokens'" in help_text


@pytest.mark.parametrize("flags,needle", [
    (["--prompt", "two pictures", "--image", "{png}", "--image", "{png}"],
     "--image gives 2 images but at most 1 per prompt"),
    (["--prompt", "x", "--speculative", "dspark", "--num-speculative-tokens", "9"],
     "--num-speculative-tokens 9: the drafter proposes at most 7 tokens a step"),
    (["--prompt", "short", "--prompt", "word " * 300, "--max-model-len", "256"],
     "--prompt 2 has 301 tokens but the maximum sequence length is 256"),
    (["--chat", "--prompt", "word " * 300, "--max-model-len", "256"], "--prompt 1 has "),
])
def test_checks_that_need_no_model_come_before_loading(monkeypatch, tmp_path, capsys, flags, needle):
    """Image counts and the draft length (read from the drafter's config.json) are refused before the model loads."""
    _refuse_loading(monkeypatch)
    png = tmp_path / "a.png"
    png.write_bytes(b"not read before the model loads")
    code, _, err = run(["generate", *[f.format(png=png) for f in flags]], capsys)
    assert code == 2 and err.count("\n") == 1 and needle in err, err


def test_input_file_lines_name_their_max_new_tokens_and_image_limit(monkeypatch, tmp_path, capsys):
    calls = capture_generate(monkeypatch)
    (tmp_path / "a.png").write_bytes(b"x")
    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps({"prompt": "a"}) + "\n"
                        + json.dumps({"prompt": "b", "images": ["a.png", "a.png"]}) + "\n")
    code, out, err = run(["generate", "--input-file", str(requests), "--output-format", "json"], capsys)
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 1 and len(calls) == 1
    assert {"line": 2, "error": rows[0]["error"]} == rows[0]
    assert "'images' gives 2 images but at most 1 per prompt" in err
    assert rows[1]["line"] == 1 and rows[1]["max_new_tokens"] == 512


def _with_tokenizer(ckpt, folder, write):
    """`ckpt`'s weights and config under `folder`, with the tokenizer files `write(folder)` makes."""
    folder.mkdir()
    for f in ckpt.iterdir():
        if f.suffix in (".safetensors", ".json") and not f.name.startswith("tokenizer") \
                and f.name != "generation_config.json":
            (folder / f.name).symlink_to(f)
    write(folder)
    return folder


def _foreign_tokenizer(folder):
    """A byte-level BPE tokenizer with none of MiniMax's special tokens (another model's tokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["hello world, the weather in Lisbon is fine"] * 20, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.save(str(folder / "tokenizer.json"))


def test_a_tokenizer_without_the_chat_tokens_is_named(tiny_bf16, tmp_path, capsys):
    """Another model's tokenizer: chat prompts are refused naming the missing markers (BPE would split them into
    pieces silently); raw prompts run, with a note that no token ends a reply."""
    import minimax_ref as mr
    from minimax_ref.errors import CheckpointError

    folder = _with_tokenizer(tiny_bf16, tmp_path / "foreign", _foreign_tokenizer)
    tok = mr.load_tokenizer(folder)
    assert tok.eos_token_ids == () and tok.special_ids.turn_end is None
    messages = [{"role": "user", "content": "hi"}]
    assert "]~!b[" in tok.apply_chat_template(messages, tokenize=False)
    with pytest.raises(CheckpointError, match=r"foreign: the tokenizer has no token for .*'\]~!b\['.*not MiniMax's"):
        tok.apply_chat_template(messages)
    base = ["generate", "--ckpt-path", str(folder), "--prompt", "hello", "--max-new-tokens", "3", "--temperature", "0"]
    code, out, err = run(base, capsys)
    assert code == 0 and "no end-of-text token" in err and "runs to --max-new-tokens" in err
    code, out, err = run([*base, "--stop", "zz"], capsys)  # the user gave the reply an end: no note
    assert code == 0 and "no end-of-text token" not in err
    code, out, err = run([*base, "--chat"], capsys)
    assert code != 0 and "the tokenizer has no token for" in err and "Traceback" not in err


def test_a_tokenizer_larger_than_the_model_is_refused_where_it_reaches_past(tiny_bf16, tmp_path):
    """A tokenizer whose ids run past the model's vocab_size (1,024 here) is another model's: a prompt encoded with
    such ids is refused naming the tokenizer and both sizes, not an index error in the embedding."""
    import minimax_ref as mr
    from minimax_ref.errors import ConfigError
    from minimax_ref.weights.synth_tokenizer import write_test_tokenizer

    folder = _with_tokenizer(tiny_bf16, tmp_path / "big", lambda d: write_test_tokenizer(d, 1500))
    model, tok = load_model(folder, dtype=torch.float32), mr.load_tokenizer(folder)
    with pytest.raises(ConfigError, match=r"prompts\[0\]: the tokenizer \(.*big, 1500 ids\) encodes it with ids "
                                          r"past the model's vocab_size 1024"):
        mr.generate(model, tok, ["hi"], chat=True, max_new_tokens=2)


@pytest.mark.parametrize("flag, value, message", [
    ("--synthetic-experts", "3", "error: --synthetic-experts 3 is fewer than num_experts_per_tok=4 (of "
                                 "--synthetic-weights tiny)"),
    ("--synthetic-layers", "0", "error: --synthetic-layers 0 must be >= 1 (of --synthetic-weights tiny)"),
])
def test_a_bad_synthetic_shape_names_the_flag_given(capsys, flag, value, message):
    """The synthetic model's shape is refused naming --synthetic-experts / --synthetic-layers, the flags of this
    command, not `synth`'s --experts / --layers."""
    assert main(["generate", "--synthetic-weights", "tiny", flag, value, "--prompt", "Hi",
                 "--max-new-tokens", "1"]) == 2
    assert message in capsys.readouterr().err.splitlines()
