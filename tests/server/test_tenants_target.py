"""Tenants on the target: the caches of `specwire serve` shared across HTTP clients.

The prefix oracle of issue 23 on the target side: a victim (API key A) sends a private
prompt; an attacker (key B) who knows its opening sends [opening, recovered tokens,
guess, filler] and reads timings.cache_n (the slot's KV cache reused), then [opening,
recovered tokens, guess] and reads draft_n / draft_n_accepted (the n-gram lookup cache
of earlier requests), and id_slot. Over real HTTP on the toy engine, one slot:

- without API keys (one tenant: today's behaviour, kept) the probe tells the true guess
  at every position, which shows the oracle is real and the probe able to find it;
- with two keys, everything the attacker sees is the same whether the victim wrote the
  secret or another text (so it learns nothing of it); the victim still reuses its own
  cache.

And the invariance: on fakes, requests of interleaved scopes give the tokens of plain
decoding, and of the same requests all in one scope, for the n-gram drafter and a draft
model (with and without a draft, every draft length); within a scope the caches are
still reused, across scopes never.
"""

from __future__ import annotations

import httpx
import pytest
from fakes import FakeBackend, FakeModel
from toy_server import ToyBackend, serve_app

from specwire.config import DraftParams, SamplingParams
from specwire.drafters.model import ModelDrafter
from specwire.drafters.ngram.cache import LookupCache
from specwire.drafters.ngram.drafter import NgramDrafter
from specwire.engine.engine import Engine, Request
from specwire.server import ServerSettings, create_app

pytestmark = pytest.mark.q8_0   # the tests' fast target (bundled.py)

OPENING = "Dear bank, keep this private. "
SECRET = "pin7"
OTHER = "no,m"            # the same length: what the victim writes in the other run
FILLER = "~unrelated words follow"
POSITIONS = len(SECRET)


def _app(api_key: str | None):
    engine = Engine(ToyBackend(delay=0.0), NgramDrafter(keep=0.0))
    return create_app(engine, ServerSettings(sampling=SamplingParams(temperature=0.0),
                                             api_key=api_key))


