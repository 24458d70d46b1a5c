"""Reading a tool-call block: the namespaced tag tree of its invokes, and each argument value coerced
by the tool's JSON schema (spec `chat.md`).

`_parse_block` is the entry point; `stream.StreamingParser` (and with it `parse_output`) finds the
blocks in generated text and hands their inner text here. A value that does not fit its schema
stays a string and an error entry is added; a block that cannot be read raises `_Malformed`, which
the caller turns into content plus an error entry.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .messages import normalize_tools
from .render import _value_xml
from .tokens import _INVOKE_RE, _TAG_RE, NS

_INT_RE = re.compile(r"[+-]?\d+")
_NUMBER_RE = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")


class _Malformed(Exception):
    pass


@dataclass
class _Element:
    name: str
    attr_name: str | None
    start: int  # span of the inner text in the block
    end: int = -1
    children: list[Any] = field(default_factory=list)  # str | _Element

    @property
    def elements(self) -> list[_Element]:
        return [c for c in self.children if isinstance(c, _Element)]

    def stray_text(self) -> bool:
        return any(isinstance(c, str) and c.strip() for c in self.children)


def _parse_tree(text: str) -> list[Any]:
    """Split a tool-call block's inner text into text runs and namespaced elements."""
    root = _Element("", None, 0)
    stack = [root]
    pos = 0
    while True:
        k = text.find(NS, pos)
        chunk = text[pos:] if k < 0 else text[pos:k]
        if chunk:
            stack[-1].children.append(chunk)
        if k < 0:
            break
        m = _TAG_RE.match(text, k + len(NS))
        if not m:
            raise _Malformed(f"the namespace token at offset {k} is not followed by a tag")
        closing, body = m.group(1) == "/", m.group(2)
        if closing:
            if len(stack) == 1 or stack[-1].name != body:
                want = stack[-1].name if len(stack) > 1 else None
                raise _Malformed(f"closing tag </{body}> does not match "
                                 + (f"<{want}>" if want else "any open tag"))
            stack[-1].end = k
            stack.pop()
        else:
            if not body or body.startswith("/"):
                raise _Malformed("empty tag name")
            inv = _INVOKE_RE.fullmatch(body)
            el = _Element("invoke", inv.group(1) if inv.group(1) is not None else inv.group(2), m.end()) \
                if inv else _Element(body, None, m.end())
            stack[-1].children.append(el)
            stack.append(el)
        pos = m.end()
    if len(stack) > 1:
        raise _Malformed(f"tag <{stack[-1].name}> is never closed")
    return root.children


