"""The docs' configuration reference, generated from the config dataclasses (never written by
hand): every command's options with their flags, YAML keys, defaults and help, and the keys of a
workflow's sections. ``python -m rmflow.reference docs/reference/config.md`` (``make reference``)
writes it; the test suite fails when the file is not what this module generates."""

from __future__ import annotations

import sys
from typing import Any

from rmflow.cli_options import flags_of
from rmflow.schemas.config import EvalConfig, ExportConfig, PreprocessConfig, ScoreConfig, ServeConfig
from rmflow.schemas.options import leaves, sections
from rmflow.schemas.train_config import TrainConfig

# (command, config, positional options, options not given as flags, what the command's text adds)
COMMANDS = (
    ("preprocess", PreprocessConfig, (), ("beam_args",),
     "Any other `--option` is a Beam pipeline option, passed to Beam unchanged (`beam_args`); one Beam does not "
     "know either is refused, naming the nearest option of the command."),
    ("train", TrainConfig, (), (),
     "Options come from `--config FILE.yaml` (sections nested, or dotted keys), the flags below and "
     "`--set key=value` (the dotted key), each over the one before. An unknown key is refused, naming the known ones."),
    ("eval", EvalConfig, (), (), ""),
    ("export", ExportConfig, ("run",), (), ""),
    ("score", ScoreConfig, (), ("beam_args",),
     "With `--runner`, any other `--option` is a Beam pipeline option (`beam_args`); one Beam does not know "
     "either is refused, naming the nearest option of the command."),
    ("serve", ServeConfig, ("model",), (), ""),
)


def _shown(value: Any) -> str:
    if value is None or value == () or value == "":
        return "-"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, tuple):
        return "`" + ",".join(map(str, value)) + "`"
    return f"`{value!r}`" if isinstance(value, str) and (value.strip() != value) else f"`{value}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def command_reference(name: str, cls: type, positional: tuple[str, ...], hidden: tuple[str, ...], note: str) -> str:
    dotted = cls is TrainConfig
    lines = [f"## `rmflow {name}`", ""]
    if note:
        lines += [note, ""]
    groups: dict[str, list] = {}
    for leaf in leaves(cls):
        groups.setdefault(leaf.path.rpartition(".")[0], []).append(leaf)
    helps = {n: f.metadata["help"] for n, f in sections(cls).items()}
    for prefix, group in sorted(groups.items(), key=lambda g: g[0] != ""):  # the top level first
        if prefix:
            lines += [f"### `{prefix}`", "", helps[prefix], ""]
        lines += ["| key | flag | default | |", "|---|---|---|---|"]
        for leaf in group:
            if leaf.path in positional:
                flag = f"argument `{leaf.name.upper()}`"
            elif leaf.path in hidden:
                flag = "-"
            else:
                flag = ", ".join(f"`{f}`" for f in flags_of(leaf, dotted))
            default = "required" if leaf.required or leaf.path in positional else _shown(leaf.default)
            lines.append(f"| `{leaf.path}` | {flag} | {default} | {_cell(leaf.help)} |")
        lines.append("")
    return "\n".join(lines)


def workflow_reference() -> str:
    from rmflow.workflow import EVAL_KEYS, EXPORT_KEYS, PREPROCESS_SET, TRAIN_SET

    return "\n".join([
        "## `rmflow run workflow.yaml`", "",
        "A workflow is a YAML mapping: `output` (its folder) and one section per stage, each holding that "
        "command's keys as above.", "",
        "| section | keys | set by the workflow |", "|---|---|---|",
        f"| `preprocess` | `rmflow preprocess`'s | {', '.join(f'`{k}`' for k in PREPROCESS_SET)} |",
        f"| `train` | `rmflow train`'s | {', '.join(f'`{k}`' for k in TRAIN_SET)} |",
        f"| `eval` (optional) | {', '.join(f'`{k}`' for k in sorted(EVAL_KEYS))} | `model`, `output`; "
        "`data` defaults to the workflow's shards |",
        f"| `export` (optional) | `true`, or {', '.join(f'`{k}`' for k in sorted(EXPORT_KEYS))} | `run`, `output` |",
        "",
    ])


def generate() -> str:
    parts = ["# Configuration reference", "",
             "Generated from the config dataclasses by `make reference` (`python -m rmflow.reference "
             "docs/reference/config.md`); do not edit. Every option has one definition: its flag, its "
             "YAML key and this page are read from it.", ""]
    parts += [command_reference(*c) for c in COMMANDS]
    parts.append(workflow_reference())
    return "\n".join(parts)


def main(argv: list[str]) -> int:
    text = generate()
    if not argv:
        sys.stdout.write(text)
        return 0
    with open(argv[0], "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
