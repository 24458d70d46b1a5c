"""Evaluate a checkpoint folder on the seed's checks and the nano measurements; prints one JSON summary.

    python examples/nano/eval.py --ckpt-path nano-ckpt [--device cuda] [--out eval.json]

Seed checks, each one run of the `minimax-ref generate` command line (`--output-format json`, the
seed's evaluation sampling: temperature 0.6, top_p 0.95, top_k 20, unless --check-temperature):

* arithmetic: `--chat --thinking enabled --prompt "What is 17*23?"` -> content "391", with the
  reasoning split off;
* tool call: `--chat --tools tools.json --prompt "Weather in Lisbon for 3 days?"` -> a parsed
  `get_weather` call with city "Lisbon" (and days 3);
* image: `--chat --image 427.png --prompt "What number is this?"` -> "427".

Measurements, through the Python API (`minimax_ref.generation.generate`, batched):

* exact copying of the held-out cities and order ids through tool calls, sampled at temperature 1.0,
  top_p 0.95 (top_k off): the parsed call's argument must equal the held-out string exactly;
* tool-argument copy accuracy on held-out long city names (10-15 characters, diacritics or several
  words), greedy (`long_name_copying`, --n-long): overall, with diacritics, multi-word, by kind
  (spaces / hyphen / apostrophe / one word, ascii / non-ascii) and by length; each miss with the token where the
  reply first leaves the name, that token's probability and the token chosen instead (`first_miss`);
* the same on fresh random strings of 6-20 characters (`fresh_string_copying`, --n-random; lower,
  title, upper and mixed case, diacritics, digits in turn: `data.fresh_copy_strings`, which no
  training draw can produce): overall, by style and by length;
* arithmetic accuracy on held-out problems (thinking enabled, greedy), by operation;
* image accuracy on held-out numbers (greedy);
* prompt lengths against the MSA threshold (top-k blocks x block size), to show the sparse path is used;
* with a `dspark/` drafter: greedy speculative decoding next to plain greedy (identical tokens) and the
  mean accepted length.

The held-out items come from --heldout, else the checkpoint's `nano_run.json`, else
`data.make_heldout(--seed)`. Any checkpoint folder works (a checkpoint without a vision tower skips
the image parts); a check that fails is reported, never fatal. A count of 0 skips its measurement,
e.g. the copying measurements alone:

    python examples/nano/eval.py --ckpt-path CKPT --no-cli --n-long 50 --n-random 100 \\
        --n-cities 0 --n-orders 0 --n-arith 0 --n-images 0 --n-speculative 0
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `examples.nano` importable from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


from examples.nano import data as nd
from minimax_ref.generation.chat import EVAL_SAMPLING
from minimax_ref.weights.loader import resolve_dtype


def load_heldout(ckpt: Path, path: Path | None, seed: int) -> tuple[nd.Heldout, str]:
    """The held-out split and where it came from."""
    if path is not None:
        return nd.read_heldout(path), str(path)
    run = ckpt / "nano_run.json"
    if run.is_file():
        raw = json.loads(run.read_text(encoding="utf-8"))
        if "heldout" in raw:
            return nd.Heldout.from_json(raw["heldout"]), str(run)
    return nd.make_heldout(seed), f"make_heldout({seed})"


def _cli_command() -> list[str]:
    exe = shutil.which("minimax-ref")
    return [exe] if exe else [sys.executable, "-m", "minimax_ref.cli"]


def run_cli(ckpt: Path, args: Sequence[str], model_flags: Sequence[str]) -> dict[str, Any]:
    """One `minimax-ref generate ... --output-format json` run: its result object, or {"error": ...}."""
    cmd = [*_cli_command(), "generate", "--ckpt-path", str(ckpt), *model_flags, *args, "--output-format", "json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, encoding="utf-8")
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]}
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        return {"error": f"unreadable output: {proc.stdout[-200:]!r}"}


def _brief(result: dict[str, Any]) -> dict[str, Any]:
    keys = ("reasoning", "content", "tool_calls", "finish_reason", "errors", "error")
    return {k: result[k] for k in keys if k in result}


def seed_checks(ckpt: Path, work: Path, model_flags: list[str], sampling: dict[str, Any], has_vision: bool,
                ) -> dict[str, Any]:
    """The seed's three checks through the command line."""
    flags = ["--temperature", str(sampling["temperature"]), "--top-p", str(sampling["top_p"]),
             "--top-k", str(sampling["top_k"]), "--seed", "0"]
    out: dict[str, Any] = {"sampling": sampling}
    a, op, b = nd.SEED_PROBLEM
    r = run_cli(ckpt, ["--chat", "--thinking", "enabled", "--prompt", f"What is {a}{op}{b}?",
                       "--max-new-tokens", "384", *flags], model_flags)
    answer = str(nd.solve(a, op, b))
    out["arithmetic_17x23"] = {"pass": (r.get("content") or "").strip() == answer and bool(r.get("reasoning")),
                               **_brief(r)}
    tools = nd.write_tools_json(work / "tools.json")
    r = run_cli(ckpt, ["--chat", "--tools", str(tools), "--prompt", "Weather in Lisbon for 3 days?",
                       "--max-new-tokens", "128", *flags], model_flags)
    calls = r.get("tool_calls") or []
    first = calls[0] if calls else {}
    out["tool_call_lisbon"] = {
        "pass": first.get("name") == "get_weather" and (first.get("arguments") or {}).get("city") == "Lisbon",
        "days_right": (first.get("arguments") or {}).get("days") == 3, **_brief(r)}
    if has_vision:
        image = work / "427.png"
        nd.seed_image_spec().render().save(image)
        r = run_cli(ckpt, ["--chat", "--image", str(image), "--prompt", "What number is this?",
                           "--max-new-tokens", "32", *flags], model_flags)
        out["image_427"] = {"pass": (r.get("content") or "").strip() == str(nd.SEED_IMAGE_NUMBER), **_brief(r)}
    else:
        out["image_427"] = {"pass": None, "skipped": "the checkpoint has no vision tower"}
    out["passed"] = sum(1 for v in out.values() if isinstance(v, dict) and v.get("pass") is True)
    return out


