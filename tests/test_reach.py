"""Every reach into another library's private internals is in freetune/reach/ (or FreetuneTrainer, freetune/trainer.py),
where it is named, tagged with the release it was written against, and re-read when a library is upgraded.

The rule, read from the source (an AST walk over freetune/, outside reach/ and trainer.py). A private name is one that
starts with a single underscore (dunders are Python's protocol, not a library's internals). A reach is:
- an import of a private module or name from another library (`import torch._dynamo`, `from x import _y`);
- a private attribute of a name imported from another library, anywhere along the chain (`torch._foreach_copy_`,
  `torch.ops.aten._flash_attention_forward`);
- a private attribute, read by `.` or by getattr/hasattr with a literal or a module constant, that freetune does not
  define itself (`shell._showtraceback`); `self._x` counts as freetune's own only where the same module defines `_x`
  (else it is a foreign base class's: a TrainerCallback reading the Trainer's state);
- a private attribute written (`=`, setattr, delattr) onto anything but `self`/`cls`: freetune's own state on another
  library's object (`_freetune_*` on peft's layers) is kept through freetune.reach.torch.stash;
- a private method defined in a subclass of another library's class (it overrides, or may collide with, the base
  class's internals: BatchRebalanceSampler._assign).
freetune's own private names (the allow-list) are read from the code: defined by a def or class, assigned at module
or class level, or assigned on `self`; a freetune module's private (`kernels._dequantize`) is freetune's own too.
"""

import ast
import sys

from conftest import REPO

PACKAGE = REPO / "freetune"
ALLOWED_FILES = ("reach/", "trainer.py")  # relative to freetune/
NAME_FUNCTIONS = {"getattr": "read", "hasattr": "read", "setattr": "write", "delattr": "write"}


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def is_foreign(module: str) -> bool:
    """Another library's module: neither freetune's own nor Python's standard library (stable by promise)."""
    top = module.split(".")[0]
    return bool(top) and top != "freetune" and top not in sys.stdlib_module_names


def own_private_names(trees: dict) -> tuple[set, dict]:
    """(names freetune defines anywhere, {module: names that module defines}), and the module-level string constants
    that hold a private name ({constant: value}), for getattr(x, CONSTANT)."""
    everywhere, per_module, constants = set(), {}, {}
    for module, tree in trees.items():
        mine = per_module.setdefault(module, set())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                mine.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _base_name(node) in (
                    "self", "cls"):
                mine.add(node.attr)
        for scope in [tree] + [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
            for node in scope.body:
                targets = node.targets if isinstance(node, ast.Assign) else (
                    [node.target] if isinstance(node, ast.AnnAssign) else [])
                for target in targets:
                    for name in ast.walk(target):
                        if isinstance(name, ast.Name):
                            mine.add(name.id)
                            value = getattr(node, "value", None)
                            if scope is tree and isinstance(value, ast.Constant) and isinstance(value.value, str):
                                constants[name.id] = value.value
        everywhere |= mine
    return everywhere, per_module, {k: v for k, v in constants.items() if is_private(v)}


def _base_name(node) -> str | None:
    """The name at the root of an attribute chain (`torch` in torch.ops.aten._x), or None."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def foreign_names(tree) -> set:
    """Names a module binds to another library's modules or objects (import torch; from transformers import X)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names if is_foreign(a.name)}
        elif isinstance(node, ast.ImportFrom) and not node.level and is_foreign(node.module or ""):
            names |= {a.asname or a.name for a in node.names}
    return names


def freetune_module_names(tree) -> set:
    """Names a module binds to freetune's own modules (from freetune.speed import nf4; import freetune.speed.mlp)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] == "freetune"}
        elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == "freetune"):
            names |= {a.asname or a.name for a in node.names}
    return names


def reaches(source: str, module: str = "freetune.example", own=None, per_module=None, constants=None) -> list[str]:
    """Every private reach in `source` (a freetune module's text), as 'line: what'."""
    tree = ast.parse(source)
    if own is None:
        own, per_module, constants = own_private_names({module: tree})
    here, foreign, mine = per_module.get(module, set()), foreign_names(tree), freetune_module_names(tree)
    found = []

    def access(node, base, name: str, write: bool) -> None:
        root = _base_name(base)
        if root in mine:  # a freetune module's private (kernels._dequantize): freetune's own
            return
        if root in foreign:
            found.append(f"{node.lineno}: {ast.unparse(node)} (private of another library)")
        elif root in ("self", "cls") and isinstance(base, ast.Name):
            if not write and name not in here:
                found.append(f"{node.lineno}: {ast.unparse(node)} (a private of self this module does not define: "
                             f"a foreign base class's)")
        elif write:
            found.append(f"{node.lineno}: {ast.unparse(node)} (private attribute written onto another object)")
        elif name not in own:
            found.append(f"{node.lineno}: {ast.unparse(node)} (private attribute freetune does not define)")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names
                      if is_foreign(a.name) and any(is_private(part) for part in a.name.split("."))]
        elif isinstance(node, ast.ImportFrom) and not node.level and is_foreign(node.module or ""):
            if any(is_private(part) for part in node.module.split(".")) or any(is_private(a.name) for a in node.names):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ClassDef) and any(_base_name(base) in foreign for base in node.bases):
            found += [f"{item.lineno}: {node.name}.{item.name} (private method of a subclass of another library's "
                      f"class)" for item in node.body
                      if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and is_private(item.name)]
        elif isinstance(node, ast.Attribute) and is_private(node.attr):
            access(node, node.value, node.attr, isinstance(node.ctx, (ast.Store, ast.Del)))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in NAME_FUNCTIONS
              and len(node.args) >= 2):
            name_arg = node.args[1]
            if isinstance(name_arg, ast.Constant) and isinstance(name_arg.value, str):
                name = name_arg.value
            else:  # a module constant holding the name (FUSED_ATTR, kernels.FUSED_ATTR)
                key = name_arg.id if isinstance(name_arg, ast.Name) else getattr(name_arg, "attr", None)
                name = constants.get(key, "")
            if is_private(name):
                access(node, node.args[0], name, NAME_FUNCTIONS[node.func.id] == "write")
    return found


