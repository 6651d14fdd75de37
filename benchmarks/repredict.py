"""What `plan` predicts for each configuration of a finished bench run, with today's model.

A bench run stores every record's rounds, times and calibration in its results.json; the
prediction it printed is the model's of that day. This recomputes it with the current
model (specwire/bench/predict.py), so that a change to the model is checked against runs
already measured, before new ones are:

    python -m benchmarks.repredict bench-out/results.json [more.json ...]
    python -m benchmarks.repredict --per-prompt bench-out/results.json

--per-prompt predicts each prompt of each configuration from its own rounds against its
own plain rate, so that an error over the set can be traced to the request that makes it.
"""

from __future__ import annotations

import argparse
import copy
import json

from specwire.bench import sweep
from specwire.bench.runner import RunParams
from specwire.policy.throughput import VerifyCurve


def repredict(results: dict) -> list[tuple[str, dict | None, dict | None]]:
    """(label, the stored prediction, today's) per record of a results.json."""
    calib = _calibration(results)
    plain_tps = results["calibration"]["plain_tps_overall"]
    out = []
    for rec in results["records"]:
        cfg = RunParams.from_dict(rec)
        out.append((rec.get("label") or cfg.label(), rec.get("plan"),
                    sweep.prediction(rec, cfg, plain_tps, calib)))
    return out


def _calibration(results: dict) -> dict:
    cal = results["calibration"]
    return {"draft_tps": cal["draft_tps"], "draft_prompt_tps": cal.get("draft_prompt_tps"),
            "verify": VerifyCurve([tuple(p) for p in cal["verify_cost"]])}


def per_prompt(results: dict) -> list[tuple[str, list[tuple[str, dict | None]]]]:
    """(label, [(prompt id, today's prediction for that prompt alone)]) per record: each
    prompt's rounds as a record of one prompt, against that prompt's plain rate."""
    calib = _calibration(results)
    plain = {p["id"]: p for p in results["records"][0]["prompts"]}
    out = []
    for rec in results["records"]:
        cfg = RunParams.from_dict(rec)
        rows = []
        for p in rec["prompts"]:
            st = p["stats"]
            one = copy.deepcopy(rec)
            one.update(prompts=[p], rounds=st["rounds"], accepted_hist=st["accepted_hist"],
                       draft_n=st["draft_n"], draft_n_accepted=st["draft_n_accepted"],
                       short_rounds=st.get("short_rounds", 0),
                       asked_rounds=st.get("asked_rounds", st["rounds"]),
                       rejected_rounds=st.get("rejected_rounds"),
                       tokens_generated=p["generated"],
                       time={"ms": {"draft": st.get("draft_ms", 0.0)}})
            base = plain[p["id"]]
            plain_tps = 1000.0 * base["generated"] / base["predicted_ms"]
            rows.append((p["id"], sweep.prediction(one, cfg, plain_tps, calib)))
        out.append((rec.get("label") or cfg.label(), rows))
    return out


def _pct(p: dict | None) -> str:
    return "-" if not p or p.get("error_pct") is None else f"{p['error_pct']:+.1f}%"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="bench results.json files")
    ap.add_argument("--per-prompt", action="store_true",
                    help="each prompt's error, predicted from its own rounds")
    args = ap.parse_args()
    for path in args.results:
        with open(path, encoding="utf-8") as f:
            results = json.load(f)
        print(path)
        if args.per_prompt:
            for label, prompts in per_prompt(results):
                cells = "  ".join(f"{pid} {_pct(pred)}" for pid, pred in prompts)
                print(f"  {label:44s} {cells}")
            continue
        rows = repredict(results)
        print(f"  {'configuration':44s} {'measured':>9s} {'stored':>8s} {'today':>8s}")
        for label, stored, today in rows:
            measured = (today or stored or {}).get("measured_tps")
            shown = "-" if measured is None else f"{measured:.2f}"
            print(f"  {label:44s} {shown:>9s} {_pct(stored):>8s} {_pct(today):>8s}")


if __name__ == "__main__":
    main()
