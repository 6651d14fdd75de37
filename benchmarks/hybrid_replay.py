"""The hybrid drafter replayed against the target's own greedy output, on a modelled clock.

    python -m benchmarks.hybrid_replay [--prompts code,prose,qa] [--limit 4] [-n 96]

Greedy output does not depend on the drafter (lossless), so it is generated once per
prompt, and so is the draft model's greedy draft (with its per-token confidence) at
every position of it. Every configuration is then replayed against those records: each
round's draft is judged exactly and costs what it would on this pair, in plain target
steps: verifying n drafted tokens t_v(n + 1) (the target's measured curve), the model
catching up on m tokens d * t_v(m) and drafting k tokens d * (k - 1) more (d: a draft
evaluation over a target step, measured, or --draft-cost). The hybrid's own clock
(what it measures to choose) is this modelled clock, so its choices are those it would
make on a machine where these costs hold; a shared machine's noise is left out.

Besides the drafters as built (n-gram, model, hybrid, under the adaptive policy, and
under a fixed one), three references. `foresight`: each round the candidate (n-gram,
model, or a plain step) with the most tokens per step, the verdicts known in advance (a
per-round greedy choice, so a reference, not a strict bound). `two-branch`: both
candidates verified every round in one decode as two sequences sharing the last token
(t_v(n + k + 1)), the longer kept prefix taken, the model asked every round. And
`hybrid+both`: the hybrid's own rounds, but wherever it had both candidates, both
verified when that would have given more tokens per step (foresight again): what
verifying two branches could add to the hybrid at most.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

from benchmarks.ngram_replay import DEFAULT_CURVE, curve_cost, parse_curve
from specwire.config import DraftParams, SamplingParams
from specwire.drafters.base import Draft, DrafterBase
from specwire.drafters.hybrid import kept_prefix
from specwire.policy.adaptive import AdaptivePolicy, FixedPolicy

#: a draft evaluation over a target step, bundled pair, one thread each (q2_k vs F32)
DEFAULT_DRAFT_COST = 0.3


@dataclass(slots=True)
class Record:
    """A prompt, the target's greedy output, and the model's draft at each position."""

    prompt: list[int]
    output: list[int]
    drafts: list[list[int]]       # drafts[pos]: after prompt + output[:pos]
    confidence: list[list[float]]


@dataclass(slots=True)
class Clock:
    """The modelled clock, in plain target steps."""

    now: float = 0.0

    def perf_counter(self) -> float:
        return self.now


@dataclass(slots=True)
class Costs:
    verify: Callable[[int], float]   # t_v(n) in steps, n tokens in the batch
    draft: float                     # one draft evaluation in steps

    def catch_up(self, m: int) -> float:
        return self.draft * self.verify(m) if m > 0 else 0.0


class ReplayedModel(DrafterBase):
    """The draft model, its drafts read from the records, its time spent on the clock."""

    name = "model:replayed"

    def __init__(self, clock: Clock, costs: Costs) -> None:
        self.clock, self.costs = clock, costs
        self.record: Record | None = None
        self.cached: list[int] = []
        self.stop_rule = None
        self.spent = 0.0

    def begin(self, prompt, sampling, params, *, policy=None, grammar=None) -> None:
        self.stop_rule = policy.keep_drafting if policy is not None else None
        self.cached = []

    def cost(self, history: Sequence[int], n: int) -> float:
        same = 0
        for a, b in zip(self.cached, history, strict=False):
            if a != b:
                break
            same += 1
        return self.costs.catch_up(len(history) - same) + self.costs.draft * max(n - 1, 0)

    def propose(self, history: Sequence[int], k: int) -> Draft:
        rec = self.record
        pos = len(history) - len(rec.prompt)
        tokens, conf = rec.drafts[pos][:k], rec.confidence[pos][:k]
        if self.stop_rule is not None:
            n = 0
            while n < len(tokens) and self.stop_rule(n, conf[n]):
                n += 1
            tokens, conf = tokens[:n], conf[:n]
        spent = self.cost(history, len(tokens))
        self.clock.now += spent
        self.spent += spent
        self.cached = [*history, *tokens[:-1]]
        return Draft(list(tokens), confidence=list(conf))

    def learn(self, history, accepted, appended) -> None:
        """Nothing: the next proposal catches up by common prefix, as the model does."""

    def end(self) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return {}


@dataclass(slots=True)
class Replayed:
    tokens: int = 0
    steps: float = 0.0
    rounds: int = 0
    model_steps: float = 0.0
    counters: dict = field(default_factory=dict)

    @property
    def speedup(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0


def replay(records: Sequence[Record], make_drafter, policy, costs: Costs) -> Replayed:
    """The engine's loop on the modelled clock; one drafter and policy for all prompts."""
    clock = Clock()
    model = ReplayedModel(clock, costs)
    drafter = make_drafter(model)
    out = Replayed()
    greedy = SamplingParams(temperature=0.0)
    with mock.patch("specwire.drafters.hybrid.time", clock), \
            mock.patch("specwire.drafters.ngram.drafter.time", clock):
        for rec in records:
            model.record = rec
            adaptive = isinstance(policy, AdaptivePolicy)
            if adaptive:        # as the engine does: a drafter that stops is asked the most
                policy.drafter_stops = drafter.capabilities.stops
                # and the drafter reads the policy's cost models (the hybrid feeds the
                # model's drafting cost, which the policy reads)
                drafter.use_costs(policy.costs, policy.draft)
            policy.start()
            drafter.begin(rec.prompt, greedy, DraftParams(n_max=policy.n_max),
                          policy=policy if adaptive else None)
            history, pos, output = [*rec.prompt, rec.output[0]], 1, rec.output
            while pos < len(output):
                k = policy.choose(len(output) - pos - 1)
                t0 = clock.now
                draft = list(drafter.propose(history, k).tokens)[:k] if k > 0 else []
                draft_s = clock.now - t0
                kept = kept_prefix(draft, output[pos:])
                steps = costs.verify(len(draft) + 1)
                clock.now += steps
                policy.observe(len(draft), kept, draft_s, steps)
                new = output[pos:pos + kept + 1]
                history.extend(new)
                pos += len(new)
                drafter.learn(history, kept, len(new))
                out.rounds += 1
            drafter.end()
            out.tokens += len(output) - 1
    out.steps, out.model_steps = clock.now, model.spent
    out.counters = {k: v for k, v in drafter.stats().items() if k.endswith("rounds")}
    return out


