"""Tiny pure-numpy stand-ins for models, drafters and a broken verifier.

Nothing here loads llama.cpp. A `FakeModel` computes logits as a deterministic
function of the last two tokens and the position, from seeded tables, so that
decoding with it is cheap, reproducible and has structure (greedy decoding
cycles, which gives the n-gram drafter something to find). A `FakeBackend`
speaks the engine's Backend protocol on top of one, with the same contract as
llama.cpp's: one KV "cache" (a token list), logits rows that view a shared
buffer overwritten by the next eval, and an error past the context size.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence

import numpy as np

from specwire.backend.base import BackendError
from specwire.config import DraftParams, SamplingParams, VerifyMode
from specwire.drafters.base import Capabilities, Draft, DrafterBase
from specwire.link.transport.base import Transport
from specwire.sample.sampling import SparseDraft
from specwire.sample.verify import Outcome, Verifier

#: How many of the highest token ids are "junk": logits so low that no filter
#: (top-k 40, top-p, min-p 0.05) and no argmax ever keeps them.
JUNK = 6
_JUNK_BIAS = -40.0
_PERIOD = 7


class FakeModel:
    """Logits row = A[last] + B[previous] + C[position % 7] (+ a junk bias).

    sharp scales A and B (how peaked the distributions are); pos_weight scales
    the positional term. Rows predict the token at position len(prefix).
    """

    def __init__(self, n_vocab: int = 32, seed: int = 0, sharp: float = 2.0,
                 pos_weight: float = 0.3) -> None:
        if n_vocab <= JUNK + 4:
            raise ValueError("n_vocab too small")
        rs = np.random.default_rng(seed)
        self.n_vocab = n_vocab
        self.a = rs.normal(size=(n_vocab, n_vocab)) * sharp
        self.b = rs.normal(size=(n_vocab + 1, n_vocab)) * (0.5 * sharp)  # row n_vocab: no previous
        self.c = rs.normal(size=(_PERIOD, n_vocab)) * pos_weight
        self._apply_junk()

    def _apply_junk(self) -> None:
        self.a[:, self.n_vocab - JUNK:] = _JUNK_BIAS

    def perturbed(self, scale: float, seed: int) -> FakeModel:
        """Another model: these tables plus Gaussian noise of std `scale` (for a draft)."""
        other = object.__new__(FakeModel)
        rs = np.random.default_rng(seed)
        other.n_vocab = self.n_vocab
        other.a = self.a + rs.normal(size=self.a.shape) * scale
        other.b = self.b + rs.normal(size=self.b.shape) * scale
        other.c = self.c + rs.normal(size=self.c.shape) * scale
        other._apply_junk()
        return other

    def row(self, prefix: Sequence[int]) -> np.ndarray:
        """(V,) float32 logits for the token that follows prefix (non-empty)."""
        last = prefix[-1]
        prev = prefix[-2] if len(prefix) > 1 else self.n_vocab
        r = self.a[last] + self.b[prev] + self.c[len(prefix) % _PERIOD]
        return r.astype(np.float32)

    @property
    def real_tokens(self) -> int:
        """Ids below this are ordinary tokens; the rest are junk."""
        return self.n_vocab - JUNK


class FakeClock:
    """A perf_counter that moves only by the fixed costs the fakes charge to it.

    The adaptive policy and the hybrid drafter learn from measured times; on a busy
    machine a fake round that takes microseconds may take milliseconds, and their
    decisions with it. A test that checks them installs this clock as the `time` of the
    modules that measure (they use only perf_counter) and gives it to the FakeBackends,
    whose evals then cost what they are told; a drafter's time is charged by the test.
    """

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def charge(self, seconds: float) -> None:
        self.now += seconds

    def sleep(self, seconds: float) -> None:
        """A wait moves the clock as a charge does (the emulated backend holds with it)."""
        self.now += max(0.0, seconds)

    def install(self, monkeypatch, *modules) -> FakeClock:
        """Be the `time` of these modules for the test."""
        for module in modules:
            monkeypatch.setattr(module, "time", self)
        return self


class FakeBackend:
    """The Backend protocol over a FakeModel, with call logs for the tests.

    evals: one (n_past_before, tokens) per eval; truncates: each n passed. clock: a
    FakeClock charged cost = (seconds per eval, seconds per token) for each eval.
    """

    def __init__(self, model: FakeModel, n_ctx: int = 512, name: str = "fake.gguf",
                 eog: Sequence[int] = (), clock: FakeClock | None = None,
                 cost: tuple[float, float] = (10e-3, 1e-3)) -> None:
        self.clock, self.cost = clock, cost
        self.model = model
        self.name = name
        self.n_vocab = model.n_vocab
        self.n_ctx = n_ctx
        self.eog = set(eog)
        self._tokens: list[int] = []
        self._buf = np.zeros((n_ctx, model.n_vocab), dtype=np.float32)
        self.evals: list[tuple[int, tuple[int, ...]]] = []
        self.truncates: list[int] = []
        self.shifts: list[tuple[int, int]] = []
        self.decode_s = 0.0

    @property
    def n_past(self) -> int:
        return len(self._tokens)

    @property
    def tokens(self) -> Sequence[int]:
        return tuple(self._tokens)

    def eval(self, tokens: Sequence[int], logits: str = "last") -> np.ndarray:
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise BackendError(f"{self.name}: empty batch")
        if any(not 0 <= t < self.n_vocab for t in tokens):
            raise BackendError(f"{self.name}: token out of range in {tokens}")
        if self.n_past + len(tokens) > self.n_ctx:
            raise BackendError(f"{self.name}: context full ({self.n_past} + {len(tokens)} > "
                               f"{self.n_ctx})")
        t0 = time.perf_counter()
        start = self.n_past
        self.evals.append((start, tuple(tokens)))
        self._tokens.extend(tokens)
        n = len(tokens)
        # Like llama.cpp, rows live in one buffer that the next eval overwrites.
        self._buf[:] = np.nan
        for i in range(n):
            self._buf[i] = self.model.row(self._tokens[:start + i + 1])
        if self.clock is None:
            self.decode_s += time.perf_counter() - t0
        else:
            self.decode_s += self.cost[0] + self.cost[1] * n
            self.clock.charge(self.cost[0] + self.cost[1] * n)
        if logits == "all":
            return self._buf[:n]
        if logits == "last":
            return self._buf[n - 1:n]
        if logits == "none":
            return self._buf[:0]
        raise ValueError(logits)

    def truncate(self, n: int) -> None:
        if not 0 <= n <= self.n_past:
            raise BackendError(f"{self.name}: truncate({n}) with {self.n_past} cached")
        self.truncates.append(n)
        del self._tokens[n:]

    def reuse_chunks(self, prompt: Sequence[int], n_past: int, n_min: int) -> int:
        """A list cannot shift its entries' positions: the common prefix only."""
        return n_past

    def can_shift(self) -> bool:
        return True

    def shift(self, n_keep: int, n_discard: int) -> None:
        """Context shift: the run [n_keep, n_keep + n_discard) goes and the rest moves down;
        FakeModel's rows read positions by index, so they move with it, as RoPE's do."""
        if n_keep < 0 or n_discard <= 0 or n_keep + n_discard > self.n_past:
            raise BackendError(f"{self.name}: shift({n_keep}, {n_discard}) with "
                               f"{self.n_past} cached")
        self.shifts.append((n_keep, n_discard))
        del self._tokens[n_keep:n_keep + n_discard]

    def tokenize(self, text: str, add_special: bool = True,
                 parse_special: bool = True) -> list[int]:
        return [ord(ch) % self.model.real_tokens for ch in text]

    def detokenize(self, tokens: Sequence[int]) -> bytes:
        return bytes(0x41 + int(t) for t in tokens)

    def is_eog(self, token: int) -> bool:
        return token in self.eog

    def vocab_fingerprint(self) -> str:
        return hashlib.sha256(f"fake:{self.n_vocab}".encode()).hexdigest()[:16]

    def chat_template(self) -> str | None:
        return None


