"""Per-request limits and rules of generation: seed and temperature ranges, JSONL line splitting, stop strings and
stop token ids (API, scheduler, streaming, CLI), image lines that fail alone, and the per-request timings."""

from __future__ import annotations

import json
import time

import pytest
import torch
from cli_fakes import capture_generate
from PIL import Image

import minimax_ref as mr
from minimax_ref.cli.main import main
from minimax_ref.errors import InputError
from minimax_ref.generation import decoding
from minimax_ref.generation.generate import StopText
from minimax_ref.generation.sampling import MAX_TEMPERATURE, MIN_TEMPERATURE, SamplingParams, filtered_probs
from minimax_ref.research.records import read_jsonl


@pytest.fixture(scope="module")
def model(tiny_nvfp4):
    return mr.load_model(tiny_nvfp4, dtype=torch.float32)


@pytest.fixture(scope="module")
def tok(tiny_nvfp4):
    return mr.load_tokenizer(tiny_nvfp4)


def run(args, capsys):
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------------------------------------ seeds


def test_seeds_outside_what_a_generator_takes_are_input_errors(model, tok):
    kw = dict(max_new_tokens=1, temperature=0.7)
    for seed in (2**64, -2**63 - 1):
        with pytest.raises(InputError, match=r"seed=.*\[-2\*\*63, 2\*\*64 - 1\]"):
            mr.generate(model, tok, "hi", seed=seed, **kw)
    with pytest.raises(InputError, match=r"seed\[1\]="):
        mr.generate(model, tok, ["a", "b"], seed=[0, 2**64], **kw)
    with pytest.raises(InputError, match=r"seed \+ 1 is past the largest seed"):
        mr.generate(model, tok, ["a", "b"], seed=2**64 - 1, **kw)
    with pytest.raises(InputError, match=r"seed=.*2\*\*64 - 1"):
        mr.generate_ids(model, [[1, 2]], seed=2**64, max_new_tokens=1)
    # the ends of the range run; a negative seed is taken modulo 2**64, as torch.Generator.manual_seed does
    top = mr.generate(model, tok, ["a"], seed=2**64 - 1, **kw)[0]
    assert top.token_ids == mr.generate(model, tok, ["a"], seed=-1, **kw)[0].token_ids
    mr.generate(model, tok, ["a"], seed=-2**63, **kw)


def test_input_file_line_with_a_bad_seed_fails_alone(tiny_nvfp4, tmp_path, capsys):
    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "a", "max_new_tokens": 2, "seed": 2**64}, {"prompt": "b", "max_new_tokens": 2, "seed": -2**63 - 1},
        {"prompt": "c", "max_new_tokens": 2, "seed": 2**64 - 1}]) + "\n")
    code, out, err = run(["generate", "--ckpt-path", str(tiny_nvfp4), "--input-file", str(requests),
                          "--output-format", "json"], capsys)
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 1 and "Traceback" not in err
    assert [r["line"] for r in rows[:2]] == [1, 2] and all("2**64 - 1" in r["error"] for r in rows[:2])
    assert rows[2]["line"] == 3 and len(rows[2]["token_ids"]) == 2
    assert rows[-1]["summary"]["failed"] == 2


def test_cli_seed_plus_prompt_index_is_checked_before_loading(monkeypatch, capsys):
    import minimax_ref.cli.generate as cli_generate

    monkeypatch.setattr(cli_generate, "load_from_args", lambda args: (_ for _ in ()).throw(AssertionError("loaded")))
    code, _, err = run(["generate", "--seed", str(2**64 - 1), "--prompt", "a", "--prompt", "b"], capsys)
    assert code == 2 and "seed + 1 is past the largest seed" in err
    code, _, err = run(["generate", "--seed", str(2**64), "--prompt", "a"], capsys)
    assert code == 2 and "2**64 - 1" in err


# ------------------------------------------------------------------------------------------------ temperature


