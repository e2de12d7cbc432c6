"""Config dataclasses as option trees: one definition per option, read by every surface.

A command's config is a frozen dataclass whose fields are options (``option``) or sections
(``section``: a nested config dataclass, e.g. ``TrainConfig.optimizer``). From that one tree
come: the typed YAML / JSON form (``Config.from_dict``: nested mappings or dotted keys, unknown
keys refused), ``--set key=value``
(``Config.with_overrides``), the CLI's flags (``rmflow.cli_options``, from ``leaves``) and the
docs' config reference (``rmflow.reference``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from typing import Any

from rmflow.schemas import jsontext
from rmflow.schemas.errors import RmflowError


class ConfigError(RmflowError, ValueError):
    """A configuration value is invalid; the message says which and how to fix it."""


def option(default: Any, help: str, *, flags: tuple[str, ...] = (), required: bool = False,
           resume_free: bool = False) -> Any:
    """A config field. ``help``: its one description (CLI help, docs reference). ``flags``: the
    CLI's names for it (default ``--name-with-dashes``; a train option also keeps its dotted
    ``--section.name``). ``required``: the CLI asks for it. ``resume_free``: a resumed run may change
    it without changing what the run computes (where it logs, how it uses the hardware)."""
    return dataclasses.field(default=default, metadata={
        "help": help, "flags": tuple(flags), "required": required, "resume_free": resume_free})


def section(cls: type, help: str, *, optional: bool = False) -> Any:
    """A nested config: ``cls``'s defaults unless given (``optional``: absent, None, unless given)."""
    meta = {"help": help, "section": cls, "optional": optional}
    if optional:
        return dataclasses.field(default=None, metadata=meta)
    return dataclasses.field(default_factory=cls, metadata=meta)


def help_for(cls: type, name: str) -> str:
    return next(f.metadata["help"] for f in dataclasses.fields(cls) if f.name == name)


def section_of(f: dataclasses.Field) -> type | None:
    return f.metadata.get("section")


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One option of a config tree: its dotted path and its field."""

    path: str
    field: dataclasses.Field

    @property
    def name(self) -> str:
        return self.field.name

    @property
    def type(self) -> str:
        return str(self.field.type)

    @property
    def default(self) -> Any:
        return self.field.default

    @property
    def help(self) -> str:
        return self.field.metadata["help"]

    @property
    def flags(self) -> tuple[str, ...]:
        return self.field.metadata.get("flags", ())

    @property
    def required(self) -> bool:
        return self.field.metadata.get("required", False)

    @property
    def resume_free(self) -> bool:
        return self.field.metadata.get("resume_free", False)


def leaves(cls: type, prefix: str = "") -> Iterator[Leaf]:
    """Every option of ``cls``, sections' options included (dotted paths), in declaration order."""
    for f in dataclasses.fields(cls):
        sub = section_of(f)
        if sub is not None:
            yield from leaves(sub, f"{prefix}{f.name}.")
        else:
            yield Leaf(prefix + f.name, f)


def command_flags(cls: type) -> list[str]:
    """Every CLI flag of a config's options: each its own ``--name-with-dashes`` and the flags it
    names (what a misspelt flag is matched against)."""
    return [flag for leaf in leaves(cls) for flag in ("--" + leaf.name.replace("_", "-"), *leaf.flags)]


def sections(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls) if section_of(f) is not None}


_TYPE_WORDS = {"int": "an integer", "float": "a finite number", "bool": "true or false", "str": "a string"}


def _nest(data: Mapping[str, Any], cls: type) -> dict[str, Any]:
    """``{"a.b": 1, "a": {"c": 2}}`` -> ``{"a": {"b": 1, "c": 2}}`` for the sections ``a`` of
    ``cls`` (dotted keys, as ``--set`` takes; deeper levels are their section's to split)."""
    subs = sections(cls)
    out: dict[str, Any] = {}
    for key, value in data.items():
        head, dot, rest = str(key).partition(".")
        if not dot or head not in subs:
            if head in subs and isinstance(out.get(head), dict):
                given = _as_mapping(subs[head], value)
                _refuse_twice(head, out[head], given)
                value = {**out[head], **given}
            out[key] = value
            continue
        inner = _as_mapping(subs[head], out.get(head))
        _refuse_twice(head, inner, {rest: value})
        inner[rest] = value
        out[head] = inner
    return out


def _refuse_twice(section: str, have: Mapping[str, Any], given: Mapping[str, Any]) -> None:
    """One option given twice, nested and dotted (``optimizer: {learning_rate: ...}`` and
    ``optimizer.learning_rate: ...``): two spellings of one key, neither of which may silently win."""
    twice = sorted(set(have) & set(given))
    if twice:
        raise ConfigError(f"{', '.join(f'{section}.{k}' for k in twice)} given twice (nested and dotted, two spellings "
                          "of one option): give it once")