def freetune_trees() -> dict:
    trees = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        trees[module] = (path, ast.parse(path.read_text()))
    return trees


def test_no_private_reach_into_another_library_outside_freetune_reach_and_the_trainer():
    trees = freetune_trees()
    own, per_module, constants = own_private_names({m: tree for m, (_, tree) in trees.items()})
    found = []
    for module, (path, tree) in trees.items():
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith(ALLOWED_FILES):
            continue
        found += [f"freetune/{relative}:{hit}" for hit in
                  reaches(path.read_text(), module, own, per_module, constants)]
    assert not found, ("private reaches outside freetune/reach/ and freetune/trainer.py; move each into the reach "
                       "module of its library, named and tagged with the release it was written against:\n"
                       + "\n".join(found))


def test_the_rule_finds_each_kind_of_reach_and_passes_freetune_s_own_names():
    violations = {
        "import torch._dynamo\n": "import torch._dynamo",
        "from transformers.trainer import _is_peft_model\n": "_is_peft_model",
        "import torch\ntorch._foreach_copy_(a, b)\n": "torch._foreach_copy_",
        "import torch\ntorch.ops.aten._flash_attention_forward(q)\n": "torch.ops.aten._flash_attention_forward",
        "def show(shell):\n    shell._showtraceback(1, 2, 3)\n": "shell._showtraceback",
        "def f(kernel):\n    return getattr(kernel, '_allow_stdin', False)\n": "_allow_stdin",
        "def f(layer, w):\n    layer._freetune_packed = w\n": "layer._freetune_packed",
        "ATTR = '_freetune_fused'\ndef f(m):\n    setattr(m, ATTR, True)\n": "setattr(m, ATTR, True)",
        "class Callback:\n    def on_log(self):\n        return self._trainer\n": "self._trainer",
        "from transformers import Trainer\nclass T(Trainer):\n    def _save(self):\n        pass\n": "T._save",
    }
    for source, expected in violations.items():
        found = reaches(source)
        assert len(found) == 1 and expected in found[0], (source, found)
    allowed = ("class Sync:\n    def __init__(self):\n        self._token = 1\n"
               "    def _clean(self):\n        return self._token\n"
               "def make():\n    sync = Sync()\n    return sync._clean()\n"
               "import torch\ntorch.__version__\n"
               "from freetune import kernels\nkernels._dequantize(1)\n")
    assert reaches(allowed) == []
