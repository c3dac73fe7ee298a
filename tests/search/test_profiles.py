"""Hardware profiles from a name or a JSON file: a bad one is refused with coded problems."""

from __future__ import annotations

import json

import pytest

import meshplan


@pytest.mark.parametrize(
    ("content", "code", "fragment"),
    [
        (None, "profile-unreadable", "Cannot read the profile"),
        ("{bad", "profile-not-json", "is not JSON"),
        ("[1]", "profile-not-object", "holds a list, not an object of fields"),
    ],
)
def test_an_unusable_profile_file_says_why_with_its_code(tmp_path, content, code, fragment):
    path = tmp_path / "mine.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(meshplan.ArgumentError, match=fragment) as info:
        meshplan.load_profile(str(path))
    assert [(p.code, p.path) for p in info.value.problems] == [(code, str(path))]


def test_every_bad_field_of_a_profile_is_one_problem(tmp_path):
    mine = dict(meshplan.get_profile("h100").to_dict(), peak_flops=-1, colour="red")
    del mine["memory_bytes"]
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(mine))
    with pytest.raises(meshplan.ArgumentError, match="not a valid hardware profile") as info:
        meshplan.load_profile(str(path))
    messages = [p.message for p in info.value.problems]
    assert {p.code for p in info.value.problems} == {"profile-field"}
    assert messages == [
        "missing field 'memory_bytes'",
        "unknown field 'colour'",
        "peak_flops is -1: out of range (matmul FLOP/s of one device, above 0)",
    ]
    assert "required: name, peak_flops" in info.value.problems[0].fix


def test_an_unknown_profile_name_lists_the_known_ones():
    with pytest.raises(meshplan.ArgumentError, match="Known: cpu, a100, h100") as info:
        meshplan.get_profile("a1000")
    assert info.value.problems[0].code == "unknown-profile"
