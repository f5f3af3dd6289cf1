"""The docs run: the README's usage example, every docs block marked `<!-- runnable -->`,
and docs/statemachines.md is exactly what `python -m kvnumba.statemachines` prints."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RUNNABLE = re.compile(r"<!-- runnable -->\s*\n```python\n(.*?)\n```", re.S)


def _usage_block() -> str:
    text = (ROOT / "README.md").read_text()
    section = re.search(r"^## Usage\n(.*?)(?=^## )", text, re.S | re.M)
    assert section, "README.md has no '## Usage' section"
    block = re.search(r"```python\n(.*?)\n```", section.group(1), re.S)
    assert block, "the Usage section has no ```python block"
    return block.group(1)


def _runnable_blocks():
    out = []
    for path in sorted(DOCS.glob("*.md")):
        for i, match in enumerate(RUNNABLE.finditer(path.read_text())):
            out.append(pytest.param(match.group(1), id=f"{path.name}-{i}"))
    return out


def _run(code: str, name: str) -> None:
    exec(compile(code, name, "exec"), {"__name__": "__docs__"})


def test_readme_usage_example_runs():
    code = _usage_block()
    assert 10 <= len(code.splitlines()) <= 40
    _run(code, "README.md#usage")


def test_readme_quickstart_is_kept():
    text = (ROOT / "README.md").read_text()
    assert "python -m pip install -e . && python -m kvnumba demo" in text
    assert "python -m pip install -e '.[test]' && python -m pytest -q" in text


def test_docs_have_runnable_blocks():
    assert len(_runnable_blocks()) >= 4


def test_runnable_docs_blocks_need_only_kvnumba():
    """The blocks run with kvnumba alone installed: no test-only imports."""
    for param in _runnable_blocks():
        assert "pytest" not in param.values[0], param.id


def test_every_contract_section_the_code_cites_exists():
    sections = set(re.findall(r"^## (\d+)\. ", (DOCS / "contract.md").read_text(), re.M))
    cited = set()
    for path in list(ROOT.glob("kvnumba/**/*.py")) + list(ROOT.glob("statemachines/*.py")) + \
            list(ROOT.glob("tests/*.py")) + list(ROOT.glob("bench/*.py")):
        for match in re.finditer(r"contract §(\d+)(?:[-/]§(\d+)|(?:, §(\d+))*)",
                                 path.read_text()):
            cited.update(re.findall(r"§(\d+)", match.group(0)))
    assert cited and cited <= sections, sorted(cited - sections)


@pytest.mark.parametrize("code", _runnable_blocks())
def test_runnable_docs_block(code, request):
    _run(code, request.node.callspec.id)


def test_statemachines_md_is_generated():
    from kvnumba.statemachines.__main__ import render

    committed = (DOCS / "statemachines.md").read_text()
    assert committed == render(), ("docs/statemachines.md is stale: regenerate it with "
                                   "python -m kvnumba.statemachines > docs/statemachines.md")
    printed = subprocess.run([sys.executable, "-m", "statemachines"], capture_output=True,
                             text=True, cwd=ROOT, timeout=120, check=True).stdout
    assert printed == committed


def test_statemachines_md_shows_every_edge():
    import kvnumba.statemachines as sm

    committed = (DOCS / "statemachines.md").read_text()
    for spec in (sm.SLOT_LIFECYCLE, sm.STEP_PROTOCOL):
        assert "```mermaid\n" + sm.mermaid(spec) + "```" in committed


def test_architecture_md_is_generated():
    """docs/architecture.md is what `python -m kvnumba.layers` prints: the layers, the
    planes and the modules' docstrings as the source has them now."""
    from kvnumba.layers import render
    committed = (DOCS / "architecture.md").read_text()
    assert committed == render(), ("docs/architecture.md is stale: regenerate it with "
                                   "python -m kvnumba.layers > docs/architecture.md")


def test_architecture_md_lists_every_module_once():
    from kvnumba.layers import graph
    committed = (DOCS / "architecture.md").read_text()
    for name in graph():
        if name.endswith("__init__") and name != "__init__":
            folder = name.rsplit(".", 1)[0].replace(".", "/")
            assert committed.count(f"| `{folder}/` |") == 1, folder
        else:
            shown = "kvnumba" if name == "__init__" else name
            assert committed.count(f"| `{shown}` |") == 1, shown