def best_of(records: Sequence[Record], costs: Costs, k: int, both: bool) -> Replayed:
    """foresight (both=False): each round the best of n-gram, model and a plain step, known
    in advance; two-branch (both=True): n-gram and model verified together every round."""
    from specwire.drafters.ngram.drafter import NgramDrafter
    clock = Clock()
    model = ReplayedModel(clock, costs)
    ngram = NgramDrafter(cache=None, keep=0.3)
    out = Replayed()
    greedy = SamplingParams(temperature=0.0)
    for rec in records:
        model.record = rec
        model.begin(rec.prompt, greedy, DraftParams())
        ngram.begin(rec.prompt, greedy, DraftParams(n_max=k))
        history, pos, output = [*rec.prompt, rec.output[0]], 1, rec.output
        while pos < len(output):
            room = len(output) - pos - 1
            ng = list(ngram.propose(history, min(k, room)).tokens)
            md = rec.drafts[pos][:min(k, room)]
            kn, km = kept_prefix(ng, output[pos:]), kept_prefix(md, output[pos:])
            m_cost = model.cost(history, len(md))
            if both:
                spent = (m_cost if md else 0.0) + costs.verify(len(ng) + len(md) + 1)
                kept, asked = max(kn, km), bool(md)
            else:
                options = [(1.0 / costs.verify(1), 0, costs.verify(1), False),
                           ((kn + 1) / costs.verify(len(ng) + 1), kn, costs.verify(len(ng) + 1),
                            False),
                           ((km + 1) / (m_cost + costs.verify(len(md) + 1)), km,
                            m_cost + costs.verify(len(md) + 1), True)]
                _, kept, spent, asked = max(options if md else options[:2],
                                            key=lambda o: o[0])
            if asked:
                model.spent += m_cost
                model.cached = [*history, *md[:-1]]
            clock.now += spent
            new = output[pos:pos + kept + 1]
            history.extend(new)
            pos += len(new)
            ngram.learn(history, kn if kept == kn else 0, len(new))
            out.rounds += 1
        ngram.end()
        out.tokens += len(output) - 1
    out.steps, out.model_steps = clock.now, model.spent
    return out


