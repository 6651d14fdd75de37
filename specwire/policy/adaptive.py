"""Draft-length policies: how many tokens to ask the drafter for each round.

`fixed` always asks for --draft-max. `adaptive` estimates online what a round yields,
E(k) = (1 - a^(k+1)) / (1 - a), and costs, T(k) = t_d(k) + t_v(k + 1) plus a part that
does not depend on k (the draft model's first evaluation, a synchronous round trip), and
asks for the k that maximises E / T: the model `specwire plan` uses (policy/throughput.py).
With a draft model it also stops each draft token by token in place of --draft-p-min, while
P(every token so far is kept) stays above stop_threshold(), by the draft's confidence
calibrated against what verification kept (Calibration); a synchronous draft node is sent
the threshold (link/session.py). docs/planner.md has the online model.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from specwire.policy import throughput
from specwire.policy.costs import DraftCost, VerifyCost
from specwire.policy.scoped import Scoped
from specwire.policy.throughput import VerifyCurve

#: Bins of a draft model's top probability, for calibrating it against acceptance.
CONFIDENCE_EDGES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99)
_MIDS = tuple((lo + hi) / 2 for lo, hi in zip((0.0, *CONFIDENCE_EDGES), (*CONFIDENCE_EDGES, 1.0),
                                               strict=True))


def _bin(confidence: float) -> int:
    return bisect.bisect_right(CONFIDENCE_EDGES, confidence)


@dataclass(slots=True)
class Calibration:
    """P(the target keeps a draft token | the draft's top probability), learnt per bin.

    A draft's top probability is not that chance (this pair's draft is underconfident:
    tokens it gives 0.6-0.75 are kept about 9 times in 10), so it is counted: per bin,
    weighted tokens judged (`seen`) and kept (`hits`). The prior is sqrt(p) from 2
    pseudo-tokens, optimistic enough that low bins get tried and learnt. A draft node's
    sessions share one, updated from several threads without a lock: a lost update
    only slows learning.
    """

    alpha: float = 0.01
    seen: list[float] = field(default_factory=lambda: [2.0] * len(_MIDS))
    hits: list[float] = field(default_factory=lambda: [2.0 * math.sqrt(m) for m in _MIDS])

    def __call__(self, confidence: float) -> float:
        b = _bin(confidence)
        return self.hits[b] / self.seen[b]

    def learn(self, confidence: Sequence[float], kept: int) -> None:
        """The first `kept` tokens were kept and the next one, if any, was not; tokens
        after a rejection were never judged and teach nothing."""
        w = 1.0 - self.alpha
        for j, p in enumerate(confidence[: kept + 1]):
            b = _bin(p)
            self.seen[b] = w * self.seen[b] + 1.0
            self.hits[b] = w * self.hits[b] + (1.0 if j < kept else 0.0)


@dataclass(slots=True)
class CalibratedStop:
    """A draft's stop rule: propose token i while P(it and every token before it in this
    draft are kept) >= threshold. Called with i = 0, 1, ... and each token's confidence."""

    calibration: Calibration
    threshold: float = 0.0
    kept: float = 1.0  # P(every token proposed so far in this draft is kept)

    def __call__(self, i: int, confidence: float) -> bool:
        if i == 0:
            self.kept = 1.0
        kept = self.kept * self.calibration(confidence)
        if kept < self.threshold:
            return False
        self.kept = kept
        return True


#: The verification curve assumed before the policy has timed one.
_ASSUMED = VerifyCurve()


@dataclass(frozen=True, slots=True)
class Peers:
    """The sequences of a step whose drafts share this sequence's draft context, drafted
    in lockstep (one draft decode per position for all): `after` of them choose after
    this one and are taken to choose alike; of those that chose before, the longest
    draft asked (`paid`, whose decodes the step runs anyway) and how many draft."""

    after: int = 0
    paid: int = 0
    drafting: int = 0

    @property
    def sharing(self) -> int:
        """Sequences drafting in lockstep if this one drafts."""
        return 1 + self.after + self.drafting


ALONE = Peers()