def _batched(model: Any, tok: Any, prompts: list[Any], batch: int, **kw: Any) -> list[Any]:
    import minimax_ref as mr

    images = kw.pop("images", None)
    results = []
    for i in range(0, len(prompts), batch):
        part = None if images is None else images[i:i + batch]
        results += mr.generate(model, tok, prompts[i:i + batch], images=part, **kw)
    return results


def _exact_city_copies(model: Any, tok: Any, names: Sequence[str], batch: int, rng: random.Random,
                       ) -> tuple[list[str | None], list[Any]]:
    """Greedy `get_weather` calls for weather requests naming `names`: each call's parsed `city`, and the replies."""
    prompts = [nd.weather_request(c, rng.randint(1, 7), rng) for c in names]
    results = _batched(model, tok, prompts, batch, chat=True, tools=nd.TOOLS, max_new_tokens=96, temperature=0.0)
    got = []
    for r in results:
        call = next((c for c in r.tool_calls if c.get("name") == "get_weather"), {})
        got.append((call.get("arguments") or {}).get("city"))
    return got, results


def first_miss(model: Any, tok: Any, reply: Any, want: str, got: str | None) -> dict[str, Any] | None:
    """Where a greedy `reply` (a `GenerationResult`) whose call named `got` instead of `want` first leaves `want`:
    the reply's text with `want` in place of `got`, scored teacher-forced after the same prompt (`minimax_ref.score`),
    gives the first position whose most likely token is not the reply's: `before` (the three tokens before it),
    `right` (the token the reply needed), `p_right` (its probability) and `chosen` (the most likely token). A
    confident miss (`p_right` near 0) asks for other training than a near-tie. None without a call (`got` None) or
    where the reply's text does not hold `got` as written; `right` None where every position's most likely token is
    the corrected reply's."""
    import math

    import minimax_ref as mr

    if got is None or got not in reply.text:
        return None
    ids = tok.encode(reply.text.replace(got, want, 1))
    prompt = list(reply.prompt_token_ids)
    scored = mr.score(model, None, [{"input_ids": prompt + ids, "completion_start": len(prompt)}]).per_trace[0]
    for i, (target, chosen) in enumerate(zip(ids, scored.argmax)):
        if int(chosen) != target:
            return {"before": tok.decode(ids[max(0, i - 3):i]), "right": tok.decode([target]),
                    "p_right": round(math.exp(-float(scored.nll[i])), 4), "chosen": tok.decode([int(chosen)])}
    return {"before": None, "right": None, "p_right": None, "chosen": None}


