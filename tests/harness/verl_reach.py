"""Derives, from this project's source, every name it takes from verl (``tests/test_verl_api_on_cpu.py``).

1. Reaches: the source is parsed with ``ast``; every verl import, every attribute path off a verl
   name, every verl module named in a string (``*_MODULE`` constants, ``when_imported`` targets,
   ``-m`` launches) and every attribute path off the module a ``when_imported`` callback receives
   becomes a ``Reach`` that ``unresolved`` imports / ``getattr``-s against the installed verl.
   Module-level names bound to a ``verl_adapter`` call (``api = va.trainer_api()``) count as verl
   names, so ``api.tq.kv_list`` is checked like an import.
2. Classes deriving from verl classes lean on verl's private API: every ``self.X`` / ``super().X``
   they read that this project does not define, and every method or attribute they define that
   nothing in this project reads (so only verl can: an override), must exist on a verl class in
   their MRO (``hasattr``, or ``self.X`` / ``"X"`` in that class's source). ``@register`` worker
   methods are this project's worker-group API and annotated class attributes are dataclass
   fields (``BaseConfig`` sections): new names, not overrides.
3. Duck-typed reaches on objects verl hands over (``worker.actor.engine``, ``engine.module``) are
   not derivable: their types are only known at run time (the e2e ``main_ppo`` tests run them).
4. The functions take a root and a package name, not this repository's layout, so a test can run
   them on a deliberately broken package and see them fail.
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib
import inspect
import textwrap
from dataclasses import dataclass
from pathlib import Path

VERL_ROOTS = ("verl", "transfer_queue")  # transfer_queue is pinned with verl: its V1 trainer moves batches through it
ADAPTER = "thundersync_verl.verl_adapter"


@dataclass(frozen=True)
class Reach:
    where: str  # "path:line"
    module: str  # an importable module
    attrs: tuple[str, ...] = ()  # the getattr path below it

    @property
    def name(self) -> str:
        return ".".join((self.module, *self.attrs))


def _is_verl(module: str) -> bool:
    return module.split(".")[0] in VERL_ROOTS


def resolve(module: str, attrs: tuple[str, ...] = ()):
    """``module.attrs...`` as Python's import statement finds it (a missing attribute may be a submodule)."""
    obj, path = importlib.import_module(module), module
    for attr in attrs:
        try:
            obj = getattr(obj, attr)
        except AttributeError:
            if not inspect.ismodule(obj):
                raise AttributeError(f"{path} has no attribute {attr!r}") from None
            submodule = f"{obj.__name__}.{attr}"
            try:
                obj = importlib.import_module(submodule)
            except ModuleNotFoundError as e:
                if e.name != submodule:
                    raise
                raise AttributeError(f"{path} (module {obj.__name__}) has no attribute or submodule {attr!r}") from None
        path = f"{path}.{attr}"
    return obj


# -- source files ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Source:
    module: str
    package: str  # what a relative import is relative to
    path: str  # relative to the root the package was read from
    tree: ast.Module

    def where(self, node) -> str:
        return f"{self.path}:{getattr(node, 'lineno', 0)}"


def package_sources(root: Path, package: str) -> list[Source]:
    out = []
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        is_init = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if is_init else parts)
        out.append(Source(module, module if is_init else module.rpartition(".")[0], str(path.relative_to(root)),
                          ast.parse(path.read_text(), str(path))))
    return out


def _own_nodes(node):
    """Nodes inside ``node`` that are not inside a nested function or class (those are scopes of their own)."""
    for child in ast.iter_child_nodes(node):
        yield child
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            yield from _own_nodes(child)


