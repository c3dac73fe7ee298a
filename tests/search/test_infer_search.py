"""A model stripped of its names searches to within 5% of its hand-named top-1.

``meshplan.search_rules(8, ..., profile=..., compile_top=0)`` (analytic) of each model
with the names a person wrote (meshplan's examples' own; by path for Hugging Face's,
:mod:`unnamed_models`), and of the same model with no names at all, which the search
infers (:func:`meshplan.infer_names`). ``benchmarks/bench_infer.py`` prints the ratios.
"""

from __future__ import annotations

import re

import pytest

import meshplan
import unnamed_models as um

GOAL = 0.05


def searches(state, step, tokens, named_state, named_step, devices=8, profile="h100"):
    """The top-1 of the hand-named model and of the unnamed one, and the inferred names."""
    hand = meshplan.search_rules(
        devices, named_state, named_step, tokens, profile=profile, compile_top=0
    )
    inferred = meshplan.search_rules(devices, state, step, tokens, profile=profile, compile_top=0)
    return hand.best, inferred.best, inferred.path_rules


def ratio(hand, inferred):
    return inferred.cost.step_s / hand.cost.step_s


def same_names(state, path_rules):
    """Each array's hand-written names against those the rules give it."""
    leaves, _ = meshplan._spmd.leaves.array_leaves(state)
    for leaf in leaves:
        path = meshplan._text.path_text(leaf.keypath)
        got = next(n for p, n in path_rules if re.fullmatch(p, path))
        assert (got or (None,) * len(leaf.shape)) == tuple(leaf.names or ()) or not leaf.shape, path


@pytest.mark.slow
def test_the_transformer_stripped_of_its_names_is_named_and_searched_as_written():
    state, step, tokens = um.transformer("tiny", batch=16, seq=128)
    hand, inferred, rules = searches(meshplan.unbox(state), step, tokens, state, step)
    same_names(state, rules)
    assert abs(ratio(hand, inferred) - 1) <= GOAL
    assert (inferred.mesh_text, inferred.short_rules) == (hand.mesh_text, hand.short_rules)


@pytest.mark.slow
def test_the_transformer_stripped_of_its_names_searches_as_written_on_256_tpu_v5e():
    state, step, tokens = um.transformer("small", batch=256, seq=512)
    hand, inferred, _ = searches(meshplan.unbox(state), step, tokens, state, step, 256, "tpu_v5e")
    assert abs(ratio(hand, inferred) - 1) <= GOAL


@pytest.mark.slow
def test_the_llama_example_with_grouped_query_attention_searches_as_written():
    state, step, tokens = um.llama(
        32, 256, embed=1024, heads=8, kv_heads=4, head_dim=128, mlp=4096, layers=4, vocab=32000
    )
    hand, inferred, rules = searches(meshplan.unbox(state), step, tokens, state, step)
    same_names(state, rules)
    assert abs(ratio(hand, inferred) - 1) <= GOAL


def _hf(build, hand_names):
    state, step, tokens = build()

    def plain(s, x):
        return step(meshplan.unbox(s), x)

    named = meshplan.name_by_path(state, hand_names)
    return searches(state, step, tokens, named, plain)


@pytest.mark.slow
def test_hugging_face_gpt2_searches_as_its_names_written_by_hand():
    hand, inferred, rules = _hf(lambda: um.gpt2(768, 12, 2, 50257, 16, 256), um.GPT2_NAMES)
    assert abs(ratio(hand, inferred) - 1) <= GOAL
    by_path = dict(rules)
    assert by_path[r"(?:.*/)?transformer/h/\d+/attn/c_attn/kernel"] == ("heads", "embed")


@pytest.mark.slow
def test_hugging_face_llama_searches_as_its_names_written_by_hand():
    hand, inferred, rules = _hf(
        lambda: um.hf_llama(1024, 8, 4096, 2, 32000, 16, 256), um.LLAMA_NAMES
    )
    assert abs(ratio(hand, inferred) - 1) <= GOAL
    assert dict(rules)[r"(?:.*/)?model/layers/\d+/self_attn/o_proj/kernel"] == ("heads", "embed")
