"""The import rules of the layout: which package may import which, and no cycles.

Every import counts: top-level, inside a function and under TYPE_CHECKING, read from
the source so a violation is caught before anything runs. A unit is a package under
specwire/ (link/transport/ belongs to link/) or a module at its root.

    cli -> build, bench, server, node -> engine, link -> drafters -> policy -> sample -> config

The research scripts (benchmarks/) sit above all of it; nothing in specwire/ or in the
product suite (tests/) imports them.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOT = REPO / "specwire"
PB = ("specwire.link.transport.specwire_pb2", "specwire.link.transport.specwire_pb2_grpc",
      "specwire.link.transport.protocol")

_CORE = ("config", "sample")
_DRAFT = (*_CORE, "policy", "backend", "drafters")
#: Per unit: the other units of specwire it may import (anything not listed is forbidden).
ALLOWED: dict[str, tuple[str, ...]] = {
    "config": (),
    "settings": ("config", "emulate"),
    "backend": ("config",),
    "text": _CORE,                # tool formats build their grammars with the schema converter
    "sample": ("config",),
    "assets": ("config", "backend"),
    "policy": _CORE,
    "emulate": (*_CORE, "policy", "backend"),
    "drafters": _DRAFT,
    "engine": _DRAFT,
    "link": (*_DRAFT, "settings"),
    "node": (*_DRAFT, "settings", "link", "emulate"),
    "server": (*_DRAFT, "settings", "engine", "text"),
    "build": (*_DRAFT, "settings", "engine", "link", "assets", "emulate"),
    "bench": (*_DRAFT, "settings", "engine", "link", "text", "assets", "build", "emulate"),
    "cli": (*_DRAFT, "settings", "engine", "link", "text", "assets", "build", "bench", "node",
            "server", "emulate"),
    "__main__": ("cli",),
    "__init__": (),
}
#: Known edges against the layering, each with the module that makes it; to be removed.
EXCEPTIONS: dict[str, tuple[str, ...]] = {
    # the grammar's llama.cpp binding (its log set-up) lives with the grammar spec
    "sample/constraints/grammar.py": ("specwire.backend.llama_process",),
    # the HTTP edge checks float32 rounding through the link's protobuf edge (F6)
    "server/schemas.py": ("specwire.link.transport", "specwire.link.transport.protocol"),
}
#: Finer rules inside a unit: (directory or file under specwire/, module prefixes it may
#: not import). The link's domain and its transport know nothing above them.
FORBIDDEN: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("link/messages.py", ("specwire.link", "specwire.drafters", "specwire.backend",
                          "specwire.policy", "specwire.settings")),
    ("link/rule.py", ("specwire.link", "specwire.drafters", "specwire.backend",
                      "specwire.policy", "specwire.settings")),
    ("link/transport", ("specwire.link.branch", "specwire.link.session", "specwire.link.remote",
                        "specwire.link.threaded", "specwire.link.alternates", "specwire.drafters",
                        "specwire.backend", "specwire.policy", "specwire.settings")),
    ("drafters", ("specwire.link", "specwire.engine", "specwire.node")),
    ("node", ("specwire.engine", "specwire.server", "specwire.cli")),
)
#: Only the transport, the node and the known exception handle protobuf.
PB_USERS = ("link/transport", "node", "server/schemas.py")
#: Module cycles known today (each pair imports the other, one side lazily); no new ones.
MODULE_CYCLES: set[frozenset[str]] = set()


def imports(path: Path) -> set[str]:
    """Every module the file imports, with `from a import b` counted as a and a.b."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def _hits(names: Iterable[str], prefixes: tuple[str, ...]) -> list[str]:
    return sorted(n for n in names if any(n == p or n.startswith(p + ".") for p in prefixes))


def _sources() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py") if "_pb2" not in p.name)


def _module(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p) for p in ROOT.rglob("*.py")}


