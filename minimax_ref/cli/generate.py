"""`minimax-ref generate`: its flags, the run (prompts, an --input-file of JSONL requests, an --interactive chat),
and the printers of streamed and finished replies."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from ..errors import InputError, MiniMaxRefError
from .arg_types import finite_float, nonneg_int, positive_int
from .model_args import add_intervention_flags, add_model_flags, load_from_args

DIM, RESET = "\x1b[2m", "\x1b[0m"


def build_generate_parser(p: argparse.ArgumentParser) -> None:
    from ..generation.chat import DEFAULT_MAX_NEW_TOKENS
    from ..generation.chat import RECOMMENDED_SAMPLING as rec

    add_model_flags(p)
    add_intervention_flags(p)
    p.add_argument("--prompt", action="append", default=None,
                   help="prompt text (repeat for a batch); with --chat, one user message")
    p.add_argument("--input-file", type=Path, default=None,
                   help="JSONL batch: one request per line with 'prompt' or 'messages', optional 'tools', "
                        "'images' (file paths relative to the JSONL file), 'stop', 'stop_token_ids' and sampling "
                        "overrides (a line without 'max_new_tokens' takes --max-new-tokens, itself 512 when not "
                        "given); one JSON result per line on stdout as each request completes (not in input order: "
                        "each names its 'line' and 'id'), then a summary line. A result's time_to_first_token_seconds "
                        "counts from its admission into the batch (its prefill start) to its first token; "
                        "admitted_seconds (its wait in the queue) and seconds (its end) count from the start of its "
                        "batched call")
    p.add_argument("--interactive", action="store_true", help="multi-turn chat session (/reset, /exit)")
    p.add_argument("--max-batch-size", type=positive_int, default=None,
                   help="requests decoded together by continuous batching: when one finishes, the next waiting one "
                        "takes its place (default: as many as the memory left after loading holds at their length, "
                        "up to 64 on a GPU and 16 on a CPU; the run's stats name it)")
    p.add_argument("--prefill-chunk", type=positive_int, default=None,
                   help="prompt tokens per prefill forward, like vLLM's --max-num-batched-tokens (default: the "
                        "largest power of two whose activations take at most a quarter of the memory left, up to "
                        "16384 on a GPU and 2048 on a CPU)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help=f"most tokens per reply, >= 1 (default: {DEFAULT_MAX_NEW_TOKENS}, room for the reasoning "
                        "of a thinking turn before its answer); also the default of --input-file lines without "
                        "'max_new_tokens'")
    p.add_argument("--temperature", type=finite_float, default=rec["temperature"],
                   help=f"0 = greedy; otherwise a normal float32, about 1.2e-38 to 3.4e38 (logits are divided by it "
                        f"in fp32) (default: {rec['temperature']}, MiniMax's recommendation)")
    p.add_argument("--top-p", type=finite_float, default=rec["top_p"], help=f"in (0, 1] (default: {rec['top_p']})")
    p.add_argument("--top-k", type=int, default=rec["top_k"], help=f"0 = off (default: {rec['top_k']})")
    p.add_argument("--seed", type=int, default=0,
                   help="sampling seed, in [-2**63, 2**64 - 1]; prompt i uses seed + i (default: 0)")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop string (repeatable): a reply ends once its text holds one, and its text ends before it "
                        "(finish=stop; streamed text holds back what could begin one); --input-file lines may give "
                        "their own 'stop'")
    p.add_argument("--stop-token-id", type=nonneg_int, action="append", default=None, metavar="N",
                   help="extra stop token id (repeatable), besides the checkpoint's end-of-text ids; --input-file "
                        "lines may give their own 'stop_token_ids'")
    p.add_argument("--chat", action="store_true", help="render prompts with the chat template")
    p.add_argument("--thinking", choices=["adaptive", "enabled", "disabled"], default="adaptive",
                   help="thinking mode of the chat template (default: adaptive)")
    p.add_argument("--system", default=None, help="system message (chat mode)")
    p.add_argument("--tools", type=Path, default=None, help="JSON file: a list of tool (function) schemas")
    p.add_argument("--hide-reasoning", action="store_true", help="do not print the reasoning (text output)")
    p.add_argument("--output-format", choices=["text", "json"], default="text",
                   help="text (streamed) or json (one object per prompt per line)")
    p.add_argument("--speculative", choices=["none", "dspark"], default="none",
                   help="speculative decoding: dspark = the checkpoint's dspark/ drafter (default: none)")
    p.add_argument("--num-speculative-tokens", type=int, default=None, metavar="N",
                   help="with --speculative: drafts verified per step, 1..block size (default: the drafter's "
                        "block size)")
    p.add_argument("--drafter-capture", choices=["pre-norm", "post-norm"], default="pre-norm",
                   help="with --speculative: feed the target's last layer to the drafter before (pre-norm, "
                        "default) or after (post-norm) the target's final norm")
    p.add_argument("--image", type=Path, action="append", default=None, metavar="FILE",
                   help="image file (repeat for several, up to --limit-images); placed before the prompt "
                        "text (with --chat, at the start of the user turn) unless the prompt holds one "
                        "]<]image[>[ marker per image. Applies to every --prompt, and to --input-file "
                        "records without 'images'")
    p.add_argument("--limit-images", type=nonneg_int, default=None, metavar="N",
                   help="most images one prompt may carry (default: 1, the release deployment's limit)")


def _read_tools(path: Path | None):
    if path is None:
        return None
    from ..generation.chat import normalize_tools
    from ..research.records import read_json

    tools = read_json(path, flag="--tools")
    if isinstance(tools, dict):
        tools = [tools]
    normalize_tools(tools)
    return tools


def _check_number(value, name: str, *, integer: bool = False):
    """`value` of sampling field `name` if it is a JSON number (an integer when `integer`), else an InputError
    naming the field: a quoted or null value must not reach the sampler's comparisons as a raw TypeError."""
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        kind = "an integer" if integer else "a number"
        raise InputError(f"{name}={value!r}: must be {kind}")
    if not integer and not math.isfinite(value):
        raise InputError(f"{name}={value!r}: must be a finite number")
    return value


