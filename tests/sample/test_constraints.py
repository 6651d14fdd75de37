"""Constrained sampling: the cheap way of asking a grammar gives the whole-mask answer.

A grammar is part of the target's sampling, applied before every filter (llama.cpp's
grammar-first order). `sampling` asks the constraint about the best few tokens
first and the whole vocabulary only when it must; these tests compare it with the
plain definition (mask every refused token, then filter) on random rows and
masks, and check that a Verifier with a stateful constraint gives the same tokens
with a draft as without. The grammar engine itself is llama.cpp's (slow tests
at the end compile real GBNF against the bundled vocabulary).
"""

from __future__ import annotations

from dataclasses import replace

import bundled
import numpy as np
import pytest
from fakes import FakeModel

from specwire.config import ConfigError, SamplingParams, VerifyMode
from specwire.sample import sampling
from specwire.sample.constraints import GrammarSpec, schema_grammar
from specwire.sample.verify import Verifier


def reference_candidates(row: np.ndarray, params: SamplingParams, mask: np.ndarray) -> list[int]:
    """The definition: refused tokens out, then top-k, top-p, min-p on what is left."""
    ids = np.flatnonzero(mask)
    ids = ids[np.argsort(-row[ids], kind="stable")]
    if params.top_k > 0:
        ids = ids[: params.top_k]
    logits = row[ids].astype(np.float64)
    p = np.exp(logits - logits[0])
    p /= p.sum()
    n = len(ids)
    if params.top_p < 1.0:
        n = min(n, int(np.searchsorted(np.cumsum(p), params.top_p)) + 1)
    if params.min_p > 0.0:
        n = min(n, max(1, int(np.count_nonzero(p[:n] >= params.min_p * p[0]))))
    return sorted(ids[:n].tolist())


SETTINGS = [
    SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
    SamplingParams(temperature=1.0, top_k=0, top_p=0.9, min_p=0.0),
    SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.1),
    SamplingParams(temperature=1.0, top_k=5, top_p=1.0, min_p=0.0),
    SamplingParams(temperature=0.7, top_k=100, top_p=0.5, min_p=0.01),
]


@pytest.mark.parametrize("params", SETTINGS)
@pytest.mark.parametrize("density", [0.5, 0.01, 0.0005])
def test_candidates_under_a_mask_equal_the_whole_mask_definition(params, density) -> None:
    """Dense masks, sparse ones and masks that leave only a handful of 20k tokens."""
    gen = np.random.default_rng(int(density * 1e4) + params.top_k)
    v = 20000
    for _ in range(25):
        row = (gen.normal(size=v) * gen.uniform(1.0, 4.0)).astype(np.float32)
        mask = gen.random(v) < density
        mask[gen.integers(v)] = True
        asked = []

        def allow(ids, mask=mask, asked=asked):
            asked.append(len(ids))
            return mask[ids]

        c = sampling.candidates(row, params, allow=allow)
        assert sorted(c.ids.tolist()) == reference_candidates(row, params, mask)
        assert np.all(np.diff(c.scaled) <= 0)
        want = int(np.flatnonzero(mask)[np.argmax(row[mask])])
        assert sampling.greedy(row, params, allow=lambda ids, m=mask: m[ids]) == want


def test_a_mask_is_asked_about_few_tokens_when_the_favourites_fit() -> None:
    """The point of the tiers: with the model's top tokens allowed, no whole-vocabulary scan."""
    v = 262144
    row = np.random.default_rng(1).normal(size=v).astype(np.float32)
    mask = np.ones(v, dtype=bool)
    asked: list[int] = []

    def allow(ids):
        asked.append(len(ids))
        return mask[ids]

    sampling.candidates(row, SETTINGS[0], allow=allow)
    sampling.greedy(row, SETTINGS[0], allow=allow)
    assert max(asked) <= 4096


def test_nothing_allowed_is_a_clear_error() -> None:
    row = np.zeros(100, dtype=np.float32)
    with pytest.raises(ConfigError, match="grammar"):
        sampling.greedy(row, SamplingParams(temperature=0.0), allow=lambda ids: ids < 0)


class ParityGrammar:
    """A stateful toy constraint: token parity must alternate; ids over 25 never allowed."""

    def __init__(self, start: int = 0) -> None:
        self.parity, self.accepted = start, []

    def allowed(self, ids: np.ndarray) -> np.ndarray:
        return (ids % 2 == self.parity) & (ids <= 25)

    def accept(self, token: int) -> None:
        assert self.allowed(np.array([token]))[0], token
        self.parity ^= 1
        self.accepted.append(token)


V = 32
TARGET = FakeModel(n_vocab=V, seed=0)
OTHER = TARGET.perturbed(0.7, seed=5)


