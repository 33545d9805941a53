"""The shape docs/testing.md's contributing rules ask of the code: short functions that take
few parameters (a trial's state travels as one object, not as loose arguments)."""

import ast
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "src" / "hpo"
MAX_LINES = 80
MAX_PARAMETERS = 6


def _functions() -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    found = []
    for path in sorted(SOURCE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                found.append((f"{path.relative_to(SOURCE)}:{node.lineno} {node.name}", node))
    return found


def parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Its parameters, a method's self or cls not counted, *args and **kwargs one each."""
    a = node.args
    names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
    return (len([n for n in names if n not in ("self", "cls")])
            + (a.vararg is not None) + (a.kwarg is not None))


def test_every_function_is_under_80_lines():
    long = [where for where, node in _functions()
            if (node.end_lineno or node.lineno) - node.lineno + 1 >= MAX_LINES]
    assert not long


def test_no_function_takes_more_than_six_parameters():
    assert len(_functions()) > 500  # the walk reached the package
    many = [f"{where} ({parameters(node)})" for where, node in _functions()
            if parameters(node) > MAX_PARAMETERS]
    assert not many


def test_the_count_sees_every_kind_of_parameter():
    (node,) = ast.parse("def f(self, a, /, b, *c, d, **e): pass").body
    assert isinstance(node, ast.FunctionDef) and parameters(node) == 5