def _stop_kwargs(args: argparse.Namespace, o: dict) -> dict:
    """generate's `stop` (a list of strings) and `stop_token_ids` (a list of ids >= 0): a request's own 'stop' /
    'stop_token_ids', else --stop / --stop-token-id; checked here (InputError naming the field)."""
    from ..generation.decoding import stop_id_set
    from ..generation.generate import stop_strings

    if "stop" in o:
        stop = list(stop_strings(o["stop"], "'stop'"))
    else:
        stop = [s for flag in args.stop or [] for s in stop_strings(flag, "--stop")]
    ids = stop_id_set(o.get("stop_token_ids", args.stop_token_id), "'stop_token_ids'")
    return {"stop": stop, "stop_token_ids": sorted(ids)}


def _sampling_kwargs(args: argparse.Namespace, override: dict | None = None) -> dict:
    """generate's sampling and stop arguments: the flags, overridden by a request's own fields; every value is
    checked (types and ranges) here, before any model work."""
    from ..generation.chat import DEFAULT_MAX_NEW_TOKENS

    o = override or {}
    default_new = DEFAULT_MAX_NEW_TOKENS if args.max_new_tokens is None else args.max_new_tokens
    kw = {"max_new_tokens": o.get("max_new_tokens", default_new),
          "temperature": o.get("temperature", args.temperature), "top_p": o.get("top_p", args.top_p),
          "top_k": o.get("top_k", args.top_k), "seed": o.get("seed", args.seed)}
    from ..generation.decoding import check_seed
    from ..generation.generate import SamplingParams

    for name in ("temperature", "top_p"):
        _check_number(kw[name], name)
    for name in ("max_new_tokens", "top_k", "seed"):
        _check_number(kw[name], name, integer=True)
    check_seed(kw["seed"])  # a torch.Generator takes [-2**63, 2**64 - 1]: refused here, not mid-run
    SamplingParams(kw["temperature"], kw["top_p"], kw["top_k"])  # validate before loading anything
    kw.update(_stop_kwargs(args, o))
    if kw["max_new_tokens"] < 1:
        what = (f"max_new_tokens={kw['max_new_tokens']!r}" if "max_new_tokens" in o
                else f"--max-new-tokens {kw['max_new_tokens']}")
        raise InputError(f"{what}: must be >= 1 (generate makes at least one token); to score a prompt without "
                         "generating, use `minimax-ref score`")
    return kw