def test_temperatures_outside_normal_float32_are_refused_everywhere(model, tok, tmp_path, capsys, monkeypatch):
    for t in (1e-39, 1e-300, 1e39):
        with pytest.raises(InputError, match="normal float32"):
            SamplingParams(temperature=t)
        with pytest.raises(InputError, match="normal float32"):
            mr.generate(model, tok, "hi", temperature=t, max_new_tokens=1)
    SamplingParams(temperature=MIN_TEMPERATURE)
    SamplingParams(temperature=MAX_TEMPERATURE)
    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps({"prompt": "a", "temperature": 1e-39}) + "\n" + json.dumps({"prompt": "b"}) + "\n")
    calls = capture_generate(monkeypatch)
    code, out, err = run(["generate", "--input-file", str(requests), "--output-format", "json"], capsys)
    assert code == 1 and [c["prompts"] for c in calls] == [["b"]]
    assert f"{requests}:1: temperature=1e-39: a positive temperature must be a normal float32" in err
    code, _, err = run(["generate", "--prompt", "x", "--temperature", "1e-39"], capsys)
    assert code == 2 and "normal float32" in err


def test_extreme_temperatures_sample_their_limits():
    """As the temperature goes to 0 the distribution goes to the argmax; to infinity, uniform over the top k."""
    logits = torch.tensor([[5.0, 3.0, 1.0, -2.0], [1e-7, 0.5e-7, 0.0, -1e-7]])
    tiny = filtered_probs(logits, SamplingParams(temperature=MIN_TEMPERATURE))
    assert torch.equal(tiny[0], torch.tensor([1.0, 0.0, 0.0, 0.0]))
    huge = filtered_probs(logits, SamplingParams(temperature=MAX_TEMPERATURE, top_k=2))
    torch.testing.assert_close(huge, torch.tensor([[0.5, 0.5, 0.0, 0.0]] * 2))


def test_the_smallest_temperature_generates_the_greedy_tokens(model, tok):
    """Logits of a few units over 1.2e-38 pass fp32's largest number: the unlikely tokens go to probability 0."""
    kw = dict(max_new_tokens=6, stop_ids=[], top_k=0, top_p=1.0)
    prompts = ["The weather", "Numbers"]
    greedy = mr.generate(model, tok, prompts, temperature=0, **kw)
    cold = mr.generate(model, tok, prompts, temperature=MIN_TEMPERATURE, **kw)
    assert [r.token_ids for r in cold] == [r.token_ids for r in greedy]


# ------------------------------------------------------------------------------------------------ JSONL lines


def _awkward_jsonl(records: list) -> bytes:
    """A BOM, CRLF line ends, and strings holding U+2028 / U+2029 / U+0085 unescaped (legal in JSON)."""
    return b"\xef\xbb\xbf" + b"\r\n".join(json.dumps(r, ensure_ascii=False).encode() for r in records) + b"\r\n"


def test_jsonl_lines_split_only_at_newlines(tmp_path):
    records = [{"prompt": "one\u2028two"}, {"prompt": "three\u2029\x85four"}, {"prompt": "five"}]
    path = tmp_path / "traces.jsonl"
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in records), encoding="utf-8")
    assert read_jsonl(path, lambda obj, n: (n, obj), flag="--traces", what="traces") == list(enumerate(records, 1))
    path.write_bytes(_awkward_jsonl(records))
    seen = read_jsonl(path, lambda obj, n: (n, obj), flag="--traces", what="traces")
    assert seen == [(1, records[0]), (2, records[1]), (3, records[2])]
    path.write_bytes(_awkward_jsonl(records[:2]) + b'{"prompt": \r\n')
    with pytest.raises(InputError, match=r"traces.jsonl:3: not valid JSON"):
        read_jsonl(path, lambda obj, n: obj, flag="--traces", what="traces")


