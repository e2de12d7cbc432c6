"""Installation: pyproject.toml builds without deprecation warnings, and the demo installs only
what it needs (no PyTorch, no Google Cloud extras); the tests keep them."""

import pathlib
import subprocess
import tomllib
import warnings

REPO = pathlib.Path(__file__).resolve().parents[1]


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
    assert installs and all(line.rstrip().endswith("-e .") for line in installs), installs
    dry = subprocess.run(["make", "-n", "-C", str(REPO), "test", "VENV=/nonexistent-venv"], capture_output=True,
                         text=True, check=True).stdout
    assert "-e '.[test]'" in dry