def _check_prompt_encoding(prompts: list[str]) -> None:
    """Refuse a --prompt holding bytes that are not UTF-8: on POSIX, argv bytes that do not decode arrive as
    lone surrogates (U+DC80..U+DCFF, one per byte), which the tokenizer cannot take."""
    for i, text in enumerate(prompts, start=1):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            offset = len(text[:e.start].encode("utf-8"))
            c = ord(text[e.start])
            what = (f"byte 0x{c - 0xDC00:02x}" if 0xDC80 <= c <= 0xDCFF
                    else f"lone surrogate U+{c:04X}")
            raise InputError(f"--prompt {i}: not UTF-8 text ({what} at offset {offset}): the terminal or "
                             "script passed it in another encoding (e.g. Latin-1); convert it to UTF-8 "
                             "(iconv -t UTF-8) or use a UTF-8 locale") from None


def _check_images_allowed(args: argparse.Namespace, n: int, what: str) -> None:
    """Refuse more images than a prompt may carry (--limit-images, else the runtime's default) before loading."""
    from ..model.config import RuntimeConfig

    limit = RuntimeConfig().max_images_per_prompt if args.limit_images is None else args.limit_images
    if n > limit:
        raise InputError(f"{what} gives {n} images but at most {limit} per prompt are allowed (raise the limit with "
                         "--limit-images)")


def _length_checker(args: argparse.Namespace):
    """(the checkpoint's tokenizer, --max-model-len) for the length checks before the model loads, or None where they
    cannot run there (synthetic weights; a checkpoint whose tokenizer does not load is the loader's to report, with
    its other problems)."""
    if getattr(args, "synthetic_weights", None) is not None:
        return None
    from ..generation.tokenizer import load_tokenizer
    from ..model.config import RuntimeConfig, load_model_config
    from ..weights.embedded import default_checkpoint

    path = args.ckpt_path or default_checkpoint()
    try:
        limit = RuntimeConfig(max_seq_len=args.max_model_len).resolved(
            load_model_config(path).text.max_position_embeddings, "--max-model-len").max_seq_len
        return load_tokenizer(path), limit
    except MiniMaxRefError:
        return None


def _check_request_lengths(args: argparse.Namespace, requests: list) -> list:
    """--input-file records whose prompt leaves no room under --max-model-len become their line's error, before the
    model loads (records with images are checked when they run: their token counts come from the pictures)."""
    checker = _length_checker(args)
    if checker is None:
        return requests
    from ..generation.generate import encode_prompt

    tok, limit = checker
    out = []
    for n, req_id, kw in requests:
        outside = [] if isinstance(kw, str) else [t for t in kw["stop_token_ids"] if not 0 <= t < tok.vocab_size]
        if outside:  # an id the tokenizer cannot produce would never stop the reply
            kw = f"'stop_token_ids' {outside[:5]} are outside the vocabulary [0, {tok.vocab_size})"
        if not isinstance(kw, str) and not kw["images"]:
            try:
                length = len(encode_prompt(tok, kw["prompts"][0], chat=kw["chat"], tools=kw["tools"],
                                           thinking=kw["thinking"], system=kw["system"], where="the prompt"))
            except MiniMaxRefError as e:
                kw = str(e)
            else:
                if length >= limit:
                    kw = (f"the prompt has {length} tokens but the maximum sequence length is {limit} (raise "
                          "--max-model-len, or shorten the prompt)")
        out.append((n, req_id, kw))
    return out


def _check_prompt_lengths(args: argparse.Namespace, tools) -> None:
    """Refuse a --prompt whose tokens leave no room under --max-model-len, before the model loads: the prompts are
    encoded with the checkpoint's tokenizer as `generate` will encode them (prompts with images, whose token counts
    come from their pictures, and synthetic weights are checked when they run)."""
    if args.prompt is None or args.image:
        return
    from ..generation.generate import encode_prompt

    checker = _length_checker(args)
    if checker is None:
        return
    tok, limit = checker
    for i, prompt in enumerate(args.prompt, start=1):
        n = len(encode_prompt(tok, prompt, chat=args.chat, tools=tools, thinking=args.thinking, system=args.system,
                              where=f"--prompt {i}"))
        if n >= limit:
            raise InputError(f"--prompt {i} has {n} tokens but the maximum sequence length is {limit} (raise "
                             "--max-model-len, or shorten the prompt)")


