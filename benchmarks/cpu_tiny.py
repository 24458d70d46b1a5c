"""Prefill and decode speed on the `tiny` preset on CPU: minimax-ref vs transformers, same weights,
measured in one run. Prints one JSON object (tokens/s of each and the ratios).

    python benchmarks/cpu_tiny.py [--prompt-len 512] [--new-tokens 64] [--fast off|on|compiled]

`--fast` picks minimax-ref's fast paths (`minimax_ref/fast/`; default off, the reference). With `compiled` the
decoder layers of each decode step run `torch.compile`d: one untimed run compiles them first (tens of seconds).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from common import add_fast_flag  # noqa: E402  (puts the repository root on the path)
from oracle import hf_text_model  # noqa: E402

from minimax_ref.fast import apply  # noqa: E402
from minimax_ref.weights.loader import load_model  # noqa: E402
from minimax_ref.weights.synth import write_checkpoint  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--format", default="nvfp4")
    add_fast_flag(ap, ["off", "on", "compiled"], "off")
    args = ap.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint(Path(tmp) / "ck", "tiny", args.format)
        ours = load_model(path, dtype=torch.float32, max_seq_len=args.prompt_len + args.new_tokens + 1)
        theirs = hf_text_model(ours, attn_impl="sdpa")
        apply(ours, args.fast)
    ids = torch.randint(0, 1000, (1, args.prompt_len), generator=torch.Generator().manual_seed(0))

    n, P = args.new_tokens, args.prompt_len

    def ours_run():
        cache = ours.new_cache(1, P + n)
        t0 = time.perf_counter()
        logits = ours(ids, positions=torch.arange(P)[None], cache=cache)
        t1 = time.perf_counter()
        tokens = []
        for i in range(n):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(int(nxt))
            logits = ours(nxt, positions=torch.tensor([[P + i]]), cache=cache)
        return t1 - t0, time.perf_counter() - t1, tokens

    def theirs_run():
        t0 = time.perf_counter()
        out = theirs(ids, use_cache=True)
        t1 = time.perf_counter()
        past, logits, tokens = out.past_key_values, out.logits, []
        for _ in range(n):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(int(nxt))
            out = theirs(nxt, past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits
        return t1 - t0, time.perf_counter() - t1, tokens

    with torch.no_grad():
        if args.fast == "compiled":
            ours_run()  # compiles the decode step's layers
        runs = [(ours_run(), theirs_run()) for _ in range(args.repeats)]  # interleaved: same machine state
    ours_prefill = min(r[0][0] for r in runs)
    ours_decode = min(r[0][1] for r in runs)
    theirs_prefill = min(r[1][0] for r in runs)
    theirs_decode = min(r[1][1] for r in runs)
    result = {
        "preset": "tiny", "format": args.format, "dtype": "float32", "threads": torch.get_num_threads(),
        "fast": args.fast,
        "prompt_len": P, "new_tokens": n, "repeats": args.repeats,
        "ours_prefill_tok_s": round(P / ours_prefill, 1),
        "transformers_prefill_tok_s": round(P / theirs_prefill, 1),
        "prefill_speedup": round(theirs_prefill / ours_prefill, 3),
        "ours_decode_tok_s": round(n / ours_decode, 1),
        "transformers_decode_tok_s": round(n / theirs_decode, 1),
        "decode_speedup": round(theirs_decode / ours_decode, 3),
        "same_greedy_tokens": runs[0][0][2] == runs[0][1][2],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
