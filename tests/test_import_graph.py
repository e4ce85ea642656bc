"""The package's import graph has no cycle, ``TYPE_CHECKING`` imports included (the layers
themselves are checked by import-linter in ``make test``)."""

import grimp


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in graph.find_modules_directly_imported_by(module):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


def test_no_module_imports_itself_through_others():
    graph = grimp.build_graph("fitforge", include_external_packages=False)
    assert _cycles(graph) == []
    assert len(graph.modules) > 50  # the whole package was read


def test_at_most_eight_modules_sit_at_the_top_of_the_package():
    graph = grimp.build_graph("fitforge", include_external_packages=False)
    top = [m for m in graph.find_children("fitforge") if not graph.find_children(m)]
    assert len(top) <= 8, top


def test_handlers_hold_no_rank_logic():
    """A handler asks ``state.run.ranks`` (fitforge.core.processes) for what every rank must share;
    only fitforge.distributed (and the metrics' cross-rank sums) speaks torch.distributed."""
    import ast
    from pathlib import Path

    import fitforge.handlers

    found = []
    for path in sorted(Path(fitforge.handlers.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            module = node.module or "" if isinstance(node, ast.ImportFrom) else ""
            if any(n.startswith("torch.distributed") for n in names) or module.startswith(
                ("torch.distributed", "fitforge.distributed.ranks")
            ):
                found.append(f"{path.name}:{node.lineno}")
    assert not found, found
