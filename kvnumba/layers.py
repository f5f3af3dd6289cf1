"""The package's layering, written down once: each module's layer (`LAYERS`), the import
graph read from the source (`graph`), and docs/architecture.md made from both and the
modules' docstrings (`render`).

The page cannot drift from the code: `tests/test_layers.py` holds the code to the layers
and `tests/test_docs.py` the page to `render()`. Regenerate with

    python -m kvnumba.layers > docs/architecture.md

Reads source files only: it imports no kvnumba module.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent

#: each module's layer: the longest dotted prefix of a module's name (relative to the
#: package) that is a key here gives it; a folder's modules share its layer unless named.
#: An import goes to a lower layer, or within a folder without a circle.
LAYERS = {
    "errors": 0,
    "args": 1, "layers": 1,
    "arith": 2,                      # pure arithmetic: pages, positions, prefix keys
    "kinds": 3,                      # the layer kinds, one type each
    "layerspec": 4,
    "config": 5,
    "statemachines": 5,              # installed inside kvnumba; imports no kvnumba module
    "scales": 6, "refusals": 6, "device": 6,
    "host": 7,
    "protocol": 8, "kernels": 8,
    "data": 9, "reference": 9,
    "cache": 10,
    "serving": 11,
    "__init__": 12,                  # the public face: `import kvnumba as kv`
    "demo": 13, "hf": 13,
    "serve": 14,                     # the OpenAI-compatible server over hf's engine
    "__main__": 15,
}

#: the rules beyond the layers, each a test of tests/test_layers.py
RULES = (
    "no import goes to a higher layer, and there is no import circle;",
    "`host/` reaches no device: only the foundations below it (`args`, `arith`, "
    "`config`, `errors`, `kinds`, `layerspec`, `refusals`, `statemachines`) and itself;",
    "`kernels/` know storage layouts, page tables and the segment table "
    "(`arith.positions`), nothing of slots or caches;",
    "`serving/` drives any BatchControl through its verbs: it reaches no cache, data "
    "plane, kernel or device.",
)


def module_name(path: Path) -> str:
    """`path`'s dotted name relative to the package (`cache.pool`, `__init__`, ...)."""
    return ".".join(path.relative_to(PACKAGE).with_suffix("").parts)


def layer_key(name: str) -> str:
    """The key of `LAYERS` that places module `name` (its longest prefix there)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYERS:
            return ".".join(parts[:n])
    return parts[0]


def imports(path: Path) -> set:
    """The kvnumba modules `path` imports at run time (dotted, relative to the package;
    imports under `if TYPE_CHECKING:` name types only and are left out)."""
    tree = ast.parse(path.read_text())
    package = module_name(path).split(".")[:-1]
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


def graph() -> dict:
    """Every module of the package -> the kvnumba modules it imports (`imports`)."""
    return {module_name(p): imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


def summary(path: Path) -> str:
    """The first paragraph of `path`'s docstring, on one line."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return " ".join(doc.split("\n\n")[0].split()).replace("|", "\\|")


def _file(name: str) -> Path:
    where = PACKAGE.joinpath(*name.split("."))
    return where / "__init__.py" if where.is_dir() else where.with_suffix(".py")


HEADER = """\
<!-- Generated by `python -m kvnumba.layers` from kvnumba.layers.LAYERS, the imports and
     the modules' docstrings. Do not edit by hand; regenerate with
     python -m kvnumba.layers > docs/architecture.md
     (tests/test_docs.py fails when this file and the source disagree.) -->
# Architecture

kvnumba is a stack of small modules, each with one job, in one folder per plane, whose
imports flow one way: from the errors, arguments and configuration at the bottom, through
the host planes, the kernels and the data plane, up to the caches, the serving faces over
any BatchControl and the integrations on top. `tests/test_layers.py` reads the imports
from the source and holds the package to these rules:

"""

FOOTER = """
How a step moves through these modules, and where its time goes:
[steps.md](steps.md). The contract they implement: [contract.md](contract.md); the
machines that order the calls: [statemachines.md](statemachines.md).
"""


def render() -> str:
    """docs/architecture.md, from `LAYERS`, the imports and the docstrings."""
    modules = graph()
    out = [HEADER, "".join(f"- {rule}\n" for rule in RULES), "\n## The planes\n\n",
           "| folder | its job |\n|---|---|\n"]
    folders = sorted({name.rsplit(".", 1)[0] for name in modules if "." in name and
                      name.endswith("__init__")} - {"__init__"})
    for folder in folders:
        out.append(f"| `{folder.replace('.', '/')}/` | {summary(_file(folder))} |\n")
    out.append("\n`statemachines/` (installed as `kvnumba.statemachines`) declares the slot "
               "lifecycle and the step protocol once, as data, and compiles them; it "
               "generates [statemachines.md](statemachines.md). `bench/` (installed as "
               "`kvnumba.bench`) holds the benchmarks.\n")
    out.append("\n## The modules, by layer\n\n| layer | module | its one job |\n|---|---|---|\n")
    listed = sorted((name for name in modules if not name.endswith("__init__") or
                     name == "__init__"), key=lambda n: (LAYERS[layer_key(n)], n))
    for name in listed:
        shown = "kvnumba" if name == "__init__" else name
        out.append(f"| {LAYERS[layer_key(name)]:g} | `{shown}` | "
                   f"{summary(PACKAGE / (name.replace('.', '/') + '.py'))} |\n")
    out.append("\n" + diagram(modules) + FOOTER)
    return "".join(out)


def diagram(modules: dict) -> str:
    """A mermaid flowchart of the layers: one node per layer (its modules), an arrow from
    a layer to each layer that imports it directly (transitively implied arrows left
    out)."""
    groups: dict = {}
    for name in modules:
        key = layer_key(name)
        shown = key if key.count(".") or key in ("__init__", "__main__") else \
            (f"{key}/" if (PACKAGE / key).is_dir() else key)
        groups.setdefault(LAYERS[key], set()).add("kvnumba" if shown == "__init__" else shown)
    groups.setdefault(LAYERS["statemachines"], set()).add("statemachines/")
    order = sorted(groups)
    edges = set()
    for name, names in modules.items():
        for target in names:
            a, b = LAYERS[layer_key(target)], LAYERS[layer_key(name)]
            if a < b:
                edges.add((a, b))
    # transitive reduction: an arrow another path already implies is left out
    reach = {a: {b for x, b in edges if x == a} for a in order}
    for a in reversed(order):
        for b in list(reach[a]):
            reach[a] |= reach[b]
    kept = sorted((a, b) for a, b in edges
                  if not any(b in reach[c] for x, c in edges if x == a and c != b))
    node = {layer: f"L{i}" for i, layer in enumerate(order)}
    lines = ["```mermaid", "flowchart BT"]
    for layer in order:
        lines.append(f"    {node[layer]}[\"{' · '.join(sorted(groups[layer]))}\"]")
    for a, b in kept:
        lines.append(f"    {node[a]} --> {node[b]}")
    lines.append("```")
    return "\n".join(lines) + "\n\n(An arrow points from what is imported to what imports it.)\n"


if __name__ == "__main__":
    print(render(), end="")
