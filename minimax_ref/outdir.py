"""Output folders written whole or not at all (`synth`, `prune`, `golden`).

A command that writes a folder checks first that `--out` is new or empty (writing over another checkpoint
would leave a mix of two) and, when it knows the size, that the disk has room. It then writes under a
temporary name beside `--out` and renames the folder when it is complete, so an interrupted or failed
write, a full disk included, leaves nothing behind. Folders and files are created with the process's umask,
as any other file.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import InputError


def check_new_folder(out: Path, nbytes: int | None = None, flag: str = "--out") -> None:
    """Refuse `out` unless it is absent or an empty folder, and (with `nbytes`) a disk with less room than that."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InputError(f"{flag} {out}: {'is a file' if not out.is_dir() else 'is not empty'}: choose a new or "
                         "empty folder (writing over existing files would leave a mix of two outputs)")
    parent = next(p for p in (out.parent, *out.parents) if p.exists())
    try:  # a probe, not os.access: root passes access checks on read-only and virtual file systems
        os.rmdir(tempfile.mkdtemp(prefix=".minimax-ref-probe-", dir=parent))
    except OSError as e:
        raise InputError(f"{flag} {out}: cannot create a folder in {parent} ({e.strerror}); choose a writable "
                         "place") from None
    if nbytes is not None:
        free = shutil.disk_usage(parent).free
        if free < nbytes:
            raise InputError(f"{flag} {out}: the output needs {nbytes / 2**30:,.2f} GiB but {parent} has "
                             f"{free / 2**30:,.2f} GiB free")


@contextmanager
def staged_folder(out: Path, flag: str = "--out") -> Iterator[Path]:
    """A new empty folder beside `out` to write into; renamed to `out` when the block ends normally, removed when
    it raises. `out` must be absent or empty (`check_new_folder`). A full disk (ENOSPC) becomes an InputError."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    if tmp.exists():  # left by a killed run of this process id
        shutil.rmtree(tmp)
    os.mkdir(tmp)  # not tempfile.mkdtemp: its mode 0700 would outlive the rename
    try:
        yield tmp
        if out.exists():
            out.rmdir()  # empty (checked before writing); a file placed there meanwhile makes this fail
        tmp.rename(out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if e.errno == errno.ENOSPC:
            raise InputError(f"{flag} {out}: no space left on the device while writing; nothing was left "
                             "behind") from None
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
