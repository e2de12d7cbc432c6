"""A command's typer options, derived from its config dataclass (``rmflow.schemas.options``):
one flag per option, its type, default and help the field's. A train option's flag is its dotted
path (``--optimizer.learning-rate``), besides any short name the field gives (``--data``)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import typer

from rmflow.schemas.options import Leaf, leaves

_TYPES: dict[str, Any] = {"int": int, "float": float, "bool": bool, "str": str, "str | None": str | None}


def _annotation(leaf: Leaf, optional: bool) -> Any:
    kind = leaf.type
    if kind.startswith("tuple[str"):
        out: Any = list[str]
    else:
        out = _TYPES.get(kind, str)  # a union (a mixture, a step, a mapping): the text, for the config's parser
    return out | None if optional and out is not (str | None) else out


def flags_of(leaf: Leaf, dotted: bool) -> tuple[str, ...]:
    own = "--" + (leaf.path if dotted else leaf.name).replace("_", "-")
    names = (own, *[f for f in leaf.flags if f != own]) if dotted or not leaf.flags else leaf.flags
    if leaf.type == "bool":
        head, dot, tail = names[0][2:].rpartition(".")
        return (f"{names[0]}/--{head}{dot}no-{tail}",)
    return names


def _param(leaf: Leaf, *, dotted: bool, positional: bool) -> inspect.Parameter:
    name = leaf.path.replace(".", "__")
    if positional:
        info = typer.Argument(..., help=leaf.help)
        return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=_annotation(leaf, False))
    if dotted:  # a tree read from --config too: a flag not given leaves the value to the file or the default
        default: Any = None
        shown = f"{leaf.help} \\[default: {_shown(leaf.default)}]"  # escaped: rich would read it as markup
    else:
        default = ... if leaf.required else list(leaf.default) if isinstance(leaf.default, tuple) else leaf.default
        shown = leaf.help
    panel = f"{leaf.path.rpartition('.')[0]} options" if dotted and "." in leaf.path else None
    info = typer.Option(default, *flags_of(leaf, dotted), help=shown, show_default=not dotted, rich_help_panel=panel)
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=info,
                             annotation=_annotation(leaf, dotted or default is None))


def _shown(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(value) or "none"
    return repr(value) if value in ("", None) else str(value)


def config_options(cls: type, *, dotted: bool = False, positional: tuple[str, ...] = (), exclude: tuple[str, ...] = (),
                   extra: tuple[inspect.Parameter, ...] = ()) -> Callable:
    """Decorate ``fn(options, **extra)`` into a typer command function whose parameters are
    ``cls``'s options (``exclude`` left out, ``positional`` as arguments) and ``extra``;
    ``options`` is {dotted path: value} of the options given (every one, unless ``dotted``: then
    only the flags given, the rest left to a --config file and the defaults)."""
    chosen = [leaf for leaf in leaves(cls) if leaf.path not in exclude]
    params = [_param(leaf, dotted=dotted, positional=leaf.path in positional) for leaf in chosen]
    params = sorted(params, key=lambda p: not isinstance(p.default, typer.models.ArgumentInfo)) + list(extra)
    paths = {leaf.path.replace(".", "__"): leaf.path for leaf in chosen}

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def command(**kwargs):
            options = {paths[k]: _commas(v) if dotted else v for k, v in kwargs.items()
                       if k in paths and (v is not None or not dotted)}
            return fn(options, **{k: v for k, v in kwargs.items() if k not in paths})

        command.__signature__ = inspect.Signature(params)
        command.__annotations__ = {p.name: p.annotation for p in params}
        del command.__wrapped__  # typer reads the signature above, not fn's
        return command

    return decorate


def _commas(value: Any) -> Any:
    """A list flag's values, each split at commas (``--logging.report-to tensorboard,wandb``)."""
    if isinstance(value, (list, tuple)):
        return [part.strip() for v in value for part in str(v).split(",") if part.strip()]
    return value


def parameter(name: str, annotation: Any, info: Any) -> inspect.Parameter:
    """An extra parameter of a command (beside its config's options)."""
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=annotation)
