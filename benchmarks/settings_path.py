"""How far the settings of ``meshplan train`` travel: modules visited and back-steps, statically.

Starts at ``meshplan.cli.train:run(args)`` (``cli/train/command.py``) and follows the settings through the
code without running it:

* a *carrier* of the settings is ``args``, a value read from a carrier
  (``args.mesh``, ``trainer.settings``, ``request.settings["lr"]``), or an object of
  the package built from carriers: an assignment ``x = f(...)`` makes ``x`` a
  carrier when ``f`` is a class of the package, or a function annotated to return
  one, or whose body returns ``Cls(...)`` of one (``request = _request(args)``,
  ``trainer = prepare(request)``), called with a carrier. What is only computed from a setting (``rules = get_layout(request.rules)``,
  a mesh, a number) is not a carrier: it is the setting's consequence, not the setting;
* a call is *followed* when one of its arguments is a carrier (as a whole, not
  inside a larger expression), or it is a method of a carrier (``trainer.run()``);
  in the callee, the parameters bound to carriers are carriers (and ``self``, for
  a method of a carrier or a class built from carriers);
* a callee is resolved statically: a function of the same module, a name
  imported with ``from meshplan.x import f`` (at the top or inside a function), a
  class (its ``__init__``), ``self.method``, or ``obj.method`` when ``obj`` was
  built by a known class or by a function annotated to return one (or is a field
  annotated with one of a known class: ``prepared.trainer``), else (``obj``
  a carrier) when exactly one class of the package defines that method. A method of a
  ``typing.Protocol`` (``source.given(...)``, ``source`` a ``ModelSource``) is that method
  of every class of the package that defines all of the protocol's methods, followed as
  alternatives, as the branches of an ``if``: one run calls one of them. Calls that cannot be
  resolved (third-party code, callbacks, ``getattr``) are not followed.

Each function is a *stop* the first time the walk reaches it (depth first, in
the order Python runs the calls: a call's arguments before the call). The layer
of a stop is its package's in ``docs/architecture.md`` (``cli`` 8, ``examples`` 7,
``models`` 6, ``train`` 5, ``_search`` and ``testing`` 4, ``_plan`` and ``_checkpoint`` 3,
``layouts`` 2, ``_spmd`` 1, the bottom 0). A *back-step* is a stop whose layer is
above the previous stop's: the settings went down and came back up (to be read
again by a higher layer). The previous stop is the one a run reaches last before
it: for the first stop of an ``else`` branch, the last one before its ``if`` (a
run takes one branch, not both). An *upward call* is a stop whose caller's layer
is below its own: a lower layer calling back up into a higher one.

The bottom layer (``_errors``, ``_text``, ``_version``: an error record, a byte count in
words) is not a step down: every layer calls it to word what it has, and nothing there
reads a setting to decide anything. So a stop of the bottom is never the previous
stop of another (the previous is the last stop above the bottom): the command line
going on after ``error_for(...)`` is not a back-step. This changed the count from 15 to
14 (``_spmd.rules:logical_to_mesh_axes`` after ``_text:axes_text``); the figure by the
first definition is printed too (``counting the bottom``).

Two corrections since the first count (both change figures, neither hides a
call): calls are in the order Python runs them (``Trainer(..., Measures(f(...)))``
runs ``f`` first), and a method a builtin type defines too (``args.remat.replace``,
a ``str``'s) is not taken for the package's one method of that name; and ``else``
branches, as above.

Run it on a source tree (default ``src`` of this checkout)::

    python benchmarks/settings_path.py            # this checkout
    python benchmarks/settings_path.py /tmp/old/src --list   # another one, every stop listed

It prints the stops, the modules, how often the most entered module is entered,
the back-steps and the upward calls (``--list`` marks each). The figures are a static approximation: they count code
the settings can reach, not what one run executes.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import sys
from pathlib import Path

LAYERS = {
    "cli": 8,
    "examples": 7,
    "models": 6,
    "train": 5,
    "_search": 4,
    "testing": 4,
    "_plan": 3,
    "_checkpoint": 3,
    "layouts": 2,
    "_spmd": 1,
    "_errors": 0,
    "_text": 0,
    "_version": 0,
}
"""The layers of docs/architecture.md, by the package's first name under ``meshplan``."""


