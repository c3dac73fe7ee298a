"""Decoding with a key/value cache: the same bytes as the cache-free path (Linen and NNX,
rotary and learned positions, past the window), a cache placed by the rules, and
`meshplan sample --compare-cache`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshplan
from meshplan import layouts
from meshplan.cli import main
from meshplan.cli.sample import NnxModel, generate
from meshplan.cli.train import TrainRequest, prepare
from meshplan.models.decode import CACHE_NAMES, greedy_cached, init_cache
from meshplan.models.transformer import Transformer, config_from_name
from meshplan.models.transformer_nnx import FunctionalTransformer
from meshplan.train.device_mesh import make_mesh


def scaled(tree):
    """Parameters times 3: an untrained model whose logits are far from uniform."""
    return jax.tree.map(lambda x: x * 3, tree)


@pytest.mark.parametrize(
    "overrides", [{}, {"positions": "learned", "scan_layers": False}], ids=["rope", "learned-loop"]
)
@pytest.mark.slow
def test_greedy_decoding_with_the_cache_gives_the_cache_free_bytes(overrides):
    config = config_from_name(
        "tiny", num_layers=2, embed_dim=32, mlp_dim=64, max_len=24, **overrides
    )
    model = Transformer(config)
    params = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    params = scaled(meshplan.unbox(params))
    # 5 + 30 bytes: past the window of 24, where both read the last 24 bytes again
    plain = generate(model, params, b"def f", 30)
    assert greedy_cached(config, params, b"def f", 30) == plain
    assert len(set(plain)) > 3  # not a degenerate text


@pytest.mark.slow
def test_the_nnx_model_decodes_the_same_bytes_from_its_state():
    config = config_from_name("tiny", num_layers=2, embed_dim=32, mlp_dim=64, max_len=24)
    state = scaled(FunctionalTransformer(config).init(jax.random.key(0)))
    plain = generate(NnxModel(config), state, b"ab", 12)
    assert greedy_cached(config, nnx.to_pure_dict(state), b"ab", 12) == plain


def test_the_cache_has_logical_names_and_the_rules_place_it():
    config = config_from_name("tiny")
    mesh = make_mesh((2, 4))
    with jax.set_mesh(mesh), meshplan.logical_axis_rules(layouts.tensor_parallel):
        cache = jax.jit(lambda: init_cache(config, 2, 64))()
    assert CACHE_NAMES == ("layer", "batch", "length", "heads", "kv")
    placed = NamedSharding(mesh, P(None, "data", None, "model", None))
    assert cache["key"].sharding.is_equivalent_to(placed, 5), cache["key"].sharding
    assert cache["value"].shape == (2, 2, 64, 4, 32)


@pytest.mark.slow
def test_meshplan_sample_compares_the_two_paths(tmp_path, capsys):
    trainer = prepare(
        TrainRequest(
            mesh="2x4",
            overrides={"num_layers": 1, "embed_dim": 32, "mlp_dim": 64, "max_len": 64},
            settings={"steps": 2, "batch": 8, "seq_len": 16, "eval_every": 0, "eval_batches": 1},
            data=__file__,
            ckpt_dir=str(tmp_path / "run"),
        )
    )
    trainer.run()
    trainer.close()
    capsys.readouterr()
    args = ["sample", "--ckpt-dir", str(tmp_path / "run"), "--length", "10", "--temperature", "0"]
    assert main([*args, "--compare-cache", "--platform", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "with the key/value cache:" in out and "without:" in out and "tokens/s" in out
    assert "the same bytes: yes" in out
    cached = out.splitlines()[-1]
    assert main([*args, "--no-kv-cache", "--platform", "cpu"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == cached
