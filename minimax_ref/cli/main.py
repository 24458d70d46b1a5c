"""The `minimax-ref` command line: generate, synth, inspect (and the research commands).

Every user error (bad flag values, bad checkpoint, bad input file) ends with one line
`error: ...` on stderr and exit status 2; tracebacks are for bugs only.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from ..errors import InputError, MiniMaxRefError

DIM, RESET = "\x1b[2m", "\x1b[0m"


def _nonneg_int(text: str) -> int:
    v = int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"{v} must be >= 0")
    return v


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """Flags shared by every command that loads a model."""
    p.add_argument("--ckpt-path", type=Path, default=None,
                   help="checkpoint folder (default: the embedded nano checkpoint shipped with the package)")
    p.add_argument("--device", default="cpu",
                   help="torch device (default: cpu; under examples/generate.py: cuda:LOCAL_RANK when CUDA is "
                        "available, else cpu)")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                   help="compute dtype: bfloat16, float32 (the golden mode), or auto (default: bfloat16 on a GPU, "
                        "float32 on a CPU)")
    p.add_argument("--act-quant", choices=["none", "emulate"], default="none",
                   help="fake-quantize NVFP4/MXFP8 linear inputs as W4A4/W8A8 kernels do (default: none)")
    p.add_argument("--weights", choices=["dequant", "packed"], default="dequant",
                   help="dequant: decode quantized weights once at load (default); packed: keep NVFP4/MXFP8 "
                        "weights packed in memory and decode them at use (same outputs, packed-size memory)")
    p.add_argument("--fast", choices=["auto", "off", "on", "compile", "fused", "compiled"], default="auto",
                   help="fast paths (minimax_ref/fast/): auto = compiled with a CUDA --device, off on a CPU; on = "
                        "batched experts without host sync, static-shape cached attention, SDPA attention core, "
                        "two-pass packed decoding; compile = the same with torch.compile'd packed decoding; fused = "
                        "on, plus decode steps multiply packed weights with a compiled dequantize-and-multiply (with "
                        "--weights packed); compiled = fused, and each decoder layer of a decode step runs "
                        "torch.compile'd (compiled on first use, minutes on a GPU) and, on CUDA with triton, batches "
                        "of more than 8 sequences multiply packed weights with a grouped Triton kernel; every mode "
                        "but off replays decode steps from CUDA graphs on a GPU (default: auto)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                   help="KV and index-key cache storage: auto (compute dtype) or fp8 (e4m3, scale 1.0)")
    p.add_argument("--max-model-len", type=int, default=4096,
                   help="longest sequence (prompt + generated tokens) the KV cache holds (default: 4096)")
    p.add_argument("--expert-parallel", action="store_true",
                   help="tensor parallel (torchrun examples/generate.py): each rank holds whole routed experts "
                        "(E/TP per rank) instead of a slice of every expert")
    p.add_argument("--synthetic-weights", default=None, metavar="PRESET",
                   help="instead of --ckpt-path: random weights of a synth preset (tiny, tiny-vl, release, "
                        "pruned-80) generated directly on --device, in the release's formats; under torchrun each "
                        "rank generates only its slices (default weights for them: --weights as given)")
    p.add_argument("--synthetic-format", choices=["nvfp4", "mxfp8", "bf16"], default="nvfp4",
                   help="with --synthetic-weights: checkpoint format (default: nvfp4 = NVFP4 experts + MXFP8)")
    p.add_argument("--synthetic-layers", type=int, default=None, metavar="N",
                   help="with --synthetic-weights: number of layers (default: the preset's)")
    p.add_argument("--synthetic-experts", type=int, default=None, metavar="N",
                   help="with --synthetic-weights: routed experts per MoE layer (default: the preset's)")
    p.add_argument("--offload", choices=["none", "cpu", "disk"], default="none",
                   help="when the model does not fit --gpu-memory: keep the weights that do not fit packed in host "
                        "memory (cpu) or in --offload-folder (disk) and stream them to --device layer by layer, only "
                        "the chosen experts' rows of routed experts (needs --weights packed and the accelerate "
                        "package: pip install 'minimax-ref[offload]'; same outputs) (default: none)")
    p.add_argument("--gpu-memory", type=float, default=None, metavar="GIB",
                   help="with --offload: GiB of --device memory the model may take (resident weights, staging "
                        "buffers, activations and KV cache); `minimax-ref plan --offload cpu` shows the device map")
    p.add_argument("--offload-folder", type=Path, default=None, metavar="DIR",
                   help="with --offload disk: where the streamed weights are written (default: a new folder under "
                        "the cache folder, removed at exit)")


def load_from_args(args: argparse.Namespace, world=None):
    """(model, tokenizer, checkpoint path) for the model flags.

    world: the tensor-parallel `parallel.World` to load over (default: `args.world`, which
    examples/generate.py sets under torchrun; else one process).
    """

    from ..generation.tokenizer import load_tokenizer
    from ..weights.embedded import default_checkpoint
    from ..weights.loader import load_model, load_synthetic, resolve_device, resolve_dtype

    check_device_flag(args.device)
    dtype = resolve_dtype(args.dtype, resolve_device(args.device))
    world = world if world is not None else getattr(args, "world", None)
    fast = fast_mode(getattr(args, "fast", "auto"), args.device)
    if getattr(args, "offload", "none") != "none" and getattr(args, "fast", "auto") == "auto":
        # offloaded steps read the router's choice on the host: no compiled layers or CUDA graphs (offload.py);
        # the reference keeps activation memory predictable within --gpu-memory (--fast on / fused: eager twins)
        fast = False
    if fast in COMPILE_NOTICES:
        print(f"[fast] --fast {fast}: {COMPILE_NOTICES[fast]}", file=sys.stderr)
    common = dict(device=args.device, dtype=dtype, act_quant=args.act_quant, weights=args.weights,
                  max_seq_len=args.max_model_len, kv_cache_dtype=args.kv_cache_dtype, tp=world,
                  expert_parallel=getattr(args, "expert_parallel", False), fast=fast,
                  offload=getattr(args, "offload", "none"), gpu_memory=getattr(args, "gpu_memory", None),
                  offload_folder=getattr(args, "offload_folder", None))
    preset = getattr(args, "synthetic_weights", None)
    if preset is None:
        if getattr(args, "synthetic_layers", None) is not None or getattr(args, "synthetic_experts", None) is not None:
            raise InputError("--synthetic-layers and --synthetic-experts need --synthetic-weights")
        path = args.ckpt_path or default_checkpoint()
        model = load_model(path, **common)
        report_load(model)
        return model, load_tokenizer(path), path
    from ..weights.synth import PRESETS

    if args.ckpt_path is not None:
        raise InputError("give --ckpt-path or --synthetic-weights, not both")
    if preset not in PRESETS:
        raise InputError(f"--synthetic-weights {preset!r}: choose one of {sorted(PRESETS)}")
    model = load_synthetic(preset, format=args.synthetic_format, layers=args.synthetic_layers,
                           experts=args.synthetic_experts, **common)
    report_load(model)
    # the tokenizer covers every id the model can emit: random weights sample from the whole vocabulary
    return model, load_tokenizer(synthetic_tokenizer_dir(model.config.text.vocab_size)), None


# The commands that pass --offload to the models they load (`load_from_args`, `score.load_for_args`).
OFFLOAD_COMMANDS = ("generate", "golden", "score", "prune")


def check_offload_command(args: argparse.Namespace) -> None:
    """Refuse --offload / --gpu-memory / --offload-folder on a command that would load its model without them."""
    if not hasattr(args, "offload_folder"):  # not a model-loading command (plan has an --offload of its own)
        return
    asked = args.offload != "none" or args.offload_folder is not None or args.gpu_memory is not None
    if asked and args.command not in OFFLOAD_COMMANDS:
        raise InputError(f"--offload is not available for `minimax-ref {args.command}` yet (it loads its models "
                         f"itself); commands that offload: {', '.join(OFFLOAD_COMMANDS)}")


def fast_mode(flag: str, device: str) -> bool | str:
    """`load_model`'s `fast` for `--fast flag`: "auto" is the compiled fast paths on a CUDA device (what a GPU user
    wants by default) and the reference on a CPU (where the reference is the point, and compiling costs more than it
    saves)."""
    if flag == "auto":
        flag = "compiled" if device.startswith("cuda") else "off"
    return {"off": False, "on": True, "compile": "compile", "fused": "fused", "compiled": "compiled"}[flag]


# What each compiling --fast mode compiles, said before the silence it causes.
COMPILE_NOTICES = {
    "compile": "the packed-weight decoder is compiled by torch.compile on first use (a pause before the first "
               "tokens)",
    "fused": "the dequantize-and-multiply kernels are compiled by torch.compile on first use (a pause before the "
             "first decode step)",
    "compiled": "every decoder layer of a decode step is compiled by torch.compile on first use (minutes on a GPU "
                "at release size; the first decode step says when it starts and how long it took)",
}
DEVICE_TYPES = ("cpu", "cuda")  # the devices the kernels and formats (float8, packed bytes) are written for


def check_device_flag(device: str) -> None:
    """Refuse a `--device` this engine does not run on (mps, xpu, ...) before anything is loaded."""
    import torch

    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):
        raise InputError(f"--device {device!r} is not a torch device; use cpu or cuda (cuda:N)") from None
    if kind not in DEVICE_TYPES:
        raise InputError(f"--device {device}: minimax-ref runs on cpu or cuda only ({kind} lacks the float8 and "
                         "packed-weight operations it needs); use --device cpu")


def report_load(model) -> None:
    """One stderr line per rank (printed by rank 0): bytes read, weight memory, seconds. Shown under
    tensor parallelism and on a terminal; quiet for one process writing to a pipe."""
    stats = model.load_stats
    world = getattr(model, "world", None)
    if (world is None or world.size == 1) and not sys.stderr.isatty():
        return
    rows = world.gather_objects(stats) if world is not None else [stats]
    for r, st in enumerate(rows):
        mem = st.get("memory_bytes")
        print(f"[load] rank {r}/{len(rows)}: read {st['bytes_read'] / 2**20:,.1f} MiB"
              + (f", weights in memory {mem / 2**20:,.1f} MiB" if mem is not None else "")
              + f" in {st['seconds']:.2f} s", file=sys.stderr)


def synthetic_tokenizer_dir(vocab: int):
    """A folder with the synthetic test tokenizer of `vocab` ids (written once into the cache folder, like the
    embedded default checkpoint): the text side of `--synthetic-weights` runs, whose weights are noise."""
    import shutil
    import tempfile

    from ..generation.tokenizer import write_test_tokenizer
    from ..weights.embedded import cache_dir

    target = cache_dir() / f"synthetic-tokenizer-{vocab}"
    if (target / "tokenizer.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=target.parent))
    try:
        write_test_tokenizer(tmp, vocab)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race
            if not (target / "tokenizer.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


# ---------------------------------------------------------------------------------------------- generate


def build_generate_parser(p: argparse.ArgumentParser) -> None:
    from ..generation.chat import RECOMMENDED_SAMPLING as rec
    add_model_flags(p)
    p.add_argument("--prompt", action="append", default=None,
                   help="prompt text (repeat for a batch); with --chat, one user message")
    p.add_argument("--input-file", type=Path, default=None,
                   help="JSONL batch: one request per line with 'prompt' or 'messages', optional 'tools', "
                        "'images' (file paths relative to the JSONL file) and sampling overrides; one JSON "
                        "result per line on stdout, in input order")
    p.add_argument("--interactive", action="store_true", help="multi-turn chat session (/reset, /exit)")
    p.add_argument("--max-new-tokens", type=_nonneg_int, default=512,
                   help="default: 512 (room for the reasoning of a thinking turn before its answer)")
    p.add_argument("--temperature", type=float, default=rec["temperature"],
                   help=f"0 = greedy (default: {rec['temperature']}, MiniMax's recommendation)")
    p.add_argument("--top-p", type=float, default=rec["top_p"], help=f"in (0, 1] (default: {rec['top_p']})")
    p.add_argument("--top-k", type=int, default=rec["top_k"], help=f"0 = off (default: {rec['top_k']})")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
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
    p.add_argument("--limit-images", type=_nonneg_int, default=None, metavar="N",
                   help="most images one prompt may carry (default: 1, the release deployment's limit)")


def _read_tools(path: Path | None):
    if path is None:
        return None
    from ..generation.chat import normalize_tools

    try:
        tools = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise InputError(f"--tools {path}: cannot read ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"--tools {path}: not valid UTF-8 JSON ({e})") from None
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


def _sampling_kwargs(args: argparse.Namespace, override: dict | None = None) -> dict:
    """generate's sampling arguments: the flags, overridden by a request's own fields; every value is checked
    (types and ranges) here, before any model work."""
    o = override or {}
    kw = {"max_new_tokens": o.get("max_new_tokens", args.max_new_tokens),
          "temperature": o.get("temperature", args.temperature), "top_p": o.get("top_p", args.top_p),
          "top_k": o.get("top_k", args.top_k), "seed": o.get("seed", args.seed)}
    from ..generation.generate import SamplingParams

    for name in ("temperature", "top_p"):
        _check_number(kw[name], name)
    for name in ("max_new_tokens", "top_k", "seed"):
        _check_number(kw[name], name, integer=True)
    SamplingParams(kw["temperature"], kw["top_p"], kw["top_k"])  # validate before loading anything
    if kw["max_new_tokens"] < 0:
        raise InputError(f"max_new_tokens={kw['max_new_tokens']!r}: must be an integer >= 0")
    return kw


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
    print(f"[{len(result.token_ids)} tokens, finish={result.finish_reason}, prefill {s['prefill_tokens_per_s']:.1f} "
          f"tok/s, first token {s['time_to_first_token_seconds']:.2f} s, decode {s['decode_tokens_per_s']:.1f} tok/s]",
          file=sys.stderr)
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
    """`generate`'s speculative arguments for the flags; the drafter is loaded once per command."""
    if args.speculative == "none":
        return {}
    if getattr(args, "_drafter", None) is None:
        from ..generation.drafter import SUBFOLDER, load_drafter

        args._drafter = load_drafter(Path(model.ckpt_path) / SUBFOLDER, model,
                                     capture_final_norm=args.drafter_capture == "post-norm")
    return {"draft": args._drafter, "num_speculative_tokens": args.num_speculative_tokens}