def layer_of(module: str) -> int:
    """The layer of ``meshplan.cli.train`` (7) or ``meshplan.__init__`` (the top: 8)."""
    parts = module.split(".")
    return LAYERS.get(parts[1], 8) if len(parts) > 1 else 8


@dataclasses.dataclass
class Function:
    module: str
    qualname: str  # 'run' or 'Trainer.__init__'
    node: ast.FunctionDef | ast.AsyncFunctionDef
    cls: str | None

    @property
    def key(self) -> str:
        return f"{self.module}:{self.qualname}"


class Index:
    """Every module's top-level functions, classes and methods, and its imports."""

    def __init__(self, src: Path) -> None:
        self.functions: dict[str, Function] = {}
        self.classes: dict[str, tuple[str, ast.ClassDef]] = {}  # 'module:Cls'
        self.imports: dict[str, dict[str, str]] = {}  # module -> local name -> 'module:name'
        self.methods: dict[str, list[str]] = {}  # method name -> ['module:Cls.name']
        for path in sorted((src / "meshplan").rglob("*.py")):
            rel = path.relative_to(src).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            module = ".".join(parts)
            tree = ast.parse(path.read_text(), str(path))
            self.imports[module] = {}
            self._read(module, tree, path.name == "__init__.py")

    def _read(self, module: str, tree: ast.Module, package: bool) -> None:
        for node in ast.walk(tree):  # imports anywhere, also inside functions
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    self.imports[module][alias.asname or alias.name] = f"{node.module}:{alias.name}"
            elif isinstance(node, ast.ImportFrom) and node.level:
                base = module.split(".")
                base = base if package else base[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
                for alias in node.names:
                    self.imports[module][alias.asname or alias.name] = f"{target}:{alias.name}"
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                f = Function(module, node.name, node, None)
                self.functions[f.key] = f
            elif isinstance(node, ast.ClassDef):
                self.classes[f"{module}:{node.name}"] = (module, node)
                for item in node.body:
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                        f = Function(module, f"{node.name}.{item.name}", item, node.name)
                        self.functions[f.key] = f
                        self.methods.setdefault(item.name, []).append(f.key)

    def implementations(self, key: str) -> list[str]:
        """A ``typing.Protocol``'s method ``'module:Proto.name'``: that method of every class
        of the package that defines every method of the protocol (a run calls one of them);
        ``[]`` for any other function."""
        module, _, qualname = key.partition(":")
        owner, _, name = qualname.rpartition(".")
        found = self.classes.get(f"{module}:{owner}") if owner else None
        if found is None or not any(ast.unparse(b).endswith("Protocol") for b in found[1].bases):
            return []
        wanted = {
            item.name
            for item in found[1].body
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
        }
        out = []
        for cls_key, (cls_module, cls) in sorted(self.classes.items()):
            defined = {
                item.name
                for item in cls.body
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
            }
            if cls_key != f"{module}:{owner}" and wanted <= defined:
                out.append(f"{cls_module}:{cls.name}.{name}")
        return out

    def resolve_name(self, module: str, name: str, seen: int = 0) -> str | None:
        """``'module:name'`` of a function or class named ``name`` in ``module``."""
        if f"{module}:{name}" in self.functions or f"{module}:{name}" in self.classes:
            return f"{module}:{name}"
        target = self.imports.get(module, {}).get(name)
        if target is None or seen > 5:
            return None
        mod, _, attr = target.partition(":")
        if f"{mod}:{attr}" in self.functions or f"{mod}:{attr}" in self.classes:
            return f"{mod}:{attr}"
        if mod in self.imports:  # re-exported (meshplan/__init__.py)
            return self.resolve_name(mod, attr, seen + 1)
        return None


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _carries(node: ast.AST | None, tainted: set[str]) -> bool:
    """``node`` is a carrier: a carrier's name, or an attribute or item read from one."""
    while isinstance(node, ast.Attribute | ast.Subscript | ast.Starred):
        node = node.value
    return isinstance(node, ast.Name) and node.id in tainted


@dataclasses.dataclass
class Walk:
    index: Index
    stops: list[str] = dataclasses.field(default_factory=list)
    seen: set[str] = dataclasses.field(default_factory=set)
    previous: dict[str, str | None] = dataclasses.field(default_factory=dict)
    """Each stop's previous stop in a run: the last one reached before it (for the first
    stop of an ``else`` branch, the last one before the ``if``: one run takes one branch)."""
    callers: dict[str, str | None] = dataclasses.field(default_factory=dict)
    _before_else: list[str | None] | None = None

    def enter(self, key: str, tainted_params: set[str], caller: str | None = None) -> None:
        if key in self.seen:
            return
        self.seen.add(key)
        if self._before_else is not None:
            self.previous[key], self._before_else = self._before_else[0], None
        else:
            self.previous[key] = self.stops[-1] if self.stops else None
        self.callers[key] = caller
        self.stops.append(key)
        f = self.index.functions[key]
        self._body(f, set(tainted_params))

    def _body(self, f: Function, tainted: set[str]) -> None:
        types: dict[str, str] = {}  # local name -> 'module:Cls'
        # Statements in source order; a name becomes tainted when assigned from a tainted value.
        branches: list[str | None] = []  # the last stop before each open `if`
        for node in _in_order(f.node):
            if isinstance(node, _Branch):
                if node.part == "if":
                    branches.append(self.stops[-1] if self.stops else None)
                elif node.part == "else":
                    self._before_else = [branches[-1]]
                else:
                    branches.pop()
                    self._before_else = None
                continue
            if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign | ast.NamedExpr):
                value = node.value
                targets = (
                    node.targets if isinstance(node, ast.Assign) else [node.target]  # type: ignore[list-item]
                )
                if value is None:
                    continue
                built = self._type_of(f, value, types)
                hot = _carries(value, tainted) or (
                    built is not None and isinstance(value, ast.Call) and _passes(value, tainted)
                )
                for t in targets:
                    if (
                        isinstance(t, ast.Tuple)
                        and isinstance(value, ast.Tuple)
                        and len(t.elts) == len(value.elts)
                    ):  # a, b = x.a, y.b: pairwise
                        for part, v in zip(t.elts, value.elts, strict=True):
                            if _carries(v, tainted):
                                tainted |= _names(part)
                        continue
                    for name in _names(t):
                        if hot:
                            tainted.add(name)
                        if built is not None and isinstance(t, ast.Name):
                            types[t.id] = built
            elif isinstance(node, ast.For) and _carries(node.iter, tainted):
                tainted |= _names(node.target)
            elif (
                isinstance(node, ast.withitem)
                and node.optional_vars is not None
                and _carries(node.context_expr, tainted)
            ):
                tainted |= _names(node.optional_vars)
            if isinstance(node, ast.Call):
                self._call(f, node, tainted, types)

    def _type_of(self, f: Function, value: ast.AST, types: dict[str, str]) -> str | None:
        """The project class ``value`` builds or returns (or a field of a known class holds)."""
        if isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name):
            owner = types.get(value.value.id)
            if owner is None:
                return None
            module, cls = self.index.classes[owner]
            for item in cls.body:  # `trainer: Trainer` in the class body
                if (
                    isinstance(item, ast.AnnAssign)
                    and isinstance(item.target, ast.Name)
                    and item.target.id == value.attr
                ):
                    found = self.index.resolve_name(module, ast.unparse(item.annotation))
                    return found if found in self.index.classes else None
            return None
        if not isinstance(value, ast.Call):
            return None
        target = self._callee(f, value, types)
        if target is None:
            return None
        if target in self.index.classes:
            return target
        fn = self.index.functions.get(target)
        if fn is None:
            return None
        if fn.node.returns is not None:
            ret = ast.unparse(fn.node.returns).strip("'\"")
            found = self.index.resolve_name(fn.module, ret)
            if found in self.index.classes:
                return found
        for node in ast.walk(fn.node):  # else: `return Cls(...)` in its body (`-> Any`)
            value = node.value if isinstance(node, ast.Return) else None
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Name):
                found = self.index.resolve_name(fn.module, value.func.id)
                if found in self.index.classes:
                    return found
        return None

    def _callee(
        self, f: Function, call: ast.Call, types: dict[str, str], tainted: set[str] | None = None
    ) -> str | None:
        func = call.func
        if isinstance(func, ast.Name):
            return self.index.resolve_name(f.module, func.id)
        if isinstance(func, ast.Attribute):
            owner = func.value
            if isinstance(owner, ast.Name) and owner.id == "self" and f.cls is not None:
                key = f"{f.module}:{f.cls}.{func.attr}"
                return key if key in self.index.functions else None
            if isinstance(owner, ast.Name) and owner.id in types:
                key = f"{types[owner.id]}.{func.attr}"
                return key if key in self.index.functions else None
            candidates = self.index.methods.get(func.attr, [])
            on_carrier = tainted is not None and _carries(owner, tainted)
            # `args.remat.replace("-", "_")` is a str's: a name builtin types define too is not
            # the package's one method of that name.
            unique = len(candidates) == 1 and func.attr not in _BUILTIN_METHODS
            if on_carrier and unique and not func.attr.startswith("__"):
                return candidates[0]
        return None

    def _call(self, f: Function, call: ast.Call, tainted: set[str], types: dict[str, str]) -> None:
        target = self._callee(f, call, types, tainted)
        if target is None:
            return
        receiver = call.func.value if isinstance(call.func, ast.Attribute) else None
        on_tainted = receiver is not None and _carries(receiver, tainted)
        args_tainted = [_carries(a, tainted) for a in call.args]
        kw_tainted = {k.arg: _carries(k.value, tainted) for k in call.keywords}
        if not (on_tainted or any(args_tainted) or any(kw_tainted.values())):
            return
        implementations = self.index.implementations(target)
        if implementations:  # a Protocol's method: each class that implements it, as alternatives
            before = self.stops[-1] if self.stops else None
            for i, impl in enumerate(implementations):
                if i:
                    self._before_else = [before]
                self._enter_call(f, impl, on_tainted, args_tainted, kw_tainted)
                self._before_else = None
            return
        self._enter_call(f, target, on_tainted, args_tainted, kw_tainted)

    def _enter_call(
        self,
        f: Function,
        target: str,
        on_tainted: bool,
        args_tainted: list[bool],
        kw_tainted: dict[str | None, bool],
    ) -> None:
        if target in self.index.classes:
            init = f"{target}.__init__"
            if init not in self.index.functions:
                return
            target, bound = init, True
        else:
            bound = on_tainted or self.index.functions[target].cls is not None
        fn = self.index.functions[target]
        params = [a.arg for a in [*fn.node.args.posonlyargs, *fn.node.args.args]]
        if bound and params and params[0] == "self":
            first, params = params[0], params[1:]
        else:
            first = None
        marked: set[str] = set()
        if first is not None and (on_tainted or target.endswith(".__init__")):
            marked.add(first)
        for name, hot in zip(params, args_tainted, strict=False):
            if hot:
                marked.add(name)
        for name, hot in kw_tainted.items():
            if hot and name is not None:
                marked.add(name)
            if hot and name is None and fn.node.args.kwarg is not None:  # **kwargs
                marked.add(fn.node.args.kwarg.arg)
        if any(args_tainted[len(params) :]) and fn.node.args.vararg is not None:
            marked.add(fn.node.args.vararg.arg)
        if marked:
            self.enter(target, marked, f.key)


