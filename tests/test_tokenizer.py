"""Tokenizer loading, the test-tokenizer writer and streaming detokenisation."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from minimax_ref.errors import CheckpointError, InputError
from minimax_ref.generation.tokenizer import (
    SPECIAL_TOKEN_TEXTS,
    SpecialTokens,
    StreamDecoder,
    load_tokenizer,
)
from minimax_ref.weights.synth_tokenizer import MIN_TEST_VOCAB, write_test_tokenizer

# Written out here (not imported) so that a change to the token texts fails the tests.
EXPECTED_TEXTS = {
    "bod": "]~!b[",
    "turn_start": "]~b]",
    "turn_end": "[e~[",
    "image": "]<]image[>[",
    "video": "]<]video[>[",
    "image_start": "]<]start of image[>[",
    "image_end": "]<]end of image[>[",
    "think_start": "<mm:think>",
    "think_end": "</mm:think>",
    "namespace": "]<]minimax[>[",
    "dspark_noise": "]<]dspark_noise[>[",
}

MIXED = (
    "Hello, world! Yaoundé → Genève, Zürich; naïve café 😀 ∑x² 日本語 \t tabs\n"
    "def f(x):\n    return x + 1  # RD-57931-D6 <tool_call>&amp;\"quotes\"\n"
    "]~!b[]~b]user\nhi[e~[\n<mm:think>hm</mm:think>]<]minimax[>[<city>Lisbon]<]minimax[>[</city>"
    "]<]image[>[]<]start of image[>[]<]end of image[>[]<]video[>[]<]dspark_noise[>["
)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tok1024")
    write_test_tokenizer(d, 1024)
    return d


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tokenizer(tok_dir)


def test_special_token_table_matches_spec():
    assert SPECIAL_TOKEN_TEXTS == EXPECTED_TEXTS
    assert set(SpecialTokens().as_dict()) == set(EXPECTED_TEXTS)


@pytest.mark.parametrize("vocab_size", [MIN_TEST_VOCAB, 512, 1000, 4096])
def test_exact_vocab_size_and_special_tokens_on_top(tmp_path, vocab_size):
    ids = write_test_tokenizer(tmp_path, vocab_size)
    tok = load_tokenizer(tmp_path)
    assert tok.vocab_size == vocab_size
    raw = json.loads((tmp_path / "tokenizer.json").read_text())
    assert len(raw["model"]["vocab"]) + len(raw["added_tokens"]) == vocab_size
    n = len(EXPECTED_TEXTS)
    assert sorted(ids.values()) == list(range(vocab_size - n, vocab_size))
    assert tok.special_ids.as_dict() == ids
    for name, text in EXPECTED_TEXTS.items():
        tid = ids[name]
        assert tok.encode(text, add_special_tokens=False) == [tid], name
        assert tok.decode([tid]) == text
        assert tok.id_to_token(tid) == text
    # <tool_call> is ordinary text, not a special token.
    assert len(tok.encode("<tool_call>")) > 1
    assert tok.token_to_id("<tool_call>") is None


def test_large_vocab_is_padded_to_exact_size(tmp_path):
    ids = write_test_tokenizer(tmp_path, 12000)
    tok = load_tokenizer(tmp_path)
    assert tok.vocab_size == 12000
    assert ids["namespace"] == 11999
    assert tok.decode(tok.encode(MIXED)) == MIXED


def test_too_small_vocab_raises(tmp_path):
    with pytest.raises(ValueError, match="at least"):
        write_test_tokenizer(tmp_path, MIN_TEST_VOCAB - 1)
    with pytest.raises(ValueError):
        write_test_tokenizer(tmp_path, 100)


def test_round_trip_mixed_text(tok):
    ids = tok.encode(MIXED)
    assert tok.decode(ids) == MIXED
    s = tok.special_ids
    for tid in (s.bod, s.turn_start, s.turn_end, s.think_start, s.think_end, s.namespace, s.image):
        assert tid in ids
    # The post-processor of the test tokenizer adds no BOS.
    assert tok.encode("Genève") == tok.encode("Genève", add_special_tokens=False)
    stripped = tok.decode(ids, skip_special_tokens=True)
    assert "]~b]" not in stripped and "Yaoundé" in stripped and "<tool_call>" in stripped


def test_merges_were_learned(tok):
    # A trained BPE encodes common English in far fewer tokens than bytes.
    text = "The tokenizer of a language model turns text into integers"
    assert len(tok.encode(text)) < len(text.encode()) / 2


def test_writer_is_deterministic_and_fast(tmp_path):
    t0 = time.perf_counter()
    a = write_test_tokenizer(tmp_path / "a", 4096)
    elapsed = time.perf_counter() - t0
    b = write_test_tokenizer(tmp_path / "b", 4096)
    assert a == b
    names = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert elapsed < 2.0
    write_test_tokenizer(tmp_path / "c", 4096, seed=1)
    other_seed = (tmp_path / "c" / "tokenizer.json").read_bytes()
    assert other_seed != (tmp_path / "a" / "tokenizer.json").read_bytes()


def test_ids_are_read_from_files(tmp_path):
    small = write_test_tokenizer(tmp_path / "s", 600)
    big = write_test_tokenizer(tmp_path / "b", 900)
    assert all(big[k] - small[k] == 300 for k in small)
    assert load_tokenizer(tmp_path / "s").special_ids.as_dict() == small
    assert load_tokenizer(tmp_path / "b").special_ids.as_dict() == big
    assert load_tokenizer(tmp_path / "s").eos_token_ids == (small["turn_end"],)
    assert load_tokenizer(tmp_path / "b").eos_token_ids == (big["turn_end"],)


def test_tokenizer_config_contents(tok_dir):
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert cfg["bos_token"] == "]~!b[" and cfg["eos_token"] == "[e~["
    assert "chat_template" not in cfg
    decoded = {int(k): v["content"] for k, v in cfg["added_tokens_decoder"].items()}
    assert sorted(decoded.values()) == sorted(EXPECTED_TEXTS.values())
    assert all(v["special"] for v in cfg["added_tokens_decoder"].values())
    assert (tok_dir / "chat_template.jinja").is_file()


def test_missing_tokens_are_none(tmp_path, tok_dir):
    # A tokenizer without the last special token (in neither file): its id is None, not guessed.
    shutil.copytree(tok_dir, tmp_path / "t")
    last = list(SPECIAL_TOKEN_TEXTS.values())[-1]
    raw = json.loads((tmp_path / "t" / "tokenizer.json").read_text())
    raw["added_tokens"] = [t for t in raw["added_tokens"] if t["content"] != last]
    (tmp_path / "t" / "tokenizer.json").write_text(json.dumps(raw))
    cfg = json.loads((tmp_path / "t" / "tokenizer_config.json").read_text())
    cfg["added_tokens_decoder"] = {k: v for k, v in cfg["added_tokens_decoder"].items() if v["content"] != last}
    (tmp_path / "t" / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_tokenizer(tmp_path / "t")
    assert tok.special_ids.namespace is None and tok.vocab_size == 1023
    assert tok.special_ids.think_end == 1022


def test_eos_from_generation_config(tmp_path, tok_dir):
    shutil.copytree(tok_dir, tmp_path / "t")
    end = load_tokenizer(tok_dir).special_ids.turn_end
    (tmp_path / "t" / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, end]}))
    assert load_tokenizer(tmp_path / "t").eos_token_ids == (7, end)
    (tmp_path / "t" / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert load_tokenizer(tmp_path / "t").eos_token_ids == (5, end)
    (tmp_path / "t" / "generation_config.json").write_text(json.dumps({"eos_token_id": 10**9}))
    with pytest.raises(CheckpointError, match="generation_config.json"):
        load_tokenizer(tmp_path / "t")


def test_dspark_noise_id_from_drafter_config(tmp_path, tok_dir):
    shutil.copytree(tok_dir, tmp_path / "t")
    (tmp_path / "t" / "dspark").mkdir()
    (tmp_path / "t" / "dspark" / "config.json").write_text(
        json.dumps({"text_config": {"dspark_noise_token_id": 77}}))
    assert load_tokenizer(tmp_path / "t").special_ids.dspark_noise == 77
    (tmp_path / "t" / "dspark" / "config.json").write_text(json.dumps({"dspark_noise_token_id": 5000}))
    with pytest.raises(CheckpointError, match="dspark_noise_token_id"):
        load_tokenizer(tmp_path / "t")


def test_chat_template_sources(tmp_path, tok_dir):
    assert load_tokenizer(tok_dir).chat_template == (tok_dir / "chat_template.jinja").read_text()
    shutil.copytree(tok_dir, tmp_path / "t")
    (tmp_path / "t" / "chat_template.jinja").unlink()
    assert load_tokenizer(tmp_path / "t").chat_template is None
    cfg = json.loads((tmp_path / "t" / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ messages[0].content }}"
    (tmp_path / "t" / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_tokenizer(tmp_path / "t")
    assert tok.chat_template == "{{ messages[0].content }}"
    assert tok.apply_chat_template([{"role": "user", "content": "héllo"}], tokenize=False) == "héllo"
    cfg["chat_template"] = "{% if %}"
    (tmp_path / "t" / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="tokenizer_config.json: chat_template"):
        load_tokenizer(tmp_path / "t").apply_chat_template([{"role": "user", "content": "x"}])
    cfg["chat_template"] = "{{ strftime_now('%Y') }}|{{ messages[0].content }}"  # transformers' other global
    (tmp_path / "t" / "tokenizer_config.json").write_text(json.dumps(cfg))
    year = load_tokenizer(tmp_path / "t").apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    assert year.endswith("|x") and year[:4].isdigit() and int(year[:4]) >= 2000
    cfg["chat_template"] = "{{ raise_exception('no tools here') }}"
    (tmp_path / "t" / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match="no tools here"):
        load_tokenizer(tmp_path / "t").apply_chat_template([{"role": "user", "content": "x"}])


def test_named_templates_take_tool_use_with_tools(tmp_path, tok_dir):
    """tokenizer_config.json's list of named templates (transformers' form): "default" without tools, "tool_use"
    with them (the tools were silently dropped when "default" rendered every conversation)."""
    shutil.copytree(tok_dir, tmp_path / "t")
    (tmp_path / "t" / "chat_template.jinja").unlink()
    cfg = json.loads((tmp_path / "t" / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "default", "template": "plain:{{ messages[0].content }}"},
                            {"name": "tool_use", "template": "tools:{{ tools | length }}:{{ messages[0].content }}"}]
    (tmp_path / "t" / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_tokenizer(tmp_path / "t")
    hi = [{"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}
    assert tok.apply_chat_template(hi, tokenize=False) == "plain:hi"
    assert tok.apply_chat_template(hi, tools=[tool], tokenize=False) == "tools:1:hi"


def test_added_tokens_only_in_tokenizer_config_are_added(tmp_path, tok_dir):
    """Special tokens that only tokenizer_config.json's added_tokens_decoder lists (not tokenizer.json) are added at
    their ids, as transformers does: the same ids as the tokenizer that holds them; an entry that does not continue
    the ids, or names a token tokenizer.json has at another id, is refused naming both files."""
    shutil.copytree(tok_dir, tmp_path / "t")
    raw = json.loads((tmp_path / "t" / "tokenizer.json").read_text())
    raw["added_tokens"] = []
    (tmp_path / "t" / "tokenizer.json").write_text(json.dumps(raw))
    whole, split = load_tokenizer(tok_dir), load_tokenizer(tmp_path / "t")
    assert split.vocab_size == whole.vocab_size and split.special_ids == whole.special_ids
    messages = [{"role": "user", "content": "The weather in Lisbon?"}]
    assert split.apply_chat_template(messages) == whole.apply_chat_template(messages)
    cfg_path = tmp_path / "t" / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    first = min(cfg["added_tokens_decoder"], key=int)
    cfg["added_tokens_decoder"][str(int(first) + 100)] = cfg["added_tokens_decoder"].pop(first)
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"tokenizer_config.json: added_tokens_decoder\[\d+\] .* is not in "
                                              r"tokenizer.json, whose next free id is \d+"):
        load_tokenizer(tmp_path / "t")
    cfg["added_tokens_decoder"] = {"5": {"content": "!" * 3 if whole.token_to_id("!!!") else "a", "special": False}}
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="added_tokens_decoder gives .* id 5, tokenizer.json has it at"):
        load_tokenizer(tmp_path / "t")


def test_bad_folders(tmp_path, tok_dir):
    with pytest.raises(CheckpointError, match="not found"):
        load_tokenizer(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        load_tokenizer(tmp_path / "empty")
    shutil.copytree(tok_dir, tmp_path / "t")
    (tmp_path / "t" / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        load_tokenizer(tmp_path / "t")
    shutil.copytree(tok_dir, tmp_path / "u")
    (tmp_path / "u" / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(CheckpointError, match="tokenizer_config.json"):
        load_tokenizer(tmp_path / "u")
    # A file path selects its folder.
    assert load_tokenizer(tok_dir / "tokenizer.json").vocab_size == 1024


def test_decode_rejects_bad_ids(tok):
    with pytest.raises(InputError, match="outside the vocabulary"):
        tok.decode([1, 1024])
    with pytest.raises(InputError, match="outside the vocabulary"):
        tok.decode([-1])
    with pytest.raises(InputError):
        tok.encode(b"bytes")


def test_stream_decoder_emits_only_complete_utf8(tok):
    text = "Emoji 😀😃 and accents: Yaoundé, Genève; 日本語テキスト " * 3 + "[e~[ end"
    ids = tok.encode(text)
    dec = StreamDecoder(tok)
    pieces = [dec.push(i) for i in ids]
    pieces.append(dec.finish())
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces[:-1]  # some token ended inside a character and was held back
    # Several ids at once, and the tokenizer's own factory.
    dec2 = tok.stream_decoder()
    assert dec2.push(ids[:5]) + dec2.push(ids[5:]) + dec2.finish() == text


def test_stream_decoder_flushes_incomplete_tail(tok):
    ids = tok.encode("a😀")
    dec = StreamDecoder(tok)
    out = dec.push(ids[:-1])
    assert "\ufffd" not in out
    assert out + dec.finish() == tok.decode(ids[:-1])


def test_sentencepiece_fallback(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(["hello world", "the quick brown fox", "Yaoundé and Genève",
                                 "numbers 1 2 3 4 5"] * 50))
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=60, model_type="bpe",
        user_defined_symbols=["]~b]", "[e~["], minloglevel=2)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    shutil.copy(tmp_path / "sp.model", folder / "tokenizer.model")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "[e~[",
        "added_tokens_decoder": {"60": {"content": "]~!b[", "special": True}}}))
    tok = load_tokenizer(folder)
    assert tok.vocab_size == 61
    s = tok.special_ids
    assert s.bod == 60 and s.turn_start is not None and s.turn_end is not None and s.namespace is None
    assert tok.eos_token_ids == (s.turn_end,)
    ids = tok.encode("]~!b[]~b]hello world[e~[")
    assert ids[:2] == [s.bod, s.turn_start] and ids[-1] == s.turn_end
    assert tok.decode(ids) == "]~!b[]~b]hello world[e~["
    assert tok.decode(ids, skip_special_tokens=True) == "hello world"
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "legacy": False}))
    with pytest.warns(UserWarning, match="legacy=false is not reproduced"):
        load_tokenizer(folder)


def _byte_fallback_tokenizer(folder: Path) -> None:
    """A Llama-style tokenizer: a few pieces, every other character as UTF-8 byte tokens <0xNN>, decoded by
    ByteFallback (a run of byte tokens with an invalid byte becomes one U+FFFD per byte, all of it)."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    for piece in ("▁", "a", "b", "ab", "▁ab"):
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, [("a", "b"), ("▁", "ab")], byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))


def test_byte_fallback_streams_and_final_text_keep_complete_characters(tmp_path):
    """A reply cut inside a character (max_new_tokens): the tokenizer's own decode turns the whole byte run into
    U+FFFD, the character completed before it included; the stream keeps that character, and the result text
    (`decode_streamed`) is what was streamed."""
    _byte_fallback_tokenizer(tmp_path / "t")
    tok = load_tokenizer(tmp_path / "t")
    ids = tok.encode("ab 龍龘", add_special_tokens=False)
    assert len(ids) == 2 + 6  # "▁ab", "▁" and the two characters' six bytes
    cut = ids[:-1]
    assert tok.decode(cut) == "ab " + "\ufffd" * 5  # the decoder's rewrite of the run
    stream = tok.stream_decoder()
    streamed = "".join(stream.push(t) for t in cut) + stream.finish()
    assert streamed == "ab 龍" + "\ufffd" * 2  # the cut character's two bytes, as the decoder marks them
    assert tok.decode_streamed(cut) == streamed
    assert tok.decode_streamed(ids) == tok.decode(ids) == "ab 龍龘"  # a whole reply decodes as the tokenizer does
