"""Named data sets of a training run: the shard sets of a weighted mixture (``data``) and the
named evaluation sets (``data.eval``).

``data`` is one shard folder, or a mixture in one of three spellings, all read into the same
``DataSource`` tuple:

* YAML, folders with weights: ``data: {shards/hh: 0.5, shards/uf: 0.3}`` (each set named by its
  folder's last part: ``hh``, ``uf``);
* YAML, names with folders and weights: ``data: {hh: {path: gs://b/hh, weight: 0.5}, ...}``;
* one string (``--data``, ``--set data=``): ``shards/hh=0.5,shards/uf=0.3``.

A mixture is stored in its canonical form, ``{name: {path, weight}}``; one folder stays a string.
Names appear in metric keys (``pairs/hh``, ``eval/hh/accuracy``), so they are short words.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from rmflow.schemas.errors import RmflowError

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class SourceError(RmflowError, ValueError):
    """A ``data`` or ``data.eval`` value cannot be read; the message says how to write it."""


@dataclasses.dataclass(frozen=True)
class DataSource:
    """One shard set of a run's training data: its name, folder and mixture weight."""

    name: str
    path: str
    weight: float = 1.0


def name_of(path: str) -> str:
    """A shard folder's default name: its last path part (``gs://b/x/hh/`` -> ``hh``)."""
    return path.rstrip("/").rsplit("/", 1)[-1]


def _check_name(name: str, what: str) -> str:
    if not isinstance(name, str) or not NAME.match(name):
        raise SourceError(f"{what} name {name!r}: use letters, digits, '_', '.' or '-' (it names metrics such as "
                          f"eval/{{name}}/accuracy); give the set a name with the {{name: {{path: ..., weight: ...}}}} "
                          "form")
    return name


def _weight(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise SourceError(f"data: weight of {name!r} is {value!r}; give a positive number (weights need not sum to 1)")
    return float(value)


def parse_data(value: Any) -> tuple[DataSource, ...]:
    """The run's shard sets from any spelling of ``data`` (see the module docstring)."""
    if isinstance(value, str):
        if not value:
            raise SourceError("data: required (--data): a shard folder, or a mixture folder=weight,...")
        parts = [p.strip() for p in value.split(",")]
        weighted = [_is_weighted(p) for p in parts]
        if not any(weighted):  # one folder (a folder whose last part is like x=1 needs the mapping form)
            return (DataSource(name_of(value), value),)
        weights: dict[str, float] = {}
        for part, is_weighted in zip(parts, weighted):
            path, _, weight = part.rpartition("=")
            if not is_weighted or not path:
                raise SourceError(f"data {value!r}: {part!r} is not folder=weight; write every set of a mixture as "
                                  "folder=weight (a positive number), separated by commas")
            if path in weights:
                raise SourceError(f"data {value!r}: {path} is given twice; give each set once, with its weight")
            weights[path] = float(weight)
        value = weights
    if not isinstance(value, Mapping) or not value:
        raise SourceError(f"data {value!r}: give a shard folder, or a mixture {{folder: weight, ...}} or "
                          "{name: {path: folder, weight: w}, ...}")
    sources = []
    for key, spec in value.items():
        if isinstance(spec, Mapping):
            unknown = sorted(set(spec) - {"path", "weight"})
            if unknown or not isinstance(spec.get("path"), str) or not spec.get("path"):
                raise SourceError(f"data: {key!r}: give {{path: shard folder, weight: number}} (got {dict(spec)!r})")
            sources.append(DataSource(_check_name(key, "data"), spec["path"], _weight(spec.get("weight", 1.0), key)))
        else:
            if not isinstance(key, str) or not key:
                raise SourceError(f"data: {key!r} is not a shard folder")
            sources.append(DataSource(_check_name(name_of(key), "data"), key, _weight(spec, key)))
    _unique([s.name for s in sources], "data")
    return tuple(sources)


def _is_weighted(part: str) -> bool:
    """``folder=weight``: an '=' whose right side reads as a number (``nan`` and ``inf`` too, refused
    later by name); ``gs://b/date=2026-11-25/hh`` and ``data/lang=en`` are folders."""
    if "=" not in part:
        return False
    try:
        float(part.rpartition("=")[2])
    except ValueError:
        return False
    return True


def canonical_data(sources: tuple[DataSource, ...]) -> str | dict[str, dict[str, Any]]:
    """What the config stores: the folder of one set (weight 1), else ``{name: {path, weight}}``."""
    if len(sources) == 1 and sources[0].weight == 1.0 and sources[0].name == name_of(sources[0].path):
        return sources[0].path
    return {s.name: {"path": s.path, "weight": s.weight} for s in sources}


def parse_eval_data(value: Any) -> dict[str, tuple[str, ...]]:
    """``data.eval``: {name: shard folder or raw files (a string, a comma-separated string or a
    list)}; or one string ``name=path,name=path`` (``--set``)."""
    if value in (None, "", {}):
        return {}
    if isinstance(value, str):
        out: dict[str, list[str]] = {}
        for part in filter(None, (p.strip() for p in value.split(","))):
            name, sep, path = part.partition("=")
            if not sep or not path:
                raise SourceError(f"data.eval {part!r}: write name=path (several: name=path,name=path)")
            out.setdefault(name.strip(), []).append(path.strip())
        value = out
    if not isinstance(value, Mapping):
        raise SourceError(f"data.eval {value!r}: give {{name: shard folder or raw files, ...}}")
    sets = {}
    for name, paths in value.items():
        paths = [p.strip() for p in paths.split(",")] if isinstance(paths, str) else paths
        if not isinstance(paths, (list, tuple)) or not paths or not all(isinstance(p, str) and p for p in paths):
            raise SourceError(f"data.eval: {name!r}: give a shard folder or raw files (a path or a list of paths)")
        sets[_check_name(name, "data.eval")] = tuple(paths)
    return sets


def with_paths(sources: tuple[DataSource, ...], fn: Callable[[str], str]) -> tuple[DataSource, ...]:
    return tuple(dataclasses.replace(s, path=fn(s.path)) for s in sources)


def _unique(names: list[str], what: str) -> None:
    seen = {n for n in names if names.count(n) > 1}
    if seen:
        raise SourceError(f"{what}: two sets are named {sorted(seen)}; name them with the "
                          "{name: {path: ..., weight: ...}} form")