_BUILTIN_METHODS = {
    name for kind in (str, bytes, int, float, list, tuple, dict, set) for name in dir(kind)
}
"""Methods of Python's own types: a value read from a carrier may be one of those."""


def _passes(call: ast.Call, tainted: set[str]) -> bool:
    """``call`` is given a carrier, or is a method of one."""
    if isinstance(call.func, ast.Attribute) and _carries(call.func.value, tainted):
        return True
    return any(_carries(a, tainted) for a in [*call.args, *(k.value for k in call.keywords)])


@dataclasses.dataclass
class _Branch:
    """Where an ``if`` statement starts (``'if'``), its ``else`` starts, and it ends."""

    part: str


def _in_order(fn: ast.AST) -> list[ast.AST | _Branch]:
    """The nodes of ``fn``'s body in source order, nested functions and classes left out;
    an ``if`` statement's branches marked, as alternatives."""
    out: list[ast.AST | _Branch] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(
                child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef
            ):
                continue
            if isinstance(child, ast.If) and child.orelse:
                out.append(child)
                visit(child.test)
                out.append(_Branch("if"))
                for statement in child.body:
                    visit(ast.Module(body=[statement], type_ignores=[]))
                out.append(_Branch("else"))
                for statement in child.orelse:
                    visit(ast.Module(body=[statement], type_ignores=[]))
                out.append(_Branch("end"))
                continue
            if isinstance(child, ast.Assign | ast.AnnAssign | ast.AugAssign | ast.Call):
                # The calls on the right side first, then the assignment; a call's arguments
                # (`Trainer(..., Measures(train_flops(...)))`) before the call, as Python runs them.
                visit(child)
                out.append(child)
                continue
            out.append(child)
            visit(child)

    visit(fn)
    return out