@dataclass(slots=True)
class FixedPolicy:
    n_max: int

    def start(self) -> None:
        pass

    def choose(self, limit: int, batch_tokens: int = 0, peers: Peers = ALONE) -> int:
        """--draft-max, whatever else shares the target's decode."""
        return min(self.n_max, limit)

    def observe(self, drafted: int, accepted: int, draft_s: float, verify_s: float,
                confidence: list[float] | None = None, batch_tokens: int = 0,
                steady_s: float | None = None) -> None:
        pass


@dataclass(frozen=True, slots=True)
class AdaptiveParams:
    """The adaptive policy's hyperparameters (what it learns is AdaptiveState)."""

    alpha: float = 0.15  # the weight of the newest round in the estimates
    probe_every: int = 32  # most rounds at k = 0 between probes, before any backoff
    probe_backoff_max: int = 8  # the most the probe interval is multiplied by
    #: the most of its time a sequence spends on probes that do not pay (their catch-up)
    probe_budget: float = 0.01
    margin: float = 0.2  # how much better plain steps must look to stop drafting early on
    resume_gain: float = 0.05  # how much better drafting must look to start from plain steps
    settle: int = 12  # rounds that asked the drafter before the margin is dropped
    trial_rounds: int = 4  # rounds judged with the margin after a probe whose tokens were kept


@dataclass(slots=True)
class AdaptiveState:
    """What the adaptive policy has learnt (its estimates outlive a request), and where
    its sequence and the round in progress stand."""

    accepted: float = 1.5  # pseudo-counts: start optimistic (a = 0.75), learn fast
    rejected: float = 0.5
    continued: float = 4.0  # drafted tokens, and rounds the drafter ended early (g = 0.9)
    stopped: float = 0.5
    probe_backoff: int = 1  # the interval's multiplier: doubles per probe that did not pay
    probed: bool = False  # the last round asked was a probe
    probing: bool = False  # the round in progress is a probe
    idle_s: float = 0.0  # this sequence's share of the plain steps since the last probe
    idle_rounds: int = 0
    trial: int = 0  # rounds still judged with the margin after a probe whose tokens were kept
    #: probes ask for 2 tokens at least: a drafter that measures its draft without the
    #: catch-up (steady_s, a lockstep draft model) needs a second decode for it
    probing_measures: bool = False
    asked_rounds: int = 0
    kept_any: bool = False  # a drafted token was ever kept (else no benefit of the doubt)
    k: int = 0  # the draft length asked in the round in progress
    warm: bool = False  # the previous round asked for a draft
    #: tokens the drafter lacks: since it was last asked in this sequence, or since the
    #: request began (its prompt's tokens missing from the drafter's cache included)
    skipped: int = 0
    begun: bool = False  # the drafter was asked in this sequence (it has the prompt)
    limit: int = 0  # the most tokens the request may still produce (choose's limit + 1)
    round_rate: float = 0.0  # expected tokens/s of the round in progress
    batch_tokens: int = 0  # tokens the other sequences put into the round's decode
    peers: Peers = ALONE  # the sequences drafting in lockstep with it in the round's step


