"""Where the time of the jitted training step goes: op time per step, by op family.

  python -m benchmarks.profile_step --config=benchmarks/configs/multi30k_size.py [--top=15]
      [--json]

Takes the same config and flags as `benchmarks.train_step`, compiles the trainer's step,
records `--profile_steps` calls with `jax.profiler.trace` (a Perfetto trace, no TensorBoard
needed) and sums the duration of each executed op. On a CPU the ops are XLA's, grouped by
name without their numeric suffix; op times on several threads add up, so the total can
exceed the step's wall time. On a GPU only the device's kernels count (the trace's
"/device:GPU" processes): one stream, so their sum is the time the GPU computed. Matrix
multiplications (XLA's `dot`, the CPU's `ynn_fusion`, cuBLAS and Triton GEMM kernels) are
one family, cuDNN's fused attention another.
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

MATMUL = "matmul (dot, ynn_fusion, GEMM kernels)"
ATTENTION = "fused attention (cuDNN)"
# XLA op names (`copy_bitcast_fusion.17`, `wrapped_reduce-window`) are lowercase; Python
# frames (`$file.py:59 call`) and runtime events (`ThunkExecutor::Execute`, `ParseArguments`,
# `end: copy`) are not ops.
_HLO_NAME = re.compile(r"[a-z][a-z0-9_\-]*")
# GPU kernels: cuBLAS/cuBLASLt (`sm90_xmma_gemm_...`, `nvjet_...`, CUTLASS templates), XLA's
# Triton GEMM fusions (`gemm_fusion_dot_12`); cuDNN's attention (`..._sdpa_...`, `fmha`).
_GEMM_KERNEL = re.compile(r"gemm|xmma|nvjet|cutlass|^dot_|^dot$")
_ATTENTION_KERNEL = re.compile(r"sdpa|fmha|flash")
_NUMBERED = re.compile(r"([._]\d+)+$")


def op_family(name: str) -> str | None:
  """The group of a CPU trace event's name, or None for Python frames and runtime events."""
  family = name.split(".")[0]
  if not _HLO_NAME.fullmatch(family):
    return None
  return MATMUL if family in ("dot", "ynn_fusion") or family.startswith("dot_") else family


def kernel_family(name: str) -> str:
  """The group of a GPU kernel's name: matmuls, fused attention, or XLA's fusion kind (the
  kernel's name without its numbers; a C++ template's name without its arguments)."""
  lower = name.lower()
  if _ATTENTION_KERNEL.search(lower):
    return ATTENTION
  if _GEMM_KERNEL.search(lower):
    return MATMUL
  base = re.sub(r"^void ", "", name).split("<")[0].split("(")[0].strip()
  return _NUMBERED.sub("", base) or name


def _device_pids(trace_events: list[dict]) -> set:
  """Processes of the trace that are GPUs (their metadata name says /device:GPU)."""
  return {e.get("pid") for e in trace_events
          if e.get("ph") == "M" and e.get("name") == "process_name"
          and "/device:GPU" in str(e.get("args", {}).get("name", ""))}


def op_times(trace_events: list[dict]) -> collections.Counter:
  """Microseconds per op family over the complete ('X') events of a trace: the GPU's
  kernels where the trace has a GPU, else the CPU's XLA ops."""
  times: collections.Counter = collections.Counter()
  gpus = _device_pids(trace_events)
  for event in trace_events:
    if event.get("ph") != "X":
      continue
    if gpus:
      family = kernel_family(event.get("name", "")) if event.get("pid") in gpus else None
    else:
      family = op_family(event.get("name", ""))
    if family is not None:
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
    raise errors.UserError(f"the trace in {path} holds no op events that this command "
                           f"reads on the {jax.default_backend()} backend; open the trace in "
                           "Perfetto (ui.perfetto.dev) instead")
  per_step = lambda micros: micros / FLAGS.profile_steps / 1000
  families = [{"family": family, "ms_per_step": per_step(micros), "share": micros / total}
              for family, micros in times.most_common(FLAGS.top)]
  if FLAGS.json:
    print(json.dumps({**common.stamp(), "op_ms_per_step": per_step(total),
                      "families": families, "trace": path}))
    return
  print(f"{jax.devices()[0].device_kind}: op time {per_step(total):.1f} "
        f"ms per step (trace: {path})")
  for row in families:
    print(f"{row['ms_per_step']:9.1f} ms {100 * row['share']:5.1f}%  {row['family']}")


if __name__ == "__main__":
  errors.run(main)