class FakeBatch:
    """n_seq FakeBackends in one "context": decode() appends several sequences' parts at once
    (the BatchBackend protocol), with a -b budget; `decodes` logs each decode's parts as
    (seq, n_past_before, tokens). With a clock, each part costs its sequence's eval cost."""

    def __init__(self, model: FakeModel, n_seq: int, n_ctx: int = 512, n_batch: int = 512,
                 eog: Sequence[int] = (), clock: FakeClock | None = None,
                 cost: tuple[float, float] = (10e-3, 1e-3), tree_leaves: int = 1) -> None:
        self.n_seq, self.n_batch, self.decode_s = n_seq, n_batch, 0.0
        self.model = model
        #: tree parts (Part.parents) of at most this many leaves; trees logs each tree part
        #: as (seq, tokens, parents), and kept each keep_tree's nodes
        self.tree_leaves = tree_leaves
        self.trees: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []
        self.kept: list[tuple[int, ...]] = []
        self._pending: dict[int, tuple[list[int], list[int]]] = {}
        self.seqs = [FakeBackend(model, n_ctx, eog=eog, clock=clock, cost=cost)
                     for _ in range(n_seq)]
        self.decodes: list[list[tuple[int, int, tuple[int, ...]]]] = []

    def seq(self, i: int) -> FakeBackend:
        return self.seqs[i]

    def seq_decode_s(self, i: int) -> float:
        return self.seqs[i].decode_s

    def decode(self, parts) -> list[np.ndarray]:
        total = sum(len(p.tokens) for p in parts)
        if total > self.n_batch:
            raise BackendError(f"a step of {total} tokens exceeds -b {self.n_batch}")
        if len({p.seq for p in parts}) != len(parts):
            raise BackendError("two parts of one sequence in a step")
        for p in parts:
            if p.seq in self._pending:
                raise BackendError(f"sequence {p.seq} decoded again before keep_tree")
        self.decodes.append([(p.seq, self.seqs[p.seq].n_past, tuple(p.tokens)) for p in parts])
        return [self._tree(p) if p.parents is not None
                else self.seqs[p.seq].eval(p.tokens, p.logits).copy() for p in parts]

    def _tree(self, p) -> np.ndarray:
        """A tree part: one row per node, from the node's own path (the root's eval)."""
        parents = list(p.parents)
        leaves = len(set(range(len(parents))) - set(parents[1:]))
        if leaves > self.tree_leaves or parents[0] != -1 or any(
                not 0 <= q < j for j, q in enumerate(parents) if j):
            raise BackendError(f"not a tree of at most {self.tree_leaves} leaves: {parents}")
        self.trees.append((p.seq, tuple(p.tokens), tuple(parents)))
        be = self.seqs[p.seq]
        first = be.eval([p.tokens[0]], "last").copy()
        base = list(be.tokens)
        rows = np.empty((len(p.tokens), self.model.n_vocab), dtype=np.float32)
        rows[0] = first[0]
        for j in range(1, len(p.tokens)):
            path, q = [], j
            while q > 0:
                path.append(p.tokens[q])
                q = parents[q]
            rows[j] = self.model.row(base + path[::-1])
        self._pending[p.seq] = (list(p.tokens), parents)
        return rows

    def keep_tree(self, seq: int, nodes: Sequence[int]) -> None:
        tokens, parents = self._pending.pop(seq)
        prev = 0
        for j in nodes:
            if parents[j] != prev:
                raise BackendError(f"keep_tree: {list(nodes)} is not a path from the root")
            prev = j
        self.kept.append(tuple(nodes))
        if nodes:
            self.seqs[seq].eval([tokens[j] for j in nodes], "none")