def run_generate(args: argparse.Namespace) -> int:
    from ..generation.generate import generate

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
    if args.prompt is not None and any(p == "" for p in args.prompt):
        raise InputError("--prompt is empty: give some text")
    requests = _read_requests(args, tools) if args.input_file is not None else None
    if requests == []:  # an empty input file: nothing to load the model for
        return 0
    if args.prompt is not None and not args.chat:
        chat_only = [flag for flag, used in (("--tools", args.tools is not None), ("--system", args.system is not None),
                                             ("--thinking", args.thinking != "adaptive")) if used]
        if chat_only:
            verb = "applies" if len(chat_only) == 1 else "apply"
            raise InputError(f"{', '.join(chat_only)} {verb} only to chat prompts: add --chat")
    for path in args.image or []:
        if not path.is_file():  # fail before loading the model; contents are checked when decoded
            raise InputError(f"--image {path}: no such file")
    model, tok, _ = load_from_args(args)
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
    results = generate(model, tok, args.prompt, on_text=on_text, images=images, **chat_kw, **kw,
                       **_draft_kwargs(args, model))
    if close:
        close()
    for i, r in enumerate(results):
        if not stream and args.output_format == "text" and len(results) > 1:
            # several replies: each under a header naming its prompt, so they do not run together
            print(("\n" if i else "") + f"=== prompt {i + 1} of {len(results)} ===")
        _print_result(args, r, streamed=stream, max_new_tokens=kw["max_new_tokens"])
    return 0