def _merge(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """`extra` laid over `base`; `properties` and `required` are united rather than replaced."""
    out = {**base, **extra}
    for key in ("properties",):
        if isinstance(base.get(key), Mapping) and isinstance(extra.get(key), Mapping):
            out[key] = {**base[key], **extra[key]}
    if isinstance(base.get("required"), list) and isinstance(extra.get("required"), list):
        out["required"] = list(dict.fromkeys(base["required"] + extra["required"]))
    return out


def _alternatives(schema: Any) -> list[tuple[str, dict]]:
    """Flatten a schema into (type, subschema) alternatives, in the schema's order.

    `allOf` parts are merged into the schema; each `anyOf` / `oneOf` part is merged with the rest of
    the schema into an alternative of its own (at any depth).
    """
    if schema is None or isinstance(schema, bool) or not isinstance(schema, Mapping):
        return [("any", {})]
    schema = dict(schema)
    for sub in schema.pop("allOf", None) or []:
        if isinstance(sub, Mapping):
            schema = _merge(_alternatives_base(sub), schema)
    alts: list[tuple[str, dict]] = []
    for key in ("anyOf", "oneOf"):
        if key in schema:
            base = {k: v for k, v in schema.items() if k not in ("anyOf", "oneOf")}
            for sub in schema[key]:
                merged = _merge(base, sub) if isinstance(sub, Mapping) else base
                alts += _alternatives(merged)
            return alts
    types = schema.get("type")
    if types is None:
        if "properties" in schema or "additionalProperties" in schema:
            types = "object"
        elif "items" in schema:
            types = "array"
        elif "enum" in schema or "const" in schema:
            return [("enum", schema)]
        else:
            return [("any", schema)]
    for t in types if isinstance(types, list) else [types]:
        alts.append((t, schema))
    return alts


def _alternatives_base(schema: Mapping[str, Any]) -> dict[str, Any]:
    # An allOf part's own allOf is merged in first, so nested parts contribute their properties too.
    out = dict(schema)
    for sub in out.pop("allOf", None) or []:
        if isinstance(sub, Mapping):
            out = _merge(_alternatives_base(sub), out)
    return out


def _object_view(schema: Any) -> tuple[dict[str, Any], list[list[str]], Any]:
    """(properties, required lists, additionalProperties) of an object schema, its alternatives
    merged: a name that several alternatives declare may take any of their schemas; the required
    lists are one per alternative (one of them must be met)."""
    alts = [sub for kind, sub in _alternatives(schema) if kind in ("object", "any")] or [{}]
    declared: dict[str, list[Any]] = {}
    for sub in alts:
        for key, prop in (sub.get("properties") or {}).items():
            if prop not in declared.setdefault(key, []):
                declared[key].append(prop)
    props = {k: v[0] if len(v) == 1 else {"anyOf": v} for k, v in declared.items()}
    required = [list(sub.get("required") or []) for sub in alts]
    extras = [sub.get("additionalProperties", True) for sub in alts]
    extra = False if all(e is False for e in extras) else next((e for e in extras if isinstance(e, Mapping)), True)
    return props, required, extra


def _describe(schema: Any) -> str:
    alts = _alternatives(schema)
    return " or ".join(dict.fromkeys(t for t, _ in alts))


def _inner(block: str, el: _Element) -> str:
    return block[el.start:el.end]


def _leaf_text(el: _Element) -> str:
    return "".join(c for c in el.children if isinstance(c, str))


_FAIL = object()


def _same(a: Any, b: Any) -> bool:
    # True == 1 in Python, but not in JSON.
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b


def _enum_ok(value: Any, schema: Mapping) -> bool:
    if "enum" in schema and not any(_same(value, e) for e in schema["enum"]):
        return False
    return "const" not in schema or _same(value, schema["const"])


def _try_leaf(kind: str, text: str, schema: Mapping) -> Any:
    s = text.strip()
    if kind == "string":
        return text
    if kind == "integer":
        if _INT_RE.fullmatch(s):
            return int(s)
        if _NUMBER_RE.fullmatch(s):
            f = float(s)
            if math.isfinite(f) and f.is_integer():
                return int(f)
        return _FAIL
    if kind == "number":
        if _INT_RE.fullmatch(s):
            return int(s)
        if _NUMBER_RE.fullmatch(s):
            f = float(s)
            return f if math.isfinite(f) else _FAIL
        return _FAIL
    if kind == "boolean":
        return {"true": True, "false": False}.get(s.lower(), _FAIL)
    if kind == "null":
        return None if s == "null" else _FAIL
    if kind in ("object", "array"):
        if not s:
            return {} if kind == "object" else []
        # Models sometimes write a structured value as JSON text inside the tag.
        try:
            value = json.loads(s)
        except ValueError:
            return _FAIL
        return value if isinstance(value, dict if kind == "object" else list) else _FAIL
    if kind == "enum":
        for e in schema.get("enum", [schema.get("const")]):
            if _value_xml(e) == text or (not isinstance(e, str) and _value_xml(e) == s):
                return e
        return _FAIL
    return text  # "any": no schema to go by


# Non-string alternatives are tried before `string`, which would accept anything; an empty value
# prefers a string (then an empty object or list).
_LEAF_ORDER = {"boolean": 0, "integer": 1, "number": 2, "null": 3, "enum": 4, "object": 5, "array": 6,
               "string": 7, "any": 8}
_EMPTY_ORDER = {"string": 0, "enum": 1, "object": 2, "array": 3, "null": 4, "any": 5}


def _coerce(block: str, el: _Element, schema: Any, path: str) -> tuple[Any, list[str]]:
    """Coerce one element by its schema: (value, errors). A misfit is the raw inner text + an error."""
    alts = _alternatives(schema)
    structured = bool(el.elements)
    partial: tuple[Any, list[str]] | None = None
    if structured:
        objects = [sub for kind, sub in alts if kind == "object"]
        tried_objects = False
        for kind, sub in alts:
            if kind not in ("object", "array", "any"):
                continue
            if kind == "object":
                # All object alternatives are read together, so that the one declaring the names wins.
                if tried_objects:
                    continue
                tried_objects = True
                sub = objects[0] if len(objects) == 1 else {"anyOf": objects}
            got = _coerce_structured(block, el, kind, sub, path)
            if got is _FAIL:
                continue
            value, errs = got
            if not errs and _enum_ok(value, sub):
                return value, []
            if partial is None:
                partial = (value, errs or [f"{path}: value is not one of the allowed values"])
    else:
        text = _leaf_text(el)
        order = _EMPTY_ORDER if not text.strip() else _LEAF_ORDER
        for kind, sub in sorted(alts, key=lambda a: order.get(a[0], 9)):
            value = _try_leaf(kind, text, sub)
            if value is not _FAIL and _enum_ok(value, sub):
                return value, []
    if partial is not None:
        return partial
    return _inner(block, el), [f"{path}: value {_inner(block, el)!r} does not fit the schema "
                               f"({_describe(schema)}); kept as a string"]


def _coerce_structured(block: str, el: _Element, kind: str, schema: Mapping, path: str):
    children = el.elements
    if el.stray_text():
        return _FAIL
    if kind == "array" or (kind == "any" and all(c.name == "item" for c in children)):
        if not all(c.name == "item" for c in children):
            return _FAIL
        items_schema = schema.get("items") if isinstance(schema, Mapping) else None
        values, errs = [], []
        for i, c in enumerate(children):
            v, e = _coerce(block, c, items_schema, f"{path}[{i}]")
            values.append(v)
            errs += e
        return values, errs
    return _coerce_object(block, children, schema, path)


def _coerce_repeated(block: str, els: list[_Element], schema: Any, path: str) -> tuple[list[Any], list[str]]:
    """A name given several times among siblings: its values, in order, as one list.

    Under an array schema each repetition is an item (or, written as `<item>`s, a run of items);
    otherwise each is coerced by the schema itself and, unless the schema allows anything, the list
    is flagged.
    """
    alts = _alternatives(schema)
    array = next((sub for kind, sub in alts if kind == "array"), None)
    values: list[Any] = []
    errs: list[str] = []
    for el in els:
        if array is not None:
            runs = bool(el.elements) and all(c.name == "item" for c in el.elements) and not el.stray_text()
            if runs:
                v, e = _coerce(block, el, array, f"{path}[{len(values)}:]")
                if isinstance(v, list):
                    values += v
                    errs += e
                    continue
            v, e = _coerce(block, el, array.get("items"), f"{path}[{len(values)}]")
        else:
            v, e = _coerce(block, el, schema, f"{path}[{len(values)}]")
        values.append(v)
        errs += e
    if array is None and not any(kind == "any" for kind, _ in alts):
        errs.append(f"{path}: given {len(els)} times; the values are kept as a list, but the schema "
                    f"expects {_describe(schema)}")
    return values, errs


def _coerce_object(block: str, children: list[_Element], schema: Any, path: str,
                   ) -> tuple[dict[str, Any], list[str]]:
    props, required, extra = _object_view(schema)
    groups: dict[str, list[_Element]] = {}
    for c in children:
        if c.attr_name is not None:
            raise _Malformed(f"an <invoke> element inside {path}")
        groups.setdefault(c.name, []).append(c)
    out: dict[str, Any] = {}
    errs: list[str] = []
    for name, els in groups.items():
        sub_path = f"{path}.{name}" if path else name
        if name in props:
            sub = props[name]
        else:
            if extra is False:
                errs.append(f"{sub_path}: not a declared property")
            sub = extra if isinstance(extra, Mapping) else None
        # Repeated sibling tags collect into a list: no value is dropped.
        value, e = _coerce(block, els[0], sub, sub_path) if len(els) == 1 else \
            _coerce_repeated(block, els, sub, sub_path)
        out[name] = value
        errs += e
    if not any(all(r in out for r in req) for req in required):
        prefix = path + "." if path else ""
        if len(required) == 1:
            errs += [f"{prefix}{r}: required but missing" for r in required[0] if r not in out]
        else:
            wanted = " or ".join("(" + ", ".join(req) + ")" for req in required)
            errs.append(f"{path or 'arguments'}: fits none of the alternatives' required properties {wanted}")
    return out, errs


def _schema_map(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, Any] | None:
    if tools is None:
        return None
    return {t["function"]["name"]: t["function"].get("parameters") for t in normalize_tools(tools)}


def _parse_block(inner: str, schemas: dict[str, Any] | None) -> tuple[list[dict], list[str]]:
    """Parse the text between a tool-call opener and closer. Raises _Malformed."""
    nodes = _parse_tree(inner)
    calls, errors = [], []
    for node in nodes:
        if isinstance(node, str):
            if node.strip():
                raise _Malformed(f"text {node.strip()[:40]!r} outside <invoke>")
            continue
        if node.attr_name is None:
            raise _Malformed(f"<{node.name}> where an <invoke name=...> was expected")
        if not node.attr_name:
            raise _Malformed("<invoke> without a function name")
        if node.stray_text():
            raise _Malformed(f"text between the arguments of {node.attr_name!r}")
        name = node.attr_name
        where = f"tool call {len(calls) + 1} ({name})"
        if schemas is not None and name not in schemas:
            errors.append(f"{where}: no tool named {name!r} was offered")
        schema = schemas.get(name) if schemas else None
        args, errs = _coerce_object(inner, node.elements, schema or {}, "")
        errors += [f"{where}: argument {e}" for e in errs]
        calls.append({"name": name, "arguments": args})
    if not calls:
        raise _Malformed("a tool-call block without any <invoke>")
    return calls, errors
