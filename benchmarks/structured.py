"""Structured-output benchmark: JSON-schema generation with and without the drafter
following the schema, against plain decoding, on the bundled pair.

    python -m benchmarks.structured [-n 96] [--draft-max 8] [--temp 0] [--prompts 4]

Configurations (each prompt runs every one; KV caches emptied between runs):
* free/plain, free/draft          no constraint (the reference speed);
* schema/plain                    the schema on the target only, no draft;
* schema/draft-ignores            the draft model drafts freely, the target verifies
                                  under the schema (drafts that break it are rejected);
* schema/draft-follows            the draft model applies the same grammar (clone per draft).

It checks, for every prompt, that the constrained outputs are identical across
the three schema configurations (lossless), and reports tokens/s (decoding only,
the prompt's evaluation excluded), draft acceptance, and what the grammar cost:
calls into llama.cpp's grammar, token ids asked about per generated token,
whole-vocabulary scans, and milliseconds in the grammar.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field

from specwire.assets import models
from specwire.backend.llama import LlamaBackend, load_model
from specwire.config import DraftParams, ModelParams, SamplingParams
from specwire.drafters.model import ModelDrafter
from specwire.engine.engine import Engine, Request
from specwire.sample.constraints import Grammar, schema_grammar

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "city": {"type": "string"},
                         "hobbies": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "city", "hobbies"], "additionalProperties": False}
PROMPTS = [
    "Describe Ann, aged 31, from Oslo, who likes skiing and chess, as JSON.",
    "Give a JSON record for Bob, 45, living in Lyon; hobbies: cooking, cycling.",
    "As JSON: Chen is 28, lives in Taipei and enjoys photography and running.",
    "Make a JSON profile of Dana (52, Austin) who likes gardening, jazz and hiking.",
]


class _Ignoring:
    """The same draft model without its `constrain` hook: it drafts unconstrained."""

    def __init__(self, inner: ModelDrafter) -> None:
        self._inner = inner
        self.name = inner.name + "(free)"

    def __getattr__(self, name: str):
        if name == "constrain":
            raise AttributeError(name)
        return getattr(self._inner, name)


@dataclass(slots=True)
class _Totals:
    """One configuration's decoding over all prompts."""

    tokens: int = 0
    s: float = 0.0
    drafted: int = 0
    accepted: int = 0

    def as_dict(self) -> dict:
        return {"tokens": self.tokens, "s": self.s, "drafted": self.drafted,
                "accepted": self.accepted, "tok_per_s": self.tokens / self.s}


@dataclass
class _GrammarCost:
    calls: int = 0
    ids: int = 0
    full: int = 0
    seconds: float = 0.0
    sizes: list = field(default_factory=list)


def _instrument(cost: _GrammarCost, n_vocab: int) -> None:
    real = Grammar.allowed

    def allowed(self, ids):
        t = time.perf_counter()
        out = real(self, ids)
        cost.seconds += time.perf_counter() - t
        cost.calls += 1
        cost.ids += len(ids)
        cost.full += len(ids) == n_vocab
        return out

    Grammar.allowed = allowed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", type=int, default=96)
    ap.add_argument("--draft-max", type=int, default=8)
    ap.add_argument("--temp", type=float, default=0.0)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    a = ap.parse_args(argv)
    target = LlamaBackend(ModelParams(str(models.default_target()), n_ctx=1024))
    dpath = ModelParams(str(models.default_draft()), n_ctx=1024)
    drafter = ModelDrafter(LlamaBackend(dpath, load_model(dpath)))
    grammar = schema_grammar(SCHEMA)
    sampling = SamplingParams(temperature=a.temp, seed=42)
    configs = {"free/plain": (None, None), "free/draft": (None, drafter),
               "schema/plain": (grammar, None), "schema/draft-ignores": (grammar,
                                                                         _Ignoring(drafter)),
               "schema/draft-follows": (grammar, drafter)}
    totals = {k: _Totals() for k in configs}
    cost = {k: _GrammarCost() for k in configs}
    _instrument(current := _GrammarCost(), target.n_vocab)
    for text in PROMPTS[: a.prompts]:
        prompt = target.tokenize(f"<start_of_turn>user\n{text}<end_of_turn>\n"
                                 "<start_of_turn>model\n", True, True)
        outputs = {}
        for name, (g, d) in configs.items():
            target.truncate(0)
            if d is not None:
                drafter.backend.truncate(0)
            dp = DraftParams(n_max=a.draft_max, p_min=0.0, enabled=d is not None)
            before = (current.calls, current.ids, current.full, current.seconds)
            gen = Engine(target, d).generate(Request(prompt, a.n, sampling, dp, grammar=g))
            gen.run()
            dt = gen.stats.predicted_ms / 1000      # decoding only, not the prompt
            outputs[name] = gen.tokens
            tot = totals[name]
            tot.tokens += len(gen.tokens)
            tot.s += dt
            tot.drafted += gen.stats.draft_n
            tot.accepted += gen.stats.draft_n_accepted
            c = cost[name]
            c.calls += current.calls - before[0]
            c.ids += current.ids - before[1]
            c.full += current.full - before[2]
            c.seconds += current.seconds - before[3]
        same = outputs["schema/plain"] == outputs["schema/draft-ignores"] == \
            outputs["schema/draft-follows"]
        doc = target.detokenize(outputs["schema/plain"]).decode(errors="replace")
        print(f"prompt {text[:40]!r}: lossless={same} output={doc[:70]!r}")
        if not same:
            print("  MISMATCH between the constrained configurations")
            return 1
    print(f"\n{'configuration':24s} {'tok/s':>7s} {'accept':>7s} {'drafted':>8s} "
          f"{'grammar calls':>13s} {'ids/token':>9s} {'full scans':>10s} {'grammar ms':>10s}")
    for name, tot in totals.items():
        c = cost[name]
        rate = tot.accepted / tot.drafted if tot.drafted else float("nan")
        print(f"{name:24s} {tot.tokens / tot.s:7.2f} {rate:7.2f} {tot.drafted:8d} "
              f"{c.calls:13d} {c.ids / max(tot.tokens, 1):9.0f} {c.full:10d} "
              f"{1000 * c.seconds:10.1f}")
    print(json.dumps({k: v.as_dict() for k, v in totals.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