def _check_draft_length(args: argparse.Namespace) -> None:
    """Refuse --num-speculative-tokens past the drafter's block size, read from its dspark/config.json, before the
    model loads (a checkpoint without one is refused when the drafter loads)."""
    synthetic = args.ckpt_path is None and getattr(args, "synthetic_weights", None) is not None
    if args.speculative == "none" or args.num_speculative_tokens is None or synthetic:
        return
    from ..generation.drafter import SUBFOLDER
    from ..weights.embedded import default_checkpoint

    config = Path(args.ckpt_path or default_checkpoint()) / SUBFOLDER / "config.json"
    try:
        raw = json.loads(config.read_text())
    except (OSError, ValueError):
        return
    block = (raw.get("text_config") or raw).get("dspark_block_size") if isinstance(raw, dict) else None
    if isinstance(block, int) and args.num_speculative_tokens > block:
        raise InputError(f"--num-speculative-tokens {args.num_speculative_tokens}: the drafter proposes at most "
                         f"{block} tokens a step (dspark_block_size in {config})")


def _print_result(args: argparse.Namespace, result, streamed: bool, max_new_tokens: int | None = None) -> None:
    if args.output_format == "json":
        print(json.dumps(result.as_dict(), ensure_ascii=False), flush=True)
        _note_cut(args, result, max_new_tokens)
        return
    if not streamed:
        if result.reasoning and not args.hide_reasoning:
            print(f"{DIM}{result.reasoning}{RESET}" if sys.stdout.isatty() else result.reasoning)
        print(result.content)
    for call in result.tool_calls:
        print(json.dumps({"tool_call": call}, ensure_ascii=False))
    s = result.stats
    # the first decode step is the warm-up, timed apart: with no other step there is no decode rate to show
    decode = f"{s['decode_tokens_per_s']:.1f} tok/s" if s["decode_tokens"] else "- (no step after the warm-up)"
    print(f"[{len(result.token_ids)} tokens, finish={result.finish_reason}, prefill {s['prefill_tokens_per_s']:.1f} "
          f"tok/s, first token {s['time_to_first_token_seconds']:.2f} s, decode {decode}]", file=sys.stderr)
    _note_cut(args, result, max_new_tokens)


def _note_cut(args: argparse.Namespace, result, max_new_tokens: int | None) -> None:
    """Say on stderr when a reply stopped at --max-model-len before --max-new-tokens (the cache was full)."""
    n_prompt, n_new = len(result.prompt_token_ids), len(result.token_ids)
    if max_new_tokens is not None and result.finish_reason == "length" and n_new < max_new_tokens:
        print(f"note: stopped after {n_new} of --max-new-tokens {max_new_tokens} tokens: the prompt ({n_prompt} "
              f"tokens) plus the reply reached --max-model-len {args.max_model_len}; raise --max-model-len for "
              "longer replies", file=sys.stderr)


def _stream_printer(args: argparse.Namespace, tools, reasoning_started: bool):
    """on_text callback that prints content (and dimmed reasoning) as it becomes certain."""
    from ..generation.chat import StreamingParser

    parser = StreamingParser(tools, reasoning_started=reasoning_started)
    tty = sys.stdout.isatty()
    shown = {"reasoning": False}

    def emit(events) -> None:
        for ev in events:
            if ev["type"] == "reasoning" and not args.hide_reasoning:
                sys.stdout.write(f"{DIM}{ev['text']}{RESET}" if tty else ev["text"])
                shown["reasoning"] = True
            elif ev["type"] == "content":
                if shown["reasoning"]:  # the answer starts on its own line, as in the non-streamed output
                    sys.stdout.write("\n")
                    shown["reasoning"] = False
                sys.stdout.write(ev["text"])
        sys.stdout.flush()

    def on_text(row: int, text: str) -> None:
        emit(parser.feed(text))

    def close() -> None:
        emit(parser.finish())
        sys.stdout.write("\n")

    return on_text, close


def _draft_kwargs(args: argparse.Namespace, model) -> dict:
    """`generate`'s arguments that come with the loaded model: the interventions of --expert-mask / --drop-experts
    and the speculative ones; the drafter is loaded once per command."""
    from ..research.intervened import cli_interventions

    if args.speculative == "none":
        return {"interventions": cli_interventions(args, model)}
    if getattr(args, "_drafter", None) is None:
        from ..generation.drafter import SUBFOLDER, load_drafter

        args._drafter = load_drafter(Path(model.ckpt_path) / SUBFOLDER, model,
                                     capture_final_norm=args.drafter_capture == "post-norm")
    return {"draft": args._drafter, "num_speculative_tokens": args.num_speculative_tokens,
            "interventions": cli_interventions(args, model)}


