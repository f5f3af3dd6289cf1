"""The package's layering, read from the source: every import of a kvnumba module goes to a
layer below the importer's (or beside it, without a circle), host page accounting
reaches no device, kernels know no cache, and the session table, the step driver and
the integrations see the public face only. (Imports under `if TYPE_CHECKING:` name
types for annotations and are not imports at run time.)"""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kvnumba"

#: each module's layer (docs/architecture.md): the longest dotted prefix of a module's name
#: that has a layer gives it (a folder's modules share its layer unless named here)
LAYERS = {
    "errors": 0, "host": 0,        # host/__init__: a docstring only
    "args": 1, "host.pages": 1, "host.positions": 1, "protocol": 1,
    "host.prefix_keys": 1.5,
    "config": 2,
    "scales": 2.5,
    "statemachines": 2,              # installed inside kvnumba; imports no kvnumba module
    "refusals": 3, "host.slots": 3, "host.page_accounting": 3, "device": 3,
    "host.prefix_index": 3.5, "host.step": 3.5,
    "host.declare": 3.8,
    "kernels": 4,
    "data": 5, "reference": 5,
    "cache": 6,
    "serving": 12,
    "__init__": 12.5,                # the public face: `import kvnumba as kv`
    "demo": 13, "hf": 13, "__main__": 14,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts)


def top(name: str) -> str:
    """The key of LAYERS that places module `name` (its longest prefix there)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYERS:
            return ".".join(parts[:n])
    return parts[0]


def plane(name: str) -> str:
    return name.split(".")[0]


def imports(path: Path) -> set:
    """The kvnumba modules `path` imports at run time (dotted, relative to the package)."""
    tree = ast.parse(path.read_text())
    here = module_name(path).split(".")
    package = here[:-1] if path.name != "__init__.py" else here[:-1]
    typing_only = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
            typing_only.update(id(n) for n in ast.walk(node))
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1] if node.level > 1 else package
                target = base + (node.module.split(".") if node.module else [])
                if not node.module:      # `from . import ptx, write`: modules, or names
                    for alias in node.names:     # the package itself defines
                        where = PACKAGE.joinpath(*target, alias.name)
                        is_module = where.with_suffix(".py").exists() or where.is_dir()
                        found.add(".".join(target + [alias.name] if is_module else
                                           target + ["__init__"]))
                    continue
                found.add(".".join(target))
            elif node.module and node.module.split(".")[0] == "kvnumba":
                found.add(".".join(node.module.split(".")[1:]) or "__init__")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "kvnumba":
                    found.add(".".join(alias.name.split(".")[1:]) or "__init__")
    return {name for name in found if name}


GRAPH = {module_name(p): imports(p) for p in PACKAGE.rglob("*.py")}


def test_every_module_has_a_layer():
    assert {top(name) for name in GRAPH} <= set(LAYERS), set(map(top, GRAPH)) - set(LAYERS)


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_flow_down(module):
    mine = LAYERS[top(module)]
    for name in GRAPH[module]:
        if top(name) == top(module):
            continue                  # inside a package: checked for circles below
        assert LAYERS[top(name)] < mine, f"{module} (layer {mine}) imports {name} " \
                                         f"(layer {LAYERS[top(name)]})"


def test_no_import_circles():
    modules = set(GRAPH)

    def resolve(name):     # `kernels` as a package means its __init__
        return name if name in modules else f"{name}.__init__"

    state = {}

    def visit(node, path):
        state[node] = "open"
        for child in map(resolve, GRAPH.get(node, ())):
            if child not in modules or child.endswith("__init__") and child != node:
                continue
            assert state.get(child) != "open", " -> ".join(path + [child])
            if child not in state:
                visit(child, path + [child])
        state[node] = "done"

    for module in sorted(modules):
        if module not in state:
            visit(module, [module])


def reach(module: str) -> set:
    seen, stack = set(), [module]
    while stack:
        for name in GRAPH.get(stack.pop(), ()):
            if name not in seen:
                seen.add(name)
                stack.append(name)
    return seen


#: what host/ may reach: the foundations below the device, and itself
HOST_REACH = {"args", "config", "errors", "protocol", "refusals", "statemachines"}


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if plane(m) == "host"))
def test_the_host_planes_reach_no_device(module):
    reached = {name for name in reach(module) if plane(name) != "host"}
    assert {top(name) for name in reached} <= HOST_REACH, reached


def test_kernels_know_no_cache():
    for module, names in GRAPH.items():
        if plane(module) == "kernels":
            assert {top(n) for n in names} <= {"kernels", "device", "config",
                                               "host.positions"}, module


@pytest.mark.parametrize("module", ["serving.sessions", "serving.driver"])
def test_the_faces_over_a_control_import_no_cache(module):
    reached = {plane(name) for name in reach(module)}
    assert not reached & {"cache", "data", "kernels", "device"}, reached