def _post(client: httpx.Client, key: str | None, prompt: str, n: int = 4) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = client.post("/completion", json={"prompt": prompt, "n_predict": n,
                                         "speculative.n_max": 4}, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()


def _seen(answer: dict) -> tuple:
    """Everything a response tells its client of the caches."""
    t = answer["timings"]
    return (answer["content"], answer.get("id_slot"), t["cache_n"], t["prompt_n"],
            t.get("draft_n", 0), t.get("draft_n_accepted", 0))


def _attack(url: str, victim_key: str | None, attacker_key: str | None,
            victim_text: str) -> list[list[tuple]]:
    """Per position, per guess (the true one first): what the attacker saw, each probe
    right after the victim's request (which puts its text in the slot and the lookup
    cache again)."""
    rows = []
    with httpx.Client(base_url=url, timeout=30) as c:
        for i in range(POSITIONS):
            known = OPENING + SECRET[:i]
            true = SECRET[i]
            guesses = [true] + [g for g in "xw@" if g != true][:2]
            row = []
            for g in guesses:
                _post(c, victim_key, OPENING + victim_text)
                kv = _post(c, attacker_key, known + g + FILLER)
                _post(c, victim_key, OPENING + victim_text)
                lookup = _post(c, attacker_key, known + g, n=6)
                row.append((*_seen(kv), *_seen(lookup)))
            rows.append(row)
    return rows


def _told(rows: list[list[tuple]]) -> int:
    """Positions where the true guess's cache_n or drafted tokens stood out."""
    told = 0
    for row in rows:
        true, others = row[0], row[1:]
        kv = true[2] > max(o[2] for o in others)
        lookup = true[10] > max(o[10] for o in others)
        told += kv or lookup
    return told


def test_one_tenant_keeps_todays_caches_and_the_probe_works() -> None:
    """The control: no API keys (every request one scope), the probe finds the secret by
    both caches, as it did before scopes."""
    with serve_app(_app(None)) as url:
        rows = _attack(url, None, None, SECRET)
    assert _told(rows) == POSITIONS, rows
    for i, row in enumerate(rows):                  # the slot's cache: one more token
        assert row[0][2] == len(OPENING) + i + 1 and row[1][2] == len(OPENING) + i
        assert row[0][10] > 0                       # the lookup cache: a draft


def test_another_api_key_learns_nothing_from_the_victims_caches() -> None:
    with serve_app(_app("key-victim,key-attacker")) as url:
        secret = _attack(url, "key-victim", "key-attacker", SECRET)
    with serve_app(_app("key-victim,key-attacker")) as url:
        other = _attack(url, "key-victim", "key-attacker", OTHER)
    # What the attacker saw is the same either way: a function of its own requests only.
    # (Its guesses of a position follow its probes of the earlier ones, which hold the
    # true tokens, so the true guess may stand out by the attacker's own cache: the
    # comparison with the other text is the test, not _told.)
    assert secret == other
    for row in secret:
        assert all(seen[2] == 0 for seen in row)   # a slot of another scope: emptied


def test_the_victim_still_reuses_its_own_caches() -> None:
    with serve_app(_app("key-victim,key-attacker")) as url, \
            httpx.Client(base_url=url, timeout=30) as c:
        first = _post(c, "key-victim", OPENING + SECRET)
        again = _post(c, "key-victim", OPENING + SECRET + FILLER)
        assert again["timings"]["cache_n"] == len(OPENING + SECRET)
        _post(c, "key-attacker", OPENING + SECRET + FILLER)   # takes the one slot
        back = _post(c, "key-victim", OPENING + SECRET + FILLER)
        assert back["timings"]["cache_n"] == 0                 # emptied for the attacker
        salted = c.post("/completion", json={"prompt": OPENING + SECRET, "n_predict": 4,
                                              "cache_salt": "mine"},
                        headers={"Authorization": "Bearer key-victim"}).json()
        assert salted["timings"]["cache_n"] == 0               # a salt is a scope apart
        assert back["content"] == again["content"] and salted["content"] == first["content"]


def test_get_slots_shows_another_keys_slot_without_its_details() -> None:
    """GET /slots with API keys: the slot A's request filled shows A its cached tokens,
    and B only that it exists (no n_cached, no request settings); without keys, all."""
    with serve_app(_app("key-victim,key-attacker")) as url, \
            httpx.Client(base_url=url, timeout=30) as c:
        _post(c, "key-victim", OPENING + SECRET)

        def slot0(key: str) -> dict:
            r = c.get("/slots", headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
            return r.json()[0]

        assert slot0("key-victim")["n_cached"] > len(OPENING)
        theirs = slot0("key-attacker")
        assert "n_cached" not in theirs and "params" not in theirs and "n_prompt_tokens" \
            not in theirs and theirs["id"] == 0 and theirs["is_processing"] is False
    with serve_app(_app(None)) as url, httpx.Client(base_url=url, timeout=30) as c:
        _post(c, None, OPENING + SECRET)
        assert c.get("/slots").json()[0]["n_cached"] > len(OPENING)


# ------------------------------------------------------------------------- invariance

TARGET = FakeModel(n_vocab=48, seed=3)
DRAFT = TARGET.perturbed(0.3, seed=4)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 9, 10], [1, 2, 3, 4, 5, 6, 7, 8, 11],
           [5, 6, 7, 8, 1, 2, 3, 4], [5, 6, 7, 8, 1, 2, 9, 9]]
SCOPES = ["", "a", "a", "b", "b"]


def _drafter(kind: str):
    if kind == "ngram":
        return NgramDrafter(keep=0.0, cache=LookupCache())
    return ModelDrafter(FakeBackend(DRAFT, name="draft.gguf"))


def _run(kind: str, scopes: list[str], n_max: int, seed: int | None) -> list[tuple]:
    sampling = (SamplingParams(temperature=0.0) if seed is None
                else SamplingParams(temperature=0.9, seed=seed))
    engine = Engine(FakeBackend(TARGET), _drafter(kind) if kind != "plain" else None)
    out = []
    for prompt, scope in zip(PROMPTS * 2, scopes * 2, strict=True):
        dp = DraftParams(n_max=n_max, p_min=0.0, cache_scope=scope, enabled=kind != "plain")
        g = engine.generate(Request(list(prompt), 12, sampling, dp))
        tokens = [t for part in g for t in part]
        out.append((tokens, g.stats.cache_n, g.stats.draft_cache_n or 0, g.stats.draft_n))
    return out