class RecordingHybrid:
    """A HybridDrafter that notes, per round, both candidates and what it handed out."""

    def __new__(cls, ngram, model):
        from specwire.drafters.hybrid import HybridDrafter

        class Recording(HybridDrafter):
            def _hand_out(self, history, offer, draft, use_ngram):
                out = super()._hand_out(history, offer, draft, use_ngram)
                rec = self.model.record
                truth = rec.output[len(history) - len(rec.prompt):]
                self.rounds.append((truth, list(offer.tokens),
                                    None if draft is None else list(draft.tokens),
                                    list(out.tokens)))
                return out

        h = Recording(ngram, model)
        h.rounds = []
        return h


def with_both(records: Sequence[Record], costs: Costs, k: int) -> Replayed:
    """The hybrid's rounds, both candidates verified where that gives more per step."""
    from specwire.drafters.ngram.drafter import NgramDrafter
    made = []

    def make(model):
        made.append(RecordingHybrid(NgramDrafter(cache=None), model))
        return made[-1]
    out = replay(records, make, AdaptivePolicy(k), costs)
    for truth, ng, md, handed in made[0].rounds:
        if not ng or not md:
            continue
        alone = costs.verify(len(handed) + 1)
        both = costs.verify(len(ng) + len(md) + 1)
        kept_alone = kept_prefix(handed, truth)
        kept_both = max(kept_prefix(ng, truth), kept_prefix(md, truth))
        if (kept_both + 1) / both > (kept_alone + 1) / alone:
            out.steps += both - alone
            out.tokens += kept_both - kept_alone   # more tokens in these rounds' time
    return out


def configurations(k: int):
    """(label, drafter factory taking the replayed model, policy factory)."""
    from specwire.drafters.hybrid import HybridDrafter
    from specwire.drafters.ngram.drafter import NgramDrafter
    return [
        ("ngram", lambda m: NgramDrafter(cache=None), lambda: AdaptivePolicy(k)),
        ("model", lambda m: m, lambda: AdaptivePolicy(k)),
        ("model k fixed", lambda m: m, lambda: FixedPolicy(k)),
        ("hybrid", lambda m: HybridDrafter(NgramDrafter(cache=None), m),
         lambda: AdaptivePolicy(k)),
        ("hybrid k fixed", lambda m: HybridDrafter(NgramDrafter(cache=None), m),
         lambda: FixedPolicy(k)),
    ]


def report(sets: dict[str, list[Record]], points, draft_cost: float, k: int) -> None:
    costs = Costs(curve_cost(points), draft_cost)
    print("t_v(n)/t_v(1): " + ", ".join(f"{n}:{c:.2f}" for n, c in points)
          + f"; a draft evaluation = {draft_cost:.3f} steps; k <= {k}")
    names = [*sets, "all"]
    print(f"{'configuration':16s} " + " ".join(f"{n:>14s}" for n in names))
    everything = [r for recs in sets.values() for r in recs]
    rows = [(label, lambda recs, d=d, p=p: replay(recs, d, p(), costs))
            for label, d, p in configurations(k)]
    rows += [("foresight", lambda recs: best_of(recs, costs, k, False)),
             ("two-branch", lambda recs: best_of(recs, costs, k, True)),
             ("hybrid+both", lambda recs: with_both(recs, costs, k))]
    for label, run in rows:
        cells = []
        for name in names:
            r = run(everything if name == "all" else sets[name])
            extra = "/".join(str(int(v)) for v in r.counters.values())
            cells.append(f"{r.speedup:5.2f}x {extra:>7s}" if extra else f"{r.speedup:5.2f}x")
        print(f"{label:16s} " + " ".join(f"{c:>14s}" for c in cells))


