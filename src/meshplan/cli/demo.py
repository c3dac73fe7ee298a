"""``meshplan demo``: the guide's whole workflow on 8 emulated CPU devices."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from meshplan.cli.devices import use_cpu_devices
from meshplan.cli.output import say, text

if TYPE_CHECKING:
    import jax
    from jax.sharding import PartitionSpec

HELP = "Run the guide's workflow (sharded init, train, inference, logical axes, checkpoint restore onto another mesh) on 8 CPU devices."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--depth", type=int, default=1024, help="hidden size (default 1024)")
    parser.add_argument("--layers", type=int, default=4, help="DotReluDot layers (default 4)")
    parser.add_argument("--steps", type=int, default=5, help="timed train steps (default 5)")
    parser.add_argument(
        "--no-explicit", action="store_true", help="skip the run on an Explicit mesh"
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
    use_cpu_devices(8, console, flag=None)  # the workflow needs 8: a 2x4 and a 4x2 mesh
    import jax
    from jax.sharding import PartitionSpec

    import meshplan
    from meshplan.examples import workflow as wf
    from meshplan.examples.mlp import LOGICAL_RULES

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
