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

import json
import os
import statistics
import subprocess
import sys
import time
from typing import Sequence

from absl import flags

from transformer_jax import errors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_WALL = "wall_secs"
FLAGS = flags.FLAGS


def define_flags() -> None:
  """The command-line flags, defined only when this module is the program (absl flags are
  global: tests import this module beside others that define --config and --json)."""
  flags.DEFINE_string("config", None, "Config file of train.py.", required=True)
  flags.DEFINE_string("workdir", None, "Seed S trains in WORKDIR/seed_S.", required=True)
  flags.DEFINE_list("seeds", ["0", "1", "2"], "Comma-separated integer seeds.")
  flags.DEFINE_list("metrics", ["eval/accuracy"], "Comma-separated metrics of metrics.jsonl.")
  flags.DEFINE_bool("json", False, "Print one JSON object instead of a table.")


def final_metrics(workdir: str, names: Sequence[str]) -> dict[str, float]:
  """The newest value of each metric in workdir/metrics.jsonl."""
  found: dict[str, float] = {}
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      record = json.loads(line)
      found.update({k: record[k] for k in names if k in record})
  missing = [k for k in names if k not in found]
  if missing:
    raise errors.UserError(f"{workdir}/metrics.jsonl has no {missing}; name metrics that "
                           "its lines hold in --metrics")
  return found


def summary(values: Sequence[float]) -> tuple[float, float]:
  """(mean, sample standard deviation; 0 for one value)."""
  return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def main(argv: list[str]) -> None:
  overrides = argv[1:]               # after --: more train.py flags
  not_flags = [a for a in overrides if not a.startswith("--")]
  if not_flags:
    raise errors.UserError(f"unexpected arguments {not_flags}: after -- come train.py flags "
                           "(--config.field=value)")
  try:
    seeds = [int(s) for s in FLAGS.seeds]
  except ValueError:
    raise errors.UserError(f"--seeds={','.join(FLAGS.seeds)}: expected comma-separated "
                           "integers") from None
  names = [m for m in FLAGS.metrics if m]
  if not seeds or not names:
    raise errors.UserError("--seeds and --metrics each need at least one entry")
  config_file = FLAGS.config.split(":")[0]     # ml_collections: FILE[:ARGUMENT]
  if not os.path.isfile(config_file):
    raise errors.MissingFileError(f"--config={FLAGS.config}: no such file")

  rows = []
  for seed in seeds:
    workdir = os.path.join(FLAGS.workdir, f"seed_{seed}")
    command = [sys.executable, os.path.join(ROOT, "train.py"), f"--config={FLAGS.config}",
               f"--config.seed={seed}", f"--workdir={workdir}", *overrides]
    print(f"seed {seed}: {' '.join(command[1:])}", file=sys.stderr, flush=True)
    started = time.perf_counter()
    status = subprocess.run(command).returncode
    if status:
      raise errors.UserError(f"seed {seed}: train.py exited with status {status}; its output "
                             "above says why")
    rows.append({"seed": seed, **final_metrics(workdir, names),
                 _WALL: round(time.perf_counter() - started, 1)})

  stats = {k: summary([row[k] for row in rows]) for k in names}
  if FLAGS.json:
    print(json.dumps({"config": FLAGS.config, "overrides": overrides, "runs": rows,
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
  define_flags()
  errors.run(main)
