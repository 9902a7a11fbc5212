"""Validation loss against wall time: our runs (a workdir's TensorBoard events) beside
nanoGPT's (its train.py's log, run with --log_interval=1), in one plot.

  python -m benchmarks.lm_curves --ours=W1,W2 --nanogpt=LOG1,LOG2 \
      --labels="ours,nanoGPT ..." --output=docs/shakespeare_val_loss.png [--y_max=1.8]

Our time axis: seconds since the run's event file was opened (the run's start, compiling
included). nanoGPT's: the sum of its logged iteration times (each iteration's wall time,
its evaluations and compiling included). Prints each run's points as well.
"""

from __future__ import annotations

import glob
import os
import re

from absl import flags

from transformer_jax import errors

FLAGS = flags.FLAGS
_STEP = re.compile(r"^step (\d+): train loss [\d.]+, val loss ([\d.]+)")
_ITER = re.compile(r"^iter (\d+): loss [\d.]+, time ([\d.]+)ms")


def define_flags() -> None:
  flags.DEFINE_list("ours", [], "Our workdirs.")
  flags.DEFINE_list("nanogpt", [], "nanoGPT train.py logs.")
  flags.DEFINE_list("labels", [], "One label per run, ours first.")
  flags.DEFINE_string("output", None, "The PNG to write.", required=True)
  flags.DEFINE_string("metric", "eval/loss", "Our metric to plot.")
  flags.DEFINE_float("y_max", None, "Top of the loss axis (default: the largest loss), so "
                     "that the first evaluations do not flatten the rest.")


def our_curve(workdir: str, metric: str) -> list[tuple[float, float]]:
  """(seconds since the run's start, metric) at each evaluation."""
  from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
  from tensorboard.util import tensor_util
  files = sorted(glob.glob(os.path.join(workdir, "tensorboard", "events.out.tfevents.*")))
  if not files:
    raise errors.MissingFileError(f"{workdir}: no TensorBoard events in {workdir}/tensorboard")
  start, points = None, []
  for event in EventFileLoader(files[0]).Load():
    start = event.wall_time if start is None else start
    for value in event.summary.value:
      if value.tag == metric:   # the loader migrates simple values into tensors
        number = (value.simple_value if value.WhichOneof("value") == "simple_value"
                  else float(tensor_util.make_ndarray(value.tensor)))
        points.append((event.wall_time - start, number))
  return points


def nanogpt_curve(log: str) -> list[tuple[float, float]]:
  """(seconds of iterations so far, val loss) at each of the log's evaluations."""
  elapsed, points, pending = 0.0, [], []
  with open(log) as f:
    for line in f:
      if (match := _STEP.match(line)):
        pending.append(float(match.group(2)))
      elif (match := _ITER.match(line)):
        elapsed += float(match.group(2)) / 1000
        points += [(elapsed, loss) for loss in pending]   # its evaluation ends this iteration
        pending = []
  return points


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise errors.UserError(f"unexpected arguments: {' '.join(argv[1:])}")
  runs = ([our_curve(w, FLAGS.metric) for w in FLAGS.ours]
          + [nanogpt_curve(log) for log in FLAGS.nanogpt])
  labels = FLAGS.labels or FLAGS.ours + FLAGS.nanogpt
  if len(labels) != len(runs):
    raise errors.UserError(f"--labels: {len(labels)} given for {len(runs)} runs")
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  figure, axes = plt.subplots(figsize=(7, 4.2))
  for label, points in zip(labels, runs):
    print(label + ": " + ", ".join(f"{t / 60:.1f} min {v:.4f}" for t, v in points))
    axes.plot([t / 60 for t, _ in points], [v for _, v in points], marker="o", markersize=3,
              label=label)
  axes.set_xlabel("wall time (minutes)")
  axes.set_ylabel("validation loss (nats per character)")
  if FLAGS.y_max is not None:
    axes.set_ylim(top=FLAGS.y_max)
  axes.grid(alpha=0.3)
  axes.legend(loc="upper right", fontsize="small")   # the curves end low on the right
  figure.tight_layout()
  figure.savefig(FLAGS.output, dpi=110)
  print(f"wrote {FLAGS.output}")


if __name__ == "__main__":
  define_flags()
  errors.run(main)
