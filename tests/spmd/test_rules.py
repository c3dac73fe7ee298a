"""Rule resolution (``logical_to_mesh_axes``) against Flax's own as an oracle, the active
rules (thread-local, nesting) and the errors for bad rules."""

from __future__ import annotations

import re
import threading

import flax.linen as nn
import pytest
from jax.sharding import PartitionSpec as P

import meshplan

U = P.UNCONSTRAINED

REFERENCE_NAMES = ("batch", "length", "heads", "features")
REFERENCE_RULES = (("batch", "X"), ("features", "X"), ("heads", "Y"), ("batch", "Z"))

T5X_RULES = (
    ("batch", "data"),
    ("vocab", "model"),
    ("embed", None),
    ("mlp", "model"),
    ("heads", "model"),
    ("kv", None),
    ("joined_kv", "model"),
)


def test_reference_example_holds_exactly():
    spec = meshplan.logical_to_mesh_axes(REFERENCE_NAMES, REFERENCE_RULES)
    assert isinstance(spec, P)
    assert spec == P("X", None, "Y", None)
    assert tuple(spec) == ("X", None, "Y", None)


# (id, array_dim_names, rules, expected).  Every case is also run through Flax's
# logical_to_mesh_axes, which must give the same result.
CASES = [
    ("reference", REFERENCE_NAMES, REFERENCE_RULES, P("X", None, "Y", None)),
    ("single", ("batch",), (("batch", "data"),), P("data")),
    ("two_dims", ("batch", "embed"), (("batch", "data"), ("embed", "model")), P("data", "model")),
    ("priority_first_rule_wins", ("embed",), (("embed", "model"), ("embed", "data")), P("model")),
    ("mesh_axis_taken", ("a", "b"), (("a", "X"), ("b", "X")), P("X", None)),
    ("later_rule_after_axis_taken", ("a", "b"), (("a", "X"), ("b", "X"), ("b", "Y")), P("X", "Y")),
    ("rule_order_not_dim_order", ("a", "b"), (("b", "X"), ("a", "X"), ("a", "Y")), P("Y", "X")),
    ("repeated_name_first_wins", ("batch",), (("batch", "data"), ("batch", "model")), P("data")),
    ("mesh_axis_tuple", ("batch",), (("batch", ("data", "model")),), P(("data", "model"))),
    ("mesh_axis_tuple_of_one", ("a",), (("a", ("X",)),), P(("X",))),
    ("mesh_axis_tuple_of_three", ("a", "b"), (("a", ("X", "Y", "Z")),), P(("X", "Y", "Z"), None)),
    ("tuple_partly_taken", ("a", "b"), (("a", "X"), ("b", ("X", "Y"))), P("X", None)),
    (
        "tuple_partly_taken_then_single",
        ("a", "b"),
        (("a", "X"), ("b", ("X", "Y")), ("b", "Y")),
        P("X", "Y"),
    ),
    ("tuple_takes_both_axes", ("a", "b"), (("a", ("X", "Y")), ("b", "Y")), P(("X", "Y"), None)),
    ("tuple_blocks_single", ("a", "b"), (("a", ("X", "Y")), ("b", "X")), P(("X", "Y"), None)),
    ("none_rule_unshards", ("a",), (("a", None), ("a", "X")), P(None)),
    ("none_rule_then_other_dim", ("a", "b"), (("a", None), ("a", "X"), ("b", "X")), P(None, "X")),
    ("none_rule_takes_no_axis", ("a", "b"), (("a", None), ("b", "X")), P(None, "X")),
    ("unconstrained_in_names", ("a", U), (("a", "X"),), P("X", U)),
    ("unconstrained_twice_in_names", (U, "a", U), (("a", "X"),), P(U, "X", U)),
    ("unconstrained_in_rules", ("a",), (("a", U),), P(U)),
    ("unconstrained_rule_takes_no_axis", ("a", "b"), (("a", U), ("b", "X")), P(U, "X")),
    ("unconstrained_rule_blocks_later_rule", ("a",), (("a", U), ("a", "X")), P(U)),
    ("none_in_names", (None, "a"), (("a", "X"),), P(None, "X")),
    ("none_twice_in_names", (None, None, "a"), (("a", "X"),), P(None, None, "X")),
    ("all_none_names", (None, None), (("a", "X"),), P(None, None)),
    ("empty_rules_tuple", ("a", "b"), (), P(None, None)),
    ("empty_rules_list", ("a", "b"), [], P(None, None)),
    ("empty_names", (), (("a", "X"),), P()),
    ("names_none", None, (("a", "X"),), None),
    ("names_list", ["a", "b"], (("a", "X"), ("b", "Y")), P("X", "Y")),
    ("names_partition_spec", P("a", "b"), (("a", "X"), ("b", "Y")), P("X", "Y")),
    ("names_partition_spec_with_none", P(None, "b"), (("b", "Y"),), P(None, "Y")),
    ("rules_list_of_lists", ("a", "b"), [["a", "X"], ["b", "Y"]], P("X", "Y")),
    ("rules_list_of_tuples", ("a",), [("a", "X")], P("X")),
    ("unmatched_name_unsharded", ("a", "zzz"), (("a", "X"),), P("X", None)),
    ("rule_for_absent_name_ignored", ("a",), (("zzz", "X"), ("a", "X")), P("X")),
    (
        "same_axis_two_names",
        ("batch", "length"),
        (("batch", "data"), ("length", "data")),
        P("data", None),
    ),
    ("passthrough_tuple_takes_axes", (("X", "Y"), "a"), (("a", "X"),), P(("X", "Y"), None)),
    ("t5x_activations", ("batch", "length", "embed"), T5X_RULES, P("data", None, None)),
    ("t5x_mlp_kernel", ("embed", "mlp"), T5X_RULES, P(None, "model")),
    ("t5x_attention_kernel", ("embed", "heads", "kv"), T5X_RULES, P(None, "model", None)),
    ("t5x_mlp_before_heads", ("heads", "mlp"), T5X_RULES, P(None, "model")),
    ("t5x_embedding", ("vocab", "embed"), T5X_RULES, P("model", None)),
    (
        "guide_rules_kernel",
        ("embed", "hidden"),
        (("batch", "data"), ("hidden", "model")),
        P(None, "model"),
    ),
    (
        "guide_rules_scanned_kernel",
        ("layer", "hidden", "embed"),
        (("batch", "data"), ("hidden", "model")),
        P(None, "model", None),
    ),
    (
        "six_dims",
        ("a", "b", "c", "d", "e", "f"),
        (("f", "X"), ("e", "X"), ("e", "Y"), ("d", ("Y", "Z")), ("d", "Z"), ("a", None)),
        P(None, None, None, "Z", "Y", "X"),
    ),
]


