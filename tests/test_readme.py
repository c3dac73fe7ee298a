"""The README's quick start does what it says (tests/test_docs.py runs every block of it)."""

from pathlib import Path

import pytest

from docblocks import blocks_of

README = Path(__file__).parent.parent / "README.md"


@pytest.mark.slow
def test_readme_quick_start_runs_and_shards_w2_by_rows():
    blocks = [b for b in blocks_of(README.read_text(), "README.md") if b.lang == "python"]
    assert blocks, "the README has a python quick start"
    namespace: dict = {}
    exec(compile(blocks[0].text, str(README), "exec"), namespace)
    params = namespace["params"]["params"]
    w2 = params["W2"]
    assert type(w2).__name__ == "Partitioned"
    assert w2.names == ("model", None)
    assert str(w2.value.sharding.spec) == "P('model', None)"
    assert params["Dense_0"]["kernel"].value.sharding.spec[1] == "model"


def test_readme_gives_the_two_commands():
    text = README.read_text()
    assert "make demo" in text and "make test" in text
