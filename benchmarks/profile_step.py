"""Where the time of the jitted training step goes: XLA op time per step, by op family.

  python -m benchmarks.profile_step --config=benchmarks/configs/multi30k_size.py [--top=15]

Takes the same config and flags as `benchmarks.train_step`, compiles the trainer's step,
records `--profile_steps` calls with `jax.profiler.trace` (a Perfetto trace, no TensorBoard
needed) and sums the duration of each executed op. Ops are grouped by name without their
numeric suffix; matrix multiplications (`dot`, and the CPU's `ynn_fusion` kernels) are one
group. Op times on several threads add up, so the total can exceed the step's wall time.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import re
import tempfile

import jax
from absl import flags, logging

from benchmarks import common, train_step
from transformer_jax import errors

flags.DEFINE_integer("profile_steps", 5, "Steps recorded in the trace.", lower_bound=1)
flags.DEFINE_integer("top", 15, "Op families printed.", lower_bound=1)
FLAGS = flags.FLAGS

MATMUL = "matmul (dot, ynn_fusion)"
# XLA op names (`copy_bitcast_fusion.17`, `wrapped_reduce-window`) are lowercase; Python
# frames (`$file.py:59 call`) and runtime events (`ThunkExecutor::Execute`, `ParseArguments`,
# `end: copy`) are not ops.
_HLO_NAME = re.compile(r"[a-z][a-z0-9_\-]*")


def op_family(name: str) -> str | None:
  """The group of a trace event's name, or None for Python frames and runtime events."""
  family = name.split(".")[0]
  if not _HLO_NAME.fullmatch(family):
    return None
  return MATMUL if family in ("dot", "ynn_fusion") or family.startswith("dot_") else family


def op_times(trace_events: list[dict]) -> collections.Counter:
  """Microseconds per op family over the complete ('X') events of a trace."""
  times: collections.Counter = collections.Counter()
  for event in trace_events:
    family = op_family(event.get("name", ""))
    if event.get("ph") == "X" and family is not None:
      times[family] += event.get("dur", 0)
  return times


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise errors.UserError(f"unexpected arguments: {' '.join(argv[1:])}")
  logging.set_verbosity(logging.WARNING)
  s = common.setup()
  batch = common.random_batch(s, FLAGS.seed, packed=FLAGS.packed)
  _, call = train_step.prepare_jax(s, batch)
  for _ in range(FLAGS.warmup):
    call()
  directory = tempfile.mkdtemp(prefix="profile_step_")
  with jax.profiler.trace(directory, create_perfetto_trace=True):
    for _ in range(FLAGS.profile_steps):
      call()
  (path,) = glob.glob(f"{directory}/**/*perfetto_trace.json.gz", recursive=True)
  with gzip.open(path) as f:
    trace = json.load(f)
  times = op_times(trace["traceEvents"] if isinstance(trace, dict) else trace)
  total = sum(times.values())
  if not total:
    raise errors.UserError(f"the trace in {path} holds no XLA op events that this command "
                           f"reads on the {jax.default_backend()} backend; open the trace in "
                           "Perfetto (ui.perfetto.dev) instead")
  print(f"{jax.devices()[0].device_kind}: op time {total / FLAGS.profile_steps / 1000:.1f} "
        f"ms per step (trace: {path})")
  for family, micros in times.most_common(FLAGS.top):
    print(f"{micros / FLAGS.profile_steps / 1000:9.1f} ms {100 * micros / total:5.1f}%  {family}")


if __name__ == "__main__":
  errors.run(main)
