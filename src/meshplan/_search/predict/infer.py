"""Logical names for a model that has none, read from its step's dataflow.

:func:`infer_names` traces the step once and joins the dimensions the program makes
one (:mod:`meshplan._search.predict.dim_classes`), then names each class of the state's
dimensions by its role, where the program shows it:

* ``layer``: a scanned stack's leading dimension;
* ``vocab``: the rows of a table looked up with the batch's token ids (an embedding),
  and so the logits of a tied head;
* ``embed``: that table's features, the residual stream (without a lookup: the class
  in the most arrays: the norms' scales, most matmuls' inputs; on a tie, the batch's
  features);
* ``heads`` and ``kv``: a product of two activations (attention's q·kᵀ and its
  probabilities times v) batched over ``heads``, contracting or giving ``kv``, the
  head dimension, where a weight's matmul made them (every layer's, where the layers
  are not scanned); with grouped-query attention, the query's heads are ``heads`` and
  the keys' and values' (their major factor) ``kv_heads``;
* ``mlp``: a weight's output that another weight contracts back into ``embed`` (every
  layer's);
* a dimension that a reshape merges from others (``heads x kv``, a fused ``qkv``
  kernel's ``3 x heads x kv``) takes its major named factor's name;
* any other: ``dim_<size>`` (``dim_<size>_<n>`` where several have that size).

Biases, norms and the optimizer's moments share their class's name; a dimension of
size 1 gets ``None``, and so does one whose name an earlier dimension of its array has
(a square ``embed x embed`` kernel's output). The names come back as path rules
(:class:`InferredNames`), the ``(pattern, names)`` pairs :func:`meshplan.name_by_path` takes, one per parameter (a
layer index written ``\\d+`` where every layer has the same names), matching the
optimizer's copies too.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any, overload

import jax

from meshplan._search.predict.dim_classes import DimClasses, Node, dim_classes
from meshplan._search.predict.trace import Workload, trace_workload
from meshplan._spmd.leaves import array_leaves
from meshplan._text import path_text

__all__ = ["InferredNames", "NameClass", "infer_names"]

Names = tuple[str | None, ...]
PathRule = tuple[str, Names | None]


@dataclasses.dataclass(frozen=True)
class NameClass:
    """One inferred name: its dimension's ``size``, its ``role`` in the step, and how many
    state ``arrays`` carry it.

    Example:
        >>> import jax, jax.numpy as jnp, meshplan
        >>> state = {"w": jax.ShapeDtypeStruct((64, 256), jnp.float32),
        ...          "b": jax.ShapeDtypeStruct((256,), jnp.float32)}
        >>> step = lambda s, x: jax.grad(lambda s: (x @ s["w"] + s["b"]).sum())(s)
        >>> inferred = meshplan.infer_names(step, state, jax.ShapeDtypeStruct((8, 64), jnp.float32))
        >>> inferred.names_of()["embed"].size, inferred.names_of()["embed"].arrays
        (256, 2)
    """

    name: str
    size: int
    role: str
    arrays: int


class InferredNames(Sequence[PathRule]):
    """Path rules inferred from a step (:func:`infer_names`): a sequence of ``(pattern,
    names)`` pairs, as :func:`meshplan.name_by_path` takes them, and what each name is
    (``classes``: :class:`NameClass`, shown by :meth:`text`).

    Example:
        >>> import jax, jax.numpy as jnp, meshplan
        >>> state = {"w": jax.ShapeDtypeStruct((64, 256), jnp.float32),
        ...          "b": jax.ShapeDtypeStruct((256,), jnp.float32)}
        >>> step = lambda s, x: jax.grad(lambda s: (x @ s["w"] + s["b"]).sum())(s)
        >>> inferred = meshplan.infer_names(step, state, jax.ShapeDtypeStruct((8, 64), jnp.float32))
        >>> list(inferred)
        [('b', ('embed',)), ('w', ('dim_64', 'embed'))]
    """

    def __init__(self, rules: Sequence[PathRule], classes: Sequence[NameClass]) -> None:
        self.rules: tuple[PathRule, ...] = tuple(rules)
        self.classes: tuple[NameClass, ...] = tuple(classes)

    @overload
    def __getitem__(self, i: int) -> PathRule: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[PathRule]: ...
    def __getitem__(self, i: int | slice) -> PathRule | Sequence[PathRule]:
        return self.rules[i]

    def __len__(self) -> int:
        return len(self.rules)

    def __iter__(self) -> Iterator[PathRule]:
        return iter(self.rules)

    def __eq__(self, other: object) -> bool:
        return list(self.rules) == list(other) if isinstance(other, Sequence) else False

    def __hash__(self) -> int:
        return hash(self.rules)

    def __repr__(self) -> str:
        return f"InferredNames({list(self.rules)!r})"

    def names_of(self) -> dict[str, NameClass]:
        """``{name: NameClass}``.

        Example:
            >>> import jax, jax.numpy as jnp, meshplan
            >>> state = {"w": jax.ShapeDtypeStruct((64, 256), jnp.float32),
            ...          "b": jax.ShapeDtypeStruct((256,), jnp.float32)}
            >>> step = lambda s, x: jax.grad(lambda s: (x @ s["w"] + s["b"]).sum())(s)
            >>> inferred = meshplan.infer_names(step, state, jax.ShapeDtypeStruct((8, 64), jnp.float32))
            >>> sorted(inferred.names_of())
            ['dim_64', 'embed']
        """
        return {c.name: c for c in self.classes}

    def text(self) -> str:
        """The names with their sizes and roles, then the rules, as a person reads them.

        Example:
            >>> import jax, jax.numpy as jnp, meshplan
            >>> state = {"w": jax.ShapeDtypeStruct((64, 256), jnp.float32),
            ...          "b": jax.ShapeDtypeStruct((256,), jnp.float32)}
            >>> step = lambda s, x: jax.grad(lambda s: (x @ s["w"] + s["b"]).sum())(s)
            >>> print(meshplan.infer_names(step, state, jax.ShapeDtypeStruct((8, 64), jnp.float32)).text())
            name    size  role
            embed    256  residual stream: the most arrays' dimension
            dim_64    64  contracted by a matmul
            <BLANKLINE>
            b  ('embed',)
            w  ('dim_64', 'embed')
        """
        rows = [("name", "size", "role")] + [(c.name, str(c.size), c.role) for c in self.classes]
        w0, w1 = (max(len(r[k]) for r in rows) for k in (0, 1))
        lines = [f"{a:<{w0}}  {b:>{w1}}  {c}" for a, b, c in rows]
        wp = max((len(p) for p, _ in self.rules), default=0)
        return "\n".join([*lines, "", *(f"{p:<{wp}}  {n!r}" for p, n in self.rules)])


# -- naming the classes ----------------------------------------------------------------


class _Namer:
    def __init__(self, c: DimClasses) -> None:
        self.c = c
        self.names: dict[Node, tuple[str, str]] = {}  # root -> (name, role)
        counts: collections.Counter[Node] = collections.Counter()
        for nodes in c.state:  # each class once an array, in the order of its dimensions
            counts.update(dict.fromkeys(c.find(n) for n in nodes if c.size(n) > 1).keys())
        self.counts = counts
        self.batch = c.find(c.batch) if c.batch is not None else None
        self.order = list(counts)  # in order of first appearance

    def give(self, root: Node | None, name: str, role: str, *, factor: bool = False) -> None:
        """Name ``root``'s class: a class of the state's, or (``factor``) one that only a
        merged dimension of the state is made of (attention's ``heads``, ``kv``)."""
        if root is None or root in self.names or root == self.batch:
            return
        if root in self.counts or factor:
            self.names[root] = (name, role)

    def free(self, roots: Sequence[Node]) -> list[Node]:
        return [r for r in roots if r in self.counts and r not in self.names and r != self.batch]

    def run(self) -> dict[Node, tuple[str, str]]:
        c = self.c
        if self.batch is not None and self.batch in self.counts:
            self.names[self.batch] = ("batch", "the batch")
        for s in c.scans:
            self.give(c.find(s), "layer", "scanned layers: the stack's leading dimension")
        self.lookups()
        self.embed()
        self.attention()
        self.merged()  # a merge of heads x kv is heads, before it looks like an MLP's hidden
        self.mlp()  # before another stream: a norm may reduce an MLP's hidden too
        self.streams()
        self.mlp()
        self.merged()
        self.rest()
        return self.names

    def lookups(self) -> None:
        """``vocab``: the rows a lookup of token ids reads, and a dimension of a one-hot of
        them (a lookup as a matmul, the loss's targets: the logits) or of the logits an
        integer-label loss picks by them, that the batch lacks."""
        c = self.c
        for n, by_ids, _ in c.rows:
            if by_ids:
                self.give(c.find(n), "vocab", "vocabulary: the rows a lookup of token ids reads")
        own = {c.find(n) for n in c.batch_dims}
        for r in dict.fromkeys(c.find(n) for n in c.id_dims):
            if r not in own:
                self.give(r, "vocab", "vocabulary: a one-hot of the token ids, or logits they pick")
        self._features = next((rest for _, by_ids, rest in c.rows if by_ids), None)

    def embed(self) -> None:
        c = self.c
        if self._features is not None:
            features = self.free([c.find(n) for n in self._features])
            if len(features) == 1:
                self.give(features[0], "embed", "residual stream: the embedding's features")
                return
        left = self.free(self.order)
        inputs = {c.find(n) for n in c.batch_dims}  # the features the batch brings
        if left:
            best = max(left, key=lambda r: (self.counts[r], r in inputs, c.size(r)))
            self.give(best, "embed", "residual stream: the most arrays' dimension")

    def weight_free(self) -> set[Node]:
        """Classes a weight's matmul produces, and their factors (``heads x kv``)."""
        c = self.c
        out = {
            c.find(n)
            for _, _, fl, fr, side in c.dots
            if side in (0, 1)
            for n in (fl if side == 0 else fr)
        }
        return self.made_of(list(out))

    def attention_dims(self, made: set[Node]) -> tuple[list[Node], set[Node], set[Node]]:
        """Of the products of two activations batched over the batch (attention): the
        classes a weight made that they are batched over, those q·kᵀ contracts (a score:
        contracting what a weight made), and the free ones of the others (v's head
        dimension) that no score has."""
        c = self.c
        batched: dict[Node, None] = {}
        kv: set[Node] = set()
        score_free: set[Node] = set()
        value_free: set[Node] = set()
        for contract, batch, fl, fr, side in c.dots:
            roots = [c.find(n) for n in batch]
            if side != "acts" or self.batch not in roots:
                continue
            batched.update(dict.fromkeys(r for r in roots if r in made and r != self.batch))
            contracted = {c.find(n) for n in contract} & made
            free = {c.find(n) for n in (*fl, *fr)} & made
            kv |= contracted
            (score_free if contracted else value_free).update(free)
        return list(batched), kv, value_free - score_free

    def attention(self) -> None:
        made = self.weight_free()
        batched, kv, value_kv = self.attention_dims(made)
        # Grouped-query attention batches q·kᵀ over kv_heads, the major factor of the
        # query's heads (kv_heads x group, the group not a head dimension, nor made of
        # one: Bloom's fused heads x (3 x kv) is not grouped): the query's heads are the
        # whole, the keys' the factor.
        wholes = {self.c.find(w): tuple(map(self.c.find, f)) for w, f in self.c.products}
        split = {
            w: f
            for w, f in wholes.items()
            if f[0] in batched and w in self.counts and not self.made_of(f) & (kv | value_kv)
        }
        parts = {x for f in split.values() for x in f}
        heads = [*split, *(r for r in batched if r not in parts)]
        for r in heads:
            self.give(r, "heads", "attention heads: q·kᵀ is batched over them", factor=True)
        for r in heads:
            major = wholes.get(r, ())[:1]
            if major and major[0] in made:
                self.give(
                    major[0],
                    "kv_heads",
                    "the keys' and values' heads (grouped-query "
                    "attention): the major factor of the query's heads",
                    factor=True,
                )
        for r in [*kv, *value_kv]:
            self.give(r, "kv", "head dimension: q·kᵀ contracts it", factor=True)

    def made_of(self, roots: Sequence[Node]) -> set[Node]:
        """``roots`` and every class they are split into, transitively."""
        out, todo = set(roots), list(roots)
        while todo:
            for factors in self.c.factors(todo.pop()):
                todo += [f for f in factors if f not in out]
                out.update(factors)
        return out

    def streams(self) -> None:
        """Another residual stream (a second tower's, an encoder's with no lookup): a class
        an activation's reduction (a norm) runs over and a weight's matmul contracts."""
        c = self.c
        reduced = {c.find(n) for n in c.reduced}
        contracted = {c.find(n) for con, _, _, _, side in c.dots if side in (0, 1) for n in con}
        if any(n == "embed" for n, _ in self.names.values()):
            for r in self.free([r for r in self.order if r in reduced & contracted]):
                self.give(r, "embed", "residual stream: a norm reduces it, a weight contracts it")

    def mlp(self) -> None:
        c = self.c
        embeds = {r for r, (n, _) in self.names.items() if n == "embed"}
        if not embeds:
            return
        up: set[Node] = set()
        down: set[Node] = set()
        for contract, _, fl, fr, side in c.dots:
            if side not in (0, 1):
                continue
            weight_free = {c.find(n) for n in (fl if side == 0 else fr)}
            contracted = {c.find(n) for n in contract}
            if embeds & contracted:
                up |= weight_free
            if embeds & weight_free:
                down |= contracted
        for r in self.free([r for r in self.order if r in up & down]):
            self.give(r, "mlp", "MLP hidden: a weight's output contracted back into embed")

    def merged(self) -> None:
        """A class made of others takes its major named factor's name."""
        for _ in range(4):  # merges of merges
            for r in self.free(self.order):
                for factors in self.c.factors(r):
                    named = [self.names[f][0] for f in factors if f in self.names]
                    if named:
                        parts = " x ".join(
                            self.names[f][0] if f in self.names else str(self.c.size(f))
                            for f in factors
                        )
                        self.give(r, named[0], f"merged {parts}: named after its major factor")
                        break

    def rest(self) -> None:
        c = self.c
        left = self.free(self.order)
        sizes = collections.Counter(c.size(r) for r in left)
        seen: collections.Counter[int] = collections.Counter()
        for r in left:
            size = c.size(r)
            name = f"dim_{size}" if sizes[size] == 1 else f"dim_{size}_{seen[size]}"
            seen[size] += 1
            self.give(r, name, self.role(r))

    def role(self, root: Node) -> str:
        c = self.c
        if any(c.find(n) == root for n, _, _ in c.rows):
            return "rows of a table looked up by index (not by the batch's token ids)"
        contracted = any(c.find(n) == root for d in c.dots for n in d[0])
        produced = any(c.find(n) == root for d in c.dots for n in (*d[2], *d[3]))
        if contracted and produced:
            return "a matmul's output that another contracts"
        if contracted:
            return "contracted by a matmul"
        if produced:
            return "a matmul's output"
        return "elementwise only (no matmul reads it)"


# -- path rules ------------------------------------------------------------------------


def _once(names: Names) -> Names:
    """``names`` with each name on its first dimension only: a name names one dimension
    of an array (a square ``embed x embed`` kernel's output is left unnamed)."""
    return tuple(None if n in names[:i] else n for i, n in enumerate(names))


def _leaf_paths(abstract_state: Any) -> list[str | None]:
    """The path of each of ``jax.tree.leaves(abstract_state)`` as :func:`meshplan.explain`
    prints it (``None`` for a leaf that is not an array)."""
    leaves, _ = array_leaves(abstract_state)
    by_id = {id(leaf.value): path_text(leaf.keypath) for leaf in leaves}
    return [by_id.get(id(x)) for x in jax.tree.leaves(abstract_state)]


def _params_root(paths: Sequence[str]) -> str | None:
    """``'params/'`` where the state holds its parameters under ``params`` (a Flax
    ``TrainState``, Linen variables) beside other trees (the optimizer's)."""
    top = {p.split("/", 1)[0] for p in paths}
    return "params/" if "params" in top and len(top) > 1 else None


def _general(path: str) -> str:
    """``path`` as a pattern, each layer index written ``\\d+``."""
    return "/".join(r"\d+" if part.isdigit() else re.escape(part) for part in path.split("/"))


def _rules(paths: Sequence[str | None], names: Sequence[Names]) -> list[PathRule]:
    """One rule per parameter (its optimizer's copies matched by the same pattern), a layer
    index as ``\\d+`` where every layer has the same names; exact rules first where a
    general one would name an array wrongly."""
    named = [
        (p, n)
        for p, n in zip(paths, names, strict=True)
        if p is not None and any(x is not None for x in n)
    ]
    root = _params_root([p for p, _ in named])
    prefix = "(?:.*/)?" if root else ""
    params = [(p[len(root) :], n) for p, n in named if root and p.startswith(root)] or named
    groups: dict[str, set[Names]] = collections.defaultdict(set)
    for p, n in params:
        groups[_general(p)].add(n)
    rules: list[PathRule] = []
    for p, n in params:
        pattern = _general(p) if len(groups[_general(p)]) == 1 else re.escape(p)
        rule = (prefix + pattern, n)
        if rule not in rules:
            rules.append(rule)
    exact: list[PathRule] = []
    for p, n in named:
        got = next((r for r in rules if re.fullmatch(r[0], p)), None)
        if got is None or got[1] != n:
            exact.append((re.escape(p), n))
    rules = exact + rules
    alone: list[PathRule] = []  # scalars and arrays of size-1 dimensions: left as they are
    for path in paths:
        if path is not None and not any(re.fullmatch(r[0], path) for r in rules + alone):
            alone.append((_general(path), None))
    return rules + alone


def _unnamed(abstract_state: Any) -> bool:
    """Whether no array of the state carries names (logical or mesh axes)."""
    leaves, _ = array_leaves(abstract_state, (("meshplan.search: names are logical", None),))
    return bool(leaves) and all(leaf.kind == "unboxed" for leaf in leaves)


def _unboxed(step_fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """``step_fn`` of a state named by :func:`meshplan.name_by_path`: it gets the plain
    arrays it was written for (a Hugging Face model reads no boxes)."""
    from meshplan._spmd.boxes import unbox

    def step(state: Any, batch: Any) -> Any:
        return step_fn(unbox(state), batch)

    return step


def name_unnamed(
    step_fn: Callable[[Any, Any], Any], abstract_state: Any, example_batch: Any
) -> tuple[InferredNames, Any, Callable[[Any, Any], Any], Workload] | None:
    """For a state with no names: the inferred names, the state named by them, the step
    that takes it, and its workload (traced as :func:`meshplan.search_rules` traces);
    ``None`` for a state with names.

    The step gets the named state as it is (Flax modules read boxed parameters, and
    constrain them to their names where they read them, as they do for a model written
    with names); a step that cannot read boxes (Hugging Face's GPT-2 reads its tied
    embedding with ``.T``) gets it unboxed.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from meshplan._search.predict.infer import name_unnamed
        >>> state = {"w": jax.ShapeDtypeStruct((64, 256), jnp.float32)}
        >>> step = lambda s, x: jax.grad(lambda s: (x @ s["w"]).sum())(s)
        >>> x = jax.ShapeDtypeStruct((8, 64), jnp.float32)
        >>> names, named, named_step, work = name_unnamed(step, state, x)
        >>> named["w"].names, work.param_names, name_unnamed(named_step, named, x)
        (('embed', 'dim_256'), ('embed', 'dim_256'), None)
    """
    from meshplan._spmd.by_path import name_by_path

    if not _unnamed(abstract_state):
        return None
    names = infer_names(step_fn, abstract_state, example_batch)
    named = name_by_path(abstract_state, names)
    try:
        work = trace_workload(step_fn, named, example_batch, read_constraints=True)
    except Exception:  # a step that reads plain arrays only
        step_fn = _unboxed(step_fn)
        work = trace_workload(step_fn, named, example_batch, read_constraints=True)
    return names, named, step_fn, work


def infer_names(
    step_fn: Callable[[Any, Any], Any], abstract_state: Any, example_batch: Any
) -> InferredNames:
    """Path rules that name every dimension of the state, inferred from the step's dataflow.

    The step is traced once (``jax.make_jaxpr``, nothing compiled) as
    :func:`meshplan.search_rules` calls it, ``step_fn(abstract_state, example_batch)``.
    Dimensions the program makes one (through matmuls, elementwise ops, broadcasts,
    transposes, reshapes that split or merge, scans, lookups) share a name; the names
    are those a person would write where the role is clear (``embed``, ``mlp``,
    ``heads``, ``kv``, ``vocab``, ``layer``), else ``dim_<size>``: see
    :mod:`meshplan._search.predict.infer`. Pass the result to :func:`meshplan.name_by_path`.

    Example:
        >>> import jax, jax.numpy as jnp, meshplan
        >>> state = {"up": jax.ShapeDtypeStruct((64, 256), jnp.float32),
        ...          "down": jax.ShapeDtypeStruct((256, 64), jnp.float32),
        ...          "scale": jax.ShapeDtypeStruct((64,), jnp.float32)}
        >>> def step(s, x):
        ...     def loss(s):
        ...         h = x * s["scale"]
        ...         return ((x + jax.nn.relu(h @ s["up"]) @ s["down"]) ** 2).mean()
        ...     return jax.grad(loss)(s)
        >>> list(meshplan.infer_names(step, state, jax.ShapeDtypeStruct((8, 64), jnp.float32)))
        [('down', ('mlp', 'embed')), ('scale', ('embed',)), ('up', ('embed', 'mlp'))]

    Args:
        step_fn: ``step_fn(state, batch)``, not jitted (a jitted one is walked through).
        abstract_state: The state: arrays or ``ShapeDtypeStruct``s (boxes are read through).
        example_batch: The batch; its first array's first dimension is the batch.

    Returns:
        :class:`InferredNames`: the ``(pattern, names)`` rules, and each name's size and role.
    """
    c = dim_classes(step_fn, abstract_state, example_batch)
    given = _Namer(c).run()

    def name(n: Node) -> str | None:
        if c.size(n) <= 1:
            return None
        got = given.get(c.find(n))
        return got[0] if got else None

    names = [_once(tuple(name(n) for n in nodes)) for nodes in c.state]
    rules = _rules(_leaf_paths(abstract_state), names)
    arrays: collections.Counter[str] = collections.Counter()
    for n in names:
        arrays.update({x for x in n if x is not None})
    classes: dict[str, NameClass] = {}
    for root, (nm, role) in given.items():
        if nm in arrays and nm not in classes and nm != "batch":
            classes[nm] = NameClass(nm, c.size(root), role, arrays[nm])
    return InferredNames(rules, list(classes.values()))