def test_input_file_lines_split_only_at_newlines(tmp_path, capsys, monkeypatch):
    calls = capture_generate(monkeypatch)
    requests = tmp_path / "requests.jsonl"
    requests.write_bytes(_awkward_jsonl([{"prompt": "one\u2028two"}, {"prompt": "three\u2029\x85four"}])
                         + b'{"prompt": \r\n' + json.dumps({"prompt": "five"}).encode() + b"\n")
    code, out, err = run(["generate", "--input-file", str(requests), "--output-format", "json"], capsys)
    assert code == 1 and calls[0]["prompts"] == ["one\u2028two", "three\u2029\x85four", "five"]
    assert f"{requests}:3: not valid JSON" in err and json.loads(out.splitlines()[0])["line"] == 3
    assert sorted(json.loads(line)["line"] for line in out.splitlines()[1:-1]) == [1, 2, 4]


# ------------------------------------------------------------------------------------------------ stop strings


class _CharDecoder:
    """A stream decoder whose tokens are characters."""

    def push(self, token):
        return token

    def finish(self):
        return ""


def test_stop_text_holds_back_what_could_begin_a_stop_string():
    w = StopText(_CharDecoder(), ["</s>", "END"])
    assert [w.push(c) for c in "x</y"] == ["x", "", "", "</y"]
    assert [w.push(c) for c in "EN"] == ["", ""]
    assert [w.push(c) for c in "d<"] == ["ENd", ""]
    assert [w.push(c) for c in "/s>more"] == ["", "", "", "", "", "", ""]
    assert w.end == len("x</yENd") and w.text[:w.end] == "x</yENd" and w.finish() == ""
    w = StopText(_CharDecoder(), ["ab"])
    assert [w.push(c) for c in "xa"] == ["x", ""] and w.finish() == "a"  # a held tail is released at the end


def _unstopped(model, tok, prompt, n=24):
    return mr.generate(model, tok, [prompt], max_new_tokens=n, temperature=0, stop_ids=[])[0]


def _stop_string_of(text: str) -> tuple[str, int]:
    """A 3-character piece of `text` from past its first few characters, and where it first occurs."""
    for p in range(4, len(text) - 3):
        s = text[p:p + 3]
        if s.strip() and "\ufffd" not in s:
            return s, text.index(s)
    pytest.skip("the reply has no usable piece")


def test_stop_string_ends_the_reply_before_it(model, tok):
    full = _unstopped(model, tok, "The weather in Lisbon")
    stop, at = _stop_string_of(full.text)
    pieces = []
    res = mr.generate(model, tok, ["The weather in Lisbon"], max_new_tokens=24, temperature=0, stop_ids=[],
                      stop=stop, on_text=lambda row, text: pieces.append(text))[0]
    assert res.finish_reason == "stop" and res.text == full.text[:at] and "".join(pieces) == full.text[:at]
    # it stops at the token that completes the stop string: the tokens are the unstopped run's up to there
    n = len(res.token_ids)
    assert res.token_ids == full.token_ids[:n]
    assert stop in tok.decode_streamed(res.token_ids) and stop not in tok.decode_streamed(res.token_ids[:-1])
    # a list of stop strings: the first to appear wins
    res2 = mr.generate(model, tok, ["The weather in Lisbon"], max_new_tokens=24, temperature=0, stop_ids=[],
                       stop=["\x00never", stop])[0]
    assert res2.token_ids == res.token_ids and res2.text == res.text


def test_stop_token_ids_end_the_reply_and_are_not_text(model, tok):
    full = _unstopped(model, tok, "Numbers")
    j = 3
    t = full.token_ids[j]
    first = full.token_ids.index(t)
    res = mr.generate(model, tok, ["Numbers", "Numbers"], max_new_tokens=24, temperature=0, stop_ids=[],
                      stop_token_ids=[[t], None])
    assert res[0].finish_reason == "stop" and res[0].token_ids == full.token_ids[:first + 1]
    assert res[0].text == tok.decode_streamed(full.token_ids[:first])
    assert res[1].token_ids == full.token_ids  # the other prompt's setting is its own
    with pytest.raises(InputError, match=r"stop_token_ids\[0\] \[\d+\] are outside the vocabulary"):
        mr.generate(model, tok, ["a"], max_new_tokens=1, stop_token_ids=[[10**9]])