def run_generate(args: argparse.Namespace) -> int:
    from ..generation.generate import generate, read_stop_ids
    from ..research.intervened import cli_interventions

    if args.speculative == "none" and (args.num_speculative_tokens is not None or args.drafter_capture != "pre-norm"):
        raise InputError("--num-speculative-tokens and --drafter-capture need --speculative dspark")
    if args.num_speculative_tokens is not None and args.num_speculative_tokens < 1:
        raise InputError(f"--num-speculative-tokens {args.num_speculative_tokens}: must be >= 1")
    tools = _read_tools(args.tools)
    kw = _sampling_kwargs(args)
    modes = sum(x is not None and x is not False
                for x in (args.prompt, args.input_file, args.interactive or None))
    if modes != 1:
        raise InputError("give exactly one of --prompt, --input-file or --interactive")
    if args.interactive and args.output_format == "json":
        raise InputError("--output-format json applies to --prompt and --input-file; --interactive prints text")
    if args.prompt is not None and any(p == "" for p in args.prompt):
        raise InputError("--prompt is empty: give some text")
    if args.prompt is not None:
        _check_prompt_encoding(args.prompt)
        from ..generation.decoding import prompt_seeds

        prompt_seeds(args.seed, len(args.prompt))  # prompt i samples with --seed + i: in range too
    requests = _read_requests(args, tools) if args.input_file is not None else None
    if requests == []:  # an empty input file: nothing to load the model for
        return 0
    if requests is not None:
        requests = _check_request_lengths(args, requests)
    if args.prompt is not None and not args.chat:
        chat_only = [flag for flag, used in (("--tools", args.tools is not None), ("--system", args.system is not None),
                                             ("--thinking", args.thinking != "adaptive")) if used]
        if chat_only:
            verb = "applies" if len(chat_only) == 1 else "apply"
            raise InputError(f"{', '.join(chat_only)} {verb} only to chat prompts: add --chat")
    for path in args.image or []:
        if not path.is_file():  # fail before loading the model; contents are checked when decoded
            raise InputError(f"--image {path}: " + ("a directory, not an image file" if path.is_dir()
                                                    else "no such file"))
    _check_images_allowed(args, len(args.image or []), "--image")
    _check_draft_length(args)
    _check_prompt_lengths(args, tools)
    cli_interventions(args)  # a bad --expert-mask / --drop-experts is refused before the model loads
    model, tok, _ = load_from_args(args)
    args.max_model_len = model.max_seq_len  # the default resolved against the model's limit, for the notes
    # with --stop / --stop-token-id the user has given the reply its end
    if not (read_stop_ids(getattr(model, "ckpt_path", None), tok.eos_token_ids) or args.stop or args.stop_token_id):
        print(f"note: {tok.path}: no end-of-text token (generation_config.json eos_token_id, tokenizer_config.json "
              "eos_token, or the chat format's turn end): every reply runs to --max-new-tokens unless --stop or "
              "--stop-token-id ends it", file=sys.stderr)
    if args.limit_images is not None:
        import dataclasses

        model.runtime = dataclasses.replace(model.runtime, max_images_per_prompt=args.limit_images)
    chat_kw = {"chat": args.chat, "tools": tools, "thinking": args.thinking, "system": args.system}

    if args.interactive:
        return _interactive(args, model, tok, tools, kw)
    if requests is not None:
        return _batch_file(args, model, tok, requests)

    stream = args.output_format == "text" and len(args.prompt) == 1
    on_text = close = None
    if stream:
        started = args.chat and args.thinking == "enabled"
        on_text, close = _stream_printer(args, tools, started)
    images = [args.image] * len(args.prompt) if args.image else None
    from ..progress import GenerationProgress

    progress = None if stream else GenerationProgress(len(args.prompt), len(args.prompt) * kw["max_new_tokens"])
    results = generate(model, tok, args.prompt, on_text=on_text, images=images, **chat_kw, **kw,
                       max_batch_size=args.max_batch_size, prefill_chunk=args.prefill_chunk,
                       on_token=progress and (lambda row, tok: progress.token()),
                       on_result=progress and (lambda row, res: progress.request_done(
                           kw["max_new_tokens"] - len(res.token_ids))),
                       **_draft_kwargs(args, model))
    if close:
        close()
    if progress:
        progress.close()
    for i, r in enumerate(results):
        if not stream and args.output_format == "text" and len(results) > 1:
            # several replies: each under a header naming its prompt, so they do not run together
            print(("\n" if i else "") + f"=== prompt {i + 1} of {len(results)} ===")
        _print_result(args, r, streamed=stream, max_new_tokens=kw["max_new_tokens"])
    return 0