def _chain(node) -> tuple[str, tuple[str, ...]] | None:
    """``a.b.c`` -> ("a", ("b", "c")); None unless it is a plain attribute path off a name."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    return (node.id, tuple(reversed(attrs))) if isinstance(node, ast.Name) else None


def _import_roots(node, package: str) -> list[tuple[str, str, tuple[str, ...], str]]:
    """``(bound name, module, attribute path, what it imports)`` for each name an import statement binds."""
    if isinstance(node, ast.Import):
        return [(a.asname or a.name.split(".")[0], a.name if a.asname else a.name.split(".")[0], (), a.name)
                for a in node.names]
    base = node.module or ""
    if node.level:
        parts = package.split(".")
        base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
    return [(a.asname or a.name, base, (a.name,), f"{base}.{a.name}") for a in node.names if a.name != "*"]


# -- point 1: imports, attribute paths and module strings ------------------------------------------
@dataclass(frozen=True)
class _Root:
    module: str
    attrs: tuple[str, ...]
    verl: bool  # attribute paths off it reach into verl


def _call_name(call: ast.Call) -> str:
    chain = _chain(call.func)
    return "" if chain is None else (chain[1][-1] if chain[1] else chain[0])


def _params(fn) -> list[str]:
    if isinstance(fn, ast.ClassDef):
        return []
    a = fn.args
    return [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs, *(x for x in (a.vararg, a.kwarg) if x))]


class ReachScanner:
    """Every verl reach of one source file (the module docstring, point 1)."""

    def __init__(self, src: Source):
        self.src = src
        self.callbacks: dict[int, str] = {}  # id(def node) -> the module its first parameter receives
        self.found: dict[str, Reach] = {}
        body = src.tree.body
        self.module_defs = {n.name: n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        self.consts = {t.id: n.value.value for n in body if isinstance(n, ast.Assign)
                       and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                       for t in n.targets if isinstance(t, ast.Name)}

    def run(self) -> list[Reach]:
        for _ in range(2):  # pass 1 finds the when_imported callbacks, pass 2 binds their parameter
            self.found = {}
            self._scope(self.src.tree, {}, module_level=True)
        return list(self.found.values())

    def _add(self, node, module: str, attrs: tuple[str, ...] = ()) -> None:
        reach = Reach(self.src.where(node), module, attrs)
        self.found.setdefault(reach.name, reach)

    def _scope(self, node, env: dict, module_level: bool) -> None:
        env, own = dict(env), list(_own_nodes(node))
        for n in own:
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                for name, module, attrs, full in _import_roots(n, self.src.package):
                    env[name] = _Root(module, attrs, _is_verl(module))
                    if _is_verl(module):
                        self._add(n, *((full, ()) if isinstance(n, ast.Import) else (module, attrs)))
        self._aliases(own, env, module_level)
        self._module_strings(own)
        self._when_imported(own, env)
        inner = {id(n.value) for n in own if isinstance(n, ast.Attribute)}
        for n in own:
            chain = _chain(n) if isinstance(n, ast.Attribute) and id(n) not in inner else None
            root = env.get(chain[0]) if chain else None
            if root is not None and root.verl:
                self._add(n, root.module, root.attrs + chain[1])
        for n in own:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                inner_env = {k: v for k, v in env.items() if k not in _params(n)}
                target = self.callbacks.get(id(n))
                if target and _params(n):
                    inner_env[_params(n)[0]] = _Root(target, (), _is_verl(target))
                self._scope(n, inner_env, module_level=False)

    def _aliases(self, own: list, env: dict, module_level: bool) -> None:
        """``x = a.b`` extends a root; at module level ``x = va.getter()`` makes ``x`` a verl object."""
        for _ in range(2):
            for n in own:
                if not isinstance(n, ast.Assign):
                    continue
                names = [e.id for t in n.targets for e in (t.elts if isinstance(t, ast.Tuple) else [t]) if isinstance(e, ast.Name)]
                chain = _chain(n.value)
                if chain and chain[0] in env and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
                    root = env[chain[0]]
                    env[names[0]] = _Root(root.module, root.attrs + chain[1], root.verl)
                elif module_level and isinstance(n.value, ast.Call) and self._adapter_call(n.value, env):
                    env.update({name: _Root(self.src.module, (name,), True) for name in names})

    def _adapter_call(self, call: ast.Call, env: dict) -> bool:
        chain = _chain(call.func)
        root = env.get(chain[0]) if chain else None
        return root is not None and ".".join((root.module, *root.attrs, *chain[1])).startswith(ADAPTER + ".")

    def _module_strings(self, own: list) -> None:
        """``*_MODULE = "verl...."`` constants and ``[..., "-m", "verl....", ...]`` launches."""
        for n in own:
            if (isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                    and _is_verl(n.value.value) and any(isinstance(t, ast.Name) and t.id.endswith("_MODULE") for t in n.targets)):
                self._add(n, n.value.value)
            if isinstance(n, (ast.List, ast.Tuple)):
                values = [e.value if isinstance(e, ast.Constant) else None for e in n.elts]
                for flag, value in zip(values, values[1:]):
                    if flag == "-m" and isinstance(value, str) and _is_verl(value):
                        self._add(n, value)

    def _when_imported(self, own: list, env: dict) -> None:
        defs = {n.name: n for n in own if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        for n in own:
            if not (isinstance(n, ast.Call) and _call_name(n) == "when_imported" and len(n.args) == 2):
                continue
            target = self._string_value(n.args[0], env)
            if not isinstance(target, str):
                raise ValueError(f"{self.src.where(n)}: the module of this when_imported call is not readable statically")
            if _is_verl(target):
                self._add(n, target)
            fn = defs.get(n.args[1].id) or self.module_defs.get(n.args[1].id) if isinstance(n.args[1], ast.Name) else None
            if fn is not None:
                self.callbacks[id(fn)] = target

    def _string_value(self, expr, env: dict):
        if isinstance(expr, ast.Constant):
            return expr.value
        if isinstance(expr, ast.Name) and expr.id in self.consts:
            return self.consts[expr.id]
        chain = _chain(expr)
        root = env.get(chain[0]) if chain else None
        return resolve(root.module, root.attrs + chain[1]) if root is not None else None


def verl_reaches(sources: list[Source]) -> list[Reach]:
    found: dict[str, Reach] = {}
    for src in sources:
        for reach in ReachScanner(src).run():
            found.setdefault(reach.name, reach)
    return sorted(found.values(), key=lambda r: r.name)


def unresolved(reaches: list[Reach]) -> list[str]:
    missing = []
    for reach in reaches:
        try:
            resolve(reach.module, reach.attrs)
        except (ImportError, AttributeError) as e:
            missing.append(f"{reach.name} (used at {reach.where}): {type(e).__name__}: {e}")
    return missing


# -- point 2: names that classes deriving from verl read, write or override ----------------------
@dataclass(frozen=True)
class ClassSite:
    src: Source
    node: ast.ClassDef
    scope: ast.AST | None  # the enclosing function of a class built by a factory; None otherwise
    qualname: str


def class_sites(src: Source) -> list[ClassSite]:
    out = []

    def walk(node, qual: str, scope) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                q = f"{qual}.{child.name}" if qual else child.name
                out.append(ClassSite(src, child, scope, q))
                walk(child, q, scope)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                walk(child, f"{qual + '.' if qual else ''}{child.name}.<locals>", child)
            else:
                walk(child, qual, scope)

    walk(src.tree, "", None)
    return out


def _value(expr, site: ClassSite):
    """A class's base expression evaluated as Python would: scope-local imports and assignments first,
    then the module's globals; zero-argument calls (``va.tinker_actor_worker_base()``) are made."""
    if isinstance(expr, ast.Call) and not expr.args and not expr.keywords:
        return _value(expr.func, site)()
    if isinstance(expr, ast.Attribute):
        return getattr(_value(expr.value, site), expr.attr)
    if not isinstance(expr, ast.Name):
        raise ValueError(f"{site.src.where(expr)}: base class of {site.qualname} is not a name, attribute or getter call")
    for n in _own_nodes(site.scope) if site.scope is not None else ():
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            for name, module, attrs, _ in _import_roots(n, site.src.package):
                if name == expr.id:
                    return resolve(module, attrs)
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == expr.id for t in n.targets):
            return _value(n.value, site)
    namespace = vars(importlib.import_module(site.src.module))
    return namespace[expr.id] if expr.id in namespace else getattr(builtins, expr.id)