@pytest.mark.parametrize("kind", ["ngram", "model"])
@pytest.mark.parametrize("n_max", [1, 3, 8])
@pytest.mark.parametrize("seed", [None, 11])
def test_scopes_change_no_output(kind: str, n_max: int, seed: int | None) -> None:
    plain = [r[0] for r in _run("plain", SCOPES, n_max, seed)]
    scoped = _run(kind, SCOPES, n_max, seed)
    shared = _run(kind, [""] * len(SCOPES), n_max, seed)
    assert [r[0] for r in scoped] == plain == [r[0] for r in shared]
    # The caches still serve a scope's own requests, and never another's: a request
    # following one of its own scope reuses what it would with one scope for all, a
    # request following another scope's reuses nothing.
    order = SCOPES * 2
    for j in range(1, len(order)):
        if order[j] == order[j - 1]:
            assert scoped[j][1:3] == shared[j][1:3] and scoped[j][1] > 0, j
        else:
            assert scoped[j][1:3] == (0, 0), (j, scoped[j])


def test_the_slot_choice_compares_prompts_within_the_scope_only() -> None:
    """pick_slot (--slot-prompt-similarity): the victim's slot draws its own scope's next
    request by prefix, never another scope's (that one goes to the least recently used
    slot, as a prompt sharing nothing would)."""
    from types import SimpleNamespace

    from specwire.server.slots import pick_slot
    victim = [5, 6, 7, 8, 9, 10]
    slots = [SimpleNamespace(index=0, scope="A", last_used=2.0,
                             target=SimpleNamespace(tokens=victim)),
             SimpleNamespace(index=1, scope="B", last_used=1.0,
                             target=SimpleNamespace(tokens=[1, 2, 3]))]

    def pick(scope: str, prompt: list[int]) -> int:
        req = Request(prompt, 4, draft=DraftParams(cache_scope=scope))
        return pick_slot(req, slots, 0.1).index

    assert pick("A", victim + [11]) == 0
    assert pick("B", victim + [11]) == 1 == pick("C", victim + [11])
    slots[1].last_used = 3.0
    assert pick("C", victim + [11]) == 0     # the least recently used, emptied on entry


@pytest.mark.slow
@pytest.mark.parametrize("drafting", [["-t", "1", "-td", "1"], ["-t", "1", "--draft-ngram"]],
                         ids=["draft-model", "ngram"])
def test_two_api_keys_on_the_bundled_pair(drafting: list[str]) -> None:
    """`specwire serve -np 1 --api-key A,B` on the bundled pair (the in-process draft
    model, then the n-gram drafter): B's probe of A's prompt, right after A's request,
    reuses nothing of the slot's caches (cache_n, draft_cache_n) and sees the same
    whether A wrote the secret or another text; A's own next turn reuses its prompt;
    every answer equals plain decoding (speculative false)."""
    from serve_process import run_serve

    keys = ("victim-key-0123", "attacker-key-0123")
    auth = [{"Authorization": f"Bearer {k}"} for k in keys]
    with run_serve(*drafting, "-c", "512", "-np", "1", "--api-key", ",".join(keys),
                   no_traceback=True) as (url, _), \
            httpx.Client(base_url=url, timeout=300) as c:
        def tokens(text: str) -> list[int]:
            return c.post("/tokenize", json={"content": text}, headers=auth[0]).json()["tokens"]

        def ask(who: int, prompt: list[int], **extra) -> dict:
            r = c.post("/completion", headers=auth[who], json={
                "prompt": prompt, "n_predict": 6, "temperature": 0, "return_tokens": True,
                **extra})
            assert r.status_code == 200, r.text
            return r.json()

        opening = tokens("Keep this private. My account password is")
        secret, other = tokens(" tulip-4817, never share it."), tokens(" daisy-1234, fine.")
        filler = tokens(" Unrelated filler words follow here.")
        seen = {}
        for name, text in (("secret", secret), ("other", other)):
            rows = []
            for i in range(3):
                ask(0, opening + text)
                probe = ask(1, opening + secret[:i + 1] + filler)
                t = probe["timings"]
                rows.append((probe["tokens"], t["cache_n"], t["prompt_n"],
                             t.get("draft_cache_n", 0), probe.get("id_slot")))
            seen[name] = rows
        assert seen["secret"] == seen["other"]
        assert all(r[1] == 0 and r[3] == 0 for r in seen["secret"])
        ask(0, opening + secret)
        own = ask(0, opening + secret + filler)
        assert own["timings"]["cache_n"] >= len(opening + secret) - 1
        plain = ask(1, opening + secret + filler, speculative=False)
        assert own["tokens"] == plain["tokens"]
        assert [r[0] for r in seen["secret"]] == [
            ask(1, opening + secret[:i + 1] + filler, speculative=False)["tokens"]
            for i in range(3)]


