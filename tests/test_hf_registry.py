"""Every causal-LM architecture of the installed `transformers`, built tiny and random, is
refused at construction with a `ConfigError` or served equal to its own `generate()`
(tests/registry.py), as docs/transformers.md's generated table says: the short list
`registry.SHORT` under CI, the whole registry under `HYPOTHESIS_PROFILE=thorough`.

An architecture `transformers` cannot build tiny (or generate from) is "not built":
there is nothing to serve; the table names its error."""
import os
import re
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import registry  # noqa: E402

THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"
DOC = Path(__file__).resolve().parent.parent / "docs" / "transformers.md"


def block() -> str:
    """docs/transformers.md's generated registry table, between its markers."""
    text = DOC.read_text()
    return text[text.index("<!-- registry table -->"):text.index("<!-- end registry table -->")]


def documented() -> dict:
    """model type -> the outcome docs/transformers.md's registry table gives it."""
    return {m.group(1): m.group(2) for m in
            re.finditer(r"^\| `([^`]+)` \| ([a-z ]+) \|", block(), re.M)}


def test_the_table_lists_every_architecture_once_and_none_failing():
    """The table lists the short list, none failing; and, from the `transformers` it was
    made with (its first line names the version), every architecture that ships."""
    import transformers
    rows = documented()
    assert set(registry.SHORT) <= set(rows) and "failing" not in rows.values()
    made_with = re.search(r"transformers (\S+),", block()).group(1)
    if transformers.__version__ == made_with:
        assert sorted(rows) == sorted(registry.architectures())


def test_the_hand_written_table_agrees_with_the_registry_table():
    """A row of the architecture table that says the registry sweep tests its models
    names model types the registry table lists as served."""
    text = DOC.read_text()
    hand = text[:text.index("<!-- registry table -->")]
    rows = [line for line in hand.splitlines()
            if line.startswith("| ") and "tested by the registry sweep" in line]
    assert rows
    rows_outcome = documented()
    for line in rows:
        named = re.findall(r"`([a-z0-9_]+)`", line.split(" | ")[0])
        assert named and all(rows_outcome[m] == "served" for m in named), (named, line)


@pytest.mark.parametrize("model_type", registry.architectures() if THOROUGH else registry.SHORT)
def test_an_architecture_is_refused_up_front_or_served_exactly(model_type):
    result = registry.sweep_one(model_type)
    assert result["outcome"] != "failing", result
    assert documented()[model_type] == result["outcome"], result
