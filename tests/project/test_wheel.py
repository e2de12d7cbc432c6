"""rmflow as users install it: the built wheel, installed (not editable) into a fresh virtualenv
with one extra at a time. Every file of the source trees ships; every command's ``--help`` runs;
``preprocess`` runs under the preprocess extra, ``train``, ``export`` and ``eval`` of a raw JSONL
(preprocessed in process, no Beam) under the train extra,
``serve`` answers a real request under the serve extra; a command whose extra is missing says
which to install in one line.

The virtualenvs are offline: each gets the wheel (``pip install --no-deps``) and, for its
dependencies, exactly the distributions pip would install for ``rmflow[EXTRA]`` (resolved from
the wheel's metadata and the installed packages' own, markers and extras evaluated), linked
file by file from this environment. A module an extra does not declare is therefore missing
there, as it would be on a user's machine.
"""

from __future__ import annotations

import email.parser
import gzip
import importlib.metadata
import itertools
import json
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import time
import zipfile

import pytest
import requests
from packaging.requirements import Requirement

REPO = pathlib.Path(__file__).resolve().parents[2]
TREES = {"rmflow": "rmflow", "rmflow/schemas": "schemas", "rmflow/rendering": "rendering", "rmflow/pipelines": "pipelines",
         "rmflow/trainer": "trainer"}
COMMANDS = ("preprocess", "train", "run", "eval", "score", "serve", "export")
DEMO = "rmflow/demo/hh_rlhf_helpful_sample.jsonl.gz"


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    """Built from a copy of what the build reads (the project files and the source trees), not
    in the checkout: setuptools never removes a file from build/lib, so a module moved away would
    ship beside its new home."""
    out, tree = tmp_path_factory.mktemp("wheel"), tmp_path_factory.mktemp("tree")
    for name in ("pyproject.toml", "setup.py", "README.md"):  # what the build reads, and the trees it packages
        shutil.copy(REPO / name, tree / name)
    for folder in set(TREES.values()):
        shutil.copytree(REPO / folder, tree / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "-w", str(out), str(tree)], check=True, capture_output=True)
    [built] = out.glob("rmflow-*.whl")
    return built


def _wheel_requires(wheel: pathlib.Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as z:
        [meta] = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        message = email.parser.Parser().parsestr(z.read(meta).decode())
    return [Requirement(r) for r in message.get_all("Requires-Dist") or []]


def _closure(wheel: pathlib.Path, extra: str) -> list[importlib.metadata.Distribution]:
    """The installed distributions ``pip install rmflow[extra]`` brings."""
    own = _wheel_requires(wheel)
    todo, extras_of, found = [Requirement(f"rmflow[{extra}]")], {}, {}
    while todo:
        req = todo.pop()
        name = _canonical(req.name)
        wanted = set(req.extras)
        if name in extras_of and wanted <= extras_of[name]:
            continue
        extras_of[name] = extras_of.get(name, set()) | wanted
        if name == "rmflow":
            requires = own
        else:
            try:
                found[name] = dist = importlib.metadata.distribution(name)
            except importlib.metadata.PackageNotFoundError:
                continue  # a dependency for another platform or Python (its marker is false here)
            requires = [Requirement(r) for r in dist.requires or ()]
        for r in requires:
            if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in extras_of[name] or {""}):
                todo.append(r)
    return list(found.values())


def _link_site(dists: list[importlib.metadata.Distribution], site: pathlib.Path) -> None:
    for dist in dists:
        for f in dist.files or ():
            if str(f).startswith(".."):  # console scripts, outside site-packages
                continue
            src, dst = pathlib.Path(dist.locate_file(f)), site / f
            if src.exists() and not dst.exists():
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.symlink_to(src)


@pytest.fixture(scope="module")
def venvs(wheel, tmp_path_factory):
    """``venvs(extra)``: a virtualenv with the wheel and rmflow[extra]'s dependencies (made once)."""
    made = {}

    def make(extra: str) -> pathlib.Path:
        if extra not in made:
            root = tmp_path_factory.mktemp(f"venv-{extra}")
            subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "env")], check=True)
            python = root / "env" / "bin" / "python"
            subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
                            "--no-index", str(wheel)], check=True, capture_output=True)
            _link_site(_closure(wheel, extra), root / "deps")
            [site] = (root / "env" / "lib").glob("python3*/site-packages")
            (site / "rmflow_test_dependencies.pth").write_text(f"import site; site.addsitedir({str(root / 'deps')!r})\n")
            made[extra] = root / "env"
        return made[extra]

    return make


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, "JAX_PLATFORMS": "cpu", "COLUMNS": "200"}


def _rmflow(venv: pathlib.Path, *args: str, cwd: pathlib.Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(venv / "bin" / "rmflow"), *args], cwd=cwd, env=_env(), capture_output=True,
                          text=True, timeout=timeout)