def _resolve(name: str) -> str | None:
    """The specwire module a dotted import name lands in (a.b.Name -> a.b)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name if name and name != "specwire" else None


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _targets(path: Path) -> set[str]:
    """The modules the file imports: `from a import b` is a.b where b is a module, else a
    (so a package's __init__ counts only where a name of its own is imported)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in MODULES else node.module)
    return {m for m in map(_resolve, out) if m}


def module_graph(paths: Iterable[Path]) -> dict[str, set[str]]:
    return {_module(p): _targets(p) - {_module(p)} for p in paths}


def unit_graph(modules: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for m, targets in modules.items():
        out.setdefault(unit(m), set()).update(unit(t) for t in targets if unit(t) != unit(m))
    return out


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def check(path: Path, rel: str) -> list[str]:
    """The imports of `path`, standing at specwire/`rel`, that break ALLOWED, FORBIDDEN
    or PB_USERS."""
    me = unit(_module(ROOT / rel))
    found = []
    for name in sorted(n for n in imports(path) if n.startswith("specwire")):
        target = _resolve(name)
        if target is None or _hits([name], EXCEPTIONS.get(rel, ())):
            continue
        if unit(target) != me and unit(target) not in ALLOWED[me]:
            found.append(name)
        if any(rel == d or rel.startswith(d + "/") for d, prefixes in FORBIDDEN
               if _hits([name], prefixes)):
            found.append(name)
        if _hits([name], PB) and not any(rel == d or rel.startswith(d + "/") for d in PB_USERS):
            found.append(name)
    return sorted(set(found))


def violations(paths: Iterable[Path]) -> dict[str, list[str]]:
    out = {p.relative_to(ROOT).as_posix(): check(p, p.relative_to(ROOT).as_posix())
           for p in paths}
    return {k: v for k, v in out.items() if v}


def test_every_unit_has_rules() -> None:
    """A new package gets a row in ALLOWED (its place in the layers), not a pass."""
    assert {unit(_module(p)) for p in _sources()} <= set(ALLOWED)


def test_imports_follow_the_layers() -> None:
    """No module imports a unit its own may not know, nor what FORBIDDEN keeps from it."""
    assert violations(_sources()) == {}


def test_no_cycle_between_packages() -> None:
    assert cycles(unit_graph(module_graph(_sources()))) == []


def test_no_new_cycle_between_modules() -> None:
    found = {frozenset(c) for c in cycles(module_graph(_sources()))}
    assert found <= MODULE_CYCLES, found - MODULE_CYCLES


def test_the_exceptions_are_still_needed() -> None:
    """An exception nothing uses any more is dropped from the table."""
    for rel, prefixes in EXCEPTIONS.items():
        assert _hits(imports(ROOT / rel), prefixes), rel


def test_the_product_does_not_import_the_research_scripts() -> None:
    for path in [*_sources(), *sorted((REPO / "tests").rglob("*.py"))]:
        assert not _hits(imports(path), ("benchmarks",)), path


def test_the_checker_sees_lazy_and_type_checking_imports(tmp_path: Path) -> None:
    """The rules above can fail: an import inside a function or under TYPE_CHECKING is
    found, a lower unit importing a higher one is a violation, and a cycle is one."""
    f = tmp_path / "m.py"
    f.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                 "    from specwire.engine.engine import Generation\n"
                 "def f():\n    from specwire.link.transport import specwire_pb2 as pb\n")
    found = imports(f)
    assert _hits(found, PB) == ["specwire.link.transport.specwire_pb2"]
    assert "specwire.engine.engine.Generation" in found
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize(("where", "line"), [
    ("sample/verify.py", "def f():\n    from specwire.engine import engine\n"),
    ("drafters/model.py", "from specwire.link.branch import BranchDrafter\n"),
    ("link/transport/channel.py", "from specwire.link.branch import BranchDrafter\n"),
    ("engine/engine.py", "from specwire.cli.args import CliError\n"),
    ("server/app.py", "from specwire.link.transport import specwire_pb2\n"),
])
def test_a_violation_is_reported(tmp_path: Path, where: str, line: str) -> None:
    """One bad import, in a copy of a real module, is caught by the same check."""
    copy = tmp_path / "specwire" / where
    copy.parent.mkdir(parents=True)
    copy.write_text((ROOT / where).read_text() + "\n" + line)
    assert check(copy, where), (where, line)