REQUEST_KEYS = ("prompt", "messages", "tools", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "thinking",
                "system", "id", "images")
THINKING_MODES = ("adaptive", "enabled", "disabled")


def _check_request(args: argparse.Namespace, req: object, tools) -> dict:
    """`generate`'s keyword arguments for one --input-file record, every field checked (InputError otherwise)."""
    if not isinstance(req, dict) or ("prompt" in req) == ("messages" in req):
        raise InputError("each line must be an object with exactly one of 'prompt' or 'messages'")
    unknown = sorted(set(req) - set(REQUEST_KEYS))
    if unknown:
        raise InputError(f"unknown keys {unknown} (known: {list(REQUEST_KEYS)})")
    chat = args.chat or "messages" in req
    prompt = req.get("messages", req.get("prompt"))
    if "messages" in req:
        if not isinstance(prompt, list) or not prompt or not all(isinstance(m, dict) for m in prompt):
            raise InputError("'messages' must be a non-empty list of message objects")
    elif not isinstance(prompt, str) or not prompt:
        raise InputError(f"'prompt' must be a non-empty string, got {prompt!r}")
    req_tools = tools
    if "tools" in req:
        from ..generation.chat import normalize_tools

        req_tools = req["tools"] if not isinstance(req["tools"], dict) else [req["tools"]]
        if not isinstance(req_tools, list):
            raise InputError(f"'tools' must be a list of tool schemas, got {req['tools']!r}")
        normalize_tools(req_tools)
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
    if isinstance(prompt, list):
        from ..generation.multimodal import rebase_image_paths

        prompt = rebase_image_paths(prompt, base)
    return {"prompts": [prompt], "chat": chat, "tools": req_tools, "thinking": thinking, "system": system,
            "images": [images] if images else None, **_sampling_kwargs(args, req)}