@dataclass(slots=True)
class AdaptivePolicy:
    """Online estimates of a round's yield and cost; chooses k by expected throughput.

    The policy is its hyperparameters (`params`, frozen), what it has learnt and where
    its round stands (`state`), the cost models it reads (`costs`, `draft`) and the
    confidence calibration of its stop rule; its methods are the rule.

    Asked for k tokens, a drafter may stop sooner (a draft model at --draft-p-min,
    a pipelined drafter with fewer tokens ready). So two chains are estimated:
    the drafter goes on to a next token with probability g, and a drafted token
    is accepted with probability a. A round asked for k then drafts
    E[D] = g + g^2 + ... + g^k tokens, keeps (g a) + ... + (g a)^k of them plus
    the target's own token, and costs c + d E[D] (drafter: per round and per
    token, fitted as a line) + v0 + v1 E[D] (verification, also a line).

    Estimates are exponentially weighted (params.alpha for the newest round)
    so that the policy follows a prompt that turns from copying to free text.
    They outlive a request (see PolicyMemory): the costs are the machine's, and
    the last request's acceptance is a better first guess than a fixed prior.
    A round that follows a round without a draft is left out of the drafter's
    cost: it first caught up with the tokens it had not seen (the prompt, or a
    stretch of plain steps), work that a steady run of rounds does not repeat.
    What a stretch of plain steps made it redo is charged to plain steps instead
    (catch_up_cost): with a draft model, stopping to draft is not free. What the
    first round of a request pays to catch up with the prompt is learnt apart
    (prompt_cost), per token: it prices the first draft of a request in a batch,
    and every probe.

    In a batch, probes of a drafter that does not pay are also rationed by what
    they cost: with a draft model a probe first catches up with everything the
    sequence decoded plainly (the prompt too), which can take as long as many
    plain steps, and every sequence waits for it. A probe waits until the plain
    rounds since the last one, at this sequence's share of each step, add up to
    1 / probe_budget times its expected cost, so that probing costs at most about
    probe_budget of the time. Such a probe drafts the tokens it was asked for
    whatever the stop rule says, or it would teach nothing; one whose tokens are kept is
    followed by a few rounds judged with the early margin (`trial`), so that the
    drafter's cost is measured on rounds without a catch-up before it is judged.

    Within a round, a draft model in this process asks keep_drafting before each
    token; the policy calibrates its confidence from what verification kept.
    """

    n_max: int
    params: AdaptiveParams = AdaptiveParams()
    state: AdaptiveState = field(default_factory=AdaptiveState)
    #: the draft backend's drafting cost, read to price rounds and fed by this policy's
    #: caught-up rounds, unless the drafter stops its own drafts (drafter_stops: the
    #: hybrid times its model itself, a lookup costs nothing); Engine.policy hands the
    #: engine's (policy/costs.py)
    draft: DraftCost = field(default_factory=DraftCost)
    #: the target's verification cost, read to price rounds (policy/costs.py)
    costs: VerifyCost = field(default_factory=VerifyCost)
    #: no engine handed `costs`: observe feeds it from this policy's rounds (Engine.policy
    #: hands the engine's, which every decode feeds)
    own_costs: bool = True
    calibration: Calibration = field(default_factory=Calibration)
    stop: CalibratedStop = field(init=False)
    #: the drafter prices each of its tokens and stops where they stop paying, at no cost
    #: to ask (the n-gram lookup): ask it for the most, as its drafts are not the geometric
    #: chain this model assumes (a long match is right all the way or not). The engine
    #: sets it from the drafter's declared Capabilities.stops, for a request.
    drafter_stops: bool = False

    def __post_init__(self) -> None:
        self.stop = CalibratedStop(self.calibration)

    def start(self, behind: int = 0) -> None:
        """A new sequence: keep the estimates, forget the round in progress. The rounds
        since the last probe carry over, so that probes go on at their (backed-off)
        interval across requests shorter than it. behind: the prompt's tokens that the
        drafter will have to catch up with when first asked."""
        st = self.state
        st.k, st.warm = 0, False
        st.skipped, st.begun = behind, False

    def behind(self, tokens: int) -> None:
        """The drafter lacks this many of the new request's prompt tokens (known once it
        has begun the sequence, after start)."""
        st = self.state
        if not st.begun:
            st.skipped = tokens

    @property
    def acceptance(self) -> float:
        """a: a drafted token is kept, given the ones before it were."""
        st = self.state
        return st.accepted / (st.accepted + st.rejected)

    @property
    def continuation(self) -> float:
        """g: the drafter produces a next token when asked for one more."""
        st = self.state
        return st.continued / (st.continued + st.stopped)

    def draft_cost(self, drafted: float) -> float:
        """Seconds the target waits for a round that drafts this many tokens."""
        return self.draft.seconds(drafted)

    def verify_cost(self, n: float) -> float:
        """t_v(n) in seconds: a line through every verification seen, so that one slow
        round at a batch size the policy then avoids cannot stick. Before any, the
        throughput model's assumed curve with a step as the unit (its slope is also the
        line's prior until a second size is seen)."""
        got = self.costs.seconds(n)
        return _ASSUMED.cost(n) if got is None else got

    def catch_up_cost(self) -> float:
        """Seconds per plain step that the drafter spends catching up once asked again: a
        draft model evaluates the tokens it missed; a remote or n-gram drafter, nothing."""
        return self.draft.catch_up()

    def prompt_cost(self) -> float:
        """Seconds per prompt token that the drafter's first round of a request spends
        catching up (0 before it has been seen)."""
        return self.draft.prompt()

    def behind_s(self) -> float:
        """Seconds the next round that asks the drafter spends catching up first."""
        st = self.state
        if st.warm:
            return 0.0
        per = self.catch_up_cost() if st.begun else self.prompt_cost()
        return per * st.skipped

    def rate(self, k: int, batch_tokens: int | None = None) -> float:
        """Expected tokens per second of the target decode in which this sequence's round
        asks for k tokens beside batch_tokens tokens of other sequences (default: what
        choose was last told). Alone this is throughput.round_rate; in a batch it is
        throughput.step_rate, which compares the whole step's tokens and time, because
        this sequence's drafting and catch-up hold up every sequence of the step."""
        st = self.state
        b = st.batch_tokens if batch_tokens is None else batch_tokens
        draft_s = self.draft_cost if k else self._catch_up_s
        if b == 0 and not (k and self._reads_prompt()):
            return throughput.round_rate(self.acceptance, k, draft_s, self.verify_cost,
                                         self.continuation)
        # Alone, what plain steps make the drafter redo is charged to them; in a batch the
        # rounds that ask a drafter which has fallen behind pay for it, spread over what
        # the request may still produce (a steady run of drafts pays it once).
        behind = 0.0
        if k:
            tokens = throughput.expected_tokens(self.continuation * self.acceptance, k)
            behind = self.behind_s() * min(1.0, tokens / max(1, st.limit))
        peers = st.peers
        if peers == ALONE:
            return throughput.step_rate(self.acceptance, k, self.draft_cost,
                                        self.verify_cost, self.continuation, b, behind)
        # In lockstep a draft position is one draft decode for every drafting sequence.
        together = self.draft.lockstep(peers.sharing)

        def lockstep_s(drafted: float) -> float:
            return self.draft_cost(drafted) * together

        g = self.continuation
        paid = lockstep_s(throughput.drafted_tokens(g, peers.paid)) if peers.paid else 0.0
        return throughput.step_rate(self.acceptance, k, lockstep_s, self.verify_cost, g, b,
                                    behind, peers.after, paid)

    def _reads_prompt(self) -> bool:
        """The request's first draft is still to come, and its drafter must read the
        prompt first: alone, drafting must pay for that read over what the request may
        still produce (throughput.request_rate), or this request runs plainly."""
        st = self.state
        return not st.begun and not st.warm and self.behind_s() > 0.0

    def _catch_up_s(self, _drafted: float) -> float:
        return self.catch_up_cost()

    def choose(self, limit: int, batch_tokens: int = 0, peers: Peers = ALONE) -> int:
        """The k with the best expected rate, at most limit. batch_tokens: how many tokens
        other sequences put into the same target decode (0 alone). Alone a round pays a
        whole step, which drafting spreads over several tokens; in a big batch the step
        is paid anyway, so drafting is chosen only where it still beats the batch's own
        rate. peers: the sequences of the step that draft in lockstep with this one (their
        draft decodes are shared). A drafter that stops by itself (drafter_stops) is asked
        for the most."""
        st = self.state
        st.batch_tokens, st.limit = batch_tokens, limit + 1
        st.peers = peers if batch_tokens else ALONE
        st.probing = False
        if self.drafter_stops and limit > 0:
            st.k = min(self.n_max, limit)     # the drafter cuts its own draft
        else:
            st.k = self._best(min(self.n_max, limit))
        st.round_rate = self.rate(st.k) if st.k else 0.0
        return st.k

    def stop_threshold(self) -> float:
        """The least P(every token so far is kept) for which one more draft token pays:
        the round's expected rate x (one more draft token + the extra verification of a
        batch one longer). Both costs are lines, so the threshold holds for every i.
        Before a round is chosen (a draft node's Open), the rate of a full-length round."""
        per_token = self.draft.per_token()
        if self.state.peers != ALONE:
            # A lockstep position's decode serves every draft still going at it: one more
            # token of this draft costs its share of that decode.
            live = max(1, self.draft.live)
            per_token *= self.draft.lockstep(live) / live
        return self.round_rate() * (per_token + self.verify_cost(2) - self.verify_cost(1))

    def round_rate(self) -> float:
        """The expected tokens/s of the round in progress (before one is chosen, a
        full-length round's)."""
        return self.state.round_rate or self.rate(self.n_max)

    def keep_drafting(self, i: int, confidence: float) -> bool:
        """Should a draft model propose token i (0-based) of this round, given its top
        probability? Yes while P(it and every token before it kept) >= stop_threshold."""
        st = self.state
        if st.probing and st.batch_tokens:
            self.stop.threshold = 0.0
        elif i == 0 or st.peers != ALONE:   # in lockstep, as the drafts beside it stop
            self.stop.threshold = self.stop_threshold()
        return self.stop(i, confidence)

    def _best(self, limit: int) -> int:
        st = self.state
        rates = [self.rate(k) for k in range(limit + 1)]
        best_k = 0
        for k in range(1, limit + 1):
            if rates[k] > rates[best_k] * 1.0001:
                best_k = k
        if limit == 0:      # the request's last token: nothing to draft, nothing learnt
            if not st.batch_tokens:
                st.idle_rounds = 0    # alone, as before: probes restart their count
            return 0
        # From plain steps (or a probe), drafting must look clearly better to resume: on a
        # loaded machine one fast verification can flatten the fitted curve, and a
        # useless drafter's few-percent "gain" is then noise that costs real rounds.
        if best_k > 0 and (not st.warm or st.probed) and \
                rates[best_k] < rates[0] * (1.0 + self.params.resume_gain):
            best_k = 0
        if best_k > 0:
            st.idle_rounds, st.idle_s = 0, 0.0
            st.probed, st.probe_backoff = False, 1
            return best_k
        try_k = max(range(1, limit + 1), key=rates.__getitem__)
        if st.probing_measures:
            try_k = max(try_k, min(2, limit))   # a second token's decode prices drafting
        # Early on, stop drafting only when plain steps look clearly better: the first
        # estimates are noisy, and a wrong stop costs many rounds before a probe. Not for
        # a drafter none of whose tokens was ever kept: a useless one would pay each of
        # those rounds, and a probe soon recovers a merely unlucky one. (In a batch a
        # probe is no start: its outcome is judged without the margin.)
        early = st.warm and (st.asked_rounds < self.params.settle and st.kept_any and (
            not st.probed or not st.batch_tokens) or st.trial > 0)
        if early and rates[try_k] * (1.0 + self.params.margin) >= rates[0]:
            st.idle_rounds = 0
            return try_k
        # Probe now and then, or the estimates could never recover: soon when drafting
        # looks almost worth it, rarely when it looks hopeless, and more rarely after
        # each probe that left drafting not worth it (a useless drafter's probes are
        # pure cost; a probe whose tokens are kept resets the interval).
        if st.probed:
            st.probed = False
            st.probe_backoff = min(2 * st.probe_backoff, self.params.probe_backoff_max)
        # In a batch the others' tokens dilute the gap; probe by this sequence's own share.
        gap = min(1.0, (1.0 - rates[try_k] / rates[0]) * (1 + st.batch_tokens))
        st.idle_rounds += 1
        interval = min(self.params.probe_every, max(2, int(4 * self.params.probe_every * gap)))
        if st.idle_rounds < interval * st.probe_backoff:
            return 0
        if st.batch_tokens and st.idle_s * self.params.probe_budget < self.probe_cost(try_k):
            return 0
        if not st.batch_tokens and self._reads_prompt() and rates[try_k] < rates[0] < \
                throughput.round_rate(self.acceptance, try_k, self.draft_cost,
                                      self.verify_cost, self.continuation):
            return 0    # drafting would pay but for the prompt's read: a probe teaches nothing
        st.idle_rounds, st.idle_s, st.probed = 0, 0.0, True
        st.probing = True
        return try_k

    def probe_cost(self, k: int) -> float:
        """Seconds a probe asking for k tokens holds up its step: the drafter's catch-up
        and its draft."""
        return self.behind_s() + self.draft_cost(throughput.drafted_tokens(self.continuation, k))

    def observe(self, drafted: int, accepted: int, draft_s: float, verify_s: float,
                confidence: list[float] | None = None,
                batch_tokens: int | None = None, steady_s: float | None = None) -> None:
        """A round's outcome. verify_s is the whole target decode, which also carried
        batch_tokens tokens of other sequences (default: what choose was told): the
        verification line is fitted on the decode's size, so that choose can price what a
        round adds to it. steady_s: what the draft would have cost without its catch-up,
        where the drafter measured it (a lockstep draft of 2 tokens or more): a round
        after plain steps, a probe's, then teaches the drafter's cost too."""
        st = self.state
        w = 1.0 - self.params.alpha
        if confidence:
            self.calibration.learn(confidence, accepted)
        if st.k:
            st.asked_rounds += 1
            st.trial = max(0, st.trial - 1)
            st.continued = w * st.continued + drafted
            st.stopped = w * st.stopped + (1 if drafted < st.k else 0)
            if not st.warm and steady_s is not None:
                st.probing_measures = True
            if not self.drafter_stops:  # else it times its own draft model, if it has one
                if st.warm:
                    self.draft.observe(drafted, draft_s)
                elif steady_s is not None:
                    self.draft.observe(drafted, steady_s)
            if not st.warm and st.skipped and not self.drafter_stops and (
                    st.begun or steady_s is not None or self.draft.line.w > 0.0):
                # the first round after plain steps, or of the request (a prompt's read
                # once a draft's own time is known: else all of the round would count)
                steady = self.draft.seconds(drafted) if steady_s is None else steady_s
                extra = max(0.0, draft_s - steady)
                (self.draft.catch_up if st.begun else self.draft.prompt).add(st.skipped, extra)
            st.skipped, st.begun = 0, True
        else:
            st.skipped += 1
            b = st.batch_tokens if batch_tokens is None else batch_tokens
            st.idle_s += verify_s / (1 + b)
        if accepted:
            st.kept_any = True
        if st.probed and accepted:
            st.probed, st.probe_backoff = False, 1
            if st.batch_tokens:
                st.trial = self.params.trial_rounds
        if drafted:
            st.accepted = w * st.accepted + accepted
            st.rejected = w * st.rejected + (1 if accepted < drafted else 0)
        st.warm = st.k > 0
        if self.own_costs:
            b = st.batch_tokens if batch_tokens is None else batch_tokens
            self.costs.observe(1 + drafted + b, verify_s)


