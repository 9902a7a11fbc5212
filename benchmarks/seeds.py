"""One config over several seeds: each seed's final metrics and wall time, and the mean and
standard deviation of each metric (the headline figures of benchmarks/RESULTS.md).

  python -m benchmarks.seeds --config=configs/conll2003.py --workdir=workdirs/conll2003 \
      [--seeds=0,1,2] [--metrics=eval/f1,eval/precision,eval/recall] [--json] \
      [-- --config.field=value ...]

Seed S trains `python train.py --config=... --config.seed=S --workdir=<workdir>/seed_S`
(one after the other: on a small machine parallel runs only slow each other down). A
workdir that already finished is not trained again (train.py only re-evaluates it), so the
command also re-prints a finished table. Metrics are those of the last line of each
metrics.jsonl that has them (the final evaluation, after averaging if the config averages).
The standard deviation is the sample one (n - 1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_WALL = "wall_secs"


def final_metrics(workdir: str, names: Sequence[str]) -> dict[str, float]:
  """The newest value of each metric in workdir/metrics.jsonl."""
  found: dict[str, float] = {}
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      record = json.loads(line)
      found.update({k: record[k] for k in names if k in record})
  missing = [k for k in names if k not in found]
  if missing:
    raise SystemExit(f"error: {workdir}/metrics.jsonl has no {missing}")
  return found


def summary(values: Sequence[float]) -> tuple[float, float]:
  """(mean, sample standard deviation; 0 for one value)."""
  return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", required=True)
  parser.add_argument("--workdir", required=True, help="seed S trains in WORKDIR/seed_S")
  parser.add_argument("--seeds", default="0,1,2")
  parser.add_argument("--metrics", default="eval/accuracy")
  parser.add_argument("--json", action="store_true")
  parser.add_argument("overrides", nargs="*", help="after --: more train.py flags")
  args = parser.parse_args(argv)
  try:
    seeds = [int(s) for s in args.seeds.split(",")]
  except ValueError:
    parser.error(f"--seeds={args.seeds!r}: comma-separated integers")
  names = [m for m in args.metrics.split(",") if m]

  rows = []
  for seed in seeds:
    workdir = os.path.join(args.workdir, f"seed_{seed}")
    command = [sys.executable, os.path.join(ROOT, "train.py"), f"--config={args.config}",
               f"--config.seed={seed}", f"--workdir={workdir}", *args.overrides]
    print(f"seed {seed}: {' '.join(command[1:])}", file=sys.stderr, flush=True)
    started = time.perf_counter()
    if subprocess.run(command).returncode:
      raise SystemExit(f"error: seed {seed} failed (its output is above)")
    rows.append({"seed": seed, **final_metrics(workdir, names),
                 _WALL: round(time.perf_counter() - started, 1)})

  stats = {k: summary([row[k] for row in rows]) for k in names}
  if args.json:
    print(json.dumps({"config": args.config, "overrides": args.overrides, "runs": rows,
                      "mean": {k: m for k, (m, _) in stats.items()},
                      "std": {k: s for k, (_, s) in stats.items()}}))
    return
  print("| seed | " + " | ".join(names) + " | wall time of this command (s) |")
  print("| --- |" + " --- |" * (len(names) + 1))
  for row in rows:
    print(f"| {row['seed']} | " + " | ".join(f"{row[k]:.4f}" for k in names)
          + f" | {row[_WALL]} |")
  print("| mean ± std | " + " | ".join(f"{m:.4f} ± {s:.4f}" for m, s in stats.values())
        + " | |")


if __name__ == "__main__":
  main()