def _read_requests(args: argparse.Namespace, tools) -> list[tuple[int, object, dict | str]]:
    """Every record of --input-file as (line number, id or None, generate's kwargs or the line's error message),
    all checked before anything is loaded; blank lines are skipped. An unreadable file is one InputError."""
    path = args.input_file
    if path.is_dir():
        raise InputError(f"--input-file {path}: is a directory, not a JSONL file")
    try:
        data = path.read_bytes()  # any readable file: a pipe or /dev/null as well as a regular file
    except FileNotFoundError:
        raise InputError(f"--input-file {path}: no such file") from None
    except OSError as e:
        raise InputError(f"--input-file {path}: cannot read ({e.strerror})") from None
    try:
        lines = data.decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise InputError(f"--input-file {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
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


def _batch_file(args, model, tok, requests) -> int:
    """Run the checked --input-file records in order; the bad ones (and ones whose run fails) are reported with
    their line number and the rest still run. Exit status 1 when any line failed."""
    from ..generation.generate import generate

    status = 0
    for n, req_id, kw in requests:
        try:
            if isinstance(kw, str):
                raise InputError(kw)
            res = generate(model, tok, **kw, **_draft_kwargs(args, model))[0]
            out = res.as_dict()
            if req_id is not None:
                out["id"] = req_id
            if args.output_format == "json":
                print(json.dumps(out, ensure_ascii=False), flush=True)
                _note_cut(args, res, kw["max_new_tokens"])
            else:
                _print_result(args, res, streamed=False, max_new_tokens=kw["max_new_tokens"])
        except MiniMaxRefError as e:
            status = 1
            print(f"error: {args.input_file}:{n}: {e}", file=sys.stderr)
            if args.output_format == "json":
                print(json.dumps({"line": n, "error": str(e)}, ensure_ascii=False), flush=True)
    return status


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


# ---------------------------------------------------------------------------------------------- synth


def build_synth_parser(p: argparse.ArgumentParser) -> None:
    from ..weights.synth import FORMATS, PRESETS

    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="default: tiny")
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument("--format", choices=list(FORMATS), default="bf16",
                   help="bf16, mxfp8, or nvfp4 (= NVFP4 routed experts + MXFP8 attention/shared/dense, as the "
                        "release) (default: bf16)")
    p.add_argument("--experts", type=int, default=None, help="routed experts per MoE layer (default: the preset's)")
    p.add_argument("--layers", type=int, default=None, help="number of layers (default: the preset's)")
    p.add_argument("--seed", type=int, default=0, help="weight seed (default: 0)")
    p.add_argument("--drafter", action="store_true",
                   help="also write a DSpark drafter in OUT/dspark at the target's shapes (release layout)")
    p.add_argument("--dry-run", action="store_true", help="print the tensor count and size, write nothing")