REQUEST_KEYS = ("prompt", "messages", "tools", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "thinking",
                "system", "id", "images", "stop", "stop_token_ids")
THINKING_MODES = ("adaptive", "enabled", "disabled")


def _check_request(args: argparse.Namespace, req: object, tools) -> dict:
    """`generate`'s keyword arguments for one --input-file record, every field checked (InputError otherwise)."""
    if not isinstance(req, dict) or ("prompt" in req) == ("messages" in req):
        raise InputError("each line must be an object with exactly one of 'prompt' or 'messages'")
    unknown = sorted(set(req) - set(REQUEST_KEYS))
    if unknown:
        raise InputError(f"unknown keys {unknown} (known: {list(REQUEST_KEYS)})")
    chat = args.chat or "messages" in req
    chat_only = [key for key in ("tools", "thinking", "system") if key in req]
    if chat_only and not chat:  # as --tools / --thinking / --system without --chat: not silently dropped
        raise InputError(f"{', '.join(repr(k) for k in chat_only)} apply only to chat requests: give 'messages' "
                         "instead of 'prompt', or run with --chat")
    prompt = req.get("messages", req.get("prompt"))
    if "messages" in req:
        if not isinstance(prompt, list) or not prompt or not all(isinstance(m, dict) for m in prompt):
            raise InputError("'messages' must be a non-empty list of message objects")
    elif not isinstance(prompt, str) or not prompt:
        raise InputError(f"'prompt' must be a non-empty string, got {prompt!r}")
    req_tools = tools
    if "tools" in req:
        from ..generation.chat import record_tools

        req_tools = record_tools(req["tools"])
    thinking = req.get("thinking", args.thinking)
    if thinking not in THINKING_MODES:
        raise InputError(f"'thinking'={thinking!r}: choose one of {list(THINKING_MODES)}")
    system = req.get("system", args.system)
    if system is not None and not isinstance(system, str):
        raise InputError(f"'system' must be a string, got {system!r}")
    # Image paths in a record are relative to the input file (--image ones to the working folder).
    base = args.input_file.parent
    images = args.image
    if "images" in req:
        if not isinstance(req["images"], list) or not all(isinstance(x, str) for x in req["images"]):
            raise InputError("'images' must be a list of image file paths")
        images = [base / x for x in req["images"]]
        missing = [str(x) for x in images if not x.is_file()]
        if missing:
            raise InputError(f"'images': no such file {missing[0]}")
        _check_images_allowed(args, len(images), "'images'")
    if isinstance(prompt, list):
        from ..generation.multimodal import rebase_image_paths

        prompt = rebase_image_paths(prompt, base)
    return {"prompts": [prompt], "chat": chat, "tools": req_tools, "thinking": thinking, "system": system,
            "images": [images] if images else None, **_sampling_kwargs(args, req)}


def _read_requests(args: argparse.Namespace, tools) -> list[tuple[int, object, dict | str]]:
    """Every record of --input-file as (line number, id or None, generate's kwargs or the line's error message),
    all checked before anything is loaded; blank lines are skipped. An unreadable file is one InputError."""
    from ..research.records import jsonl_lines

    path = args.input_file
    if path.is_dir():
        raise InputError(f"--input-file {path}: is a directory, not a JSONL file")
    try:
        data = path.read_bytes()  # any readable file: a pipe or /dev/null as well as a regular file
    except FileNotFoundError:
        raise InputError(f"--input-file {path}: no such file") from None
    except OSError as e:
        raise InputError(f"--input-file {path}: cannot read ({e.strerror})") from None
    skip = 3 if data.startswith(b"\xef\xbb\xbf") else 0  # a UTF-8 byte order mark (Windows editors write one)
    try:
        lines = jsonl_lines(data[skip:].decode("utf-8"))  # at "\n" only: JSON strings may hold U+2028 unescaped
    except UnicodeDecodeError as e:
        raise InputError(f"--input-file {path}: not UTF-8 text ({e.reason} at byte {e.start + skip})") from None
    requests: list[tuple[int, object, dict | str]] = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        req = None
        try:
            try:
                req = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"not valid JSON ({e.msg} at column {e.colno})") from None
            requests.append((n, req.get("id") if isinstance(req, dict) else None, _check_request(args, req, tools)))
        except MiniMaxRefError as e:
            requests.append((n, req.get("id") if isinstance(req, dict) else None, str(e)))
    if not requests:
        print(f"note: --input-file {path} holds no requests (it is empty or blank); nothing to do", file=sys.stderr)
    return requests