class RandomDrafter(DrafterBase):
    """Proposes junk tokens from its own np.random.Generator: the target never keeps one.

    In rejection mode it sends an honest q: uniform over the junk ids.
    """

    name = "random"
    capabilities = Capabilities(provides_q=True)

    def __init__(self, n_vocab: int, seed: int = 0) -> None:
        self.ids = np.arange(n_vocab - JUNK, n_vocab, dtype=np.int64)
        self.gen = np.random.default_rng(seed)
        self.rejection = False

    def begin(self, prompt: Sequence[int], sampling: SamplingParams, params: DraftParams,
              **guide) -> None:
        self.rejection = params.mode is VerifyMode.REJECTION and not sampling.greedy

    def propose(self, history: Sequence[int], k: int) -> Draft:
        toks = [int(t) for t in self.gen.choice(self.ids, size=k)]
        if not self.rejection:
            return Draft(toks)
        q = np.full(len(self.ids), 1.0 / len(self.ids), dtype=np.float32)
        return Draft(toks, [SparseDraft(t, self.ids.copy(), q.copy()) for t in toks])

    def learn(self, history: Sequence[int], accepted: int, appended: int) -> None:
        pass

    def end(self) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return {}


class FixedDrafter(DrafterBase):
    """Proposes a function of the history (tests choose exactly what is drafted)."""

    name = "fixed"

    def __init__(self, fn) -> None:
        self.fn = fn

    def begin(self, prompt: Sequence[int], sampling: SamplingParams, params: DraftParams,
              **guide) -> None:
        pass

    def propose(self, history: Sequence[int], k: int) -> Draft:
        return Draft(list(self.fn(history, k)))

    def learn(self, history: Sequence[int], accepted: int, appended: int) -> None:
        pass

    def end(self) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return {}


class SpyDrafter(DrafterBase):
    """Wraps a drafter and records every call; `extra` tokens beyond k are asked for.
    It declares what the drafter it wraps declares."""

    def __init__(self, inner, extra: int = 0, on_propose=None) -> None:
        self.inner, self.extra, self.on_propose = inner, extra, on_propose
        self.name = f"spy:{inner.name}"
        caps = inner.capabilities
        self.capabilities = Capabilities(provides_q=caps.provides_q,
                                         deterministic=caps.deterministic)
        self.calls: list[str] = []
        self.proposals: list[tuple[tuple[int, ...], int, tuple[int, ...]]] = []
        self.learned: list[tuple[int, int, int]] = []

    def begin(self, prompt: Sequence[int], sampling: SamplingParams, params: DraftParams,
              **guide) -> None:
        self.calls.append("begin")
        self.inner.begin(prompt, sampling, params)

    def propose(self, history: Sequence[int], k: int) -> Draft:
        self.calls.append("propose")
        if self.on_propose is not None:
            self.on_propose(history)
        draft = self.inner.propose(history, k + self.extra)
        self.proposals.append((tuple(history), k, tuple(draft.tokens)))
        return draft

    def learn(self, history: Sequence[int], accepted: int, appended: int) -> None:
        self.calls.append("learn")
        self.learned.append((len(history), accepted, appended))
        self.inner.learn(history, accepted, appended)

    def end(self) -> None:
        self.calls.append("end")
        self.inner.end()

    def stats(self) -> dict[str, float]:
        return self.inner.stats()