def mro_of(site: ClassSite) -> list[type]:
    """The classes after ``site`` in its MRO (module-level classes are imported, factory ones evaluated)."""
    if site.scope is None:
        cls = resolve(site.src.module, tuple(site.qualname.split(".")))
        return list(cls.__mro__[1:])
    out: list[type] = []
    for base in site.node.bases:
        out += [k for k in _value(base, site).__mro__ if k not in out]
    return out


@dataclass
class ClassNames:
    reads: dict[str, ast.AST]  # self.X / cls.X loads
    super_reads: dict[str, ast.AST]  # super().X loads
    defines: dict[str, ast.AST]  # methods, class attributes, self.X stores
    fields: set[str]  # annotated class attributes (dataclass fields): new data, never overrides


def class_names(node: ast.ClassDef) -> ClassNames:
    names = ClassNames({}, {}, {}, set())
    for stmt in node.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.defines.setdefault(stmt.name, stmt)
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
        names.defines.update({t.id: stmt for t in targets if isinstance(t, ast.Name)})
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            names.fields.add(stmt.target.id)
    stack = list(node.body)
    while stack:
        n = stack.pop()
        if isinstance(n, ast.ClassDef):
            continue
        stack.extend(ast.iter_child_nodes(n))
        if not isinstance(n, ast.Attribute) or n.attr.startswith("__"):
            continue
        on_self = isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")
        on_super = isinstance(n.value, ast.Call) and isinstance(n.value.func, ast.Name) and n.value.func.id == "super"
        if on_self and isinstance(n.ctx, ast.Store):
            names.defines.setdefault(n.attr, n)
        elif on_self:
            names.reads.setdefault(n.attr, n)
        elif on_super:
            names.super_reads.setdefault(n.attr, n)
    return names