def test_a_request_ending_at_a_stop_string_frees_its_slot(model, tok):
    """Three sampled prompts over two slots: the first ends at its stop string, the third takes its slot while the
    second still runs; every prompt's tokens are those it gets alone."""
    prompts = ["The weather in Lisbon", "A second prompt", "Third"]
    kw = dict(max_new_tokens=16, temperature=0.9, top_k=0, top_p=1.0, stop_ids=[])
    free = mr.generate(model, tok, prompts[0], seed=5, **kw)[0]
    stop, _ = _stop_string_of(free.text)
    together = mr.generate(model, tok, prompts, seed=[5, 6, 7], stop=[[stop], None, None], max_batch_size=2, **kw)
    assert together[0].finish_reason == "stop" and len(together[0].token_ids) < 16
    assert together[2].request["admitted_seconds"] < together[1].request["seconds"]
    alone = [mr.generate(model, tok, p, seed=s, stop=st, **kw)[0]
             for p, s, st in zip(prompts, [5, 6, 7], [stop, None, None])]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert together[0].text == alone[0].text


@pytest.mark.parametrize("kw,needle", [
    ({"stop": ""}, "stop: a stop string must not be empty"),
    ({"stop": ["a", ""]}, r"stop\[1\]: a stop string must not be empty"),
    ({"stop": ["a", 3]}, r"stop\[1\]=3: a stop string must be a string"),
    ({"stop": 3}, "stop: expected a string or a list of strings"),
    ({"stop": [["a"], None, None]}, "needs one per prompt"),
    ({"stop_token_ids": ["x"]}, "'x' \\(str\\) is not an integer token id"),
])
def test_bad_stop_settings_are_input_errors(model, tok, kw, needle):
    with pytest.raises(InputError, match=needle):
        mr.generate(model, tok, ["a", "b"], max_new_tokens=1, **kw)


def test_cli_stop_flags_and_input_file_fields(tiny_nvfp4, model, tok, tmp_path, capsys):
    full = _unstopped(model, tok, "The weather in Lisbon", n=12)
    stop, at = _stop_string_of(full.text)
    base = ["generate", "--ckpt-path", str(tiny_nvfp4), "--temperature", "0", "--max-new-tokens", "12",
            "--dtype", "float32", "--stop-token-id", str(10**6)]
    # an id past the vocabulary is refused (the flag), and per line before the model loads (the field)
    code, _, err = run(base + ["--prompt", "The weather in Lisbon"], capsys)
    assert code == 2 and "outside the vocabulary" in err
    base = base[:-2]
    code, out, _ = run(base + ["--prompt", "The weather in Lisbon", "--stop", "\x01never", "--stop", stop,
                               "--output-format", "json"], capsys)
    row = json.loads(out)
    assert code == 0 and row["text"] == full.text[:at] and row["finish_reason"] == "stop"
    code, out, _ = run(base + ["--prompt", "The weather in Lisbon", "--stop", stop], capsys)
    assert code == 0 and out.rstrip("\n") == full.text[:at]  # streamed: no piece of the stop string shown
    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "The weather in Lisbon", "stop": stop}, {"prompt": "x", "stop": 5}, {"prompt": "x", "stop": ""},
        {"prompt": "x", "stop_token_ids": ["a"]}, {"prompt": "x", "stop_token_ids": [10**6]},
        {"prompt": "The weather in Lisbon", "stop_token_ids": [full.token_ids[2]]}]) + "\n")
    code, out, err = run(base + ["--input-file", str(requests), "--output-format", "json"], capsys)
    rows = {r["line"]: r for r in map(json.loads, out.splitlines()[:-1])}
    assert code == 1
    assert rows[1]["text"] == full.text[:at] and rows[1]["finish_reason"] == "stop"
    assert "'stop': expected a string or a list of strings" in rows[2]["error"]
    assert "'stop': a stop string must not be empty" in rows[3]["error"]
    assert "'stop_token_ids': 'a' (str) is not an integer token id" in rows[4]["error"]
    assert "outside the vocabulary" in rows[5]["error"]
    first = full.token_ids.index(full.token_ids[2])
    assert rows[6]["token_ids"] == full.token_ids[:first + 1] and rows[6]["finish_reason"] == "stop"


