"""Every module a docstring, a comment or a doc page names exists: each dotted
`kvnumba.` name, and each backticked dotted name that starts with one of the package's
modules or folders (`kernels.decode`, `host.prefix_index.PrefixIndex`), imports, its
last parts found as attributes where they are not modules."""
import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import kvnumba
import kvnumba.cache

ROOT = Path(kvnumba.__file__).resolve().parent.parent
SOURCES = sorted((ROOT / "kvnumba").rglob("*.py")) + sorted((ROOT / "docs").glob("*.md")) \
    + [ROOT / "README.md"]
#: the package's modules and folders a backticked name may start with; `config` and
#: `args` are left out (in text they are a cache's or a command line's values, `cache.`
#: too unless a module of the folder follows)
TOP = {m.name for m in pkgutil.iter_modules(kvnumba.__path__)} - {"config", "args"}
CACHE = {m.name for m in pkgutil.iter_modules(kvnumba.cache.__path__)}
FILES = (".py", ".json", ".md", ".sh")
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+")


def named(text: str) -> set:
    """The names `text` gives: `kvnumba.` ones anywhere, the package's own in backticks."""
    found = {m.group(0).rstrip(".") for m in re.finditer(r"\bkvnumba(?:\.[A-Za-z_][A-Za-z0-9_]*)+",
                                                         text)}
    for quoted in re.findall(r"`([^`\n]+)`", text):
        for m in NAME.finditer(quoted):
            name, parts = m.group(0), m.group(0).split(".")
            if name.endswith(FILES) or m.start() or parts[0] not in TOP or \
                    parts[0] == "cache" and parts[1] not in CACHE:
                continue
            found.add(f"kvnumba.{name}")
    return {name for name in found if not name.endswith(FILES)}


def resolves(name: str) -> bool:
    """Whether `name` is a module, or attributes of the longest module that prefixes it."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:n]))
        except ImportError:
            continue
        for part in parts[n:]:
            if part == "*":
                return True
            if not hasattr(obj, part):
                try:
                    obj = importlib.import_module(f"{obj.__name__}.{part}")
                    continue
                except (ImportError, AttributeError):
                    return False
            obj = getattr(obj, part)
        return True
    return False


NAMES = sorted({(str(path.relative_to(ROOT)), name)
                for path in SOURCES for name in named(path.read_text())})


@pytest.mark.parametrize("where,name", NAMES)
def test_a_named_module_exists(where, name):
    assert resolves(name), f"{where} names {name}, which does not exist"


def test_the_sources_name_modules():
    assert len(NAMES) > 50
