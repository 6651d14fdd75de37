"""What `plan` predicts for each configuration of a finished bench run, with today's model.

A bench run stores every record's rounds, times and calibration in its results.json; the
prediction it printed is the model's of that day. This recomputes it with the current
model (specwire/bench/predict.py), so that a change to the model is checked against runs
already measured, before new ones are:

    python -m benchmarks.repredict bench-out/results.json [more.json ...]
"""

from __future__ import annotations

import argparse
import json

from specwire.bench import sweep
from specwire.bench.runner import RunParams
from specwire.policy.throughput import VerifyCurve


def repredict(results: dict) -> list[tuple[str, dict | None, dict | None]]:
    """(label, the stored prediction, today's) per record of a results.json."""
    cal = results["calibration"]
    calib = {"draft_tps": cal["draft_tps"], "draft_prompt_tps": cal.get("draft_prompt_tps"),
             "verify": VerifyCurve([tuple(p) for p in cal["verify_cost"]])}
    plain_tps = cal["plain_tps_overall"]
    out = []
    for rec in results["records"]:
        cfg = RunParams.from_dict(rec)
        out.append((rec.get("label") or cfg.label(), rec.get("plan"),
                    sweep.prediction(rec, cfg, plain_tps, calib)))
    return out


def _pct(p: dict | None) -> str:
    return "-" if not p or p.get("error_pct") is None else f"{p['error_pct']:+.1f}%"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="bench results.json files")
    for path in ap.parse_args().results:
        with open(path, encoding="utf-8") as f:
            rows = repredict(json.load(f))
        print(path)
        print(f"  {'configuration':44s} {'measured':>9s} {'stored':>8s} {'today':>8s}")
        for label, stored, today in rows:
            measured = (today or stored or {}).get("measured_tps")
            shown = "-" if measured is None else f"{measured:.2f}"
            print(f"  {label:44s} {shown:>9s} {_pct(stored):>8s} {_pct(today):>8s}")


if __name__ == "__main__":
    main()