# ------------------------------------------------------------------------------------------------ image lines


def test_an_unreadable_image_line_fails_alone_and_the_rest_batch_together(ckpt_factory, tmp_path, capsys,
                                                                           monkeypatch):
    vl = ckpt_factory("tiny-vl", "bf16")
    gen = torch.Generator().manual_seed(1)
    pixels = torch.randint(0, 256, (56, 84, 3), generator=gen, dtype=torch.uint8)
    Image.frombytes("RGB", (84, 56), bytes(pixels.flatten().tolist())).save(tmp_path / "good.png")
    (tmp_path / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n not an image")
    runs = []
    run_scheduler = decoding.Scheduler.run
    monkeypatch.setattr(decoding.Scheduler, "run", lambda self: runs.append(len(self.seqs)) or run_scheduler(self))
    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join(json.dumps({"prompt": "describe", "images": [name], "max_new_tokens": 2})
                                  for name in ("good.png", "bad.png", "good.png")) + "\n")
    code, out, err = run(["generate", "--ckpt-path", str(vl), "--input-file", str(requests), "--output-format",
                          "json", "--temperature", "0", "--dtype", "float32"], capsys)
    rows = {r["line"]: r for r in map(json.loads, out.splitlines()[:-1])}
    assert code == 1 and "bad.png" in rows[2]["error"] and f"{requests}:2:" in err
    assert len(rows[1]["token_ids"]) == 2 and rows[1]["token_ids"] == rows[3]["token_ids"]
    assert runs == [2]  # lines 1 and 3 in one batch, nothing rerun one at a time


# ------------------------------------------------------------------------------------------------ timings, help


def test_time_to_first_token_counts_from_admission(model, tok, monkeypatch):
    """With one slot the second prompt waits for the first (slowed to 0.1 s a decode step): its admission is after
    the first's end, and its time to first token (one prefill, no decode step), counted from there, holds none of
    that wait."""
    decode = decoding.Scheduler.decode
    monkeypatch.setattr(decoding.Scheduler, "decode", lambda self: time.sleep(0.1) or decode(self))
    first, second = mr.generate(model, tok, ["A prompt", "Another"], max_new_tokens=8, temperature=0, stop_ids=[],
                                max_batch_size=1)
    assert second.request["admitted_seconds"] >= first.request["seconds"] >= 7 * 0.1
    assert second.request["time_to_first_token_seconds"] < 0.35
    assert second.request["admitted_seconds"] + second.request["time_to_first_token_seconds"] <= \
        second.request["seconds"]


def test_help_says_results_come_as_requests_complete(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert text.count("in input order") == text.count("not in input order") == 1
    assert "as each request completes" in text
    assert "counts from its admission into the batch" in text
    assert "--stop TEXT" in text and "--stop-token-id N" in text


def test_stop_strings_under_speculative_decoding(spec_ckpt):
    """A drafter's step emits several tokens at once: a stop string completed by any of them ends the reply there,
    with the plain loop's tokens and text (greedy), and the tokens of the block after it dropped."""
    from minimax_ref.generation.drafter import load_drafter

    target = mr.load_model(spec_ckpt, dtype=torch.float32)
    tokenizer = mr.load_tokenizer(spec_ckpt)
    drafter = load_drafter(spec_ckpt / "dspark", target)
    full = _unstopped(target, tokenizer, "The weather in Lisbon")
    stop, at = _stop_string_of(full.text)
    kw = dict(max_new_tokens=24, temperature=0, stop_ids=[], stop=stop)
    plain = mr.generate(target, tokenizer, ["The weather in Lisbon", "Numbers"], **kw)
    drafted = mr.generate(target, tokenizer, ["The weather in Lisbon", "Numbers"], draft=drafter, **kw)
    assert [r.token_ids for r in drafted] == [r.token_ids for r in plain]
    assert drafted[0].text == full.text[:at] and drafted[0].finish_reason == "stop"
