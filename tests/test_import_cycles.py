"""freetune's modules import each other in one direction: no module-level import circle.

A circle (a imports b, b imports a) makes the import order matter, hides which module is the lower layer, and is
usually dodged with an import inside a function. Read from the source: every `import` and `from ... import` at a
module's top level, in `if`/`try` blocks there too (`if TYPE_CHECKING:` included: a type-only import is still a
dependency); imports inside functions are left out (heavy or optional libraries are imported there on purpose).
"""

import ast

from conftest import REPO

PACKAGE = REPO / "freetune"


def module_name(path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(module: str, node, modules: set, is_package: bool) -> set:
    """The freetune modules an import statement names (`from freetune.speed import mlp` names freetune.speed.mlp)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: from the module's package, one level up per extra dot
            package = module.split(".") if is_package else module.split(".")[:-1]
            package = package[:len(package) - node.level + 1]
            base = ".".join(package + ([base] if base else []))
        names = [base] + [f"{base}.{alias.name}" for alias in node.names]
    found = set()
    for name in names:
        while name and name not in modules:  # freetune.checkpoint.marker.MARKER -> freetune.checkpoint.marker
            name = name.rpartition(".")[0]
        if name and name != module:
            found.add(name)
    return found


def module_level_imports() -> dict:
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for module, path in paths.items():
        graph[module] = set()
        for statement in ast.parse(path.read_text()).body:
            for node in ast.walk(statement) if isinstance(statement, (ast.If, ast.Try)) else [statement]:
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    graph[module] |= imported_modules(module, node, set(paths), path.name == "__init__.py")
    return graph


def circles(graph: dict) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
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
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle_among_freetune_modules():
    graph = module_level_imports()
    assert "freetune.speed.lora_kernel" in graph["freetune.speed.mlp"]  # `from freetune.speed import lora_kernel`
    assert circles(graph) == [], "module-level import circles in freetune/ (give the shared part its own module)"


def test_a_circle_is_found_and_a_type_only_import_counts():
    graph = {"freetune.a": {"freetune.b"}, "freetune.b": {"freetune.c"}, "freetune.c": {"freetune.a"},
             "freetune.d": {"freetune.a"}}
    assert circles(graph) == [["freetune.a", "freetune.b", "freetune.c"]]
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from freetune.b import B\n"
    node = ast.parse(source).body[1].body[0]
    assert imported_modules("freetune.a", node, {"freetune.a", "freetune.b"}, False) == {"freetune.b"}
