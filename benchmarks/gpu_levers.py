"""The levers on a GPU train step ranked by the milliseconds they would save, estimated on
this machine: the step compiled for the GPU (`python -m transformer_jax.aot --json`) as it
is and with each lever, each compile's kernels priced by aot/roofline.py (bytes at HBM
bandwidth or FLOPs at peak, by family), the difference from the step as it is scaled by
the calibration against a measured step time (--measured_ms). Estimates, not measurements:
they rank what the next GPU run should time.

  python -m benchmarks.gpu_levers --config=configs/wmt14_ende_base.py --target=h100-sxm:1 \
      --measured_ms=55.7 [--levers=pallas,no_dropout] [--json]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from absl import flags

from transformer_jax import errors

flags.DEFINE_string("config", "configs/wmt14_ende_base.py", "The run config.")
flags.DEFINE_string("target", "h100-sxm:1", "aot target (KIND:N).")
flags.DEFINE_list("overrides", ["--config.model.dtype=bfloat16"], "Config flags of the step "
                  "as it is (the measured step: bf16, the config's 96 packed rows of 256).")
flags.DEFINE_float("measured_ms", None, "The measured step time of the step as it is, to "
                   "calibrate the estimates (one H100, 2026-11-28: 55.7 ms for WMT14 base).")
flags.DEFINE_list("levers", None, "Levers to estimate (default: all of LEVERS).")
flags.DEFINE_bool("json", False, "Print one JSON object.")
FLAGS = flags.FLAGS

# name: (config flags, environment) of the step with that one lever changed.
LEVERS: dict[str, tuple[list[str], dict[str, str]]] = {
    "pallas attention": (["--config.model.attention_impl=pallas"], {}),
    "cudnn packed attention (16 segments a row)": (
        ["--config.model.attention_impl=cudnn", "--config.data.max_segments=16"], {}),
    "loss over 8 tiles": (["--config.model.loss_tiles=8"], {}),
    "no dropout (its whole cost)": (["--config.model.dropout_rate=0.0"], {}),
    "dropout bits from rbg": ([], {"JAX_DEFAULT_PRNG_IMPL": "rbg"}),
    "cudnn layer norm": ([], {"XLA_FLAGS": "--xla_gpu_enable_cudnn_layer_norm=true"}),
}
BASELINE = "as it is"


def _families(extra: list[str], env: dict[str, str]) -> dict[str, float]:
  """Estimated ms per kernel family of the train step with `extra` flags and `env`."""
  command = [sys.executable, "-m", "transformer_jax.aot", f"--config={FLAGS.config}",
             f"--target={FLAGS.target}", "--programs=train_step", "--json", *FLAGS.overrides,
             *extra]
  proc = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **env})
  if proc.returncode:
    raise errors.UserError(f"{' '.join(command[2:])}: {proc.stderr.strip().splitlines()[-1]}")
  report = json.loads(proc.stdout.strip().splitlines()[-1])["programs"]["train_step"]
  return {f["family"]: f["estimated_ms"] for f in report["kernel_families"]}


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise errors.UserError(f"unexpected arguments: {' '.join(argv[1:])}")
  names = FLAGS.levers or list(LEVERS)
  unknown = sorted(set(names) - set(LEVERS))
  if unknown:
    raise errors.UserError(f"--levers: unknown {unknown}; choose from {sorted(LEVERS)}")
  base = _families([], {})
  total = sum(base.values())
  scale = FLAGS.measured_ms / total if FLAGS.measured_ms else 1.0
  rows: list[dict[str, Any]] = []
  for name in names:
    families = _families(*LEVERS[name])
    changes = {f: families.get(f, 0.0) - base.get(f, 0.0) for f in {*base, *families}}
    rows.append({"lever": name, "estimated_ms": sum(families.values()),
                 "saves_ms_calibrated": -scale * sum(changes.values()),
                 "largest_changes_ms": dict(sorted(
                     ((f, round(d, 3)) for f, d in changes.items() if abs(d) > 0.01),
                     key=lambda kv: kv[1]))})
  rows.sort(key=lambda r: -r["saves_ms_calibrated"])
  result = {"config": FLAGS.config, "target": FLAGS.target, "overrides": FLAGS.overrides,
            "estimate_note": "our roofline estimate of each kernel (aot/roofline.py), not a "
                             "measurement; savings scaled by the calibration",
            "baseline_estimated_ms": total, "measured_ms": FLAGS.measured_ms,
            "calibration": scale, "baseline_families_ms": base, "levers": rows}
  if FLAGS.json:
    print(json.dumps(result))
    return
  print(f"{FLAGS.config} on {FLAGS.target}: step estimated at {total:.1f} ms [our roofline "
        "estimate]" + (f", measured {FLAGS.measured_ms} ms: estimates x{scale:.2f}"
                       if FLAGS.measured_ms else ""))
  for row in rows:
    print(f"  saves {row['saves_ms_calibrated']:6.2f} ms  {row['lever']}")


if __name__ == "__main__":
  errors.run(main)