Policy = FixedPolicy | AdaptivePolicy


def make_policy(name: str, n_max: int) -> Policy:
    return AdaptivePolicy(n_max) if name == "adaptive" else FixedPolicy(n_max)


@dataclass(slots=True)
class PolicyMemory:
    """The policies an engine has used, kept from one request to the next.

    A server learns what drafting costs on its machine and how often its drafter
    is right once, not again at the start of every request; with 64-token
    replies the first rounds' guesses are a tenth of the work. One policy per
    (name, --draft-max) pair, since a request may change either, and per cache
    scope (policy/scoped.py): what one tenant's text taught never sets another's
    draft lengths. The costs are the machine's and shared.
    """

    #: per cache scope, (name, n_max) -> policy
    by_scope: Scoped[dict[tuple[str, int], Policy]] = field(
        default_factory=lambda: Scoped(dict))
    #: the target's verification cost, which they read (an engine's, fed by its decodes)
    costs: VerifyCost = field(default_factory=VerifyCost)
    #: the draft backend's drafting cost, which they read (one engine's sequences of a
    #: shared draft context share one)
    draft: DraftCost = field(default_factory=DraftCost)

    @property
    def policies(self) -> dict[tuple[str, int], Policy]:
        """Scope ""'s policies (a server without API keys or cache_salt has no other)."""
        return self.by_scope.get("")

    def policy(self, name: str, n_max: int, scope: str = "") -> Policy:
        """Scope's policy for (name, n_max), started for a new sequence."""
        policies = self.by_scope.get(scope)
        key = (name, n_max)
        if key not in policies:
            policies[key] = make_policy(name, n_max)
        policy = policies[key]
        policy.start()
        return policy
