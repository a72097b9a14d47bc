"""The package's imports form no circle: no two modules import each other, directly or around a
loop, and no two folders either (a folder importing a module that imports the folder back is
a lower layer reaching up). Imports inside functions and type-checking blocks count: they tie
the code together all the same."""

import ast
from pathlib import Path

import gouache

ROOT = Path(gouache.__file__).parent


def module_of(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    """gouache module -> the gouache modules it imports (a name imported from a module counts
    as the module; from a package, as the submodule where there is one)."""
    modules = {module_of(path): path for path in ROOT.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.update(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                             for alias in node.names)
        graph[name] = {target for target in found if target in modules and target != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def folder_of(module: str) -> str:
    """gouache.runner.families.unet -> gouache.runner; gouache.config -> gouache.config."""
    parts = module.split(".")
    return ".".join(parts[:2]) if (ROOT / parts[1]).is_dir() else module


def test_no_modules_import_each_other():
    assert circles(imports()) == []


def test_no_folders_import_each_other():
    folders: dict[str, set[str]] = {}
    for source, targets in imports().items():
        if source == "gouache":
            continue
        folders.setdefault(folder_of(source), set()).update(folder_of(t) for t in targets if t != "gouache")
    assert circles({f: t - {f} for f, t in folders.items()}) == []


def test_a_circle_is_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