def project_references(roots: list[Path]) -> tuple[set[str], set[str]]:
    """``(attribute names read off anything but self/cls/super(), string constants)`` in this project's Python."""
    attrs, strings = set(), set()
    for root in roots:
        for path in root.rglob("*.py"):
            for n in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(n, ast.Constant) and isinstance(n.value, str):
                    strings.add(n.value)
                elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load):
                    own = isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")
                    sup = isinstance(n.value, ast.Call) and isinstance(n.value.func, ast.Name) and n.value.func.id == "super"
                    if not (own or sup):
                        attrs.add(n.attr)
    return attrs, strings


@functools.lru_cache(maxsize=None)
def _source_names(cls: type) -> frozenset[str]:
    """``self.X`` / ``cls.X`` attributes and string constants (``getattr(self, "X", ...)``) in a class's source."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return frozenset()
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
            out.add(n.attr)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            out.add(n.value)
    return frozenset(out)


def on_verl(name: str, verl_side: list[type]) -> bool:
    return any(hasattr(k, name) or name in _source_names(k) for k in verl_side)


def _registered(node) -> bool:
    """A ``@register(...)`` worker method: this project's worker-group API, called by name through the
    worker group (names may be built, e.g. ``method + "_queued"``), not an override of verl's."""
    decorators = getattr(node, "decorator_list", [])
    return any(isinstance(d, ast.Call) and _call_name(d) == "register" for d in decorators)


@dataclass(frozen=True)
class Derived:
    site: ClassSite
    parents: tuple[ClassSite, ...]  # this project's classes after it in its MRO (mixins, intermediate bases)
    verl_side: tuple[type, ...]  # verl's classes in its MRO


def derived_classes(sources: list[Source]) -> list[Derived]:
    sites = [s for src in sources for s in class_sites(src)]
    index = {(s.src.module, s.qualname): s for s in sites}
    out = []
    for site in sites:
        if all(isinstance(b, ast.Name) and hasattr(builtins, b.id) for b in site.node.bases):
            continue  # no bases, or only builtins (exceptions): nothing of verl's
        mro = mro_of(site)
        verl_side = tuple(k for k in mro if _is_verl(k.__module__))
        if verl_side:
            parents = tuple(index[key] for k in mro if (key := (k.__module__, k.__qualname__)) in index)
            out.append(Derived(site, parents, verl_side))
    return out


def missing_class_names(derived: list[Derived], references: tuple[set[str], set[str]]) -> list[str]:
    """Names each verl-derived class needs from verl that the pinned verl lacks (the docstring, point 2)."""
    attrs, strings = references
    names = {id(s.node): class_names(s.node) for d in derived for s in (d.site, *d.parents)}
    missing = []
    for d in derived:
        family = [d.site, *d.parents, *(e.site for e in derived if d.site in e.parents)]
        own = names[id(d.site.node)]
        ours = set().union(*(names[id(s.node)].defines for s in (d.site, *d.parents)))
        parents_define = set().union(*(names[id(s.node)].defines for s in d.parents))
        family_reads = set().union(*(names.get(id(s.node), class_names(s.node)).reads for s in family))
        needs = [(n, node, f"reads self.{n}") for n, node in own.reads.items() if n not in ours]
        needs += [(n, node, f"calls super().{n}") for n, node in own.super_reads.items() if n not in parents_define]
        needs += [(n, node, f"defines {n}, which nothing in this project reads (so only verl can: an override)")
                  for n, node in own.defines.items()
                  if not n.startswith("__") and not _registered(node) and n not in own.fields
                  and n not in attrs and n not in strings and n not in family_reads]
        bases = ", ".join(f"{k.__module__}.{k.__qualname__}" for k in d.verl_side if k.__module__.startswith("verl"))
        missing += [f"{d.site.src.where(node)}: {d.site.qualname} {what}, but no verl class it derives from "
                    f"({bases}) has `{n}`" for n, node, what in needs if not on_verl(n, list(d.verl_side))]
    return missing