def _flax(names, rules):
    return nn.logical_to_mesh_axes(names, rules)


@pytest.mark.parametrize(
    ("names", "rules", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_logical_to_mesh_axes_matches_flax(names, rules, expected):
    ours = meshplan.logical_to_mesh_axes(names, rules)
    theirs = _flax(names, rules)
    assert ours == theirs
    assert ours == expected
    if expected is not None:
        assert tuple(ours) == tuple(expected)


def test_oracle_table_is_large_enough():
    assert len(CASES) + len(BOTH_RAISE) >= 40


# (id, names, rules): invalid input that both Flax and meshplan reject with a ValueError.
BOTH_RAISE = [
    ("duplicate_names", ("a", "a"), (("a", "X"),)),
    ("duplicate_names_empty_rules", ("a", "b", "a"), ()),
    ("duplicate_names_list", ["embed", "embed"], (("embed", None),)),
    ("rules_dict", ("a",), {"a": "X"}),
    ("rules_str", ("a",), "aX"),
    ("rules_int", ("a",), 5),
    ("rules_flat_pair", ("batch",), ("batch", "data")),
    ("rules_triple", ("a",), (("a", "X", "Y"),)),
    ("rules_singleton_entry", ("a",), (("a",),)),
    ("rules_long_string_entry", ("a",), (("a", "X"), "bcd")),
]


@pytest.mark.parametrize(
    ("names", "rules"), [c[1:] for c in BOTH_RAISE], ids=[c[0] for c in BOTH_RAISE]
)
def test_invalid_input_raises_in_both_flax_and_meshplan(names, rules):
    with pytest.raises(ValueError):
        _flax(names, rules)
    with pytest.raises(ValueError) as info:
        meshplan.logical_to_mesh_axes(names, rules)
    assert isinstance(info.value, meshplan.MeshplanError)


def test_duplicate_logical_name_error_names_the_dimension_and_the_fix():
    with pytest.raises(meshplan.LogicalNamesError, match=r"(?s)'embed'.*more than once") as info:
        meshplan.logical_to_mesh_axes(("embed", "mlp", "embed"), (("embed", "model"),))
    assert "('embed', 'mlp', 'embed')" in str(info.value)
    assert "own name" in str(info.value)


def test_bare_string_names_are_rejected_with_a_hint():
    with pytest.raises(meshplan.LogicalNamesError, match=r"(?s)bare string 'batch'.*\('batch',\)"):
        meshplan.logical_to_mesh_axes("batch", (("batch", "data"),))


def test_repeated_calls_give_equal_specs_for_equal_inputs():
    # The cache must not confuse a PartitionSpec with a tuple or lists with tuples.
    a = meshplan.logical_to_mesh_axes(("a", "b"), (("a", "X"),))
    b = meshplan.logical_to_mesh_axes(P("a", "b"), (("a", "X"),))
    c = meshplan.logical_to_mesh_axes(["a", "b"], [["a", "X"]])
    d = meshplan.logical_to_mesh_axes(("a", "b"), (("b", "X"),))
    assert a == b == c == P("X", None)
    assert d == P(None, "X")


# --------------------------------------------------------------------------
# The active rules
# --------------------------------------------------------------------------


def test_active_rules_default_to_empty_tuple():
    seen = []
    thread = threading.Thread(target=lambda: seen.append(meshplan.get_logical_axis_rules()))
    thread.start()
    thread.join()
    assert seen == [()]
    assert meshplan.get_logical_axis_rules() == ()


def test_set_and_get_logical_axis_rules():
    rules = (("batch", "data"), ("hidden", "model"))
    meshplan.set_logical_axis_rules(rules)
    assert meshplan.get_logical_axis_rules() == rules
    assert meshplan.logical_to_mesh_axes(("batch", "hidden")) == P("data", "model")


def test_set_logical_axis_rules_normalizes_lists_to_tuples():
    meshplan.set_logical_axis_rules([["batch", "data"], ["hidden", ["data", "model"]]])
    assert meshplan.get_logical_axis_rules() == (("batch", "data"), ("hidden", ("data", "model")))


def test_explicit_rules_override_active_rules():
    meshplan.set_logical_axis_rules((("batch", "data"),))
    assert meshplan.logical_to_mesh_axes(("batch",), (("batch", "model"),)) == P("model")
    assert meshplan.logical_to_mesh_axes(("batch",), ()) == P(None)


def test_no_active_rules_leaves_every_dimension_unsharded():
    assert meshplan.logical_to_mesh_axes(("batch", None, "hidden")) == P(None, None, None)


def test_context_sets_rules_and_restores_previous():
    outer = (("batch", "data"),)
    meshplan.set_logical_axis_rules(outer)
    with meshplan.logical_axis_rules((("batch", "model"),)):
        assert meshplan.get_logical_axis_rules() == (("batch", "model"),)
        assert meshplan.logical_to_mesh_axes(("batch",)) == P("model")
    assert meshplan.get_logical_axis_rules() == outer


def test_contexts_nest():
    with meshplan.logical_axis_rules((("batch", "data"),)):
        with meshplan.logical_axis_rules((("batch", None),)):
            assert meshplan.logical_to_mesh_axes(("batch",)) == P(None)
            with meshplan.logical_axis_rules(()):
                assert meshplan.get_logical_axis_rules() == ()
            assert meshplan.get_logical_axis_rules() == (("batch", None),)
        assert meshplan.logical_to_mesh_axes(("batch",)) == P("data")
    assert meshplan.get_logical_axis_rules() == ()


def test_context_restores_rules_even_on_exception():
    with meshplan.logical_axis_rules((("batch", "data"),)):
        with pytest.raises(RuntimeError, match="boom"), meshplan.logical_axis_rules((("x", "y"),)):
            raise RuntimeError("boom")
        assert meshplan.get_logical_axis_rules() == (("batch", "data"),)
    assert meshplan.get_logical_axis_rules() == ()


def test_context_with_bad_rules_raises_and_keeps_previous_rules():
    meshplan.set_logical_axis_rules((("batch", "data"),))
    with pytest.raises(meshplan.RulesError), meshplan.logical_axis_rules({"batch": "model"}):
        pass  # pragma: no cover - not reached
    assert meshplan.get_logical_axis_rules() == (("batch", "data"),)


def test_active_rules_are_thread_local():
    main_rules = (("batch", "data"),)
    thread_rules = (("batch", "model"),)
    meshplan.set_logical_axis_rules(main_rules)
    ready, done = threading.Event(), threading.Event()
    seen = {}

    def worker():
        seen["initial"] = meshplan.get_logical_axis_rules()
        meshplan.set_logical_axis_rules(thread_rules)
        seen["spec"] = meshplan.logical_to_mesh_axes(("batch",))
        ready.set()
        done.wait(5)
        seen["after"] = meshplan.get_logical_axis_rules()

    thread = threading.Thread(target=worker)
    thread.start()
    assert ready.wait(5)
    # The worker has set its rules; this thread still sees its own.
    assert meshplan.get_logical_axis_rules() == main_rules
    assert meshplan.logical_to_mesh_axes(("batch",)) == P("data")
    with meshplan.logical_axis_rules(()):
        pass
    done.set()
    thread.join(5)
    assert seen == {"initial": (), "spec": P("model"), "after": thread_rules}


def test_context_in_one_thread_is_invisible_to_another():
    entered, checked = threading.Event(), threading.Event()

    def worker():
        with meshplan.logical_axis_rules((("batch", "data"),)):
            entered.set()
            checked.wait(5)

    thread = threading.Thread(target=worker)
    thread.start()
    assert entered.wait(5)
    try:
        assert meshplan.get_logical_axis_rules() == ()
    finally:
        checked.set()
        thread.join(5)


# --------------------------------------------------------------------------
# Bad rules
# --------------------------------------------------------------------------

FIX = r"sequence of pairs, e\.g\. \(\('batch', 'data'\), \('hidden', 'model'\)\)"


def test_rules_error_is_a_value_error():
    assert issubclass(meshplan.RulesError, ValueError)
    assert issubclass(meshplan.RulesError, meshplan.MeshplanError)


def test_dict_rules_are_rejected_with_items_hint():
    with pytest.raises(
        meshplan.RulesError, match=r"(?s)got a dict.*tuple\(rules\.items\(\)\)"
    ) as info:
        meshplan.logical_to_mesh_axes(("batch",), {"batch": "data"})
    assert "{'batch': 'data'}" in str(info.value)


def test_single_flat_pair_is_rejected_with_wrapped_suggestion():
    # Flax silently unpacks a flat pair of two-character strings; meshplan refuses.
    with pytest.raises(
        meshplan.RulesError, match=r"(?s)single flat pair.*\(\('batch', 'data'\),\)"
    ):
        meshplan.set_logical_axis_rules(("batch", "data"))
    with pytest.raises(meshplan.RulesError, match=r"\('ab', 'cd'\)"):
        meshplan.logical_to_mesh_axes(("a",), ("ab", "cd"))
    assert meshplan.get_logical_axis_rules() == ()


@pytest.mark.parametrize(
    ("rules", "offending"),
    [
        (
            (("batch", "data"), ("hidden", "model", "x")),
            r"rules\[1\]: \('hidden', 'model', 'x'\) is not a \(name, mesh_axes\) pair",
        ),
        ((("batch", "data"), "hidden"), r"rules\[1\]: 'hidden' is not a \(name, mesh_axes\) pair"),
        ((("batch",),), r"rules\[0\]: \('batch',\) is not a \(name, mesh_axes\) pair"),
        (((1, "data"),), r"rules\[0\]: \(1, 'data'\): the logical name must be a string, got int"),
        (((None, "data"),), r"rules\[0\]: \(None, 'data'\): the logical name must be a string"),
        ((("batch", 3),), r"rules\[0\]: \('batch', 3\): mesh axes must be"),
    ],
    ids=["triple", "bare_string_entry", "singleton", "int_name", "none_name", "int_axes"],
)
def test_bad_rule_entries_are_named_with_the_fix(rules, offending):
    with pytest.raises(meshplan.RulesError, match=offending) as info:
        meshplan.logical_to_mesh_axes(("batch",), rules)
    assert "Invalid logical axis rules" in str(info.value)
    assert re.search(FIX, str(info.value))
    (problem,) = info.value.problems  # structured: nobody parses the text
    assert (problem.code, problem.severity) == ("bad-rule", "error")
    assert problem.path == re.search(r"rules\\\[(\d)", offending).group(0).replace("\\", "") + "]"


def test_every_bad_rule_is_reported_at_once():
    with pytest.raises(meshplan.RulesError) as info:
        meshplan.set_logical_axis_rules(((1, "data"), ("ok", "model"), ("x",)))
    message = str(info.value)
    assert "rules[0]" in message and "rules[2]" in message
    assert [p.path for p in info.value.problems] == ["rules[0]", "rules[2]"]
    assert "rule 1" not in message


@pytest.mark.parametrize("rules", [5, "batch", object()], ids=["int", "str", "object"])
def test_rules_that_are_not_a_sequence_are_rejected(rules):
    with pytest.raises(meshplan.RulesError, match="must be a tuple or list of"):
        meshplan.logical_to_mesh_axes(("batch",), rules)


def test_a_mesh_axis_named_twice_in_one_rule_is_a_bad_rule():
    with pytest.raises(meshplan.RulesError, match=r"'data' is named twice") as info:
        meshplan.logical_to_mesh_axes(("batch",), (("batch", ("data", "data")),))
    assert [(p.path, p.code) for p in info.value.problems] == [("rules[0]", "bad-rule")]
    plan = meshplan.explain({}, {"data": 2}, [["batch", ["data", "data"]]])
    assert [p.code for p in plan.problems] == ["bad-rule"]


def test_kinds_and_statuses_are_literal_types_the_docs_list():
    import dataclasses
    import re
    import typing
    from pathlib import Path

    from meshplan._plan.records import DimPlan, LeafLayout
    from meshplan._spmd import leaves, validate
    from meshplan._spmd.rules import DimStatus, NamesKind

    assert typing.get_args(NamesKind) == validate.KINDS
    hints = {
        "DimCheck.status": typing.get_type_hints(validate.DimCheck)["status"],
        "DimPlan.status": typing.get_type_hints(DimPlan)["status"],
        "ArrayLeaf.kind": typing.get_type_hints(leaves.ArrayLeaf)["kind"],
        "LeafNames.kind": typing.get_type_hints(leaves.LeafNames)["kind"],
        "LeafLayout.kind": typing.get_type_hints(LeafLayout)["kind"],
    }
    assert hints == {
        "DimCheck.status": DimStatus,
        "DimPlan.status": DimStatus,
        "ArrayLeaf.kind": NamesKind,
        "LeafNames.kind": NamesKind,
        "LeafLayout.kind": NamesKind,
    }
    assert "status" in {f.name for f in dataclasses.fields(validate.DimCheck)}
    page = (Path(__file__).parents[2] / "docs" / "plan.md").read_text()
    documented = re.search(r'"status": ((?:"[\w-]+"(?: \| )?)+)', page)
    assert documented is not None
    assert tuple(re.findall(r'"([\w-]+)"', documented.group(1))) == typing.get_args(DimStatus)