def run_synth(args: argparse.Namespace) -> int:
    from ..model.config import parse_model_config
    from ..weights.synth import build_config, plan_tensors, write_checkpoint

    if args.dry_run:
        cfg = parse_model_config(build_config(args.preset, args.format, args.experts, args.layers))
        count, nbytes = plan_tensors(cfg, args.format)
        print(json.dumps({"preset": args.preset, "format": args.format, "tensors": count, "bytes": nbytes}))
        return 0
    out = write_checkpoint(args.out, args.preset, args.format, experts=args.experts, layers=args.layers,
                           seed=args.seed, progress=True, drafter=args.drafter)
    print(f"wrote {out}")
    return 0


# ---------------------------------------------------------------------------------------------- inspect


def build_inspect_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("ckpt_path", type=Path, help="checkpoint folder")
    p.add_argument("--quick", action="store_true",
                   help="check the headers only (names, shapes, dtypes, formats); by default every tensor is also "
                        "read and checked for NaN / Inf values, E4M3 NaN bytes and bad scales, as loading does")
    p.add_argument("--output-format", choices=["text", "json"], default="text")


def inspect_summary(path: Path, quick: bool = False) -> dict:
    """`minimax-ref inspect`'s summary of checkpoint `path`; `problems` lists everything loading would refuse
    (header problems always; tensor values too unless `quick`)."""
    from ..weights.checkpoint import check_values, open_checkpoint

    ck = open_checkpoint(path, strict=False)
    t = ck.config.text
    problems = list(ck.problems)
    if not quick and not problems:  # values are read only from shards whose headers are sound
        problems += check_values(ck)
    summary = {
        "path": str(path),
        "layers": t.num_hidden_layers,
        "layer_kinds": [t.layer_kind(i) for i in range(t.num_hidden_layers)],
        "hidden_size": t.hidden_size,
        "vocab_size": t.vocab_size,
        "experts": t.num_local_experts,
        "experts_per_token": t.num_experts_per_tok,
        "msa": {"block_size": t.sparse.block_size, "topk_blocks": t.sparse.topk_blocks,
                "dense_up_to_tokens": t.sparse.block_size * t.sparse.topk_blocks},
        "vision": ck.config.vision is not None,
        "formats": {k: sorted(v) for k, v in sorted(ck.family_formats().items())},
        "bytes": dict(sorted(ck.family_bytes().items())),
        "tensors": len(ck.tensors),
        "notes": ck.notes,
        "problems": problems,
    }
    pruning = path / "pruning.json"
    if pruning.is_file():
        summary["pruning"] = json.loads(pruning.read_text())
    try:
        from ..generation.tokenizer import load_tokenizer

        tok = load_tokenizer(path)
        summary["tokenizer"] = {"vocab_size": tok.vocab_size, "special_ids": tok.special_ids.as_dict(),
                                "eos_token_ids": list(tok.eos_token_ids)}
    except MiniMaxRefError as e:
        summary["problems"].append(f"tokenizer: {e}")
    return summary


