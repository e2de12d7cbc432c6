"""The packages' code stays in small pieces: no function longer than 60 lines, none with more
than 8 parameters (a config section or a small spec object travels instead). The attention
kernels are the one exception: their parameters are the kernel's operands (Pallas passes one ref
per operand; the custom VJP's residuals mirror them), and their layout is the GPU's to measure."""

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("schemas", "rendering", "pipelines", "trainer", "rmflow")
MAX_LINES, MAX_PARAMETERS = 60, 8
KERNEL_MODULES = {"trainer/modeling/pallas_attention.py", "trainer/modeling/attention.py",
                  "trainer/modeling/masking.py"}


def _functions():
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield str(path.relative_to(REPO)), node


def _parameters(node) -> int:
    a = node.args
    names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)] + [x.arg for x in (a.vararg, a.kwarg) if x]
    return len([n for n in names if n not in ("self", "cls")])


def test_no_function_is_longer_than_60_lines():
    long = [f"{path}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines"
            for path, node in _functions() if node.end_lineno - node.lineno + 1 > MAX_LINES]
    assert not long, "split these:\n" + "\n".join(long)


def test_no_function_takes_more_than_8_parameters():
    many = [f"{path}:{node.lineno} {node.name}: {_parameters(node)} parameters" for path, node in _functions()
            if _parameters(node) > MAX_PARAMETERS and path not in KERNEL_MODULES]
    assert not many, "pass a config section or a small spec object instead:\n" + "\n".join(many)


def test_the_checks_can_fail(tmp_path):
    probe = ast.parse("def f(a, b, c, d, e, f, g, h, i):\n" + "    x = 1\n" * 61)
    [node] = [n for n in ast.walk(probe) if isinstance(n, ast.FunctionDef)]
    assert _parameters(node) == 9 and node.end_lineno - node.lineno + 1 == 62