CALL_KEYS = ("chat",)  # what one `generate` call shares among its prompts
# what each prompt of a call has of its own
ROW_KEYS = ("tools", "thinking", "system", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop",
            "stop_token_ids")


def _batch_file(args, model, tok, requests) -> int:
    """Run the checked --input-file records. Records that share the call-wide settings (`CALL_KEYS`) decode
    together, by continuous batching (up to --max-batch-size at once), each with its own sampling settings and
    seed (`ROW_KEYS`), so a record's tokens are those it gets alone. Each result is written as its record
    completes (not in input order), naming its line (and id), then one summary line. A record with images has them
    loaded and its length checked before the calls are formed (`_load_line_images`), so a bad picture fails its own
    line and the rest still batch together. Bad lines, and the records of a batched call that fails before they
    complete (each run again alone), are reported with their line number; the rest still run. Exit status 1 when
    any line failed."""
    from ..generation.generate import generate
    from ..progress import GenerationProgress

    failed: list[int] = []
    written: set[int] = set()
    calls_stats: list[dict] = []  # each generate call's figures, for the summary
    good = [(n, req_id, kw) for n, req_id, kw in requests if not isinstance(kw, str)]
    ids = {n: req_id for n, req_id, _ in requests}
    progress = GenerationProgress(len(good), sum(kw["max_new_tokens"] for _, _, kw in good))
    start, generated = time.perf_counter(), 0

    def fail(n: int, message: str) -> None:
        failed.append(n)
        print(f"error: {args.input_file}:{n}: {message}", file=sys.stderr)
        if args.output_format == "json":
            row = {"line": n, **({"id": ids[n]} if ids.get(n) is not None else {}), "error": message}
            print(json.dumps(row, ensure_ascii=False), flush=True)

    def write(n: int, req_id, res, max_new_tokens: int) -> None:
        nonlocal generated
        written.add(n)
        generated += len(res.token_ids)
        progress.request_done(max_new_tokens - len(res.token_ids))
        if args.output_format == "json":
            out = {"line": n, **({"id": req_id} if req_id is not None else {}), "max_new_tokens": max_new_tokens,
                   **res.as_dict()}
            # a row is written as its request completes: its stats are its own figures; the calls' (prefill and
            # decode rates, a drafter's acceptance) come in the summary line
            out["stats"] = out.pop("request")
            print(json.dumps(out, ensure_ascii=False), flush=True)
        else:
            print(f"=== line {n}" + (f" (id {req_id})" if req_id is not None else "") + " ===")
            if res.reasoning and not args.hide_reasoning:
                print(res.reasoning)
            print(res.content)
            for call in res.tool_calls:
                print(json.dumps({"tool_call": call}, ensure_ascii=False))
            r = res.request
            print(f"[{len(res.token_ids)} of at most {max_new_tokens} tokens, finish={res.finish_reason}, first token "
                  f"{r['time_to_first_token_seconds'] or 0:.2f} s after its admission, done at "
                  f"{r['seconds'] or 0:.2f} s into its call]", flush=True)
        _note_cut(args, res, max_new_tokens)

    def run(items: list) -> None:
        call = items[0][2]
        images = [kw["images"][0] if kw["images"] else None for _, _, kw in items]
        rows = {key: [kw[key] for _, _, kw in items] for key in ROW_KEYS}

        def on_result(row: int, res) -> None:
            n, req_id, kw = items[row]
            write(n, req_id, res, kw["max_new_tokens"])

        began = time.perf_counter() - start
        results = generate(model, tok, [kw["prompts"][0] for _, _, kw in items], **{k: call[k] for k in CALL_KEYS},
                           **rows, images=images if any(images) else None, max_batch_size=args.max_batch_size,
                           prefill_chunk=args.prefill_chunk, on_result=on_result,
                           on_token=lambda row, tok: progress.token(), **_draft_kwargs(args, model))
        calls_stats.append({"lines": [n for n, _, _ in items], "started_seconds": round(began, 6),
                            **results[0].stats})

    for n, _, kw in requests:
        if isinstance(kw, str):
            fail(n, kw)
    loaded = []
    for n, req_id, kw in good:
        try:
            loaded.append((n, req_id, _load_line_images(model, tok, kw)))
        except MiniMaxRefError as e:
            fail(n, str(e))
            progress.request_done(kw["max_new_tokens"])
    good = loaded
    calls: dict[str, list] = {}
    for item in good:
        key = json.dumps([item[2][k] for k in CALL_KEYS], sort_keys=True, default=str)
        calls.setdefault(key, []).append(item)
    for items in calls.values():
        try:
            run(items)
        except MiniMaxRefError as e:
            left = [item for item in items if item[0] not in written]
            if len(left) == 1 or len(items) == 1:
                for item in left:
                    fail(item[0], str(e))
                continue
            for item in left:  # find the lines at fault: each of the others runs alone
                try:
                    run([item])
                except MiniMaxRefError as e1:
                    fail(item[0], str(e1))
    progress.close()
    seconds = time.perf_counter() - start
    summary = {"requests": len(requests), "failed": len(failed), "generated_tokens": generated,
               "seconds": round(seconds, 3), "output_tokens_per_s": round(generated / seconds, 3) if seconds else 0.0,
               "calls": calls_stats}
    if args.output_format == "json":
        print(json.dumps({"summary": summary}), flush=True)
    else:
        print(f"[{summary['requests']} requests, {len(failed)} failed, {generated} tokens in {seconds:.1f} s: "
              f"{summary['output_tokens_per_s']:.1f} tok/s]", file=sys.stderr)
    return 1 if failed else 0