def record(a) -> tuple[dict[str, list[Record]], tuple, float]:
    """Generate the records on the bundled pair, and measure the curve and d."""
    import time

    from specwire.assets.models import bundled_path
    from specwire.backend.llama import LlamaBackend
    from specwire.bench import prompts as prompt_sets
    from specwire.bench.calibrate import verify_curve
    from specwire.config import ModelParams
    from specwire.drafters.model import ModelDrafter
    from specwire.drafters.ngram.drafter import NgramDrafter
    from specwire.engine.engine import Engine, Request

    target = LlamaBackend(ModelParams(str(bundled_path("target")), n_ctx=2048,
                                      n_threads=a.threads))
    draft_be = LlamaBackend(ModelParams(str(bundled_path("draft")), n_ctx=2048,
                                        n_threads=a.threads))
    model = ModelDrafter(draft_be)
    model.stop_rule = lambda i, p: True
    engine = Engine(target, NgramDrafter(cache=None))
    sets: dict[str, list[Record]] = {}
    greedy = SamplingParams(temperature=0.0)
    for name in a.prompts.split(","):
        for prompt in prompt_sets.resolve(name, a.limit):
            tokens = prompt_sets.tokenize(prompt, target)
            target.truncate(0)
            out = engine.generate(Request(tokens, a.n_predict, greedy,
                                          DraftParams(n_max=16))).run()
            drafts, conf = [[]], [[]]
            draft_be.truncate(0)
            model.begin(tokens, greedy, DraftParams())
            for pos in range(1, len(out)):
                d = model.draft_from([*tokens, *out[:pos]], a.k)
                drafts.append(list(d.tokens))
                conf.append([float(c) for c in d.confidence])
            sets.setdefault(name, []).append(Record(tokens, out, drafts, conf))
            print(f"recorded {prompt.id}: {len(out)} tokens", file=sys.stderr)
    first = next(iter(sets.values()))[0].prompt
    points = verify_curve(target, first, sizes=(1, 2, 4, 8, 16, 32)).points
    ratios = []
    for _ in range(3):
        for be in (target, draft_be):
            be.truncate(0)
            be.eval(first, logits="last")
        t0 = time.perf_counter()
        for _ in range(8):
            target.eval([first[-1]], logits="last")
        t1 = time.perf_counter()
        for _ in range(8):
            draft_be.eval([first[-1]], logits="last")
        ratios.append((time.perf_counter() - t1) / (t1 - t0))
    return sets, points, sorted(ratios)[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.hybrid_replay",
                                description="hybrid drafting replayed against greedy output")
    p.add_argument("--prompts", default="code,prose,qa")
    p.add_argument("--limit", type=int, default=4)
    p.add_argument("-n", "--n-predict", type=int, default=96)
    p.add_argument("-k", type=int, default=8, help="draft-max")
    p.add_argument("-t", "--threads", type=int, default=1)
    p.add_argument("--curve", default=None, help="t_v(n)/t_v(1) as N:COST,...")
    p.add_argument("--draft-cost", type=float, default=None,
                   help="a draft evaluation in target steps (default: as recorded)")
    p.add_argument("--records", default=None,
                   help="JSON file: read if it exists (no model is run), else written")
    a = p.parse_args(argv)
    if a.records and Path(a.records).is_file():
        data = json.loads(Path(a.records).read_text())
        sets = {n: [Record(**r) for r in recs] for n, recs in data["sets"].items()}
        points, d = tuple(tuple(x) for x in data["curve"]), data["draft_cost"]
    else:
        sets, points, d = record(a)
        if a.records:
            Path(a.records).write_text(json.dumps({
                "sets": {n: [{"prompt": r.prompt, "output": r.output, "drafts": r.drafts,
                              "confidence": r.confidence} for r in recs]
                         for n, recs in sets.items()},
                "curve": points, "draft_cost": d}))
    points = parse_curve(a.curve) if a.curve else points or DEFAULT_CURVE
    report(sets, points, a.draft_cost if a.draft_cost is not None else d, a.k)
    return 0


if __name__ == "__main__":
    sys.exit(main())
