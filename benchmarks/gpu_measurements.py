"""Every GPU measurement of issue 26 in one run, written to one JSON file: the project's own
commands, each as a subprocess with --json, with the device, date and versions.

  python -m benchmarks.gpu_measurements --output=gpu_measurements.json [--target=h100-sxm]
      [--only=train_step,torch,decode,aot_plan] [--timeout_s=540]
  python -m benchmarks.gpu_measurements --tiny --output=/tmp/m.json   # CPU: tiny shapes

- train_step: train-step MFU of WMT14 base and big, bf16, packed 256-token rows, with
  attention_impl cudnn and xla, at the paper's batch and at the largest batch per device
  that `aot --find_max_batch` plans for the target (benchmarks/train_step.py);
- torch: the same base step side by side with PyTorch, eager and torch.compile
  (benchmarks/train_step.py --compare=torch);
- decode: beam-search and greedy decoding throughput (benchmarks/decode.py);
- aot_plan: what `python -m transformer_jax.aot --target=<target>:1` plans for each measured
  train step (memory per device, roofline), to set beside the measurement.
A command that fails is recorded with its status and the tail of its stderr; the rest go on.
--tiny runs the same commands on the default config with tiny shapes (and skips cuDNN
attention without a GPU), to check the script on a CPU.
"""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
import time
from typing import Any

from absl import flags

from transformer_jax import errors

flags.DEFINE_string("output", None, "Where to write the JSON.", required=True)
flags.DEFINE_string("target", "h100-sxm", "aot target kind of this GPU (h100-sxm, h200, "
                    "a100-80gb) for the largest batch and the plan check.")
flags.DEFINE_list("only", ["train_step", "torch", "decode", "aot_plan"], "Measurements to take.")
flags.DEFINE_bool("tiny", False, "Tiny shapes on the default config (a check on a CPU).")
flags.DEFINE_integer("timeout_s", 540, "Limit per command (a lent GPU allows 10 min a command).")
FLAGS = flags.FLAGS

MEASUREMENTS = ("train_step", "torch", "decode", "aot_plan")
PAPER_ROWS = {"base": 96, "big": 96}      # configs/wmt14_ende_*.py: ~25k + 25k tokens a step


def _run(args: list[str]) -> dict[str, Any]:
  """One project command with --json: its JSON (last stdout line), or why there is none."""
  command = [sys.executable, "-m", *args, "--json"]
  start = time.perf_counter()
  try:
    proc = subprocess.run(command, capture_output=True, text=True, timeout=FLAGS.timeout_s)
  except subprocess.TimeoutExpired:
    return {"command": " ".join(command[1:]), "error": f"timed out after {FLAGS.timeout_s} s"}
  entry: dict[str, Any] = {"command": " ".join(command[1:]), "status": proc.returncode,
                           "wall_s": round(time.perf_counter() - start, 1)}
  lines = proc.stdout.strip().splitlines()
  try:
    entry["result"] = json.loads(lines[-1])
  except (IndexError, json.JSONDecodeError):
    entry["error"] = "\n".join(proc.stderr.strip().splitlines()[-5:])
  return entry


def _models() -> list[tuple[str, list[str]]]:
  """(name, the config flags and shapes of its train step)."""
  if FLAGS.tiny:
    return [("tiny", ["--config=configs/default.py", "--src_length=16", "--tgt_length=16",
                      "--steps=2", "--warmup=1"])]
  return [(m, [f"--config=configs/wmt14_ende_{m}.py", "--src_length=256", "--tgt_length=256",
               "--packed"]) for m in ("base", "big")]


def _largest_batch(config_flag: str, devices: int) -> int | None:
  """The largest global batch of one device's train step that aot plans to fit."""
  plan = _run(["transformer_jax.aot", config_flag, f"--target={FLAGS.target}:1",
               "--config.model.dtype=bfloat16", "--programs=train_step", "--find_max_batch",
               "--batch_tolerance=0.05"])
  batch = plan.get("result", {}).get("max_batch")
  return batch * devices if batch else None


def measure() -> dict[str, Any]:
  import jax
  out: dict[str, Any] = {
      "date": datetime.date.today().isoformat(), "device": jax.devices()[0].device_kind,
      "devices": jax.device_count(), "jax": jax.__version__, "tiny": FLAGS.tiny,
      "note": "measurements on this device, except aot_plan (the plan, an estimate)"}
  gpu = jax.devices()[0].platform == "gpu"
  attentions = ["cudnn", "xla"] if gpu else ["xla"]
  runs: list[dict[str, Any]] = []
  for name, model in _models():
    batches = {"paper": 8 if FLAGS.tiny else PAPER_ROWS[name]}
    if "train_step" in FLAGS.only and not FLAGS.tiny:
      largest = _largest_batch(model[0], jax.device_count())
      if largest:
        batches["largest"] = largest
    for label, rows in batches.items():
      step = ["benchmarks.train_step", *model, "--dtype=bfloat16", f"--batch_size={rows}"]
      if "train_step" in FLAGS.only:
        for attention in attentions:
          runs.append({"measurement": "train_step", "model": name, "batch": label,
                       "attention": attention, **_run([*step, f"--attention={attention}"])})
      if "aot_plan" in FLAGS.only:
        runs.append({"measurement": "aot_plan", "model": name, "batch": label,
                     **_run(["transformer_jax.aot", model[0], f"--target={FLAGS.target}:1",
                             "--config.model.dtype=bfloat16", "--programs=train_step",
                             f"--config.batch_size={rows}"])})
    if "torch" in FLAGS.only and name in ("base", "tiny"):
      runs.append({"measurement": "torch", "model": name, "batch": "paper",
                   **_run(["benchmarks.train_step", *model, "--dtype=bfloat16",
                           f"--batch_size={batches['paper']}", "--compare=torch"])})
    if "decode" in FLAGS.only:
      runs.append({"measurement": "decode", "model": name,
                   **_run(["benchmarks.decode", model[0]]
                          + (["--max_length=8"] if FLAGS.tiny else []))})
  if not gpu:
    out["skipped"] = "attention_impl=cudnn: needs a GPU"
  out["runs"] = runs
  return out


def main(argv: list[str]) -> None:
  unknown = set(FLAGS.only) - set(MEASUREMENTS)
  if unknown:
    raise errors.UserError(f"--only: unknown {sorted(unknown)}; choose from {MEASUREMENTS}")
  result = measure()
  with open(FLAGS.output, "w") as f:
    json.dump(result, f, indent=1, default=str)
  failed = [r["command"] for r in result["runs"] if "result" not in r]
  print(f"{len(result['runs'])} commands, {len(failed)} without a result; wrote {FLAGS.output}")
  for command in failed:
    print(f"  no result: {command}")


if __name__ == "__main__":
  errors.run(main)
