"""``meshplan demo``: the guide's whole workflow on 8 devices.

The machine's accelerators when JAX finds 8 or more, else 8 emulated CPU devices
(``--platform cpu`` asks for those on a machine with fewer accelerators).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from meshplan._spmd.rules import LogicalRules
from meshplan.cli.devices import PLATFORMS, found_devices, select_platform
from meshplan.cli.output import print_error, say, text

if TYPE_CHECKING:
    import jax
    from jax.sharding import PartitionSpec

HELP = "Run the guide's workflow (sharded init, train, inference, logical axes, checkpoint restore onto another mesh) on 8 devices (emulated on the CPU without accelerators); --nnx: Flax NNX's guide."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--depth", type=int, default=1024, help="hidden size (default 1024)")
    parser.add_argument("--layers", type=int, default=4, help="DotReluDot layers (default 4)")
    parser.add_argument("--steps", type=int, default=5, help="timed train steps (default 5)")
    parser.add_argument(
        "--no-explicit", action="store_true", help="skip the run on an Explicit mesh"
    )
    parser.add_argument(
        "--nnx",
        action="store_true",
        help="run Flax NNX's guide ('Scale up on multiple devices') with meshplan instead",
    )
    parser.add_argument(
        "--platform",
        choices=PLATFORMS,
        default="auto",
        help="auto: the machine's accelerators when JAX finds any (8 are needed), else 8 "
        "emulated CPU devices; cpu: those (default auto)",
    )


def _is_box(x: Any) -> bool:
    from flax.core.meta import AxisMetadata

    return isinstance(x, AxisMetadata)


def _params_table(title: str, params: Any) -> Table:
    import jax

    table = Table(title=text(title), title_justify="left")
    for column in ("parameter", "box", "names", "shape", "sharding spec", "devices per shard"):
        table.add_column(column, no_wrap=column != "names")
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_box)[0]
    for path, box in flat:
        value = box.value
        replicas = len(value.sharding.device_set) // len(
            {str(i) for i in value.sharding.devices_indices_map(value.shape).values()}
        )
        table.add_row(
            *(
                text(cell)
                for cell in (
                    "/".join(str(getattr(k, "key", k)) for k in path),
                    type(box).__name__,
                    str(box.names),
                    str(value.shape),
                    str(value.sharding.spec),
                    str(replicas),
                )
            )
        )
    return table


def _output_spec(output: jax.Array) -> PartitionSpec:
    """The mesh spec of an output of the workflow, which lays every array out on a mesh."""
    from jax.sharding import NamedSharding

    sharding = output.sharding
    assert isinstance(sharding, NamedSharding), sharding
    return sharding.spec


def _picture(console: Console, title: str, array: Any) -> None:
    import jax

    say(console, (title, "bold"), f"  shape={array.shape}  spec={array.sharding.spec}")
    jax.debug.visualize_array_sharding(array, use_color=True, scale=0.6)


def run(args: argparse.Namespace) -> int:
    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 120))
    from meshplan._errors import MeshplanError

    platform = getattr(args, "platform", "auto")
    try:  # the workflow needs 8: a 2x4 and a 4x2 mesh
        select_platform(platform, 8, console, flag=None)
        devices = found_devices(platform, needed=8)
    except MeshplanError as e:
        print_error(e)
        return 2
    say(console, (devices.describe(), "dim"))
    if args.nnx:
        return _run_nnx(args, console)
    import jax
    from jax.sharding import PartitionSpec

    import meshplan
    from meshplan.models import workflow as wf
    from meshplan.models.mlp import LOGICAL_RULES

    started = time.perf_counter()
    mesh = wf.make_mesh((2, 4))
    console.print(
        Panel.fit(
            text(
                f"JAX {jax.__version__}: {jax.device_count()} {jax.devices()[0].platform.upper()} "
                f"devices; mesh {dict(mesh.shape)} with {mesh.axis_types[0]} axes\n"
                f"MLP of {args.layers} DotReluDot layers, depth {args.depth}, batch 8"
            ),
            title="meshplan demo: the guide's workflow",
        )
    )

    results = {}
    for logical in (False, True):
        for use_scan in (False, True):
            variant = wf.Variant(use_scan, logical, args.layers, args.depth)
            results[variant.label] = result = wf.run_variant(variant, mesh, steps=args.steps)
            console.rule(text((variant.label, "bold")))
            layer = result.layer
            console.print(_params_table(f"Sharded init ({variant.label}): params", layer))
            mu = result.trained.opt_state[0].mu[variant.layer_name()]["W2"]
            say(
                console,
                f"Adam mu of W2: {mu.value.sharding.spec}   step: "
                f"{result.trained.step.sharding.spec} = {int(result.trained.step)}   "
                f"count: {result.trained.opt_state[0].count.sharding.spec}",
            )
            say(
                console,
                "train step: median ",
                (f"{wf.median_ms(result):.1f} ms", "bold"),
                f" over {len(result.step_ms)} steps;   inference: {result.output.dtype} "
                f"{result.output.shape} sharded {_output_spec(result.output)}",
            )
            if not use_scan and not logical:
                w1 = layer["Dense_0"]["kernel"].value
                _picture(console, "W1 (Dense_0/kernel): split by columns", w1)
                _picture(console, "W2: split by rows", layer["W2"].value)
            if logical:
                spec = meshplan.get_partition_spec(result.abstract_state.params)
                kernel_spec = spec[variant.layer_name()]["Dense_0"]["kernel"]
                mesh_spec = result.state_sharding.params[variant.layer_name()]["Dense_0"]["kernel"]
                device = results[wf.Variant(use_scan, False).label]
                same = jax.tree.leaves(result.state_sharding) == jax.tree.leaves(
                    device.state_sharding
                )
                say(
                    console,
                    f"logical spec {kernel_spec} -> mesh spec {mesh_spec.spec} under rules "
                    f"{LOGICAL_RULES};  shardings equal to the device-axis variant: ",
                    (str(same), "bold"),
                )

    console.rule(text(("unbox / replace_boxed", "bold")))
    loop = results[wf.Variant(False, False).label]
    params = loop.trained.params
    zeros = jax.tree.map(lambda v: v * 0, meshplan.unbox(params))
    zero_params = meshplan.replace_boxed(params, zeros)
    box = zero_params["DotReluDot_0"]["W2"]
    mapped = jax.tree_util.tree_map(lambda v: v + 1, zero_params)
    say(
        console,
        f"all-zero copy: W2 is {type(box).__name__} names={box.names}, sum="
        f"{float(box.value.sum())};  tree_map keeps boxes: "
        f"{type(mapped['DotReluDot_0']['W2']).__name__}",
    )

    console.rule(text(("checkpoint: save on 2x4, restore onto 4x2 with other shardings", "bold")))
    logical_scan = results[wf.Variant(True, True).label]
    other_mesh = wf.make_mesh((4, 2))
    other_rules = (("batch", "data"), ("hidden", "data"), ("embed", "model"))
    target = meshplan.logical_to_mesh_sharding(
        meshplan.get_partition_spec(logical_scan.abstract_state), other_mesh, other_rules
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = wf.save_state(logical_scan.trained, Path(tmp))
        restored = wf.restore_on_mesh(path, logical_scan.abstract_state, target)
    restored_params = meshplan.replace_boxed(logical_scan.trained.params, restored["params"])
    kernel = restored_params["ScanLogicalDotReluDot_0"]["Dense_0"]["kernel"]
    before = logical_scan.trained.params["ScanLogicalDotReluDot_0"]["Dense_0"]["kernel"].value
    equal = wf.trees_equal(wf.state_arrays(logical_scan.trained), restored)
    say(
        console,
        f"saved from mesh {dict(mesh.shape)} spec {before.sharding.spec}; restored onto "
        f"{dict(other_mesh.shape)} with rules {other_rules}: {type(kernel).__name__} "
        f"names={kernel.names} spec {kernel.value.sharding.spec};  values equal: ",
        (str(equal), "bold"),
    )
    _picture(console, "restored Dense_0/kernel, layer 0, on the 4x2 mesh", kernel.value[0])

    if not args.no_explicit:
        console.rule(text(("Explicit mesh (jax.make_mesh default)", "bold")))
        explicit = wf.make_mesh((2, 4), explicit=True)
        result = wf.run_variant(wf.Variant(True, True, args.layers, args.depth), explicit)
        auto_specs = [s.spec for s in jax.tree.leaves(logical_scan.state_sharding)]
        explicit_specs = [s.spec for s in jax.tree.leaves(result.state_sharding)]
        say(
            console,
            f"logical scan variant on {explicit.axis_types}: step median "
            f"{wf.median_ms(result):.1f} ms; same specs as on the Auto mesh: "
            f"{auto_specs == explicit_specs}; output spec {_output_spec(result.output)}",
        )

    ok = equal and all(
        _output_spec(r.output) == PartitionSpec("data", None) for r in results.values()
    )
    if ok:
        say(console, "\n", ("Done", "bold green"), f" in {time.perf_counter() - started:.1f} s.")
    else:
        say(console, ("\nSomething did not match: see above.", "bold red"))
    return 0 if ok else 1


# -- meshplan demo --nnx: Flax NNX's guide "Scale up on multiple devices" ---------------------


def _nnx_table(title: str, state: Any, rules: LogicalRules = ()) -> Table:
    """Each variable: its names, its shape, and its spec by meshplan and by Flax."""
    from flax import nnx

    import meshplan

    table = Table(title=text(title), title_justify="left")
    for column in ("variable", "out_sharding", "shape", "meshplan spec", "Flax spec"):
        table.add_column(column, no_wrap=True)
    with meshplan.logical_axis_rules(rules):
        ours = dict(nnx.to_flat_state(meshplan.get_partition_spec(state)))
    theirs = dict(nnx.to_flat_state(nnx.get_partition_spec(state)))
    for path, var in nnx.to_flat_state(state):
        value = var.get_value()
        cells = (
            "/".join(map(str, path)),
            str(var.get_metadata().get("out_sharding")),
            str(value.shape),
            str(ours[path].get_value()),
            str(theirs[path].get_value()),
        )
        table.add_row(*(text(cell) for cell in cells))
    return table


def _check(console: Console, checks: list[bool], what: str, ok: bool) -> None:
    checks.append(bool(ok))
    mark = ("ok  ", "bold green") if ok else ("FAIL", "bold red")
    say(console, mark, f" {what}")


def _run_nnx(args: argparse.Namespace, console: Console) -> int:
    import jax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import meshplan
    from meshplan.models import workflow_nnx as wf

    started = time.perf_counter()
    depth = args.depth
    mesh = wf.make_mesh((2, 4))
    other = wf.make_mesh((4, 2))
    checks: list[bool] = []

    def equivalent(array: Any, target: Any, spec: PartitionSpec) -> bool:
        return bool(array.sharding.is_equivalent_to(NamedSharding(target, spec), ndim=array.ndim))

    console.print(
        Panel.fit(
            text(
                f"JAX {jax.__version__}: {jax.device_count()} "
                f"{jax.devices()[0].platform.upper()} devices; mesh {dict(mesh.shape)} with "
                f"{mesh.axis_types[0]} axes\nMultiDotReluDot of {args.layers} layers (nnx.vmap), "
                f"depth {depth}, batch 8"
            ),
            title="meshplan demo --nnx: Flax NNX's guide 'Scale up on multiple devices'",
        )
    )

    console.rule(text(("Shard a single-array model", "bold")))
    w = wf.sharded_variable(mesh)
    _check(
        console,
        checks,
        f"nnx.Param out_sharding=(None, 'model'): {w.sharding.spec}",
        w.sharding.spec == P(None, "model"),
    )
    _picture(console, "w", w.get_value())
    linear, y = wf.sharded_linear(mesh)
    _check(
        console,
        checks,
        f"nnx.Linear kernel (nnx.with_partitioning): {linear.kernel.sharding.spec}",
        linear.kernel.sharding.spec == P(None, "model"),
    )
    _check(
        console,
        checks,
        f"output of ('data', None) @ (None, 'model'): {_output_spec(y)}",
        _output_spec(y) == P("data", "model"),
    )

    console.rule(text(("MultiDotReluDot: nnx.vmap layers, jax.lax.scan, nnx.Optimizer", "bold")))
    run = wf.train(
        lambda r: wf.MultiDotReluDot(depth, args.layers, rngs=r),
        mesh,
        depth=depth,
        steps=args.steps,
    )
    state = nnx.state(run.model)
    console.print(_nnx_table("the trained model: meshplan reads Flax's names as Flax does", state))
    say(
        console,
        "losses: ",
        ", ".join(f"{loss:.4f}" for loss in run.losses),
        f";  optimizer step {int(run.optimizer.step[...])}",
    )
    _check(
        console,
        checks,
        "the loss falls at every step",
        all(b < a for a, b in zip(run.losses, run.losses[1:], strict=False)),
    )
    plan = meshplan.explain(nnx.state(run.optimizer), mesh)
    mu = plan["opt_state/0/mu/layers/w2"]
    _check(
        console,
        checks,
        f"Adam's mu of w2 in meshplan's plan: {mu.spec}, {mu.shard_shape} per device",
        mu.spec == P(None, "model", None),
    )

    console.rule(text(("Checkpoint: save on 2x4, restore onto 4x2", "bold")))
    with tempfile.TemporaryDirectory() as tmp:
        path = wf.save_state(state, Path(tmp))
        restored = wf.restore_onto(
            path, lambda: wf.MultiDotReluDot(depth, args.layers, rngs=nnx.Rngs(0)), other
        )
    kernel = restored.layers.dot1.kernel.get_value()
    _check(
        console,
        checks,
        f"Orbax, targets from meshplan.get_sharding on {dict(other.shape)}: dot1 kernel "
        f"{kernel.sharding.spec}; values equal",
        equivalent(kernel, other, P(None, None, "model"))
        and wf.trees_equal(nnx.state(restored), state),
    )

    def make_logical() -> Any:
        return wf.LogicalMultiDotReluDot(depth, args.layers, rngs=nnx.Rngs(0))

    logical, logical_output = wf.run_logical(mesh, depth, num_layers=args.layers)
    with tempfile.TemporaryDirectory() as tmp:
        moved = wf.restore_with_meshplan(logical, Path(tmp), make_logical, other, wf.OTHER_RULES)
    kernel = moved.layers.dot1.kernel.get_value()
    _check(
        console,
        checks,
        f"meshplan.Checkpointer + meshplan.restore onto {dict(other.shape)} with rules "
        f"{wf.OTHER_RULES}: dot1 kernel {moved.layers.dot1.kernel.out_sharding} -> "
        f"{kernel.sharding.spec}; values equal",
        kernel.sharding.spec == P(None, "model", "data")
        and wf.trees_equal(nnx.state(moved), nnx.state(logical)),
    )

    console.rule(text(("Logical axes, with meshplan's rules", "bold")))
    console.print(
        _nnx_table(
            f"LogicalMultiDotReluDot under {wf.GUIDE_RULES}", nnx.state(logical), wf.GUIDE_RULES
        )
    )
    _check(
        console,
        checks,
        "dot1 kernel is P(None, None, 'model'), w2 is P(None, 'model', None)",
        equivalent(logical.layers.dot1.kernel.get_value(), mesh, P(None, None, "model"))
        and equivalent(logical.layers.w2.get_value(), mesh, P(None, "model", None)),
    )
    _check(
        console,
        checks,
        f"output {_output_spec(logical_output)}",
        equivalent(logical_output, mesh, P("data", None)),
    )
    with jax.set_mesh(mesh), meshplan.logical_axis_rules(wf.GUIDE_RULES):
        jaxpr = str(jax.make_jaxpr(lambda m, x: m(x))(logical, logical_output))
    _check(
        console,
        checks,
        "activation constrained in logical names: with_logical_constraint(y, ('batch', "
        "'hidden')) -> P('data', 'model') (the guide writes mesh axes here)",
        "spec=P('data', 'model')" in jaxpr,
    )

    if not args.no_explicit:
        console.rule(text(("Explicit axes", "bold")))
        explicit = wf.make_mesh((2, 4), explicit=True)
        model, x, y, abstract = wf.run_explicit(explicit, depth, num_layers=args.layers)
        _check(
            console,
            checks,
            f"the guide's Explicit model: dot1 kernel {model.layers.dot1.kernel.sharding.spec}, "
            f"w2 {model.layers.w2.sharding.spec}, eval_shape {abstract.layers.w2.sharding.spec}, "
            f"output like input: {x.sharding.is_equivalent_to(y.sharding, ndim=2)}",
            model.layers.w2.sharding.spec == P(None, "model", None)
            and x.sharding.is_equivalent_to(y.sharding, ndim=2),
        )
        on_explicit, output = wf.run_logical(explicit, depth, num_layers=args.layers)
        _check(
            console,
            checks,
            f"the logical model on the Explicit mesh: dot1 kernel "
            f"{on_explicit.layers.dot1.kernel.sharding.spec}, output {_output_spec(output)}",
            on_explicit.layers.dot1.kernel.sharding.spec == P(None, None, "model")
            and _output_spec(output) == P("data", None),
        )

    if all(checks):
        say(console, "\n", ("Done", "bold green"), f" in {time.perf_counter() - started:.1f} s.")
        return 0
    say(console, ("\nSomething did not match: see above.", "bold red"))
    return 1