def flatten(cls: type, data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` (nested sections, dotted keys or both) as {dotted path: value} of ``cls``'s options,
    an option given twice refused (``_refuse_twice``): so that another source (a flag) can replace
    any one of them by its dotted name."""
    out: dict[str, Any] = {}
    subs = sections(cls)
    for key, value in _nest(data, cls).items():
        if key in subs and value is not None:  # a section (or its scalar form: data: folder is data.train)
            out.update({f"{key}.{k}": v for k, v in flatten(section_of(subs[key]), _as_mapping(subs[key], value)).items()})
        else:
            out[key] = value
    return out


def _as_mapping(f: dataclasses.Field, value: Any) -> dict[str, Any]:
    """A section's value as a mapping: a scalar is its scalar form, None is empty."""
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return dict(value)
    cls = section_of(f)
    if isinstance(value, cls):
        return value.to_dict()
    scalar = getattr(cls, "SCALAR_FORM", "")
    if not scalar:
        raise ConfigError(f"{f.name} {value!r}: a mapping of {', '.join(x.name for x in dataclasses.fields(cls))}")
    return {scalar: value}


class Config:
    """to_dict / to_json / from_dict / with_overrides and type checks for the config dataclasses."""

    # A section given as a scalar: the field of the section it sets (``model: micro`` = ``model: {path: micro}``).
    SCALAR_FORM: str = ""
    UNKNOWN_HINT: str = ""  # what an unknown key most likely meant

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return jsontext.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def flat(self) -> dict[str, Any]:
        """{dotted path: value} of every option (an absent optional section: its path -> None)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Config):
                out.update({f"{f.name}.{k}": v for k, v in value.flat().items()})
            else:
                out[f.name] = value
        return out

    def _check_types(self) -> None:
        """Each option holds a value of its declared type (a YAML ``"no"`` where a bool belongs, a
        quoted number, a bool where a number belongs are refused); floats are finite; a whole
        float where an int belongs (``1e3`` from YAML) is taken as that int. Sections given as
        mappings (or their scalar form) become their dataclass, errors named by their path."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            sub = section_of(f)
            if sub is not None:
                object.__setattr__(self, f.name, _section_value(sub, f, value))
                continue
            type_text = str(f.type)
            if (value is None and "None" in type_text) or "|" in type_text.replace(" | None", ""):
                continue  # a union of value types (data, step) is checked by its own parser
            if type_text.startswith("int"):
                if isinstance(value, float) and value.is_integer():
                    object.__setattr__(self, f.name, int(value))
                    continue
                ok = isinstance(value, int) and not isinstance(value, bool)
            elif type_text.startswith("float"):
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                if ok:
                    object.__setattr__(self, f.name, float(value))
            elif type_text.startswith("bool"):
                ok = isinstance(value, bool)
            elif type_text.startswith("str"):
                ok = isinstance(value, str)
            elif type_text.startswith("tuple[str"):
                if isinstance(value, str):
                    value = (value,)
                ok = isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)
                if ok:
                    object.__setattr__(self, f.name, tuple(value))
            else:
                continue
            if not ok:
                hint = " (unquoted true or false)" if type_text.startswith("bool") else ""
                if type_text.startswith(("float", "int")) and isinstance(value, str) and _number_text(value):
                    hint = " (unquoted; YAML reads 1e-4 as text: write 1.0e-4)"
                raise ConfigError(f"{f.name} {value!r}: must be {_TYPE_WORDS.get(type_text.split(' ')[0], type_text)}{hint}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]):
        """The config of a mapping: nested sections or dotted keys (``optimizer.learning_rate``).
        An unknown key is refused, naming the known ones."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"{cls.__name__}: a mapping of option: value, not {data!r}")
        data = _nest(data, cls)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = [k for k in data if k not in fields]
        if unknown:
            hint = f"; {cls.UNKNOWN_HINT}" if cls.UNKNOWN_HINT else ""
            raise ConfigError(f"unknown {cls.__name__} keys {sorted(unknown)}; known: {sorted(fields)}{hint}")
        return cls(**data)

    def with_overrides(self, pairs: list[str]):
        """Apply ``key=value`` strings (``--set``), each parsed as its option's type; an optional
    section set to none (``--set lora=none``) is removed."""
        types = {leaf.path: leaf.type for leaf in leaves(type(self))}
        scalar = {name: f"{name}.{section_of(f).SCALAR_FORM}" for name, f in sections(type(self)).items()
                  if getattr(section_of(f), "SCALAR_FORM", "")}  # --set data=folder: data.train
        optional = {name for name, f in sections(type(self)).items() if f.metadata.get("optional")}
        data = self.flat()
        for pair in pairs:
            key, sep, text = pair.partition("=")
            key = scalar.get(key.strip(), key.strip())
            if sep and key in optional and text.strip().lower() in ("", "none", "null"):
                data = {k: v for k, v in data.items() if k != key and not k.startswith(f"{key}.")} | {key: None}
                continue
            if not sep or key not in types:
                raise ConfigError(f"--set {pair!r}: use key=value with a key from {sorted(types)}")
            data[key] = parse_text(text, types[key], key)
        return type(self).from_dict(data)


def _number_text(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _section_value(cls: type, f: dataclasses.Field, value: Any) -> Any:
    if f.metadata.get("optional") and (value is None or (isinstance(value, Mapping) and not value)):
        return None  # an optional section given as {} is absent
    if isinstance(value, cls):
        return value
    if value is None:
        return cls()
    scalar = getattr(cls, "SCALAR_FORM", "")
    if scalar and not isinstance(value, Mapping):
        value = {scalar: value}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{f.name} {value!r}: a mapping of {', '.join(x.name for x in dataclasses.fields(cls))}")
    try:
        return cls.from_dict(value)
    except ConfigError as e:
        text = str(e)
        if text.startswith((f"{f.name} ", f"{f.name}.", f"{f.name}:")):  # named by its path already
            raise
        raise ConfigError(f"{f.name}: {text}" if text.startswith(("unknown", cls.__name__)) else f"{f.name}.{text}") from e


def parse_text(text: str, type_name: str, key: str) -> Any:
    """A ``--set`` value as its option's type (a union of types: the text, for its own parser)."""
    try:
        if type_name == "int":
            return int(text)
        if type_name == "float":
            return float(text)
        if type_name.startswith("tuple[str"):
            return tuple(p.strip() for p in text.split(",") if p.strip())
        if type_name == "bool":
            lowered = text.strip().lower()
            if lowered not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(text)
            return lowered in ("true", "1", "yes")
    except ValueError as e:
        raise ConfigError(f"--set {key}={text}: not a valid {type_name}") from e
    return text
