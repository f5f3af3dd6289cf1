"""The package's layering (`kvnumba.layers.LAYERS`), read from the source: every import of a kvnumba module goes to a
layer below the importer's (or beside it, without a circle), host page accounting
reaches no device, kernels know no cache, and the session table, the step driver and
the integrations see the public face only. (Imports under `if TYPE_CHECKING:` name
types for annotations and are not imports at run time.)"""
import pytest

from kvnumba.layers import LAYERS, graph, layer_key as top

GRAPH = graph()


def plane(name: str) -> str:
    return name.split(".")[0]


def test_layers_are_whole_numbers():
    assert all(isinstance(layer, int) for layer in LAYERS.values()), LAYERS


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
HOST_REACH = {"args", "arith", "config", "errors", "kinds", "layerspec", "refusals",
              "statemachines"}


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if plane(m) == "host"))
def test_the_host_planes_reach_no_device(module):
    reached = {name for name in reach(module) if plane(name) != "host"}
    assert {top(name) for name in reached} <= HOST_REACH, reached


def test_kernels_know_no_cache():
    for module, names in GRAPH.items():
        if plane(module) == "kernels":
            assert {top(n) for n in names} <= {"kernels", "device", "config", "arith"}, module


@pytest.mark.parametrize("module", ["serving.sessions", "serving.driver"])
def test_the_faces_over_a_control_import_no_cache(module):
    reached = {plane(name) for name in reach(module)}
    assert not reached & {"cache", "data", "kernels", "device"}, reached


def test_no_module_over_500_lines_no_class_over_300():
    import ast

    from kvnumba.layers import PACKAGE
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        assert source.count("\n") <= 500, f"{path.relative_to(PACKAGE)}: over 500 lines"
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                lines = node.end_lineno - node.lineno + 1
                assert lines <= 300, f"{path.relative_to(PACKAGE)}: {node.name}, {lines} lines"