def measure(src: Path, start: str = "meshplan.cli.train:run") -> dict[str, object]:
    """The stops, modules and back-steps of the settings from ``start``'s first parameter."""
    index = Index(src)
    module, _, name = start.partition(":")
    start = index.resolve_name(module, name) or start  # a package's front door re-exports it
    walk = Walk(index)
    first = index.functions[start].node.args.args[0].arg
    walk.enter(start, {first})
    modules = [s.split(":")[0] for s in walk.stops]
    entries: dict[str, int] = {}
    previous = None
    for m in modules:
        if m != previous:
            entries[m] = entries.get(m, 0) + 1
        previous = m

    def layer(stop: str | None) -> int:
        return layer_of(stop.split(":")[0]) if stop is not None else -1

    def before(stop: str) -> str | None:
        """The previous stop above the bottom layer (module docstring)."""
        previous = walk.previous[stop]
        while previous is not None and layer(previous) == 0:
            previous = walk.previous[previous]
        return previous

    back = [s for s in walk.stops if before(s) is not None and layer(s) > layer(before(s))]
    back_counting_bottom = [
        s for s in walk.stops if walk.previous[s] is not None and layer(s) > layer(walk.previous[s])
    ]
    upward = [
        s for s in walk.stops if walk.callers[s] is not None and layer(s) > layer(walk.callers[s])
    ]
    top = max(entries.items(), key=lambda kv: kv[1]) if entries else ("", 0)
    return {
        "stops": len(walk.stops),
        "modules": len(set(modules)),
        "back_steps": len(back),
        "back_steps_counting_bottom": len(back_counting_bottom),
        "upward_calls": len(upward),
        "most_entered": {"module": top[0], "entries": top[1]},
        "path": walk.stops,
        "back": {s: before(s) for s in back},
        "upward": {s: walk.callers[s] for s in upward},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", nargs="?", default=str(Path(__file__).parent.parent / "src"))
    parser.add_argument("--list", action="store_true", help="print every stop, with its layer")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = measure(Path(args.src))
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    if args.list:
        back, upward = result["back"], result["upward"]
        for stop in result["path"]:  # type: ignore[attr-defined]
            mark = ""
            if stop in back:  # type: ignore[operator]
                mark += f"   <- back-step, after {back[stop]}"  # type: ignore[index]
            if stop in upward:  # type: ignore[operator]
                mark += f"   <- called up from {upward[stop]}"  # type: ignore[index]
            print(f"  {layer_of(stop.split(':')[0])}  {stop}{mark}")
    most = result["most_entered"]
    print(
        f"stops {result['stops']}, modules {result['modules']}, back-steps "
        f"{result['back_steps']} ({result['back_steps_counting_bottom']} counting the bottom), "
        f"upward calls {result['upward_calls']}; most entered: "
        f"{most['module']} ({most['entries']} times)"  # type: ignore[index]
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