def run_inspect(args: argparse.Namespace) -> int:
    s = inspect_summary(args.ckpt_path, args.quick)
    if args.output_format == "json":
        print(json.dumps(s, indent=2, ensure_ascii=False))
    else:
        kinds: dict[str, int] = {}
        for k in s["layer_kinds"]:
            kinds[k] = kinds.get(k, 0) + 1
        print(f"checkpoint  {s['path']}")
        print(f"layers      {s['layers']} ({', '.join(f'{n} x {k}' for k, n in kinds.items())})")
        print(f"hidden      {s['hidden_size']}, vocab {s['vocab_size']}, vision {'yes' if s['vision'] else 'no'}")
        print(f"experts     {s['experts']} per MoE layer, top-{s['experts_per_token']}")
        m = s["msa"]
        print(f"MSA         blocks of {m['block_size']}, top-{m['topk_blocks']} "
              f"(equals dense attention up to {m['dense_up_to_tokens']} tokens)")
        print(f"tensors     {s['tensors']}")
        print("family           format          bytes")
        for fam, fmts in s["formats"].items():
            print(f"  {fam:<14} {'/'.join(fmts):<15} {s['bytes'].get(fam, 0):>14,}")
        if "tokenizer" in s:
            sp = {k: v for k, v in s["tokenizer"]["special_ids"].items() if v is not None}
            print(f"tokenizer   vocab {s['tokenizer']['vocab_size']}, special ids {sp}")
        for note in s["notes"]:
            print(f"note        {note}")
        print(f"problems    {len(s['problems'])}")
        for p in s["problems"]:
            print(f"  - {p}")
    return 1 if s["problems"] else 0


