"""What the loop reads of the batch processor and the Estimator is declared (core/state.py's
protocols), never looked up defensively by name."""

import ast
from pathlib import Path

import fitforge

SOURCE = Path(fitforge.__file__).parent


def test_no_attribute_of_the_processor_or_the_estimator_is_read_by_name():
    found = []
    for path in sorted(SOURCE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            if node.func.id not in ("getattr", "hasattr") or len(node.args) < 2:
                continue
            target, name = ast.unparse(node.args[0]), node.args[1]
            named = isinstance(name, ast.Constant) or node.func.id == "hasattr"
            if named and ("processor" in target or "estimator" in target):
                found.append(f"{path.relative_to(SOURCE)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "declare the attribute in core/state.py's protocols instead:\n" + "\n".join(found)