@pytest.mark.slow
def test_what_one_scope_teaches_sets_no_other_scopes_draft_lengths() -> None:
    """`serve --draft-ngram --draft-policy fixed` on the bundled target: tenant A (its own
    cache_salt) sends three requests the lookup copies well, or three it copies badly;
    tenant B's next request (another salt) drafts and keeps the same tokens either way,
    as the n-gram drafter's calibration and yield are learnt per scope. The control, A
    and B without salts (one scope), in the same servers, is printed, not asserted: on
    main at d7e212f B drafts and keeps 6 of 6 after either text there too, so this test
    shows only that nothing differs; test_scoped_learning.py asserts the control."""
    from test_server import run_serve

    def seen(a_text: str) -> tuple[tuple, tuple]:
        with run_serve("-t", "1", "--draft-ngram", "--draft-policy", "fixed", "-c", "1024",
                       "-np", "1", no_traceback=True) as (url, _), \
                httpx.Client(base_url=url, timeout=300) as c:
            def ask(prompt: str, salt: str | None, n: int) -> tuple:
                body = {"prompt": prompt, "n_predict": n, "temperature": 0,
                        "return_tokens": True, **({"cache_salt": salt} if salt else {})}
                r = c.post("/completion", json=body)
                assert r.status_code == 200, r.text
                t = r.json()["timings"]
                return (tuple(r.json()["tokens"]), t.get("draft_n", 0),
                        t.get("draft_n_accepted", 0))

            out = []
            for a_salt, b_salt in (("tenant-a", "tenant-b"), (None, None)):
                for i in range(3):
                    ask(a_text.format(i=i), a_salt, 48)
                # 8 tokens: at most 8 rounds, all before the drafter's yield (timed)
                # replaces its fixed stop (RoundCost), so B's rounds are a function of
                # what its scope learnt, not of this machine's load
                out.append(ask(B_TEXT, b_salt, 8))
            return out[0], out[1]

    copying_scoped, copying_shared = seen(COPY_TEXT)
    junk_scoped, junk_shared = seen(JUNK_TEXT)
    assert copying_scoped == junk_scoped
    assert copying_scoped[1] > 0                 # B's lookup drafts: the probe is live
    print(f"one scope (the control): B drafted, kept {copying_shared[1:]} after A's copying "
          f"text, {junk_shared[1:]} after its junk")
    assert copying_shared[0] == junk_shared[0] == copying_scoped[0]


#: What the lookup copies well (the answer repeats the prompt's list) and badly (a
#: repeated cycle of words the model does not go on with), and B's probe.
COPY_TEXT = ("Copy the list exactly. List {i}: apples, pears, plums, figs, dates, limes, "
             "kiwis, grapes, lemons, cherries. Copy: apples, pears, plums, figs, dates,")
JUNK_TEXT = "zebra {i} quartz violin ember " * 12 + "Now write a sentence about the sea."
B_TEXT = ("Repeat: red, green, blue, yellow, purple, orange, pink, brown, black, white. "
          "Again: red, green, blue,")
