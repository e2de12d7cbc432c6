"""What the benchmark scripts share: where the checkout, the shared data and the demo's tokenizer
are, and the suite's helpers loaded by path.

The scripts run by path (``python benchmarks/NAME.py``), so this folder is first on their import
path and they import this module and each other by name; rmflow itself is imported as installed
(editable in a checkout, the wheel on a GPU machine), never from the checkout's folders.
"""

from __future__ import annotations

import importlib.util
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
SHARED_DATA = REPO.parent / "shared" / "data"  # ../shared/data: the real data sets (read, never shipped)
DEMO_TOKENIZER = REPO / "rmflow" / "demo" / "tokenizer"  # SmolLM2's, embedded for the demo


def load_test_helper(name: str):
    """``tests/NAME.py`` (a helper the suite shares, e.g. ``layouts``' random packed rows) loaded
    from the checkout by path: the checkout itself is never put on the import path, so rmflow is
    the installed one."""
    spec = importlib.util.spec_from_file_location(f"rmflow_test_{name}", REPO / "tests" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
