"""benchmarks/colocation.py on the bundled pair: both ways timed, one line per size."""

from __future__ import annotations

import pytest

from benchmarks.colocation import main


@pytest.mark.slow
def test_colocation_times_both_ways(capsys):
    assert main(["--reps", "1", "--sizes", "1,3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split(":")[0] for ln in lines[:2]] == ["t_v(1)", "t_v(3)"]
    assert all(" ms while it drafts: x" in ln for ln in lines[:2])


def test_colocation_rejects_bad_sizes(capsys):
    assert main(["--sizes", "0,5"]) == 2
    assert main(["--sizes", "a"]) == 2
    assert capsys.readouterr().err.count("colocation: ") == 2
