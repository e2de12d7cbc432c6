"""The manual (docs/, built by MkDocs) and the README's links cannot rot: the site builds in strict
mode (a broken link or anchor, a page left out of the navigation fails), a broken link planted in
a copy fails that build, and every relative link of the README names a file that exists."""

import pathlib
import re
import shutil

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


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
