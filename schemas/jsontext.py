"""JSON text read as every stage reads it: ``loads`` parses one document and refuses what is not
text, a lone surrogate (a ``\\ud800`` escape, valid JSON but no character: it cannot be encoded,
tokenized or written back as UTF-8) anywhere in it, keys included, and, with
``allow_nan=False``, the constants ``NaN`` and ``Infinity`` (not JSON: a reader that echoes a
field back would write a file other tools cannot read). Preprocessing reads NaN so that the
value checks name the field (a NaN margin is a ``bad_value``); scoring and serving refuse it.

``dumps`` and ``dump`` write every JSON text rmflow writes (``tests/project/test_boundary.py`` holds every
module to them): ``json``'s, with a value that is not a finite number (a metric over nothing, a
correlation of a constant) written as ``null``, never as ``NaN`` or ``Infinity``, which strict
readers (jq, JavaScript, ``json.loads`` with ``parse_constant``) refuse."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from rmflow.schemas.errors import RmflowError

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


class NotJsonText(ValueError):
    """A JSON document that cannot be read as text; the message says where and why."""


class NotJsonFile(RmflowError, ValueError):
    """A file rmflow reads as JSON (a model's config.json, a run's files, an export's info) that
    is not: said in one line naming it, never a traceback."""


def read(path: str) -> dict[str, Any]:
    """The JSON object a file holds (``loads``): every JSON file rmflow reads holds one (a model's
    config.json, a run's or an export's own files); NotJsonFile naming the file when it does not."""
    try:
        with open(path, encoding="utf-8") as f:
            value = loads(f.read())
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and NotJsonText are ValueErrors
        raise NotJsonFile(f"{path} is not valid JSON ({type(e).__name__}: {str(e)[:200]}): fix it, or give "
                          "another folder") from None
    if not isinstance(value, dict):
        raise NotJsonFile(f"{path} holds a JSON {type(value).__name__}, not the object it should: fix it, or give "
                          "another folder")
    return value


def _refuse_constant(name: str):
    raise NotJsonText(f"{name} is not JSON (RFC 8259 has no {name}): write null, a number or a string")


def _finite(literal: str) -> float:
    value = float(literal)
    if value in (float("inf"), float("-inf")):  # 1e999: no constant, yet Infinity once written back
        raise NotJsonText(f"{literal} is out of a float's range (it reads as infinity): write a smaller number")
    return value


def loads(text: str, *, allow_nan: bool = True) -> Any:
    """``json.loads(text)``; raises ``json.JSONDecodeError`` on malformed JSON, ``RecursionError``
    on absurd nesting, ``NotJsonText`` on a lone surrogate (naming its place) or a refused constant."""
    obj = json.loads(text, parse_constant=None if allow_nan else _refuse_constant,
                     parse_float=None if allow_nan else _finite)
    # Escapes make surrogates (decoded UTF-8 has none), or a text re-serialised with them raw
    if _SURROGATE_ESCAPE.search(text) or not _encodable(text):
        where = _first_surrogate(obj, "")
        if where is not None:
            raise NotJsonText(f"{where or 'the value'} holds a lone surrogate (a \\ud800-\\udfff escape "
                              "without its pair): not a character; fix the text that wrote it")
    return obj


def _first_surrogate(obj: Any, path: str) -> str | None:
    stack = [(obj, path)]
    while stack:
        value, where = stack.pop()
        if isinstance(value, str):
            if not _encodable(value):
                return where
        elif isinstance(value, dict):
            for k, v in value.items():
                if not _encodable(k):
                    return f"a key of {where or 'the object'}"
                stack.append((v, f"{where}.{k}" if where else str(k)))
        elif isinstance(value, list):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(value))
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def dumps(obj: Any, **kw: Any) -> str:
    """``json.dumps(obj, **kw)``, a non-finite float anywhere in ``obj`` written as null."""
    try:
        return json.dumps(obj, allow_nan=False, **kw)
    except ValueError as e:  # the rare document with a NaN or an infinity: rebuilt without them
        if "Out of range float" not in str(e):
            raise
        return json.dumps(finite(obj), allow_nan=False, **kw)


def dump(obj: Any, f, **kw: Any) -> None:
    """``json.dump(obj, f, **kw)``, as ``dumps`` writes it."""
    f.write(dumps(obj, **kw))


def finite(obj: Any) -> Any:
    """``obj`` with every float that is not finite (NaN, infinities; numpy's too) replaced by None."""
    if isinstance(obj, float) or type(obj).__name__ in ("float32", "float64", "float16"):
        return float(obj) if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj
