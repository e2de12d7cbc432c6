"""The manual (docs/, built by MkDocs) and the README's links cannot rot: the site builds in strict
mode (a broken link or anchor, a page left out of the navigation fails), a broken link planted in
a copy fails that build, and every relative link of the README names a file that exists."""

import pathlib
import re
import shutil

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def _build(root: pathlib.Path, site: pathlib.Path) -> None:
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    build(load_config(str(root / "mkdocs.yml"), site_dir=str(site), strict=True))


def test_the_manual_builds_strictly_and_a_broken_link_fails_it(tmp_path, monkeypatch):
    from mkdocs.exceptions import Abort

    monkeypatch.setenv("NO_MKDOCS_2_WARNING", "1")
    _build(REPO, tmp_path / "site")
    assert (tmp_path / "site" / "reference" / "config" / "index.html").is_file()  # the generated reference
    copy = tmp_path / "copy"
    shutil.copytree(REPO / "docs", copy / "docs")
    shutil.copy(REPO / "mkdocs.yml", copy / "mkdocs.yml")
    page = copy / "docs" / "training.md"
    page.write_text(page.read_text() + "\nSee [the missing page](nowhere.md#here).\n")
    with pytest.raises(Abort):
        _build(copy, tmp_path / "broken")


def test_every_relative_link_of_the_readme_names_a_file():
    text = (REPO / "README.md").read_text()
    links = [m.group(1).split("#")[0] for m in re.finditer(r"\]\(([^)\s]+)\)", text)]
    local = [link for link in links if link and "://" not in link]
    assert local, "the README links into the manual"
    assert [link for link in local if not (REPO / link).exists()] == []


def _beam_flags() -> set[str]:
    """Every option Beam's pipeline options know (what preprocess and score pass through to it)."""
    import argparse

    from apache_beam.options.pipeline_options import PipelineOptions

    parser, todo = argparse.ArgumentParser(add_help=False, conflict_handler="resolve"), [PipelineOptions]
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if "_add_argparse_args" in vars(cls):
            cls._add_argparse_args(parser)
    return set(parser._option_string_actions)


def wrong_flags(text: str) -> list[str]:
    """Every ``rmflow COMMAND ... --flag`` a text shows (code blocks, their continued lines joined,
    and inline code) whose flag that command does not have: a command a reader copies must run."""
    import typer

    from rmflow.cli import app

    group = typer.main.get_command(app)
    flags = {name: {"--help", *(o for p in cmd.params for o in (*p.opts, *p.secondary_opts)),
                    *(_beam_flags() if cmd.context_settings.get("allow_extra_args") else ())}  # passed through to Beam
             for name, cmd in group.commands.items()}
    text = re.sub(r"\\\n\s*", " ", text)  # a shell line continued
    found = []
    for m in re.finditer(r"rmflow (\w+)((?: [^`\n|#]*)?)", text):
        command, rest = m.group(1), m.group(2)
        if command not in flags:
            continue
        for flag in re.findall(r"(?<![\w-])(--?[A-Za-z][\w.-]*)", rest):
            if flag not in flags[command] and flag.split("=")[0] not in flags[command]:
                found.append(f"rmflow {command} {flag}")
    return found


def test_every_rmflow_command_the_docs_show_has_the_flags_it_uses():
    """A command in the README or the manual that names an option its command does not have fails
    (an export's model card is held to the same rule in tests/scoring/test_export.py)."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "deploy").rglob("*.md"))]
    wrong = {str(p.relative_to(REPO)): w for p in pages if (w := wrong_flags(p.read_text()))}
    assert not wrong, wrong
    assert wrong_flags("run `rmflow serve --model PATH` to serve it") == ["rmflow serve --model"]


def test_the_architecture_map_shows_both_tables_as_the_code_holds_them():
    """docs/architecture.md's two tables name every data kind (its record type and unit) and
    every head (its Hugging Face class and PEFT task), as schemas.kinds and schemas.heads say."""
    from rmflow.schemas.heads import HEADS
    from rmflow.schemas.kinds import KINDS

    text = (REPO / "docs" / "architecture.md").read_text()
    rows = {line.split("|")[1].strip().strip("`"): line for line in text.splitlines() if line.startswith("| `")}
    for kind in KINDS.values():
        row = rows.get(kind.name, "")
        assert f"`{kind.record.__name__}`" in row and kind.unit in row and f"`{kind.head.name}`" in row, kind.name
        assert all(mode in row for mode in kind.eval_modes), kind.name
    heads = HEADS.values() if isinstance(HEADS, dict) else HEADS
    for head in heads:
        row = rows.get(head.name, "")
        assert f"*{head.hf_head}" in row and f"`{head.peft_task}`" in row, head.name
