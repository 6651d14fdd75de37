"""tests/support/fast_guard.py: a test not marked slow that loads a model, or starts a process that
does, fails with "mark it slow"; a slow test is let through. Inner pytest runs (pytester,
in this process) on throw-away test files; no model is ever loaded."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from fast_guard import model_command

LOAD = """
import llama_cpp
def load():
    return llama_cpp.llama_model_load_from_file(b"/no/such/model.gguf",
                                                llama_cpp.llama_model_default_params())
"""


@pytest.fixture
def run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
        ) -> Callable[[str], pytest.RunResult]:
    """Runs a test file in an inner pytest with the guard and no other plugins (hypothesis's
    would import itself anew each time: seconds)."""
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")

    def inner(source: str) -> pytest.RunResult:
        pytester.makepyfile(test_inner=LOAD + source)
        return pytester.runpytest_inprocess("-p", "fast_guard", "-p", "no:cacheprovider")
    return inner


def test_a_fast_test_that_loads_a_model_fails_naming_the_fix(run) -> None:
    result = run("def test_loads():\n    load()\n")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*test_loads is not marked slow but loads a GGUF model "
                                 "(/no/such/model.gguf): mark it slow*"])


def test_a_swallowed_or_threaded_load_still_fails(run) -> None:
    result = run("""
import threading
def test_swallowed():
    try:
        load()
    except BaseException:
        pass
def test_in_a_thread():
    t = threading.Thread(target=load)
    t.start()
    t.join()
""")
    result.assert_outcomes(failed=2)
    assert result.stdout.str().count("mark it slow") >= 2


def test_a_model_fixture_fails_the_fast_test_that_uses_it(run) -> None:
    result = run("""
import pytest
@pytest.fixture(scope="module")
def model():
    return load()
def test_uses(model):
    pass
""")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*test_uses is not marked slow but loads a GGUF model*"])


def test_slow_tests_are_let_through(run) -> None:
    """The loader really runs (and finds no file); marks on the test or the module count."""
    result = run("""
import pytest
@pytest.mark.slow
def test_marked():
    assert not load()
class TestAll:
    pytestmark = pytest.mark.slow
    def test_in_class(self):
        assert not load()
""")
    result.assert_outcomes(passed=2)


def test_a_fast_test_may_not_start_a_model_process(run) -> None:
    result = run("""
import subprocess, sys
def test_serve():
    subprocess.run([sys.executable, "-m", "specwire", "serve", "--port", "0"])
def test_other_process():
    assert subprocess.run([sys.executable, "-c", "pass"]).returncode == 0
""")
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(["*test_serve is not marked slow but starts `specwire serve`, "
                                 "which loads a model: mark it slow*"])


@pytest.mark.parametrize(("args", "want"), [
    (["/usr/bin/python3", "-m", "specwire", "-v", "serve", "-np", "2"], "specwire serve"),
    (["specwire", "draft", "-m", "x.gguf"], "specwire draft"),
    ("python -m specwire generate hi -n 4", "specwire generate"),
    (["python", "-m", "specwire", "bench"], "specwire bench"),
    (["/opt/llama.cpp/build/bin/llama-server", "-m", "x.gguf"], "llama-server"),
    (["python", "-m", "specwire", "models", "path", "target"], None),
    (["python", "-m", "specwire", "plan", "--help"], None),
    (["python", "-m", "specwire", "serve", "--help"], None),
    (["python", "tests/specwire_serve.py"], None),
    (["git", "status"], None),
])
def test_model_command(args, want) -> None:
    assert model_command(args) == want
