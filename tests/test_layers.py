"""The import direction of the draft link's parts: node -> drafters -> draftlink <- wire.

wire/ is the transport and the protobuf edge, drafters/ both ends of a branch
session, node/ the draft node's server, draftlink/ the messages and the rule
they share. Read from the source (every import, top-level or inside a
function), so a cycle is caught before anything runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "specwire"
PB = ("specwire.wire.specwire_pb2", "specwire.wire.specwire_pb2_grpc", "specwire.wire.protocol")

#: Per package: module prefixes none of its modules may import.
FORBIDDEN = {
    "wire": ("specwire.drafters", "specwire.node", "specwire.engine", "specwire.server",
             "specwire.commands", "specwire.loader"),
    "draftlink": ("specwire.wire", "specwire.drafters", "specwire.node", "specwire.engine",
                  "specwire.backend"),
    "drafters": ("specwire.node", *PB),
    "node": ("specwire.engine", "specwire.server", "specwire.commands"),
}
#: The lower layers, by what they may import of specwire at all.
ALLOWED = {
    "wire": ("specwire.wire", "specwire.draftlink", "specwire.config", "specwire.sampling"),
    "draftlink": ("specwire.draftlink", "specwire.config", "specwire.sampling"),
}
#: The one drafter that travels over the wire: the transport's client, nothing else of it.
WIRE_FOR_DRAFTERS = {"remote.py": ("specwire.wire.client", "specwire.wire.link",
                                   "specwire.wire.linkset")}


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


def _hits(names: set[str], prefixes: tuple[str, ...]) -> list[str]:
    return sorted(n for n in names if any(n == p or n.startswith(p + ".") for p in prefixes))


def _modules(package: str) -> list[Path]:
    return sorted(p for p in (ROOT / package).glob("*.py") if not p.name.endswith("_pb2.py")
                  and not p.name.endswith("_pb2_grpc.py"))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_go_one_way(package: str) -> None:
    """No module imports what its package must not know."""
    bad = {p.name: _hits(imports(p), FORBIDDEN[package]) for p in _modules(package)}
    assert not {k: v for k, v in bad.items() if v}


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_the_lower_layers_stand_alone(package: str) -> None:
    """The transport and the domain import only each other, the settings and sampling."""
    for path in _modules(package):
        own = _hits(imports(path), ("specwire",))
        assert not [n for n in own if n != "specwire" and not _hits({n}, ALLOWED[package])], \
            (path.name, own)


def test_only_the_remote_drafter_touches_the_wire() -> None:
    """Drafters know no protobuf; the remote drafter uses the transport, nothing else."""
    for path in _modules("drafters"):
        allowed = WIRE_FOR_DRAFTERS.get(path.name, ())
        wire = _hits(imports(path), ("specwire.wire",))
        assert not [w for w in wire if _hits({w}, allowed) != [w]], (path.name, wire)


def test_the_checker_sees_lazy_and_from_imports(tmp_path: Path) -> None:
    """The rule above can fail: an import inside a function is found, under both names."""
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from specwire.wire import specwire_pb2 as pb\n")
    assert _hits(imports(f), PB) == ["specwire.wire.specwire_pb2"]
