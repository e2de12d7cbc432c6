"""The wheel's package list, derived from the folders (everything else is in pyproject.toml).

The repository's stage folders install inside the rmflow package: ``schemas/`` as
``rmflow.schemas``, ``rendering/`` as ``rmflow.rendering``, ``pipelines/`` as ``rmflow.pipelines``, ``trainer/`` as
``rmflow.trainer``.
Every folder under these trees ships, found rather than listed by hand: a hand-written list once
left ``rmflow/server/`` out of the wheel. tests/project/test_wheel.py checks that every file of the trees
is in the built wheel."""

from setuptools import find_namespace_packages, setup

TREES = {"rmflow": "rmflow", "rmflow.schemas": "schemas", "rmflow.rendering": "rendering", "rmflow.pipelines": "pipelines",
         "rmflow.trainer": "trainer"}


def packages() -> list[str]:
    found = []
    for name, folder in TREES.items():
        found += [name] + [f"{name}.{sub}" for sub in find_namespace_packages(folder)
                           if "__pycache__" not in sub.split(".")]
    return found


setup(packages=packages(), package_dir={name: folder for name, folder in TREES.items() if name != folder})
