"""The fast suite does not depend on wall-clock time: a rule and the check that keeps it.

The rule: a test that is not marked slow may read the wall clock only for a timeout, that is
`clock() < deadline` (a name saying so) or `elapsed < C` with C at least one second. It never
compares two measured durations, never asserts that something took at least some time, and
never bounds a duration below a second: those depend on the machine's speed and load. Code
under test that measures time (the policies, the drafters' costs) runs on tests/support/fakes.py's
FakeClock, installed as the `time` of the modules that measure.

The check reads every test module's source: in each fast test function, a name assigned from a
clock read (`time.perf_counter()`, `time.monotonic()`, `time.time()`...), or from an expression
using such a name, is a measured time; an `assert` comparing one other than as above fails here,
naming the file and line.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
CLOCKS = frozenset({"perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns", "time",
                    "time_ns"})
TIMEOUT_S = 1.0


def _is_clock_read(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
        return f.value.id == "time" and f.attr in CLOCKS
    return isinstance(f, ast.Name) and f.id in {"perf_counter", "monotonic"}


def _marked_slow(decorators: list[ast.expr]) -> bool:
    return any("slow" in ast.unparse(d) for d in decorators)


def _module_slow(tree: ast.Module) -> bool:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            return "slow" in ast.unparse(node.value)
    return False


class _Measured:
    """The names of one function that hold a measured time (a fixpoint over assignments and
    loop targets); `timers` are the module's functions that return one."""

    def __init__(self, fn: ast.FunctionDef, timers: frozenset[str] = frozenset()) -> None:
        self.names: set[str] = set()
        self.timers = timers
        binds = [(t, n.value) for n in ast.walk(fn)
                 if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and n.value
                 for t in (n.targets if isinstance(n, ast.Assign) else [n.target])]
        binds += [(n.target, n.iter) for n in ast.walk(fn)
                  if isinstance(n, (ast.For, ast.comprehension))]
        changed = True
        while changed:
            changed = False
            for target, value in binds:
                if not self.touches(value):
                    continue
                for n in ast.walk(target):
                    if isinstance(n, ast.Name) and n.id not in self.names:
                        self.names.add(n.id)
                        changed = True

    def touches(self, node: ast.AST) -> bool:
        return any(_is_clock_read(n) or (isinstance(n, ast.Name) and n.id in self.names)
                   or (isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                       and n.func.id in self.timers)
                   for n in ast.walk(node))

    def returns_time(self, fn: ast.FunctionDef) -> bool:
        return any(isinstance(n, ast.Return) and n.value is not None and self.touches(n.value)
                   for n in ast.walk(fn))


def _timers(tree: ast.Module) -> frozenset[str]:
    """The module's functions that return a measured time, directly or through another."""
    helpers = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    timers: frozenset[str] = frozenset()
    while True:
        found = frozenset(f.name for f in helpers if _Measured(f, timers).returns_time(f))
        if found == timers:
            return timers
        timers = found


def _allowed(left: ast.expr, op: ast.cmpop, right: ast.expr, measured: _Measured) -> bool:
    """A timeout: `measured < deadline`, or `measured < C` with C >= TIMEOUT_S."""
    if not isinstance(op, (ast.Lt, ast.LtE)):
        return False
    if isinstance(right, ast.Name) and "deadline" in right.id:
        return True
    return (isinstance(right, ast.Constant) and isinstance(right.value, (int, float))
            and right.value >= TIMEOUT_S and not measured.touches(right))


def violations(source: str, filename: str = "<test>") -> list[str]:
    """Each assert of a fast test in this module's source that compares a measured time."""
    tree = ast.parse(source)
    if _module_slow(tree):
        return []
    found = []
    timers = _timers(tree)
    for fn in _fast_tests(tree):
        measured = _Measured(fn, timers)
        for node in ast.walk(fn):
            if not isinstance(node, ast.Assert):
                continue
            for cmp in (n for n in ast.walk(node.test) if isinstance(n, ast.Compare)):
                operands = [cmp.left, *cmp.comparators]
                for left, op, right in zip(operands, cmp.ops, operands[1:], strict=False):
                    if (measured.touches(left) or measured.touches(right)) and not _allowed(
                            left, op, right, measured):
                        found.append(f"{filename}:{node.lineno} {fn.name}: "
                                     f"{ast.unparse(cmp)}")
    return found


def _fast_tests(tree: ast.Module):
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            if not _marked_slow(node.decorator_list):
                yield node
        elif isinstance(node, ast.ClassDef) and not _marked_slow(node.decorator_list):
            for item in node.body:
                if (isinstance(item, ast.FunctionDef) and item.name.startswith("test")
                        and not _marked_slow(item.decorator_list)):
                    yield item


def test_no_fast_test_compares_wall_clock_durations() -> None:
    found = [v for path in sorted(TESTS.rglob("test_*.py"))
             for v in violations(path.read_text(), str(path.relative_to(TESTS)))]
    assert not found, ("fast tests comparing wall-clock times (use FakeClock, or mark them "
                       "slow):\n" + "\n".join(found))


@pytest.mark.parametrize("body", [
    "t0 = time.perf_counter()\n    work()\n    assert time.perf_counter() - t0 < 0.5",
    "t0 = time.monotonic()\n    work()\n    elapsed = time.monotonic() - t0\n"
    "    assert 0.25 < elapsed < 2.0",
    "a = time.perf_counter()\n    b = time.perf_counter() - a\n    assert 20 * a < b",
    "t = time.time()\n    assert t - start >= 0.04",
    "lats = [time.perf_counter() - t for t in sent]\n    assert all(lat < 0.4 for lat in lats)",
])
def test_the_check_catches_duration_comparisons(body: str) -> None:
    assert violations(f"import time\ndef test_x():\n    {body}\n")


def test_the_check_follows_a_helper_that_returns_a_time() -> None:
    source = ("import time\ndef _rtt():\n    t0 = time.perf_counter()\n    ping()\n"
              "    return time.perf_counter() - t0\ndef _best():\n    return min(_rtt(), 1)\n"
              "def test_x():\n    assert _best() < 0.015\n")
    assert violations(source)


@pytest.mark.parametrize("body", [
    "deadline = time.monotonic() + 5\n    while time.monotonic() < deadline:\n"
    "        assert time.monotonic() < deadline",
    "t0 = time.monotonic()\n    work()\n    assert time.monotonic() - t0 < 2.0",
    "assert clock.perf_counter() == 0.5",
])
def test_the_check_lets_timeouts_and_fake_clocks_through(body: str) -> None:
    assert not violations(f"import time\ndef test_x():\n    {body}\n")


def test_a_slow_test_may_time_itself() -> None:
    body = "t0 = time.perf_counter()\n    assert time.perf_counter() - t0 < 0.5"
    assert not violations(f"import time\nimport pytest\n@pytest.mark.slow\n"
                          f"def test_x():\n    {body}\n")
    assert not violations(f"import time\nimport pytest\npytestmark = pytest.mark.slow\n"
                          f"def test_x():\n    {body}\n")
