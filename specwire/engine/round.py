"""One sequence's part of a step: plan it, draft it, then verify and emit its rows.

A decoding sequence's part is a round, [last token, d1..dk]: its policy picks k
(`plan`), its drafter fills it (`ask`, `drafting`, `drafted`), and once the step's
decode is in, `take` verifies the rows, rolls the KV cache back to what was kept,
emits, and tells the policy and the drafter. A sequence still reading its prompt
gets a chunk of it instead; its last chunk's row gives the first token. With an
empty draft a round is a plain decoding step.
"""

from __future__ import annotations

import time

import numpy as np

from specwire.backend.batch import Part
from specwire.drafters.base import Draft
from specwire.drafters.lockstep import Drafting
from specwire.engine import tree_round
from specwire.engine.context_shift import plan_shift, shifted
from specwire.engine.sequence import Round, SequenceState
from specwire.policy.adaptive import ALONE, Peers


def plan(s: SequenceState, space: int, batch_tokens: int, peers: Peers = ALONE) -> Part | None:
    """This step's part, at most `space` tokens (what the decode has left of -b); None
    to sit this step out. Ends the sequence (done) when it has nothing more to do.
    batch_tokens: what the other sequences put into the same decode, peers: those that
    draft in lockstep with it (the adaptive policy's concern)."""
    if s.stopped:
        s.done = True
        return None
    if space <= 0:
        return None
    prompt = s.req.prompt
    if s.prefilled < len(prompt):
        chunk = prompt[s.prefilled:s.prefilled + space]
        last = s.prefilled + len(chunk) == len(prompt)
        return Part(s.seq, chunk, "last" if last else "none")
    remaining = s.req.n_predict - len(s.tokens)
    room = s.target.n_ctx - len(s.history)
    if room <= 0 < remaining and s.context_shift:
        room = shift_context(s)
    if remaining <= 0 or room <= 0:
        s.stop_type = "limit"
        s.truncated = s.truncated or (room <= 0 and remaining > 0)
        s.done = True
        return None
    # A round appends up to k + 1 tokens; plain decoding stops at a full context.
    k = min(s.policy.choose(min(remaining, room) - 1, batch_tokens=batch_tokens, peers=peers),
            space - 1)
    now = time.perf_counter()
    s.round = Round(Draft(), max(k, 0), now, now)
    return Part(s.seq, [s.history[-1]], "all")


def shift_context(s: SequenceState) -> int:
    """A full context shifted as llama-server does (context_shift.py); the room it made
    (0 when nothing can be dropped). The drafter starts again on the shifted history."""
    target, req = s.target, s.req
    shift = plan_shift(target.n_past, len(req.prompt), req.n_keep, target.n_ctx,
                       bool(getattr(target, "adds_bos", False)), req.n_discard)
    if shift is None:
        return 0
    target.shift(shift.keep, shift.discard)
    s.history = shifted(s.history, shift)
    s.truncated = True
    s.shifts += 1
    s.drafter.rebase(s.history)
    return target.n_ctx - len(s.history)


def ask(s: SequenceState) -> None:
    """The round's draft request goes out now (a remote drafter's verdict and k), before
    any sequence of the step waits for its draft."""
    s.drafter.ask(s.history, s.round.k)


def drafting(s: SequenceState) -> Drafting | Draft:
    """The round's draft: in progress, for the step to draft together with the other
    sequences' (a draft model's sequence), or done now (any other drafter)."""
    s.round.started = time.perf_counter()
    return s.drafter.drafting(s.history, s.round.k)


def drafted(s: SequenceState, part: Part, run: Drafting | Draft) -> None:
    """The round's draft is in: it follows the last token in this step's part."""
    rnd = s.round
    draft = s.drafter.drafted(run, rnd.k)
    if len(draft) > rnd.k:
        draft = draft.cut(rnd.k)
    if len(draft) < s.req.draft.n_min:
        draft = Draft()
    rnd.draft, rnd.drafted = draft, time.perf_counter()
    if isinstance(run, Drafting):
        rnd.own_s, rnd.steady_s = run.spent, run.steady_s
    rnd.tree = tree_round.plan(s.batch, part, draft, s.verifier.mode, s.policy, s.costs,
                               s.tree_yield)


def take(s: SequenceState, rows: np.ndarray, decode_s: float) -> None:
    """The step's rows for this sequence's part: the first token after the prompt, or
    the round verified, rolled back and emitted."""
    if s.round is None:
        _prefilled(s, rows)
    else:
        _verify(s, rows, decode_s)


def _prefilled(s: SequenceState, rows: np.ndarray) -> None:
    """A prompt chunk is in the cache; after the last one, the first token."""
    prompt = s.req.prompt
    s.prefilled = s.target.n_past
    if s.prefilled < len(prompt):
        return
    first = s.verifier.sample(rows[-1], prompt)
    s.t1 = time.perf_counter()
    s.stats.prompt_ms += 1000 * (s.t1 - s.t0)
    s.history = [*prompt, first]
    s.out.extend(s.emit([first]))


def _verify(s: SequenceState, rows: np.ndarray, decode_s: float) -> None:
    """Verify the round's draft, keep what passed, emit, and teach policy and drafter."""
    st = s.stats
    rnd, s.round = s.round, None
    tv = time.perf_counter()
    s.decode_s += decode_s
    draft, history = rnd.draft, s.history
    if rnd.tree is None:
        verdict = s.verifier.verify(rows, history, draft.tokens, draft.sparse)
        s.target.truncate(len(history) + verdict.accepted)
        kept = tree_round.Kept([*draft.tokens[: verdict.accepted], verdict.token],
                               verdict.accepted, verdict.accepted)
    else:
        kept = tree_round.verify(s.batch, s.seq, s.verifier, rows, history, rnd.tree,
                                 s.tree_yield)
    # Verification: the step's decode and this sequence's own check, not the time the
    # other sequences of the step spent drafting or verifying.
    verify_s = decode_s + time.perf_counter() - tv
    st.draft_ms += 1000 * (rnd.drafted - rnd.started)
    st.verify_ms += 1000 * verify_s
    if not draft.tokens:
        st.plain_steps += 1
        st.plain_ms += 1000 * verify_s
    st.record_round(len(draft), kept.accepted, rnd.k)
    # A tree's decode was longer than the chain's: the verification line learns its size.
    extra = {} if rnd.tree is None else {"batch_tokens": len(rnd.tree) - 1 - len(draft)}
    s.policy.observe(len(draft), kept.accepted, rnd.draft_s, verify_s,
                     draft.confidence, steady_s=rnd.steady_s, **extra)
    if draft.tokens and s.tree_yield is not None:
        s.tree_yield.observe_round(len(kept.tokens), rnd.drafted - rnd.started + verify_s)
    appended = kept.tokens
    new = s.emit(appended)
    history.extend(new)
    s.out.extend(new)
    if s.stop_type == "none" and not s.stopped:
        s.drafter.learn(history, kept.chain, len(appended))
