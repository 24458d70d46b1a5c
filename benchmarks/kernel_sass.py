#!/usr/bin/env python
"""The instruction mix of the engine's Triton kernels compiled for a GPU architecture, without that GPU.

    # on any machine with triton (its bundled ptxas and cuobjdump compile and disassemble for sm_90), ~1 minute:
    python benchmarks/kernel_sass.py --out kernel_sass.jsonl
    python benchmarks/kernel_sass.py --cases gemv-nvfp4,grouped-nvfp4 --arch 90 --show-loop
    # the grouped kernel at the tuned tiles, the tile interleaved into K order against one product per plane:
    python benchmarks/kernel_sass.py --cases grouped-nvfp4-tuned,grouped-nvfp4-planes,grouped-mxfp8-planes

Each case calls the public launch function of a `fast` kernel (`gemv.packed_product`,
`grouped.packed_matmul_grouped`, `grouped.decode_grouped`, `attention_kernel.block_attention`,
`selection_kernel.block_scores`) on CPU tensors of release shapes; every Triton launch it makes is intercepted
before it runs (`JITFunction.run`), specialised as the GPU launch would be (argument types, 16-byte alignment and
divisibility, constexprs: the binder of Triton's own JIT for a `GPUTarget` of `--arch`), compiled to a cubin and
disassembled. Nothing runs: the outputs are unwritten. The kernels' GPU code path is compiled (the interpreter's
fp32 emulation off: run without `TRITON_INTERPRET`).

Per compiled kernel it reports registers, local (spilled) and shared bytes, and the instructions of its main loop
(the longest backward branch of the SASS) by opcode, per loop iteration and, where the case knows how many weight
elements one iteration of one thread covers, per element. A kernel whose loop issues more instructions per element
than the SM can retire while its bytes stream in is bound by its arithmetic, not by memory: on an H200 the CUDA cores
retire about 34 T instructions a second (132 SMs x 4 schedulers x 32 lanes x 1.98 GHz) while the copy rate (4.2-4.8
TB/s) brings 7.5-8.5 T NVFP4 elements (0.5625 bytes each with its block scale), so an NVFP4 product that issues more
than about 4 instructions per element (all its threads together) cannot read at the copy rate. `--show-loop` prints
the loop's SASS.

Static figures: how often each instruction issues, latencies and stalls are not in them; the speed of a kernel is
measured on the GPU (benchmarks/packed_gemv.py, grouped_gemm.py, attention_kernel.py, selection_kernel.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.compiler import compile as triton_compile
from triton.runtime.jit import JITFunction, create_function_from_signature

from minimax_ref.fast import attention_kernel, gemv, grouped, mma_gemv, selection_kernel
from minimax_ref.weights.checkpoint import MXFP8, NVFP4

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
_OP = re.compile(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")
_ADDR = re.compile(r"/\*([0-9a-f]{4,})\*/")
_BRA = re.compile(r"\bBRA\s+(?:`\()?(?:\.L_x_\d+\))?\s*(0x[0-9a-f]+)")


def disassemble(cubin: bytes) -> tuple[list[tuple[int, str, str]], dict[str, int]]:
    """(address, opcode, text) of every instruction of a cubin (`cuobjdump -sass`), and its resource usage
    (`cuobjdump -res-usage`: registers, stack, shared and local bytes)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        out = subprocess.run([str(BIN / "cuobjdump"), "-sass", str(path)], capture_output=True, text=True,
                             check=True).stdout
        usage = subprocess.run([str(BIN / "cuobjdump"), "-res-usage", str(path)], capture_output=True, text=True,
                               check=True).stdout
    resources = {k.lower(): int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", usage)}
    lines = []
    for line in out.splitlines():
        a, op = _ADDR.search(line), _OP.search(line)
        if a and op:
            text = re.sub(r"/\* 0x[0-9a-f]+ \*/", "", line).strip()
            lines.append((int(a.group(1), 16), op.group(1), text))
    return lines, resources


def main_loop(lines: list[tuple[int, str, str]]) -> list[tuple[int, str, str]]:
    """The instructions between the target and the source of the longest backward branch (the main loop)."""
    best = None
    for addr, op, text in lines:
        m = _BRA.search(text)
        if op == "BRA" and m and int(m.group(1), 16) < addr:
            span = (int(m.group(1), 16), addr)
            if best is None or span[1] - span[0] > best[1] - best[0]:
                best = span
    if best is None:
        return []
    return [line for line in lines if best[0] <= line[0] <= best[1]]


class Capture:
    """Intercepts `JITFunction.run`: each launch is bound, specialised and compiled for `target`, not run."""

    def __init__(self, target: GPUTarget):
        self.target = target
        self.backend = make_backend(target)
        self.kernels: list[dict] = []
        self._binders: dict[int, object] = {}

    def run(self, fn: JITFunction, *args, grid, warmup, **kwargs):
        kwargs.pop("debug", None)
        binder = self._binders.get(id(fn))
        if binder is None:
            binder = self._binders[id(fn)] = create_function_from_signature(fn.signature, fn.params, self.backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(self.backend, kwargs, bound, specialization, options)
        source = ASTSource
        if fn.is_gluon():
            from triton.experimental.gluon._runtime import GluonASTSource as source
        compiled = triton_compile(source(fn, signature, constexprs, attrs), target=self.target,
                                  options=options.__dict__)
        named = {name: value for name, value in bound.items() if signature.get(name) == "constexpr"}
        self.kernels.append({"kernel": fn.__name__, "constexprs": named, "num_warps": options.num_warps,
                             "num_stages": options.num_stages, "cubin": compiled.asm["cubin"]})
        return None

    def __enter__(self):
        capture = self
        self._saved = JITFunction.run

        def run(fn, *args, grid, warmup, **kwargs):
            return capture.run(fn, *args, grid=grid, warmup=warmup, **kwargs)

        JITFunction.run = run
        return self

    def __exit__(self, *exc):
        JITFunction.run = self._saved


def _packed(fmt: str, entries: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Zero packed operands of a stack [entries, n, k] (decoded shape) in the stored layout: shapes and dtypes are
    what a compile sees."""
    if fmt == NVFP4:
        return (torch.zeros(entries, n, k // 2, dtype=torch.uint8),
                torch.full((entries, n, k // 16), 0x38, dtype=torch.uint8).view(torch.float8_e4m3fn),
                torch.ones(entries, dtype=torch.float32))
    return (torch.zeros(entries, n, k, dtype=torch.uint8).view(torch.float8_e4m3fn),
            torch.full((entries, n, k // 32), 127, dtype=torch.uint8), None)


def case_gemv(fmt: str, entries: int, n: int, k: int, chosen: int, table: bool = False):
    """`gemv.packed_product`, one row: an `entries`-entry stack read at `chosen` entries flagged active (the routed
    experts' w1, as `FastExperts.forward_grouped` passes them) or a linear (entries 1, chosen 0); `table`: NVFP4
    through the blocks' tables."""
    def run():
        w, s, g = _packed(fmt, entries, n, k)
        words, scales, glob = gemv.reorder(fmt, w, s, g)
        x = torch.zeros(1, k, dtype=torch.bfloat16)
        active = (torch.arange(entries) < chosen).to(torch.int32) if chosen else None
        gemv.packed_product(x, fmt, n, words, scales, glob, active=active, busy=chosen or None, sms=132,
                            table=table)

    def elements(kernel: dict) -> float | None:
        c = kernel["constexprs"]
        if kernel["kernel"] != "_gemv_kernel":
            return None
        return c["TN"] * c["TK"] / (32 * kernel["num_warps"])
    return run, elements


def case_mma_gemv(fmt: str, entries: int, n: int, k: int, chosen: int, rows: int = 1, stored: bool = False,
                  ranged: bool = False):
    """`mma_gemv.packed_product`: `rows` rows against a stack read at `chosen` entries flagged active, or a linear
    (entries 1, chosen 0); `stored`: `packed_product_stored` (the weight read where it is stored); `ranged`: the
    rows sorted by entry instead, an even share each (`ends`)."""
    def run():
        parts = _packed(fmt, entries, n, k)
        x = torch.zeros(rows, k, dtype=torch.bfloat16)
        active = (torch.arange(entries) < chosen).to(torch.int32) if chosen else None
        kw = {"active": active, "busy": chosen or None}
        if ranged:
            kw = {"ends": (torch.arange(1, entries + 1) * rows // entries).to(torch.int32)}
        if stored:
            mma_gemv.packed_product_stored(x, fmt, *parts, sms=132, **kw)
        else:
            mma_gemv.packed_product(x, n, *mma_gemv.reorder(fmt, *parts), sms=132, **kw)

    def elements(kernel: dict) -> float | None:  # a lane's elements of a loop: 8 a row tile, MMA tile and step of 64
        # ranges: the longest backward branch is the loop of 16-row passes around a K loop, not an element's loop
        if kernel["kernel"] != "_mma_gemv_kernel" or kernel["constexprs"]["SELECT"] == 3:
            return None
        c = kernel["constexprs"]
        sub_steps = mma_gemv.step_columns(NVFP4 if c["NVFP4_FMT"] else MXFP8, c["STORED"]) // mma_gemv.STEP_K
        return 32 * c["RT"] * sub_steps
    return run, elements


def case_grouped(fmt: str, entries: int, n: int, k: int, rows: int, table: bool = False, x_major: int = 0,
                 tiles: str | None = None):
    """`grouped.packed_matmul_grouped` of `rows` rows over a stack (every entry active) with the default tiles, or
    `tiles` ("BN,BK,WARPS,STAGES[,X_MAJOR[,PLANES]]", `grouped.Tiles.parse`); `table`: NVFP4 through the blocks'
    tables; `x_major`: the default tiles' orientation (`grouped.Tiles.x_major`)."""
    def run():
        w, s, g = _packed(fmt, entries, n, k)
        x = torch.zeros(rows, k, dtype=torch.bfloat16)
        config = grouped.Tiles.parse(tiles) if tiles else dataclasses.replace(grouped.DEFAULT[fmt], x_major=x_major)
        grouped.packed_matmul_grouped(x, fmt, w, s, g, active=torch.ones(entries, dtype=torch.int32), split=1,
                                      table=table, tiles=config)

    def elements(kernel: dict) -> float | None:
        c = kernel["constexprs"]
        if kernel["kernel"] != "_packed_matmul_kernel":
            return None
        return c["BLOCK_N"] * c["BLOCK_K"] / (32 * kernel["num_warps"])
    return run, elements


def case_decode(fmt: str, n: int, k: int, table: bool = False):
    """`grouped.decode_grouped`: a packed weight decoded to bf16 (prefill's products); `table`: NVFP4 through the
    blocks' tables."""
    def run():
        w, s, g = _packed(fmt, 1, n, k)
        grouped.decode_grouped(fmt, w[0], s[0], g[0] if g is not None else None, table=table)

    def elements(kernel: dict) -> float | None:
        c = kernel["constexprs"]
        return c["BLOCK_N"] * c["BLOCK_K"] / (32 * kernel["num_warps"]) if kernel["kernel"] == "_decode_kernel" \
            else None
    return run, elements


def case_attention(queries: int, keys: int, sparse: bool, stored: torch.dtype = torch.float8_e4m3fn):
    """`attention_kernel.block_attention` at release head shapes (64 query / 4 kv heads of 128), keys and values as
    `stored` (fp8: a decode step's reads; bf16: a prefill's, which widens an fp8 cache first); MSA: 16 selected
    blocks of 128 per query."""
    def run():
        q = torch.zeros(1, queries, 64, 128, dtype=torch.bfloat16)
        k = torch.zeros(1, keys, 4, 128, dtype=stored)
        pos = torch.arange(keys - queries, keys)[None]
        blocks = None
        if sparse:
            blocks = torch.arange(16, dtype=torch.int32).expand(1, 4, queries, 16).contiguous()
        attention_kernel.block_attention(q, k, k, pos, 0.088, blocks=blocks, block_size=128 if sparse else 0,
                                         sms=132)
    return run, lambda kernel: None


def case_selection(queries: int, keys: int):
    """`selection_kernel.block_scores`: 4 index heads of 128, blocks of 128."""
    def run():
        iq = torch.zeros(1, queries, 4, 128, dtype=torch.bfloat16)
        ik = torch.zeros(1, keys, 128, dtype=torch.bfloat16)
        selection_kernel.block_scores(iq, ik, torch.arange(keys - queries, keys)[None], 128)
    return run, lambda kernel: None


# Release shapes: routed experts [3072, 6144] (4 chosen of 16 at batch 1), q_proj [8192, 6144] (MXFP8).
CASES = {
    "gemv-nvfp4": (case_gemv, (NVFP4, 16, 3072, 6144, 4), "1 row, 4 of 16 routed experts' w1 (NVFP4)"),
    "gemv-nvfp4-table": (case_gemv, (NVFP4, 16, 3072, 6144, 4, True),
                         "1 row, 4 of 16 routed experts' w1 (NVFP4) through the blocks' tables"),
    "gemv-mxfp8": (case_gemv, (MXFP8, 1, 8192, 6144, 0), "1 row, q_proj (MXFP8)"),
    "mma-gemv-nvfp4": (case_mma_gemv, (NVFP4, 16, 3072, 6144, 4),
                       "1 row, 4 of 16 routed experts' w1 (NVFP4) on the tensor cores from MMA fragments"),
    "mma-gemv-mxfp8": (case_mma_gemv, (MXFP8, 1, 8192, 6144, 0),
                       "1 row, q_proj (MXFP8) on the tensor cores from MMA fragments"),
    "mma-gemv-nvfp4-stored": (case_mma_gemv, (NVFP4, 16, 3072, 6144, 4, 1, True),
                              "1 row, 4 of 16 routed experts' w1 (NVFP4) on the tensor cores, read where stored"),
    "mma-gemv-mxfp8-stored": (case_mma_gemv, (MXFP8, 1, 8192, 6144, 0, 1, True),
                              "1 row, q_proj (MXFP8) on the tensor cores, read where stored"),
    "mma-gemv-nvfp4-32": (case_mma_gemv, (NVFP4, 16, 3072, 6144, 16, 32),
                          "32 rows, 16 routed experts' w1 (NVFP4) on the tensor cores from MMA fragments"),
    "mma-gemv-mxfp8-32": (case_mma_gemv, (MXFP8, 1, 8192, 6144, 0, 32),
                          "32 rows, q_proj (MXFP8) on the tensor cores from MMA fragments"),
    "mma-gemv-nvfp4-ranged": (case_mma_gemv, (NVFP4, 16, 3072, 6144, 0, 128, True, True),
                              "32 tokens' 128 (token, choice) rows sorted by expert, 16 routed experts' w1 (NVFP4) "
                              "read where stored, each expert's own rows"),
    "grouped-nvfp4": (case_grouped, (NVFP4, 16, 3072, 6144, 32), "32 rows, 16 routed experts' w1 (NVFP4)"),
    "grouped-nvfp4-table": (case_grouped, (NVFP4, 16, 3072, 6144, 32, True),
                            "32 rows, 16 routed experts' w1 (NVFP4) through the blocks' tables"),
    "grouped-mxfp8": (case_grouped, (MXFP8, 1, 8192, 6144, 32), "32 rows, q_proj (MXFP8)"),
    "grouped-nvfp4-table-xmajor": (case_grouped, (NVFP4, 16, 3072, 6144, 32, True, 1),
                                   "32 rows, 16 routed experts' w1 (NVFP4), tables, x as the MMA's row side"),
    "grouped-mxfp8-xmajor": (case_grouped, (MXFP8, 1, 8192, 6144, 32, False, 1),
                             "32 rows, q_proj (MXFP8), x as the MMA's row side"),
    # H200's tuned tiles (`grouped.TUNED`), the decoded tile interleaved into K order or one product per plane of the
    # words (`grouped.Tiles.planes`: no shared-memory round trip of the decoded tile)
    "grouped-nvfp4-tuned": (case_grouped, (NVFP4, 16, 3072, 6144, 32, False, 0, "64,128,4,4"),
                            "32 rows, 16 routed experts' w1 (NVFP4), tiles 64,128,4,4"),
    "grouped-nvfp4-planes": (case_grouped, (NVFP4, 16, 3072, 6144, 32, False, 0, "64,128,4,4,0,1"),
                             "32 rows, 16 routed experts' w1 (NVFP4), tiles 64,128,4,4, one product per plane"),
    "grouped-nvfp4-table-tuned": (case_grouped, (NVFP4, 16, 3072, 6144, 32, True, 0, "64,128,4,4"),
                                  "32 rows, 16 routed experts' w1 (NVFP4), tables, tiles 64,128,4,4"),
    "grouped-nvfp4-table-planes": (case_grouped, (NVFP4, 16, 3072, 6144, 32, True, 0, "64,128,4,4,0,1"),
                                   "32 rows, 16 routed experts' w1 (NVFP4), tables, tiles 64,128,4,4, per plane"),
    "grouped-mxfp8-tuned": (case_grouped, (MXFP8, 1, 8192, 6144, 32, False, 0, "64,128,4,4"),
                            "32 rows, q_proj (MXFP8), tiles 64,128,4,4"),
    "grouped-mxfp8-planes": (case_grouped, (MXFP8, 1, 8192, 6144, 32, False, 0, "64,128,4,4,0,1"),
                             "32 rows, q_proj (MXFP8), tiles 64,128,4,4, one product per plane"),
    "decode-nvfp4": (case_decode, (NVFP4, 3072, 6144), "prefill's decode of one expert's w1 (NVFP4)"),
    "decode-nvfp4-table": (case_decode, (NVFP4, 3072, 6144, True),
                           "prefill's decode of one expert's w1 (NVFP4) through the blocks' tables"),
    "attention-msa": (case_attention, (8192, 8192, True), "8K queries, MSA layer, fp8 keys read as stored"),
    "attention-dense": (case_attention, (8192, 8192, False), "8K queries, dense layer, fp8 keys read as stored"),
    "attention-msa-bf16": (case_attention, (8192, 8192, True, torch.bfloat16),
                           "prefill attention, MSA layer, 8K queries, bf16 keys (an fp8 cache widened first)"),
    "attention-dense-bf16": (case_attention, (8192, 8192, False, torch.bfloat16),
                             "prefill attention, dense layer, 8K queries, bf16 keys"),
    "attention-decode": (case_attention, (1, 8192, True), "decode step attention, MSA layer, 8K context"),
    "selection": (case_selection, (8192, 8192), "prefill block selection, 8K queries"),
}


def analyse(kernel: dict, per_thread_elements, show_loop: bool) -> dict:
    lines, resources = disassemble(kernel["cubin"])
    loop = main_loop(lines)
    ops = Counter(op for _, op, _ in loop)
    row = {"kernel": kernel["kernel"], "num_warps": kernel["num_warps"], "num_stages": kernel["num_stages"],
           "constexprs": {k: v for k, v in kernel["constexprs"].items() if isinstance(v, (int, float, bool, str))},
           "registers": resources.get("reg"), "local_bytes": resources.get("local"),
           "shared_bytes": resources.get("shared"), "instructions": len(lines),
           "loop_instructions": len(loop), "loop_ops": dict(ops.most_common()),
           # what moves through shared memory in the loop, and what waits: a decoded tile's round trip to the MMA's
           # operand layout shows as stores and loads with barriers; DEPBAR after each HGMMA as a wait on it
           "loop_shared": {"stores": sum(n for op, n in ops.items() if op.startswith("STS")),
                           "loads": sum(n for op, n in ops.items() if op.startswith("LDS")),
                           "barriers": ops.get("BAR", 0),
                           "mma_waits": sum("WARPGROUP.DEPBAR" in text for _, _, text in loop)}}
    elements = per_thread_elements(kernel)
    if elements:
        row["elements_per_thread_iteration"] = elements
        row["loop_instructions_per_element"] = round(len(loop) / elements, 2)
        # tensor-core MMAs do the products: the CUDA-core instructions alone
        row["non_mma_per_element"] = round(sum(n for op, n in ops.items() if "MMA" not in op) / elements, 2)
    if show_loop:
        row["loop_sass"] = [text for _, _, text in loop]
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)} (default: all)")
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (default: 90, Hopper)")
    p.add_argument("--show-loop", action="store_true", help="print each main loop's SASS")
    p.add_argument("--out", type=Path, default=None, help="append one JSON line per kernel to this file")
    args = p.parse_args(argv)
    if grouped.interpreting():
        p.error("it compiles the kernels' GPU code path: run it without TRITON_INTERPRET=1")
    names = [c for c in args.cases.split(",") if c]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        p.error(f"unknown case(s) {unknown}: choose from {', '.join(CASES)}")
    rows = []
    for name in names:
        build, params, what = CASES[name]
        run, per_element = build(*params)
        with torch.no_grad(), Capture(GPUTarget("cuda", args.arch, 32)) as cap:
            run()
        for kernel in cap.kernels:
            row = {"case": name, "what": what, "arch": f"sm_{args.arch}", "triton": triton.__version__,
                   **analyse(kernel, per_element, args.show_loop)}
            rows.append(row)
            per = row.get("loop_instructions_per_element")
            top = ", ".join(f"{op} {n}" for op, n in list(row["loop_ops"].items())[:8])
            sh = row["loop_shared"]
            print(f"{name:18s} {row['kernel']:24s} regs {row['registers']!s:>4s} local {row['local_bytes']!s:>4s} "
                  f"loop {row['loop_instructions']:5d}"
                  + (f" = {per:6.2f}/element" if per else "")
                  + f"  shared st/ld/bar {sh['stores']}/{sh['loads']}/{sh['barriers']}, mma waits {sh['mma_waits']}"
                  + f"  [{top}]", file=sys.stderr)
            if args.show_loop:
                print("\n".join(row["loop_sass"]), file=sys.stderr)
            if args.out:
                with args.out.open("a") as f:
                    f.write(json.dumps({k: v for k, v in row.items() if k != "loop_sass"}) + "\n")
    return rows


if __name__ == "__main__":
    main()