def _load_line_images(model, tok, kw: dict) -> dict:
    """An --input-file record's images loaded and preprocessed, and its prompt's length with them checked, before
    its call is formed: a picture that does not decode, or a prompt too long with its image tokens, is the line's
    own error (InputError) instead of failing the batch it would join. Returns the record with its 'images' given as
    the preprocessed (pixel_values, image_grid_thw), so they are not read twice; a record without images as is."""
    prompt = kw["prompts"][0]
    if not kw["images"] and not (kw["chat"] and isinstance(prompt, list)):
        return kw
    from ..generation.generate import encode_prompt
    from ..generation.multimodal import load_prompt_images
    from ..model.vision import tokens_per_image

    pixels = load_prompt_images(model, kw["images"][0] if kw["images"] else None, prompt, chat=kw["chat"],
                                where="the prompt")
    if pixels is None:
        return kw
    counts = tokens_per_image(pixels[1], model.config.vision.spatial_merge_size)
    length = len(encode_prompt(tok, prompt, chat=kw["chat"], tools=kw["tools"], thinking=kw["thinking"],
                               system=kw["system"], image_tokens=counts, where="the prompt"))
    if length >= model.max_seq_len:
        raise InputError(f"the prompt has {length} tokens with its images but the maximum sequence length is "
                         f"{model.max_seq_len} (raise --max-model-len, or shorten the prompt)")
    # images given beside the prompt travel preprocessed; those inside its messages stay there
    return {**kw, "images": [pixels]} if kw["images"] else kw


def _interactive(args, model, tok, tools, kw) -> int:
    from ..generation.generate import generate

    history: list[dict] = []
    print("minimax-ref interactive chat. /reset clears the history, /exit quits.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        cmd = line.strip()
        if cmd in ("/exit", "/quit"):
            return 0
        if cmd == "/reset":
            history.clear()
            print("(history cleared)", file=sys.stderr)
            continue
        if not cmd:
            continue
        content: str | list = line
        if args.image and not any(m["role"] == "user" for m in history):
            # --image files belong to the first user turn and stay in the history with it
            content = [{"type": "image", "path": str(p)} for p in args.image] + [{"type": "text", "text": line}]
        history.append({"role": "user", "content": content})
        on_text, close = _stream_printer(args, tools, args.thinking == "enabled")
        try:
            res = generate(model, tok, [history], chat=True, tools=tools, thinking=args.thinking,
                           system=args.system, on_text=on_text, **kw, **_draft_kwargs(args, model))[0]
        except MiniMaxRefError as e:
            history.pop()
            print(f"error: {e}", file=sys.stderr)
            continue
        except KeyboardInterrupt:  # Ctrl-C during a reply ends the reply; at the prompt it ends the session
            history.pop()
            print("\n(reply interrupted; the turn is dropped from the history)", file=sys.stderr)
            continue
        close()
        for call in res.tool_calls:
            print(json.dumps({"tool_call": call}, ensure_ascii=False))
        turn = {"role": "assistant", "content": res.content}
        if res.reasoning:  # the release's format keeps every earlier turn's reasoning in the prompt
            turn["reasoning_content"] = res.reasoning
        if res.tool_calls:
            turn["tool_calls"] = res.tool_calls
        history.append(turn)