def _misses(model: Any, tok: Any, wants: Sequence[str], got: Sequence[str | None], replies: Sequence[Any],
            limit: int = 12) -> list[dict[str, Any]]:
    """The first `limit` misses: `want`, `got` and `first_miss`."""
    misses = [(w, g, r) for w, g, r in zip(wants, got, replies) if g != w][:limit]
    return [{"want": w, "got": g, "first_miss": first_miss(model, tok, r, w, g)} for w, g, r in misses]


def _tally(wants: Sequence[str], gots: Sequence[str | None], groups: Sequence[Sequence[str]]) -> dict[str, Any]:
    """{"n", "exact", "rate"} per group; `groups[i]` names the groups item i is counted in."""
    counts: dict[str, list[int]] = {}
    for want, got, member in zip(wants, gots, groups):
        for g in member:
            c = counts.setdefault(g, [0, 0])
            c[0] += got == want
            c[1] += 1
    return {g: {"n": n, "exact": k, "rate": round(k / max(1, n), 4)} for g, (k, n) in counts.items()}


def _bucket(n: int, edges: Sequence[int]) -> str:
    """'len_A_B' for the bucket [A, B] of `edges` (bucket starts, ascending; the last one closes the
    buckets, or opens 'len_A_up' past it) that holds n."""
    lo = max((e for e in edges if e <= n), default=edges[0])
    nxt = [e for e in edges if e > lo]
    return f"len_{lo}_{nxt[0] - 1}" if nxt else f"len_{lo}_up"


def _by_length(wants: Sequence[str], gots: Sequence[str | None], edges: Sequence[int]) -> dict[str, Any]:
    out = _tally(wants, gots, [[_bucket(len(w), edges)] for w in wants])
    return dict(sorted(out.items(), key=lambda kv: int(kv[0].split("_")[1])))


def name_kind(name: str) -> str:
    """The separator kind a name is reported under: "spaces", "hyphen" or "apostrophe" (the first of
    these it holds, in that order), else "one_word"."""
    for kind, ch in (("spaces", " "), ("hyphen", "-"), ("apostrophe", "'")):
        if ch in name:
            return kind
    return "one_word"


