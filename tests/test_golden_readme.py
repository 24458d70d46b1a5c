"""Every golden bundle README.md shows is exported as written and passes `examples/kernel_test` (the numpy
implementation of every op, written from the manifest), and its manifest describes exactly the tensors and
parameters its entries hold, without pointers into the engine's source."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest
from golden_example import check_manifest, run_example

from minimax_ref import golden
from minimax_ref.cli.main import main

ROOT = Path(__file__).parents[1]


def readme_golden_commands() -> list[list[str]]:
    """The `minimax-ref golden ... --out DIR` exports in README.md's bash blocks (continuation lines joined), as
    argv; the one that needs a real checkpoint folder (`--ckpt-path DIR`) is left out."""
    text = (ROOT / "README.md").read_text()
    cmds = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if line.startswith("minimax-ref golden") and "--out" in line and "--ckpt-path DIR" not in line:
                cmds.append(shlex.split(line.replace('"..."', '"a golden prompt"'))[1:])
    return cmds


COMMANDS = readme_golden_commands()
SINGLE_OP = [c for c in COMMANDS if "--op" in c]
MODEL = [c for c in COMMANDS if "--op" not in c]


def test_readme_shows_every_kind_of_bundle():
    ops = {c[c.index("--op") + 1] for c in SINGLE_OP}
    assert ops == set(golden.SINGLE_OPS)
    flags = {f for c in SINGLE_OP for f in c if f.startswith("--")}
    assert {"--edge", "--act-quant", "--sweep", "--stacked", "--align-block"} <= flags
    assert MODEL and any("--page-size" in c for c in MODEL)


def _export(cmds: list[list[str]], tmp: Path, capsys) -> list[Path]:
    outs = []
    for i, argv in enumerate(cmds):
        argv = list(argv)
        k = argv.index("--out")
        argv[k + 1] = str(tmp / f"{i}-{Path(argv[k + 1]).name}")
        assert main(argv) == 0, argv
        capsys.readouterr()
        outs.append(Path(argv[k + 1]))
    return outs


def _passed(proc: subprocess.CompletedProcess) -> int:
    found = re.search(r"(\d+) passed", proc.stdout)
    return int(found.group(1)) if found else 0


@pytest.mark.slow
def test_readme_single_op_bundles_pass_the_example(tmp_path, capsys):
    outs = _export(SINGLE_OP, tmp_path, capsys)
    for out in outs:
        check_manifest(out)
        assert all(f.stat().st_mode & 0o777 == (out / "manifest.json").stat().st_mode & 0o777
                   for f in out.rglob("*.safetensors"))
    proc = run_example(outs, tmp_path)
    assert proc.returncode == 0 and "failed" not in proc.stdout, proc.stdout[-4000:] + proc.stderr[-2000:]
    entries = [e for out in outs for e in golden.load(out)]
    assert _passed(proc) >= len(entries), proc.stdout[-2000:]


@pytest.mark.slow
def test_readme_model_bundles_pass_the_example(tmp_path, capsys):
    outs = _export(MODEL, tmp_path, capsys)
    for out in outs:
        check_manifest(out)
    model = next(o for o in outs if golden.load(o, ops=["msa"]))
    msa = golden.load(model, ops=["msa"])
    assert any(bool((e.inputs["block_table"] >= 0).sum(-1).min() > 1) for e in msa)  # several pages a row
    assert any(bool((e.outputs["blocks"] >= 0).sum(-1).max() < -(-int(e.inputs["seq_lens"].max()) // 16))
               for e in msa)  # the selection drops blocks
    proc = run_example(outs, tmp_path)
    assert proc.returncode == 0 and "failed" not in proc.stdout, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert _passed(proc) >= sum(len(golden.load(o)) for o in outs)
