"""Installation: pyproject.toml builds without deprecation warnings; the stages are extras that
cover every import of their code, with no JAX on a Dataflow worker (rmflow[preprocess]) and no
Beam on an accelerator host (rmflow[train]); the demo installs only what it needs (no PyTorch, no
Google Cloud extras); the tests keep them. The built wheel, installed: tests/project/test_wheel.py."""

import ast
import importlib.metadata
import pathlib
import re
import subprocess
import sys
import tomllib
import warnings

from packaging.requirements import Requirement

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_pyproject_configures_without_deprecation_warnings():
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # SetuptoolsDeprecationWarning included (license as a table)
        dist = apply_configuration(Distribution(), str(REPO / "pyproject.toml"))
    assert dist.metadata.license_expression == "Apache-2.0"


def test_the_demo_installs_without_torch_or_google_cloud():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"])
    assert "torch" not in core and "[gcp]" not in core
    assert any("torch" in d for d in project["optional-dependencies"]["test"])
    dry = subprocess.run(["make", "-n", "-C", str(REPO), "demo", "VENV=/nonexistent-venv"], capture_output=True,
                         text=True, check=True).stdout
    installs = [line for line in dry.splitlines() if "pip install" in line and "--upgrade pip" not in line]
    assert installs and all(line.rstrip().endswith("-e '.[all]'") for line in installs), installs
    for extra in ("preprocess", "train"):
        deps = " ".join(project["optional-dependencies"][extra])
        assert "torch" not in deps and "[gcp]" not in deps, extra
    dry = subprocess.run(["make", "-n", "-C", str(REPO), "test", "VENV=/nonexistent-venv"], capture_output=True,
                         text=True, check=True).stdout
    assert "-e '.[all,test]'" in dry


PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
# Which extras each folder's code runs under (the base dependencies always).
RUNS_UNDER = {"schemas": (), "rendering": ("preprocess", "train"), "pipelines": ("preprocess",), "trainer": ("train",),
              "rmflow": ("preprocess", "train")}
IMPORT_NAMES = {"yaml": "pyyaml", "orbax": "orbax-checkpoint", "absl": "absl-py"}  # import name -> distribution
# Imported only by an opt-in feature, which says which extra to install when it is missing.
OPT_IN = {"wandb": "wandb", "starlette": "starlette", "uvicorn": "uvicorn",  # rmflow serve: the serve extra
          "prometheus_client": "prometheus-client"}


def _dist(name: str) -> str:
    return re.sub(r"[-_.]+", "-", IMPORT_NAMES.get(name, name)).lower()


def _requirements(*extras: str) -> list[Requirement]:
    reqs = [Requirement(r) for r in PROJECT["dependencies"]]
    for extra in extras:
        for r in PROJECT["optional-dependencies"][extra]:
            req = Requirement(r)
            reqs += _requirements(*req.extras) if req.name == "rmflow" else [req]
    return reqs


def _third_party_imports(folder: str) -> set[str]:
    own = {"rmflow", "schemas", "rendering", "pipelines", "trainer"}
    found = set()
    for f in (REPO / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
            found |= {n.split(".")[0] for n in names}
    return {n for n in found if n not in own and n not in sys.stdlib_module_names and n != "__future__"}


def test_each_stage_s_extra_covers_its_imports():
    for folder, extras in RUNS_UNDER.items():
        declared = {_dist(r.name) for r in _requirements(*extras)} | {_dist(d) for d in OPT_IN.values()}
        # a dependency's own dependency (absl comes with grain) counts when the metadata says so
        for r in list(declared):
            try:
                declared |= {_dist(Requirement(x).name) for x in importlib.metadata.requires(r) or ()
                             if "extra ==" not in x}
            except importlib.metadata.PackageNotFoundError:
                pass
        missing = sorted(n for n in _third_party_imports(folder) if _dist(n) not in declared)
        assert not missing, f"{folder}/ imports {missing}, which rmflow[{','.join(extras)}] does not install"


def _closure(reqs: list[Requirement]) -> set[str]:
    """Every distribution installing ``reqs`` brings (from the installed metadata; extras ignored)."""
    seen, todo = set(), [_dist(r.name) for r in reqs]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(name) or ()
        except importlib.metadata.PackageNotFoundError:
            continue
        todo += [_dist(Requirement(x).name) for x in requires if "extra ==" not in x]
    return seen


def test_a_dataflow_worker_installs_no_jax_and_a_training_host_no_beam():
    for r in _requirements("preprocess", "train"):  # the closures below read their installed metadata
        importlib.metadata.distribution(r.name)
    jax = {"jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain"}
    assert not _closure(_requirements("preprocess", "gcp")) & jax
    assert not _closure(_requirements("train")) & {"apache-beam"}
    docker = (REPO / "deploy" / "dataflow" / "Dockerfile").read_text()
    assert "ARG EXTRAS=preprocess,gcp\n" in docker, "the preprocess template image installs the preprocess stage"
    template_image = (REPO / "Makefile").read_text().split("\ntemplate-image:")[1].split("\n\n")[0]
    assert "EXTRAS" not in template_image, "make template-image builds with the Dockerfile's default extras"