def _every_help(venv: pathlib.Path, cwd: pathlib.Path) -> None:
    """``rmflow --help`` through the installed console script, then every command's ``--help`` in
    one process of the virtualenv (the installed package, its typer app; one start, not eight)."""
    r = _rmflow(venv, "--help", cwd=cwd)
    assert r.returncode == 0 and all(c in r.stdout for c in COMMANDS), r.stdout + r.stderr
    script = ("import sys; from typer.testing import CliRunner; from rmflow.cli import app\n"
              f"for c in {COMMANDS!r}:\n"
              "    r = CliRunner().invoke(app, [c, '--help'])\n"
              "    assert r.exit_code == 0 and 'Usage' in r.output, (c, r.output, r.exception)\n"
              "import rmflow; print(rmflow.__file__)")
    r = subprocess.run([str(venv / "bin" / "python"), "-c", script], cwd=cwd, env=_env(), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert str(venv) in r.stdout, f"not the installed wheel: {r.stdout}"


def _refused_for_extra(result: subprocess.CompletedProcess, extra: str) -> None:
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"pip install 'rmflow[{extra}]'" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_the_wheel_ships_every_file_of_the_trees(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {n.split("/")[0] for n in names} == {"rmflow", next(n.split("/")[0] for n in names if ".dist-info/" in n)}
    expected = set()
    for installed, folder in TREES.items():
        for f in (REPO / folder).rglob("*"):
            rel = f.relative_to(REPO / folder)
            if f.is_file() and "__pycache__" not in rel.parts and (f.suffix == ".py" or rel.parts[0] == "demo"):
                expected.add(f"{installed}/{rel.as_posix()}")
    assert "rmflow/server/app.py" in expected and "rmflow/trainer/modeling/decoder.py" in expected
    assert not expected - names, f"not in the wheel: {sorted(expected - names)}"
    stale = {n for n in names if n.endswith(".py")} - expected
    assert not stale, f"in the wheel but in no tree of the checkout: {sorted(stale)}"


@pytest.mark.slow
def test_the_preprocess_extra_alone(venvs, tmp_path):
    venv = venvs("preprocess")
    _every_help(venv, tmp_path)
    jax = subprocess.run([str(venv / "bin" / "python"), "-c", "import jax"], cwd=tmp_path, env=_env(),
                         capture_output=True)
    assert jax.returncode != 0, "rmflow[preprocess] must not bring JAX"
    r = _rmflow(venv, "preprocess", "-i", str(REPO / DEMO), "--tokenizer", str(REPO / "rmflow/demo/tokenizer"),
                "-o", str(tmp_path / "shards"), "--max-length", "128", "--max-bad-fraction", "1", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "shards" / "COMPLETED").exists()
    _refused_for_extra(_rmflow(venv, "train", "--data", str(tmp_path / "shards"), "--model", "micro", "-o",
                               str(tmp_path / "run"), cwd=tmp_path), "train")


@pytest.mark.slow
def test_the_train_extra_alone_then_serve(venvs, demo_shards, tmp_path):
    venv = venvs("train")
    _every_help(venv, tmp_path)
    with gzip.open(REPO / DEMO, "rt") as f:  # raw files: a named eval set, then eval of them
        (tmp_path / "raw.jsonl").write_text("".join(itertools.islice(f, 12)))
    # a raw named eval set is preprocessed in process: no Beam in this environment
    r = _rmflow(venv, "train", "--data", str(demo_shards), "--model", "micro", "-o", str(tmp_path / "run"),
                "--set", "max_steps=1", "--set", "batch_size=4", "--data.eval", f"raw={tmp_path / 'raw.jsonl'}",
                cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "run" / "eval_data" / "raw" / "COMPLETED").exists()
    r = _rmflow(venv, "export", str(tmp_path / "run"), "-o", str(tmp_path / "export"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    # eval of a raw JSONL preprocesses it in process: no Beam in this environment
    r = _rmflow(venv, "eval", "--model", str(tmp_path / "export"), "--data", str(tmp_path / "raw.jsonl"), "-o",
                str(tmp_path / "ev"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "ev" / "eval.json").read_text())["metrics"]["input"]["counts"]["records_read"] == 12
    _refused_for_extra(_rmflow(venv, "preprocess", "-i", str(REPO / DEMO), "--tokenizer", "t", "-o",
                               str(tmp_path / "shards"), cwd=tmp_path), "preprocess")
    _refused_for_extra(_rmflow(venv, "serve", str(tmp_path / "export"), cwd=tmp_path), "serve")

    served = venvs("serve")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([str(served / "bin" / "rmflow"), "serve", str(tmp_path / "export"), "--port", str(port),
                             "--max-length", "32", "--max-batch-rows", "1", "--token-budget", "32"],
                            cwd=tmp_path, env=_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 240
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if requests.get(url + "/health", timeout=5).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(0.1)
        text = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
        r = requests.post(url + "/get_reward", data=json.dumps({"query": [text]}), timeout=120)
        assert r.status_code == 200, r.text
        [reward] = r.json()["rewards"]
        assert isinstance(reward, float)
    finally:
        proc.kill()
        proc.wait(30)
        log.close()