def _plain(params: SamplingParams, n: int) -> list[int]:
    g = ParityGrammar()
    ver = Verifier(params, VerifyMode.COUPLED, g)
    hist = [1, 2, 3]
    for _ in range(n):
        hist.append(ver.sample(TARGET.row(hist), hist))
    return hist[3:]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0),
                                    SamplingParams(temperature=0.9, top_k=8, seed=3),
                                    SamplingParams(temperature=1.2, top_k=0, top_p=0.9,
                                                   presence_penalty=0.5,
                                                   frequency_penalty=0.3, seed=4)])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_verifier_with_a_constraint_gives_the_plain_tokens_with_any_draft(params, k) -> None:
    """Drafts from another model (which ignores the constraint) or the target's own
    constrained samples: the kept tokens are the plain constrained sequence."""
    want = _plain(params, 30)
    assert all(t % 2 == i % 2 and t <= 25 for i, t in enumerate(want))
    for drafted_by in ("other", "oracle"):
        g = ParityGrammar()
        ver = Verifier(params, VerifyMode.COUPLED, g)
        hist = [1, 2, 3]
        hist.append(ver.sample(TARGET.row(hist), hist))
        while len(hist) - 3 < 30:
            if drafted_by == "oracle":
                draft = want[len(hist) - 3: len(hist) - 3 + k]
            else:
                ctx, draft = list(hist), []
                for _ in range(k):
                    ctx.append(sampling.coupled(OTHER.row(ctx), params, len(ctx)))
                    draft.append(ctx[-1])
            rows = np.stack([TARGET.row(hist + draft[:i]) for i in range(len(draft) + 1)])
            v = ver.verify(rows, hist, draft)
            hist += [*draft[: v.accepted], v.token]
        assert hist[3:33] == want
        assert g.accepted == hist[3:]          # the state moved along kept tokens only


def test_logit_bias_and_penalties_in_llama_cpp_order() -> None:
    """bias first, then repeat (divide positive / multiply negative), then frequency and
    presence: logit - count * frequency - (count > 0) * presence."""
    row = np.array([2.0, -2.0, 1.0, 0.5], dtype=np.float32)
    p = SamplingParams(repeat_penalty=2.0, repeat_last_n=8, frequency_penalty=0.5,
                       presence_penalty=0.25, logit_bias=((2, 1.0), (3, -np.inf)))
    out = sampling.adjusted(row, p, sampling.recent_window([0, 0, 1, 2], p))
    np.testing.assert_allclose(out, [1.0 - 1.0 - 0.25, -4.0 - 0.5 - 0.25,
                                     1.0 - 0.5 - 0.25, -np.inf])
    assert sampling.greedy(row, replace(p, temperature=0.0),
                           sampling.recent_window([0, 0, 1, 2], p)) == 2


def test_json_schema_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match="response_format: unsupported or invalid JSON schema"):
        schema_grammar({"type": "nonsense"}, "response_format")
    with pytest.raises(ConfigError, match="json_schema: must be a JSON schema object"):
        schema_grammar([1], "json_schema")
    spec = schema_grammar({"type": "object", "properties": {"a": {"type": "integer"}}})
    assert "root ::=" in spec.text and spec.origin == "json_schema"


# ------------------------------------------------------------------ llama.cpp's grammar engine


@pytest.fixture(scope="module")
def vocab_model():
    from specwire.backend.llama import load_model
    from specwire.config import ModelParams
    return load_model(ModelParams(str(bundled.target())))


@pytest.mark.slow
def test_llama_cpp_grammar_masks_advances_and_reports_errors(vocab_model) -> None:
    from specwire.sample.constraints import Grammar
    g = Grammar.compile(GrammarSpec('root ::= "yes" | "no"'), vocab_model.vocab)
    yes, no, eos = (vocab_model.tokenize("yes", False, False)[0],
                    vocab_model.tokenize("no", False, False)[0], vocab_model.eos)
    assert g.allowed(np.array([yes, no, eos])).tolist() == [True, True, False]
    c = g.clone()
    g.accept(yes)
    assert g.allowed(np.array([yes, no, eos])).tolist() == [False, False, True]
    assert c.allowed(np.array([yes, no])).tolist() == [True, True]   # the clone kept its state
    with pytest.raises(ConfigError, match="does not fit"):
        g.accept(no)                     # refused in Python: llama.cpp would abort the process
    with pytest.raises(ConfigError, match=r"grammar: invalid grammar: .*Undefined rule"):
        Grammar.compile(GrammarSpec("root ::= foo"), vocab_model.vocab)
    with pytest.raises(ConfigError, match="grammar: the grammar is empty"):
        Grammar.compile(GrammarSpec("  "), vocab_model.vocab)


class CountingGrammar(ParityGrammar):
    """ParityGrammar with llama.cpp's clone/close, counting live copies."""

    live = 0

    def __init__(self, start: int = 0) -> None:
        super().__init__(start)
        CountingGrammar.live += 1

    def clone(self) -> CountingGrammar:
        c = CountingGrammar(self.parity)
        c.accepted = list(self.accepted)
        return c

    def close(self) -> None:
        CountingGrammar.live -= 1

    def accept(self, token: int) -> None:
        if not self.allowed(np.array([token]))[0]:     # as Grammar.accept refuses it
            raise ConfigError(f"grammar: token {token} does not fit the grammar here")
        super().accept(token)


def test_grammar_trail_follows_speculative_histories_and_rolls_back() -> None:
    """A pipelined draft asks about branches the next verdict may cut: the trail keeps a
    state per position and answers for any history from the common prefix."""
    from specwire.sample.constraints.trail import GrammarTrail
    CountingGrammar.live = 0
    trail = GrammarTrail(CountingGrammar(), start=3)
    prompt = [9, 9, 9]
    g = trail.after(prompt + [0, 1, 2])
    assert g.parity == 1 and g.accepted == [0, 1, 2]
    g.close()
    g = trail.after(prompt + [0, 3])          # rolled back to [0], then on along 3
    assert g.accepted == [0, 3] and trail.tokens == [0, 3]
    g.close()
    assert trail.after(prompt + [0, 2]) is None   # leaves the grammar (2 is even at odd)
    assert trail.after([9]) is None               # before the grammar's start
    trail.close()
    assert CountingGrammar.live == 0              # every copy was freed
