"""`serve -np 4` on the bundled pair: concurrent requests share one target batch.

Four concurrent greedy requests (two drafting, two plain, different prompts and
lengths) each get what they get alone from the same server; a streaming request
whose client leaves frees its slot at once while the others go on; the timings
report draft figures per request.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from serve_process import run_serve
from toy_server import _metric

pytestmark = pytest.mark.slow

PROMPTS = ["The old lighthouse keeper climbed the stairs every evening, and",
           "def mean(values):\n    total = 0\n",
           "Q: What is the capital of France?\nA:",
           "Once upon a time, in a small village by the sea, there lived a"]


def body(i: int) -> dict:
    return {"prompt": PROMPTS[i], "n_predict": 12 + 4 * i, "temperature": 0,
            "cache_prompt": False, "speculative": i % 2 == 0}


def test_concurrent_requests_get_what_they_get_alone() -> None:
    # the fixed policy drafts whatever the timings (the adaptive one may not, under load)
    with run_serve("-t", "1", "-td", "1", "-c", "1024", "-np", "4", "--draft-max", "4",
                   "--draft-policy", "fixed", "--draft-p-min", "0",
                   no_traceback=True) as (url, log):
        assert "4 slots" in log()
        alone = [httpx.post(url + "/completion", json=body(i), timeout=120).json()
                 for i in range(4)]
        got: dict[int, dict] = {}

        def ask(i: int) -> None:
            got[i] = httpx.post(url + "/completion", json=body(i), timeout=300).json()

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        # a fifth client streams and leaves early: its slot must come free
        long = {"prompt": "Tell me a story.", "n_predict": 400, "stream": True}
        with httpx.stream("POST", url + "/completion", json=long, timeout=300) as r:
            next(r.iter_lines())
        for t in threads:
            t.join(300)
        for i in range(4):
            assert got[i]["content"] == alone[i]["content"], (i, got[i], alone[i])
            assert got[i]["tokens_predicted"] == 12 + 4 * i
        assert got[0]["timings"]["draft_n"] > 0 and got[1]["timings"]["draft_n"] == 0
        assert len({got[i]["id_slot"] for i in range(4)}) == 4, "one slot each"
        deadline = time.monotonic() + 30
        while _metric(url, "requests_processing") > 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _metric(url, "requests_processing") == 0