def miss_word(want: str, got: str | None) -> str:
    """Where a copy of `want` first goes wrong: "no_call" (no parsed call), "first_word" (a character of the first
    word, or a name cut off inside it), "later_word". Words end at a space, hyphen or apostrophe. The first word is
    tokenized differently in the call (no leading space after `<city>`) than after a prompt's "in"; a prompt that
    spells it as the call does (the name quoted, or first in the message) misses the same first words, so the split
    tells where a copy drifts, not why."""
    if got is None:
        return "no_call"
    i = next((j for j, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
    first_end = next((j for j, ch in enumerate(want) if ch in " -'"), len(want))
    return "first_word" if i < first_end else "later_word"


def long_name_copying(model: Any, tok: Any, names: Sequence[str], batch: int, seed: int) -> dict[str, Any]:
    """Tool-argument copy accuracy on held-out long city names (`data.LONG_CITIES`: 10-15 characters,
    diacritics or several words), greedy: the parsed `get_weather` call's `city` must equal the name
    exactly. Reported overall (`all`), for names with diacritics, for multi-word names (spaces, hyphens
    or apostrophes), `by_kind` (`name_kind`, and ascii / diacritics), `by_length` (characters), the misses by the
    word where they first go wrong (`miss_word`) and each miss's first wrong token (`first_miss`)."""
    rng = random.Random(f"nano-eval-long-{seed}")
    names = list(names)
    got, replies = _exact_city_copies(model, tok, names, batch, rng)
    flags = [["all"] + (["diacritics"] if not c.isascii() else []) + (["multi_word"] if name_kind(c) != "one_word"
                                                                     else []) for c in names]
    return {**_tally(names, got, flags),
            "by_kind": _tally(names, got, [[name_kind(c), "ascii" if c.isascii() else "non_ascii"] for c in names]),
            "by_length": _by_length(names, got, (10, 12, 14, 16)),
            "misses_by_word": dict(Counter(miss_word(w, g) for w, g in zip(names, got) if g != w)),
            "sampling": "greedy", "misses": _misses(model, tok, names, got, replies)}


def fresh_string_copying(model: Any, tok: Any, n: int, batch: int, seed: int) -> dict[str, Any]:
    """Tool-argument copy accuracy on `n` fresh random strings of 6-20 characters
    (`data.fresh_copy_strings`: their own stream, and a reserved share of all strings that no training
    draw produces), greedy, exact match of the `get_weather` call's `city`: overall (`all`),
    `by_style` (`data.COPY_STRING_STYLES`) and `by_length` (characters); each miss with its first wrong token
    (`first_miss`)."""
    pairs = nd.fresh_copy_strings(n, seed)
    wants = [s for s, _ in pairs]
    got, replies = _exact_city_copies(model, tok, wants, batch, random.Random(f"nano-eval-fresh-prompts-{seed}"))
    return {**_tally(wants, got, [["all"]] * len(wants)),
            "by_style": _tally(wants, got, [[style] for _, style in pairs]),
            "by_length": _by_length(wants, got, (6, 10, 15, 21)),
            "sampling": "greedy", "misses": _misses(model, tok, wants, got, replies)}


def copying(model: Any, tok: Any, heldout: nd.Heldout, n_cities: int, n_orders: int, batch: int,
            seed: int) -> dict[str, Any]:
    """Exact copying of held-out cities / order ids into tool-call arguments, sampled at 1.0 / 0.95."""
    rng = random.Random(f"nano-eval-copy-{seed}")
    cities = list(heldout.cities[:n_cities])
    days = [rng.randint(1, 7) for _ in cities]
    prompts = [nd.weather_request(c, d, rng) for c, d in zip(cities, days)]
    orders = list(heldout.order_ids[:n_orders])
    prompts += [nd.order_request(o, rng) for o in orders]
    results = _batched(model, tok, prompts, batch, chat=True, tools=nd.TOOLS, max_new_tokens=96,
                       temperature=1.0, top_p=0.95, top_k=0, seed=seed)
    city_ok, days_ok, order_ok, misses = 0, 0, 0, []
    for i, r in enumerate(results):
        args = r.tool_calls[0].get("arguments", {}) if r.tool_calls else {}
        if i < len(cities):
            got = args.get("city")
            city_ok += got == cities[i]
            days_ok += got == cities[i] and args.get("days") == days[i]
            if got != cities[i]:
                misses.append({"want": cities[i], "got": got})
        else:
            want = orders[i - len(cities)]
            got = args.get("order_id")
            order_ok += got == want
            if got != want:
                misses.append({"want": want, "got": got})
    lengths = [len(r.prompt_token_ids) for r in results]
    return {"cities": {"n": len(cities), "exact": city_ok, "rate": round(city_ok / max(1, len(cities)), 4),
                       "days_also_right": days_ok},
            "order_ids": {"n": len(orders), "exact": order_ok, "rate": round(order_ok / max(1, len(orders)), 4)},
            "sampling": {"temperature": 1.0, "top_p": 0.95, "top_k": 0}, "misses": misses[:10],
            "prompt_tokens": {"min": min(lengths, default=0), "max": max(lengths, default=0)}}


_LAST_INT = re.compile(r"-?\d+")


def arithmetic(model: Any, tok: Any, heldout: nd.Heldout, n: int, batch: int, max_new_tokens: int,
               ) -> dict[str, Any]:
    """Accuracy on held-out problems with thinking enabled, greedy: the content must be the answer."""
    rng = random.Random("nano-eval-arith")
    problems = list(heldout.arithmetic[:n])
    prompts = [nd.arithmetic_question(a, op, b, rng) for a, op, b in problems]
    results = _batched(model, tok, prompts, batch, chat=True, thinking="enabled", max_new_tokens=max_new_tokens,
                       temperature=0.0)
    by_op: dict[str, list[int]] = {}
    examples = []
    for (a, op, b), r in zip(problems, results):
        right = r.content.strip() == str(nd.solve(a, op, b))
        s = by_op.setdefault(op, [0, 0])
        s[0] += right
        s[1] += 1
        if len(examples) < 5 and not right:
            examples.append({"problem": f"{a}{op}{b}", "want": nd.solve(a, op, b), "content": r.content[:40],
                             "reasoning_tail": (r.reasoning or "")[-80:]})
    total = sum(s[0] for s in by_op.values())
    return {"n": len(problems), "correct": total, "accuracy": round(total / max(1, len(problems)), 4),
            "by_op": {op: round(s[0] / s[1], 4) for op, s in sorted(by_op.items())}, "wrong_examples": examples}


def image_readings(numbers: Sequence[int], answers: Sequence[str]) -> dict[str, Any]:
    """Readings of number images graded: right when the answer is the number's digits exactly; the counts overall and
    by the number's digits (`by_digits`, "1" to "4"), and each miss with what was read and whether it has the number's
    length (`same_length`: a misread digit) or not (a digit added or dropped)."""
    by: dict[str, list[int]] = {}
    misses = []
    for k, answer in zip(numbers, answers, strict=True):
        want, got = str(k), answer.strip()
        cell = by.setdefault(str(len(want)), [0, 0])
        cell[0] += got == want
        cell[1] += 1
        if got != want:
            misses.append({"want": want, "got": got, "same_length": len(got) == len(want)})
    right = sum(c[0] for c in by.values())
    return {"n": len(numbers), "correct": right, "accuracy": round(right / max(1, len(numbers)), 4),
            "by_digits": {d: {"n": c[1], "correct": c[0]} for d, c in sorted(by.items())}, "misses": misses}


def images(model: Any, tok: Any, heldout: nd.Heldout, n: int, batch: int, fonts: Sequence[str]) -> dict[str, Any]:
    """Accuracy on images of held-out numbers (random fonts, sizes and noise), greedy, graded by `image_readings`."""
    rng = random.Random("nano-eval-images")
    numbers = list(heldout.image_numbers[:n])
    pictures = [[nd.random_image_spec(k, rng, fonts).render()] for k in numbers]
    results = _batched(model, tok, ["What number is this?"] * len(numbers), batch, chat=True, images=pictures,
                       max_new_tokens=16, temperature=0.0)
    return image_readings(numbers, [r.content for r in results])


def speculative(model: Any, tok: Any, heldout: nd.Heldout, ckpt: Path, n: int) -> dict[str, Any]:
    """Greedy decoding with the checkpoint's DSpark drafter (`dspark/`) next to plain greedy decoding:
    the tokens must be identical; the mean accepted length is what the drafter buys."""
    import minimax_ref as mr
    from minimax_ref.generation.drafter import load_drafter

    drafter = load_drafter(ckpt / "dspark", model)
    rng = random.Random("nano-eval-dspark")
    prompts = [nd.arithmetic_question(a, op, b, rng) for a, op, b in heldout.arithmetic[: n - n // 2]]
    prompts += [nd.weather_request(c, rng.randint(1, 7), rng) for c in heldout.cities[: n // 2]]
    kw = dict(chat=True, tools=nd.TOOLS, max_new_tokens=128, temperature=0.0)
    plain = mr.generate(model, tok, prompts, **kw)
    drafted = mr.generate(model, tok, prompts, draft=drafter, **kw)
    stats = drafted[0].stats
    return {"n": len(prompts), "block": drafter.block_size,
            "greedy_identical": all(a.token_ids == b.token_ids for a, b in zip(plain, drafted)),
            "mean_accepted_length": stats.get("mean_accepted_length"),
            "acceptance_rate_per_position": stats.get("acceptance_rate_per_position"),
            "decode_tokens_per_s": {"plain": plain[0].stats.get("decode_tokens_per_s"),
                                    "dspark": stats.get("decode_tokens_per_s")}}


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    import minimax_ref as mr

    ckpt = Path(args.ckpt_path)
    heldout, source = load_heldout(ckpt, args.heldout, args.seed)
    dtype = resolve_dtype(args.dtype, args.device)
    model = mr.load_model(ckpt, device=args.device, dtype=dtype, max_seq_len=args.max_model_len,
                          max_batch_size=args.batch)
    tok = mr.load_tokenizer(ckpt)
    has_vision = model.vision_tower is not None
    t = model.text
    summary: dict[str, Any] = {"checkpoint": str(ckpt), "heldout": source, "device": args.device, "dtype": args.dtype}
    sp = t.sparse
    summary["architecture"] = {"layers": [t.layer_kind(i) for i in range(t.num_hidden_layers)],
                               "experts": t.num_local_experts, "top_k": t.num_experts_per_tok,
                               "msa_dense_up_to_tokens": sp.topk_blocks * sp.block_size if any(t.sparse_layers)
                               else None, "vision": has_vision}
    t0 = time.time()
    if not args.no_cli:
        sampling = dict(EVAL_SAMPLING) if args.check_temperature is None else {
            "temperature": args.check_temperature, "top_p": EVAL_SAMPLING["top_p"], "top_k": EVAL_SAMPLING["top_k"]}
        model_flags = ["--device", args.device, "--dtype", args.dtype, "--max-model-len", str(args.max_model_len)]
        with tempfile.TemporaryDirectory() as work:
            summary["seed_checks"] = seed_checks(ckpt, Path(work), model_flags, sampling, has_vision)
    if args.n_cities or args.n_orders:
        summary["copying"] = copying(model, tok, heldout, args.n_cities, args.n_orders, args.batch, args.seed)
    if args.n_long:
        # A split written before the long names existed holds none; the seed's split then supplies them
        # (the long names were not in that run's training data at all).
        long_names = heldout.long_cities or nd.make_heldout(args.seed).long_cities
        summary["long_name_copying"] = {
            "heldout": source if heldout.long_cities else f"make_heldout({args.seed})",
            **long_name_copying(model, tok, long_names[:args.n_long], args.batch, args.seed)}
    if args.n_random:
        summary["fresh_string_copying"] = fresh_string_copying(model, tok, args.n_random, args.batch, args.seed)
    if args.n_arith:
        summary["arithmetic"] = arithmetic(model, tok, heldout, args.n_arith, args.batch, args.max_new_tokens)
    if has_vision and args.n_images:
        summary["images"] = images(model, tok, heldout, args.n_images, args.batch, nd.find_fonts(args.fonts))
    if (ckpt / "dspark").is_dir() and args.n_speculative:
        summary["dspark"] = speculative(model, tok, heldout, ckpt, args.n_speculative)
    summary["seconds"] = round(time.time() - t0, 1)
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt-path", type=Path, required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                   help="compute dtype (default auto: bfloat16 on a GPU, float32 on a CPU)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--heldout", type=Path, default=None, help="held-out split JSON (default: from nano_run.json)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=32, help="prompts generated together")
    p.add_argument("--n-cities", type=int, default=nd.N_HELDOUT_CITIES)
    p.add_argument("--n-orders", type=int, default=nd.N_HELDOUT_ORDERS)
    p.add_argument("--n-long", type=int, default=nd.N_HELDOUT_LONG_CITIES,
                   help="held-out long city names for the greedy copy-accuracy measurement (0: skip)")
    p.add_argument("--n-random", type=int, default=100,
                   help="fresh random strings of 6-20 characters for the greedy copy-accuracy measurement (0: skip)")
    p.add_argument("--n-arith", type=int, default=nd.N_HELDOUT_PROBLEMS)
    p.add_argument("--n-images", type=int, default=nd.N_HELDOUT_IMAGES)
    p.add_argument("--max-new-tokens", type=int, default=384, help="for the arithmetic reasoning")
    p.add_argument("--n-speculative", type=int, default=16, help="prompts of the DSpark check (when dspark/ exists)")
    p.add_argument("--fonts", choices=["default", "builtin"], default="default")
    p.add_argument("--check-temperature", type=float, default=None,
                   help="temperature of the seed checks (default: the seed's protocol, 0.6)")
    p.add_argument("--no-cli", action="store_true", help="skip the seed checks through the command line")
    p.add_argument("--out", type=Path, default=None, help="also write the summary here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    summary = evaluate(args)
    text = json.dumps(summary, indent=1, ensure_ascii=False)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