# ---------------------------------------------------------------------------------------------- main


# Commands implemented in their own modules: each module has `build_parser(p)` and `run(args) -> int`.
MODULE_COMMANDS: tuple[tuple[str, str, str], ...] = (
    ("score", "minimax_ref.research.score", "per-token log-likelihood of completions; drift and top-1 agreement against a "
                                   "reference checkpoint"),
    ("prune", "minimax_ref.weights.prune", "write an expert-pruned checkpoint (keep N routed experts per MoE layer)"),
    ("plan", "minimax_ref.research.plan", "per-card weight memory at tensor parallelism N and the KV-cache pool"),
    ("golden", "minimax_ref.golden", "export golden tensors (op inputs/outputs, paged KV, packed operands) for "
                                     "kernel tests, or replay a bundle"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minimax-ref", description="Reference inference engine for MiniMax-M3 "
                                     "(minimax_m3_vl) checkpoints in the release format.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, build, run, help_ in (
        ("generate", build_generate_parser, run_generate, "generate text from a checkpoint"),
        ("synth", build_synth_parser, run_synth, "write a synthetic checkpoint in the release format"),
        ("inspect", build_inspect_parser, run_inspect, "validate a checkpoint and summarise it"),
    ):
        p = sub.add_parser(name, help=help_, description=help_,
                           )
        build(p)
        p.set_defaults(run=run)
    import importlib

    for name, module, help_ in MODULE_COMMANDS:
        mod = importlib.import_module(module)
        p = sub.add_parser(name, help=help_, description=help_)
        mod.build_parser(p)
        p.set_defaults(run=mod.run)
    return parser


def import_torch_holding_ctrl_c() -> None:
    """Import torch with Ctrl-C held back until the import is done, then honoured (KeyboardInterrupt): a
    KeyboardInterrupt raised inside torch's C++ extension initialisation ends the process with a C++ `terminate`
    (SIGABRT, no exit status 130)."""
    import signal
    import threading

    if "torch" in sys.modules or threading.current_thread() is not threading.main_thread():
        import torch  # noqa: F401

        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        import torch  # noqa: F401
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught and previous is not signal.SIG_IGN:
        raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """The `minimax-ref` program: 0 on success, 1 when a command reports problems (inspect, plan, batch lines),
    2 for a user error (one `error:` line), 130 on Ctrl-C (at any moment, imports included: no traceback)."""
    try:
        import_torch_holding_ctrl_c()  # the command modules import it; Ctrl-C inside it must not abort
        args = build_parser().parse_args(argv)
        check_offload_command(args)
        return args.run(args)
    except MiniMaxRefError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