class AlwaysAcceptVerifier(Verifier):
    """Deliberately broken: keeps every draft token, then the target's bonus sample.

    Its output is distributed as the draft's, not the target's: the distribution
    tests must catch it.
    """

    def verify(self, rows: np.ndarray, history: Sequence[int], draft: Sequence[int],
               sparse: Sequence[SparseDraft] | None = None) -> Outcome:
        ctx = [*history, *draft]
        return Outcome(len(draft), self.sample(rows[len(draft)], ctx))


# ------------------------------------------------------------------ reference and statistics


def reference_probs(row: np.ndarray, params: SamplingParams,
                    history: Sequence[int] = ()) -> np.ndarray:
    """llama.cpp's sampler chain written out plainly: (V,) float64 probabilities.

    penalties (last repeat_last_n tokens, -1 = all: positive logits divided,
    negative multiplied) -> top-k -> top-p (smallest prefix whose cumulative
    probability, at temperature 1 over the top-k survivors, reaches p) ->
    min-p (probability >= min_p * the largest) -> temperature -> softmax.
    Filtered tokens get probability 0. An independent oracle for sampling.py.
    """
    logits = np.asarray(row, dtype=np.float64).copy()
    v = logits.shape[0]
    if params.repeat_penalty != 1.0 and params.repeat_last_n != 0:
        n = len(history) if params.repeat_last_n < 0 else params.repeat_last_n
        for t in set(list(history)[-n:] if n else []):
            x = logits[t]
            logits[t] = x / params.repeat_penalty if x > 0 else x * params.repeat_penalty
    order = sorted(range(v), key=lambda i: -logits[i])
    if 0 < params.top_k < v:
        order = order[:params.top_k]
    if params.top_p < 1.0:
        e = np.exp(logits[order] - logits[order[0]])
        cum, keep = 0.0, len(order)
        for i, p in enumerate(e / e.sum()):
            cum += p
            if cum >= params.top_p:
                keep = i + 1
                break
        order = order[:keep]
    if params.min_p > 0.0:
        top = logits[order[0]]
        order = [i for i in order if np.exp(logits[i] - top) >= params.min_p]
    out = np.zeros(v)
    if params.temperature <= 0.0:
        out[order[0]] = 1.0
        return out
    z = logits[order] / params.temperature
    e = np.exp(z - z.max())
    out[order] = e / e.sum()
    return out


def tv_distance(p: np.ndarray, q: np.ndarray) -> float:
    """Total-variation distance between two distributions on the same support."""
    return 0.5 * float(np.abs(np.asarray(p, float) - np.asarray(q, float)).sum())


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom, cells with expected < 5 pooled.

    An observed count where the expected probability is 0 makes it infinite.
    """
    counts = np.asarray(counts, dtype=float).ravel()
    probs = np.asarray(probs, dtype=float).ravel()
    n = counts.sum()
    if np.any(counts[probs <= 0] > 0):
        return float("inf"), 1
    expected = probs * n
    big = expected >= 5
    obs = list(counts[big])
    exp = list(expected[big])
    if (~big).any() and expected[~big].sum() > 0:
        obs.append(counts[~big].sum())
        exp.append(expected[~big].sum())
    obs_a, exp_a = np.array(obs), np.array(exp)
    return float(((obs_a - exp_a) ** 2 / exp_a).sum()), len(obs) - 1


def chi_square_limit(df: int) -> float:
    """A rejection threshold with a false-alarm probability below about 5e-6 for df 3..30.

    df + 6 sqrt(2 df) + 10, i.e. well past six standard deviations of the
    chi-square distribution (mean df, variance 2 df) at these sizes.
    """
    return df + 6.0 * (2.0 * df) ** 0.5 + 10.0


class Forward(Transport):
    """A transport whose hooks are the branch's own `_live`, `_post`, `_open` and `_await`
    (a test scripts the drafter's end by subclassing BranchDrafter with them)."""

    def live(self) -> bool:
        return self.branch._live()

    def post(self, msg) -> None:
        self.branch._post(msg)

    def open(self, session: int, history: list[int]) -> None:
        self.branch._open(session, history)

    def wait(self, left_s: float) -> None:
        self.branch._await(left_s)
