"""The test API: `load` gives `GoldenEntry`s, `compare` applies the manifest's tolerance and reports error sizes,
`replay_impl` runs a user's kernel over a bundle, `parametrize` is a pytest mark over a bundle's entries."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import InputError
from .bundle import check_sha256, entry_tensors, read_bundle_manifest
from .contract import error_sizes


@dataclass
class GoldenEntry:
    """One entry of a bundle, as `load` gives it: `inputs` (the op's operands, packed weights included),
    `outputs` (the reference's results), `params`, the op's numerics `contract` and per-output `tolerance`."""

    file: str
    op: str
    layer: int
    phase: str
    params: dict
    inputs: dict[str, torch.Tensor]
    outputs: dict[str, torch.Tensor]
    tolerance: dict[str, dict]
    contract: dict
    numerics: dict
    fp64: dict[str, torch.Tensor] = field(default_factory=dict)  # output name -> its fp64 version (when exported)

    @property
    def id(self) -> str:
        return self.file.removesuffix(".safetensors")


def load(path: str | Path, *, ops: Sequence[str] | None = None, verify: bool = True) -> list[GoldenEntry]:
    """The entries of golden bundle `path` (only those of `ops` when given). verify: check every file's sha256
    against the manifest (an InputError names the files that differ)."""
    path = Path(path)
    manifest = read_bundle_manifest(path)
    if verify:
        check_sha256(path, manifest)
    out = []
    for ent in manifest["entries"]:
        if ops is not None and ent["op"] not in ops:
            continue
        t = entry_tensors(path, ent)
        roles = {n: m["role"] for n, m in ent["tensors"].items()}
        out.append(GoldenEntry(
            file=ent["file"], op=ent["op"], layer=ent["layer"], phase=ent["phase"], params=ent["params"],
            inputs={n: v for n, v in t.items() if roles.get(n) not in ("output", "fp64")},
            outputs={n: v for n, v in t.items() if roles.get(n) == "output"},
            fp64={n.removesuffix(".fp64"): v for n, v in t.items() if roles.get(n) == "fp64"},
            tolerance=ent.get("tolerance", {}), contract=manifest.get("contracts", {}).get(ent["op"], {}),
            numerics=manifest["numerics"]))
    return out


@dataclass
class Comparison:
    """`compare`'s result: one row per output of the entry. A compared float output: name, ok, bad (elements out),
    max_abs, max_rel, max_ulps, atol, rtol (with fp64 outputs in the bundle also `fp64` and `reference_fp64`:
    {max_abs, max_rel} of the kernel's and of the reference's output against the fp64 version). A compared integer
    or exact output: name, ok, bad, elements, compared ("elementwise" / "as sets along the last axis"). An output
    the kernel did not give: name, ok False, missing True. `skipped`: outputs left out on purpose (`skip=`).
    `ignored`: outputs the kernel gave that the entry does not have (not compared: an entry without x_hat, say).
    `ok` needs every row ok and at least one output compared."""

    entry: str
    kernel_dtype: str
    rows: list[dict]
    skipped: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)

    @property
    def checked(self) -> int:
        return sum(1 for r in self.rows if not r.get("missing"))

    @property
    def ok(self) -> bool:
        return self.checked > 0 and all(r["ok"] for r in self.rows)

    def __str__(self) -> str:
        head = f"{self.entry} ({self.kernel_dtype} tolerance): {'ok' if self.ok else 'FAILED'}"
        if self.skipped:
            head += f"; left out: {', '.join(self.skipped)}"
        if self.ignored:
            head += f"; not outputs of this entry, ignored: {', '.join(self.ignored)}"
        if not self.checked:
            head += "; nothing was checked"
        lines = [head]
        for r in self.rows:
            if r.get("missing"):
                lines.append(f"  {r['name']}: MISSING: the kernel gave no {r['name']!r} (name it in skip= / "
                             "--skip-outputs if the kernel does not produce it)")
            elif "max_abs" not in r:
                lines.append(f"  {r['name']}: {'ok' if r['ok'] else 'DIFFERENT'} {r['bad']} of {r['elements']} "
                             f"elements differ (compared exactly, {r['compared']})")
            else:
                lines.append(f"  {r['name']}: {'ok' if r['ok'] else 'OUT OF TOLERANCE'} max_abs {r['max_abs']:.3g} "
                             f"max_rel {r['max_rel']:.3g} max_ulps {r['max_ulps']:.3g} (atol {r['atol']:.3g}, "
                             f"rtol {r['rtol']:.3g}, {r['bad']} elements out)"
                             + (f"; against fp64: max_abs {r['fp64']['max_abs']:.3g} (the reference's "
                                f"{r['reference_fp64']['max_abs']:.3g})" if "fp64" in r else ""))
        return "\n".join(lines)


def compare(entry: GoldenEntry, outputs: dict[str, torch.Tensor] | torch.Tensor, *,
            kernel_dtype: str | None = None, skip: Sequence[str] = ()) -> Comparison:
    """Compare a kernel's `outputs` (a dict by output name, or one tensor for a one-output entry) with the
    entry's reference under the manifest's tolerance for `kernel_dtype` ("float32" / "bfloat16"; default: the
    bundle's compute dtype). Every output of the entry is compared: one the kernel does not give fails (a row with
    missing=True) unless `skip` names it; a comparison that checks nothing is not ok. Float outputs: elementwise
    within atol + rtol * |reference|. Integer outputs and exact ones (tolerance {"exact": true}, e.g. x_hat): equal
    elementwise, or, with tolerance "order": "set" (MSA blocks), equal as sorted rows along the last axis. Outputs
    the entry lacks are ignored (listed in `Comparison.ignored`: a kernel may give x_hat for every linear); a name in
    `skip` the entry lacks is an InputError."""
    kd = kernel_dtype or entry.numerics["dtype"]
    if kd not in ("float32", "bfloat16"):
        raise InputError(f"kernel_dtype {kd!r}: choose float32 or bfloat16")
    if isinstance(outputs, torch.Tensor):
        if len(entry.outputs) != 1:
            raise InputError(f"{entry.id} has outputs {sorted(entry.outputs)}: pass a dict by name")
        outputs = {next(iter(entry.outputs)): outputs}
    unknown = sorted(set(skip) - set(entry.outputs))
    if unknown:
        raise InputError(f"{entry.id}: no output named {unknown[0]!r} to skip (outputs: {sorted(entry.outputs)})")
    ignored = sorted(set(outputs) - set(entry.outputs))
    rows = []
    for name, want in entry.outputs.items():
        if name in skip:
            continue
        if name not in outputs:
            rows.append({"name": name, "ok": False, "missing": True})
            continue
        got = outputs[name]
        tol = entry.tolerance.get(name, {})
        if tuple(got.shape) != tuple(want.shape):
            raise InputError(f"{entry.id}: output {name!r} has shape {tuple(got.shape)}, the reference's is "
                             f"{tuple(want.shape)}")
        got, want = real_queries(entry, name, got), real_queries(entry, name, want)
        sizes = error_sizes(got, want)
        if tol.get("exact") or not want.is_floating_point():
            rows.append(exact_row(entry, name, got, want, tol.get("order") == "set"))
            continue
        if kd not in tol:
            raise InputError(f"{entry.id}: the manifest gives no {kd} tolerance for {name!r}")
        atol, rtol = tol[kd]["atol"], tol[kd]["rtol"]
        g, w = got.detach().cpu().double(), want.double()
        equal = (g == w) | (torch.isnan(g) & torch.isnan(w))
        bad = int((~equal & ~((g - w).abs() <= atol + rtol * w.abs())).sum())
        row = {"name": name, "ok": bad == 0, "bad": bad, "atol": atol, "rtol": rtol, **sizes}
        if name in entry.fp64:  # errors of the kernel and of the reference against the fp64 version
            for label, t in (("fp64", got), ("reference_fp64", want)):
                e64 = error_sizes(t, real_queries(entry, name, entry.fp64[name]))
                row[label] = {"max_abs": e64["max_abs"], "max_rel": e64["max_rel"]}
        rows.append(row)
    return Comparison(entry.id, kd, rows, [n for n in entry.outputs if n in skip], ignored)


def real_queries(entry: GoldenEntry, name: str, t: torch.Tensor) -> torch.Tensor:
    """Attention output `name` restricted to the rows' real queries (cu_seqlens_q: row b's first n_b query slots;
    the right padding of a batch is not part of the contract): o [B, T, ...] to [n, ...], scores and blocks
    [B, H, T, ...] to [n, H, ...]. Other outputs as they are."""
    cu = entry.inputs.get("cu_seqlens_q")
    q_pos = entry.inputs.get("q_pos")
    if cu is None or q_pos is None or name not in ("o", "scores", "blocks"):
        return t
    B, T = q_pos.shape
    n = (cu[1:] - cu[:-1]).cpu().long()
    real = torch.arange(T)[None, :] < n[:, None]
    if real.all():
        return t
    t = t.detach().cpu()
    return t[real] if name == "o" else t.transpose(1, 2)[real]


def exact_row(entry: GoldenEntry, name: str, got: torch.Tensor, want: torch.Tensor, as_set: bool) -> dict:
    """The row of an output compared exactly: integers as integers, exact floats bit for bit (NaN equal to NaN);
    `as_set`: each row along the last axis sorted first (the order of the ids is unspecified)."""
    got = got.detach().cpu()
    if want.is_floating_point():
        g, w = got.to(want.dtype), want
        equal = (g == w) | (torch.isnan(g) & torch.isnan(w))
    else:
        if got.is_floating_point():
            raise InputError(f"{entry.id}: {name!r} holds integers ({want.dtype}); the kernel gave {got.dtype}")
        g, w = got.long(), want.long()
        if as_set:
            g, w = g.sort(-1).values, w.sort(-1).values
        equal = g == w
        if name == "expert_ids" and "logits" in entry.outputs:
            equal |= tied_choice(entry, got)[:, None]  # rows whose choice differs only among exact ties
    bad = int((~equal).sum())
    return {"name": name, "ok": bad == 0, "bad": bad, "elements": want.numel(),
            "compared": "as sets along the last axis" if as_set else "elementwise"}


def replay_impl(path: str | Path, impl: str, *, ops: Sequence[str] | None = None, device: str = "cpu",
                kernel_dtype: str | None = None, skip: Sequence[str] = ()) -> dict:
    """Run a user's kernel `impl` ("module:function", importable) on every entry of bundle `path` (of `ops`):
    function(entry) gets the entry with its inputs on `device` and returns {output name: tensor} (or None: not
    this entry). Outputs named in `skip` (in any entry) are left out; every other output of an entry the function
    ran on must be given. Returns {entries, ran, skipped_entries, checks, failures, missing, ignored, results}: one
    result row per output (file, output, ok, and `compare`'s sizes); `ignored`: "file:output" for outputs the
    function gave that its entry lacks (not compared); `ok` is False when an output fails or is missing, or when
    nothing was checked. A function that raises is an InputError carrying its own traceback."""
    import importlib
    import traceback

    try:
        dev = torch.device(device)
    except RuntimeError:
        raise InputError(f"--device {device!r}: not a torch device (cpu, cuda, cuda:1, ...)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"--device {device}: CUDA is not available here")
    mod_name, _, fn_name = impl.partition(":")
    if not mod_name or not fn_name:
        raise InputError(f"--impl {impl!r}: expected MODULE:FUNCTION, e.g. my_kernels.golden:run")
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
    except (ImportError, AttributeError) as e:
        raise InputError(f"--impl {impl!r}: cannot import it ({e}); is the module on PYTHONPATH?") from None
    entries = load(path, ops=ops)
    names = {n for e in entries for n in e.outputs}
    unknown = sorted(set(skip) - names)
    if unknown:
        raise InputError(f"--skip-outputs {unknown[0]!r}: no entry has that output (outputs: {sorted(names)})")
    rows, skipped, ignored = [], [], []
    for entry in entries:
        entry.inputs = {k: v.to(dev) for k, v in entry.inputs.items()}  # outputs: compare brings them to the host
        try:
            got = fn(entry)
        except Exception as e:  # the user's kernel failed: its own traceback, not the replay's frames
            theirs = "".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next)).rstrip()
            raise InputError(f"--impl {impl} raised on {entry.file}:\n{theirs}") from None
        if got is None:
            skipped.append(entry.file)
            continue
        if not isinstance(got, (dict, torch.Tensor)):
            raise InputError(f"--impl {impl}: returned {type(got).__name__} for {entry.file}; return {{output name: "
                             "tensor} or None")
        result = compare(entry, got, kernel_dtype=kernel_dtype, skip=[n for n in skip if n in entry.outputs])
        rows += [{"file": entry.file, "output": r.pop("name"), **r} for r in result.rows]
        ignored += [f"{entry.file}:{n}" for n in result.ignored]
    checks = sum(1 for r in rows if not r.get("missing"))
    failures = [r for r in rows if not r["ok"]]
    return {"entries": len(entries), "ran": len(entries) - len(skipped), "skipped_entries": skipped,
            "checks": checks, "failures": failures, "missing": [f"{r['file']}:{r['output']}" for r in rows
                                                                if r.get("missing")],
            "ignored": ignored, "ok": checks > 0 and not failures, "results": rows}


def tied_choice(entry: GoldenEntry, expert_ids: torch.Tensor) -> torch.Tensor:
    """bool [T]: row t of a kernel's `expert_ids` chooses experts whose choice values (sigmoid(logits) + bias,
    fp32) equal, as a multiset, those of the reference's choice: a different resolution of exact ties."""
    scores = torch.sigmoid(entry.outputs["logits"].float())
    bias = entry.inputs.get("bias")
    choice = scores if bias is None else scores + bias.float()
    ids = expert_ids.detach().cpu().long()
    if ids.shape != entry.outputs["expert_ids"].shape or bool(((ids < 0) | (ids >= choice.shape[-1])).any()):
        return torch.zeros(ids.shape[0], dtype=torch.bool)
    mine = choice.gather(-1, ids).sort(-1).values
    ref = choice.gather(-1, entry.outputs["expert_ids"].long()).sort(-1).values
    distinct = torch.tensor([len(set(r.tolist())) == len(r) for r in ids], dtype=torch.bool)
    return (mine == ref).all(-1) & distinct


def parametrize(path: str | Path, *, ops: Sequence[str] | None = None, argname: str = "golden_entry"):
    """A `pytest.mark.parametrize` over the entries of bundle `path` (ids: `op/layerNNN_phase`):

        @golden.parametrize("bundle/", ops=["nvfp4_linear"])
        def test_my_gemm(golden_entry):
            assert golden.compare(golden_entry, {"y": my_gemm(golden_entry.inputs)}).ok
    """
    import pytest

    entries = load(path, ops=ops)
    return pytest.mark.parametrize(argname, entries, ids=[e.id for e in entries])
