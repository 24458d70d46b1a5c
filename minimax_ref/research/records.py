"""Reading the JSON files a flag names: a JSONL file of records (score traces, eval tasks: one record a non-blank line,
each parsed by the caller, the first bad line named as `path:line` in the error), or one JSON document (`--tools`,
`--expert-mask`). JSONL lines end at "\n" (`jsonl_lines`); a UTF-8 byte order mark at the start is skipped."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from ..errors import InputError, MiniMaxRefError

Record = TypeVar("Record")


def jsonl_lines(text: str) -> list[str]:
    """The lines of a JSONL text: split at "\n" only, each without a trailing "\r". JSON strings may hold U+2028,
    U+2029 and U+0085 unescaped, where `str.splitlines` would also split (and misnumber the lines after)."""
    lines = text.split("\n")
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def read_json(path: str | Path, *, flag: str) -> object:
    """The JSON document in `path`. InputError naming the `flag` and the path: unreadable, not UTF-8, not JSON."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8-sig"))  # a byte order mark at the start is skipped
    except OSError as e:
        raise InputError(f"{flag} {path}: cannot read ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{flag} {path}: not valid UTF-8 JSON ({e})") from None


def read_jsonl(path: str | Path, parse: Callable[[object, int], Record], *, flag: str, what: str) -> list[Record]:
    """`parse(obj, line_number)` of every non-blank line of `path`. InputError: an unreadable or non-UTF-8 file
    (named with its `flag`), `path:line: ...` for the first line that is not JSON or that `parse` refuses, and a file
    with no record (`what`: the records' name, e.g. "traces")."""
    path = Path(path)
    try:
        # bytes, not read_text: its newline translation would split at a lone "\r"; utf-8-sig drops a BOM
        lines = jsonl_lines(path.read_bytes().decode("utf-8-sig"))
    except OSError as e:
        raise InputError(f"{flag} {path}: cannot read ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise InputError(f"{flag} {path}: not UTF-8 text ({e.reason})") from None
    records = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"not valid JSON ({e.msg} at column {e.colno})") from None
            records.append(parse(obj, n))
        except MiniMaxRefError as e:
            raise InputError(f"{path}:{n}: {e}") from None
    if not records:
        raise InputError(f"{flag} {path}: no {what} (the file is empty)")
    return records
