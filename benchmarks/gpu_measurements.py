"""The GPU measurements in one run, written to one JSON file after every command: the
project's own commands, each as a subprocess with --json, with the device, date and versions.

  python -m benchmarks.gpu_measurements --output=gpu_measurements.json [--target=h100-sxm]
      [--only=variants,torch,train_step,decode,aot_plan,multi30k,serve] [--models=base,big]
      [--attentions=auto,einsum,cudnn,xla] [--batches=paper,largest] [--largest_batch=base=948]
      [--seeds=0,1,2] [--runs=gpu_runs] [--timeout_s=540] [--budget_s=0]
  python -m benchmarks.gpu_measurements --tiny --output=/tmp/m.json   # CPU: tiny shapes

- variants: the train step of WMT14 base (and big), bf16, 96 packed rows of 256 + 256, one
  lever changed at a time against attention_impl=auto: the attention path, dropout off,
  the PRNG that draws dropout's bits, XLA's GPU options and the loss over tiles of the
  targets (STEP_VARIANTS below); and base's step profiled, its GPU time by kernel family
  (benchmarks/profile_step.py);
- train_step: the same step with each of --attentions, at the paper's batch and at the
  largest batch per device that `aot --find_max_batch` plans for the target (or
  --largest_batch, planned beforehand on a CPU machine) (benchmarks/train_step.py);
- torch: the base step unpacked, side by side with PyTorch, eager and torch.compile, in one
  process in turns (benchmarks/train_step.py --compare=torch, attention auto);
- decode: beam-search and greedy decoding throughput (benchmarks/decode.py);
- aot_plan: what `python -m transformer_jax.aot --target=<target>:1` plans for each measured
  train step (memory per device, roofline), to set beside the measurement;
- multi30k: `train.py --config=configs/multi30k.py` for each of --seeds, in RUNS/multi30k_s<seed>:
  wall time, the final val BLEU and test BLEU (the config's recipe, as on the CPU). A run
  stopped by --timeout_s is resumed exactly by the same command again;
- serve: on RUNS/multi30k_s<first seed>, predict's sentences/s (benchmarks/ctranslate2_speed.py,
  500 val lines) and the StableHLO server's requests/s, p50 and p99 with 8 clients
  (benchmarks/serve_load.py).
A command that fails is recorded with its status and the tail of its stderr; the rest go on.
--budget_s: no command starts once the run has taken that long (the most important go
first), so that a call with a hard time limit ends with its results written.
--tiny runs the same commands on the default config with tiny shapes (and skips the GPU
kernels without a GPU), to check the script on a CPU.
"""

from __future__ import annotations

import datetime
import gzip
import json
import os
import subprocess
import sys
import time
from typing import Any, Callable

from absl import flags

from benchmarks import seeds
from transformer_jax import checkpoint, errors

flags.DEFINE_string("output", None, "Where to write the JSON.", required=True)
flags.DEFINE_string("target", "h100-sxm", "aot target kind of this GPU (h100-sxm, h200, "
                    "a100-80gb) for the largest batch and the plan check.")
flags.DEFINE_list("only", ["variants", "torch"], "Measurements to take (also: train_step, "
                  "decode, aot_plan, multi30k, serve).")
flags.DEFINE_list("models", ["base", "big"], "WMT14 models of train_step, torch, decode, aot_plan.")
flags.DEFINE_list("attentions", ["auto", "einsum"], "attention_impl values of train_step "
                  "(cudnn is skipped without a GPU).")
flags.DEFINE_list("largest_batch", [], "MODEL=ROWS: the largest batch per device, from an aot "
                  "plan made beforehand on a CPU machine (`aot --target=<target>:1 "
                  "--find_max_batch`), instead of searching on the GPU (7 compiles a model).")
flags.DEFINE_list("batches", ["paper", "largest"], "Batches of train_step: the paper's rows, "
                  "the largest that fits.")
flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds of the multi30k trainings.")
flags.DEFINE_string("runs", "gpu_runs", "Folder of the multi30k workdirs and exports.")
flags.DEFINE_string("multi30k_dir", "../shared/data/multi30k", "Multi30k's files (the config's "
                    "data.dir).")
flags.DEFINE_bool("tiny", False, "Tiny shapes on the default config (a check on a CPU).")
flags.DEFINE_integer("timeout_s", 540, "Limit per command (seconds).")
flags.DEFINE_integer("budget_s", 0, "Start no command once the run has taken this long "
                     "(seconds; 0: no limit).", lower_bound=0)
FLAGS = flags.FLAGS

MEASUREMENTS = ("variants", "train_step", "torch", "decode", "aot_plan", "multi30k", "serve")
ATTENTIONS = ("auto", "einsum", "xla", "cudnn", "splash")
PROFILE = "kernel time by family"
# One lever at a time against the step with attention_impl=auto: (name, model, train_step
# arguments, environment). In order of importance: a call cut short keeps the first ones.
STEP_VARIANTS = [
    ("auto", "base", [], {}),
    ("auto", "big", [], {}),
    # Not a lever: where base's step goes, per GPU kernel (benchmarks/profile_step.py).
    (PROFILE, "base", [], {}),
    ("einsum attention", "base", ["--attention=einsum"], {}),
    ("loss over 8 tiles", "base", ["--config.model.loss_tiles=8"], {}),
    ("no dropout", "base", ["--config.model.dropout_rate=0.0"], {}),
    ("dropout bits from rbg", "base", [], {"JAX_DEFAULT_PRNG_IMPL": "rbg"}),
    ("dropout bits from unsafe_rbg", "base", [], {"JAX_DEFAULT_PRNG_IMPL": "unsafe_rbg"}),
    ("cuDNN layer norm", "base", [], {"XLA_FLAGS": "--xla_gpu_enable_cudnn_layer_norm=true"}),
    ("no Triton GEMM", "base", [], {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=false"}),
    ("no command buffers", "base", [], {"XLA_FLAGS": "--xla_gpu_enable_command_buffer="}),
    ("einsum attention", "big", ["--attention=einsum"], {}),
    ("loss over 8 tiles", "big", ["--config.model.loss_tiles=8"], {}),
    ("no dropout", "big", ["--config.model.dropout_rate=0.0"], {}),
]
# --tiny: the Multi30k recipe at a size that trains in seconds on a CPU.
TINY_MULTI30K = ["--config.num_train_steps=4", "--config.eval_every_steps=4",
                 "--config.checkpoint_every_steps=4", "--config.average_checkpoints=0",
                 "--config.eval.examples=8", "--config.data.tokenizer_max_examples=2000",
                 "--config.data.vocab_size=500", "--config.model.d_model=32",
                 "--config.model.d_ff=64", "--config.model.num_encoder_layers=1",
                 "--config.model.num_decoder_layers=1", "--config.batch_size=8"]
PAPER_ROWS = {"base": 96, "big": 96}      # configs/wmt14_ende_*.py: ~25k + 25k tokens a step


def _run(args: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
  """One project module with --json: its JSON (last stdout line), or why there is none."""
  return _run_command([sys.executable, "-m", *args, "--json"], env=env)


_STARTED = time.perf_counter()


def _run_command(command: list[str], parse_json: bool = True,
                 env: dict[str, str] | None = None) -> dict[str, Any]:
  start = time.perf_counter()
  timeout = FLAGS.timeout_s
  if FLAGS.budget_s:
    left = FLAGS.budget_s - (start - _STARTED)
    if left <= 0:
      return {"command": " ".join(command[1:]), "skipped": f"--budget_s={FLAGS.budget_s} spent"}
    timeout = min(timeout, max(30, int(left)))
  try:
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          env=_environment(env))
  except subprocess.TimeoutExpired:
    return {"command": " ".join(command[1:]), "error": f"timed out after {timeout} s"}
  entry: dict[str, Any] = {"command": " ".join(command[1:]), "status": proc.returncode,
                           **({"env": env} if env else {}),
                           "wall_s": round(time.perf_counter() - start, 1)}
  # attention_impl='cudnn' falls back to 'xla' with a warning: say so beside the number.
  fallbacks = sorted({line.strip() for line in proc.stderr.splitlines() if "falls back" in line})
  if fallbacks:
    entry["fallbacks"] = fallbacks
  if not parse_json:
    if proc.returncode:
      entry["error"] = "\n".join(proc.stderr.strip().splitlines()[-5:])
    return entry
  lines = proc.stdout.strip().splitlines()
  try:
    entry["result"] = json.loads(lines[-1])
  except (IndexError, json.JSONDecodeError):
    entry["error"] = "\n".join(proc.stderr.strip().splitlines()[-5:])
  return entry


def _environment(extra: dict[str, str] | None) -> dict[str, str]:
  """This process's environment with `extra`; XLA_FLAGS are added to those already set."""
  env = {**os.environ, **(extra or {})}
  if extra and "XLA_FLAGS" in extra and os.environ.get("XLA_FLAGS"):
    env["XLA_FLAGS"] = f"{os.environ['XLA_FLAGS']} {extra['XLA_FLAGS']}"
  return env


def _variants(runs: list[dict[str, Any]], save: Callable[[], None]) -> None:
  """Appends STEP_VARIANTS of the models asked for to `runs`, saving after each (--tiny:
  each on the tiny model)."""
  models = dict(_models())
  for name, model, args, env in STEP_VARIANTS:
    # --tiny: the default config, whose model group has no loss_tiles (a WMT14 option).
    if FLAGS.tiny and (model != "base" or any("loss_tiles" in a for a in args)):
      continue
    flags_of = models["tiny"] if FLAGS.tiny else models.get(model)
    if flags_of is None:
      continue
    rows = 8 if FLAGS.tiny else PAPER_ROWS[model]
    module = "benchmarks.profile_step" if name == PROFILE else "benchmarks.train_step"
    runs.append({"measurement": "profile" if name == PROFILE else "variant", "variant": name,
                 "model": model, "batch": rows,
                 **_run([module, *flags_of, "--dtype=bfloat16", "--attention=auto",
                         f"--batch_size={rows}", *args], env=env)})
    save()


def _multi30k(seed: str) -> dict[str, Any]:
  """One seed of the Multi30k recipe: wall time of this call and the final BLEUs."""
  workdir = os.path.join(FLAGS.runs, f"multi30k_s{seed}")
  entry = _run_command([sys.executable, "train.py", "--config=configs/multi30k.py",
                        f"--workdir={workdir}", f"--config.seed={seed}",
                        f"--config.data.dir={FLAGS.multi30k_dir}",
                        *(TINY_MULTI30K if FLAGS.tiny else [])], parse_json=False)
  try:   # the final evaluation's line (after a call cut short: none yet)
    entry["result"] = seeds.final_metrics(workdir, ["step", "eval/bleu", "test/bleu"])
  except (errors.UserError, FileNotFoundError) as e:
    entry.setdefault("error", f"no final BLEU yet ({e}); the same call resumes the run")
  return {"measurement": "multi30k", "seed": seed, "workdir": workdir, **entry}


def _serve(seed: str) -> list[dict[str, Any]]:
  """predict's sentences/s and the server's latency on the Multi30k model of `seed`."""
  workdir = os.path.join(FLAGS.runs, f"multi30k_s{seed}")
  checkpoints = os.path.join(workdir, "checkpoints")
  steps = checkpoint.checkpoint_steps(checkpoints) if os.path.isdir(checkpoints) else []
  if not steps:
    return [{"measurement": "serve", "error": f"no checkpoint in {checkpoints}: run "
             "--only=multi30k first"}]
  last = str(steps[-1])
  artifact = os.path.join(FLAGS.runs, f"multi30k_s{seed}_stablehlo")
  inputs = os.path.join(FLAGS.runs, "val32.de")
  with open(inputs, "w") as f:   # the first 32 val sentences, as on the CPU (RESULTS.md)
    with gzip.open(os.path.join(FLAGS.multi30k_dir, "val.de.gz"), "rt") as source:
      f.writelines(line for _, line in zip(range(32), source))
  runs = [{"measurement": "predict", **_run(
      ["benchmarks.ctranslate2_speed", f"--checkpoint={os.path.join(checkpoints, last)}",
       f"--inputs={os.path.join(FLAGS.multi30k_dir, 'val.de.gz')}", "--lines=500", "--batch_size=32"])}]
  if not os.path.isdir(artifact):
    runs.append({"measurement": "export", **_run_command(
        [sys.executable, "-m", "transformer_jax.export", f"--workdir={workdir}",
         "--format=stablehlo", f"--output={artifact}"], parse_json=False)})
  runs.append({"measurement": "serve", **_run(
      ["benchmarks.serve_load", f"--model={artifact}", f"--inputs={inputs}",
       f"--requests={20 if FLAGS.tiny else 200}", "--clients=8"])})
  return runs


def _models() -> list[tuple[str, list[str]]]:
  """(name, the config flags and shapes of its train step)."""
  if FLAGS.tiny:
    return [("tiny", ["--config=configs/default.py", "--src_length=16", "--tgt_length=16",
                      "--steps=2", "--warmup=1"])]
  return [(m, [f"--config=configs/wmt14_ende_{m}.py", "--src_length=256", "--tgt_length=256",
               "--packed"]) for m in FLAGS.models]


def _given_largest_batches() -> dict[str, int]:
  """--largest_batch as {model: rows per device}."""
  given = {}
  for item in FLAGS.largest_batch:
    model, _, rows = item.partition("=")
    if model not in ("base", "big") or not rows.isdigit() or int(rows) < 1:
      raise errors.UserError(f"--largest_batch: {item!r} is not MODEL=ROWS, e.g. base=933")
    given[model] = int(rows)
  return given


def _largest_batch(name: str, config_flag: str, devices: int) -> int | None:
  """The largest global batch of one device's train step that aot plans to fit."""
  given = _given_largest_batches()
  if name in given:
    return given[name] * devices
  plan = _run(["transformer_jax.aot", config_flag, f"--target={FLAGS.target}:1",
               "--config.model.dtype=bfloat16", "--programs=train_step", "--find_max_batch",
               "--batch_tolerance=0.05"])
  batch = plan.get("result", {}).get("max_batch")
  return batch * devices if batch else None


def measure(save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
  import jax
  out: dict[str, Any] = {
      "date": datetime.date.today().isoformat(), "device": jax.devices()[0].device_kind,
      "devices": jax.device_count(), "jax": jax.__version__, "tiny": FLAGS.tiny,
      "note": "measurements on this device, except aot_plan (the plan, an estimate)"}
  gpu = jax.devices()[0].platform == "gpu"
  attentions = [a for a in FLAGS.attentions if gpu or a not in ("cudnn", "splash")]
  runs: list[dict[str, Any]] = []
  out["runs"] = runs
  for name, model in _models():
    if not {"train_step", "torch", "decode", "aot_plan"} & set(FLAGS.only):
      break
    batches = {"paper": 8 if FLAGS.tiny else PAPER_ROWS[name]}
    if "train_step" in FLAGS.only and "largest" in FLAGS.batches and not FLAGS.tiny:
      largest = _largest_batch(name, model[0], jax.device_count())
      if largest:
        batches["largest"] = largest
    for label, rows in batches.items():
      step = ["benchmarks.train_step", *model, "--dtype=bfloat16", f"--batch_size={rows}"]
      if "train_step" in FLAGS.only and label in FLAGS.batches:
        for attention in attentions:
          runs.append({"measurement": "train_step", "model": name, "batch": label,
                       "attention": attention, **_run([*step, f"--attention={attention}"])})
          save(out)
      if "aot_plan" in FLAGS.only:
        runs.append({"measurement": "aot_plan", "model": name, "batch": label,
                     **_run(["transformer_jax.aot", model[0], f"--target={FLAGS.target}:1",
                             "--config.model.dtype=bfloat16", "--programs=train_step",
                             f"--config.batch_size={rows}"])})
    if "torch" in FLAGS.only and name in ("base", "tiny"):
      runs.append({"measurement": "torch", "model": name, "batch": "paper",
                   # Full rows: torch.nn.Transformer takes no segment ids (no --packed).
                   **_run(["benchmarks.train_step", *[f for f in model if f != "--packed"],
                           "--dtype=bfloat16", "--attention=auto",
                           f"--batch_size={batches['paper']}", "--compare=torch"],
                          # JAX would take 75% of the GPU before torch asks for any.
                          env={"XLA_PYTHON_CLIENT_PREALLOCATE": "false"})})
      save(out)
    if "decode" in FLAGS.only:
      runs.append({"measurement": "decode", "model": name,
                   **_run(["benchmarks.decode", model[0]]
                          + (["--max_length=8"] if FLAGS.tiny else []))})
      save(out)
  if "variants" in FLAGS.only:   # after torch: the target against torch.compile comes first
    _variants(runs, lambda: save(out))
  if "multi30k" in FLAGS.only:
    for seed in FLAGS.seeds:
      runs.append(_multi30k(seed))
      save(out)
  if "serve" in FLAGS.only:
    runs.extend(_serve(FLAGS.seeds[0]))
  if not gpu:
    out["skipped"] = "attention_impl=cudnn: needs a GPU (auto is the einsum path here)"
  return out


def main(argv: list[str]) -> None:
  unknown = set(FLAGS.only) - set(MEASUREMENTS)
  if unknown:
    raise errors.UserError(f"--only: unknown {sorted(unknown)}; choose from {MEASUREMENTS}")
  if set(FLAGS.models) - {"base", "big"}:
    raise errors.UserError(f"--models={','.join(FLAGS.models)}: choose from base, big")
  if set(FLAGS.batches) - {"paper", "largest"}:
    raise errors.UserError(f"--batches={','.join(FLAGS.batches)}: choose from paper, largest")
  if set(FLAGS.attentions) - set(ATTENTIONS):
    raise errors.UserError(f"--attentions={','.join(FLAGS.attentions)}: choose from "
                           f"{', '.join(ATTENTIONS)}")
  _given_largest_batches()      # checked before the first command
  if not all(seed.isdigit() for seed in FLAGS.seeds):
    raise errors.UserError(f"--seeds={','.join(FLAGS.seeds)}: non-negative integers, e.g. 0,1,2")
  os.makedirs(FLAGS.runs, exist_ok=True)

  def save(result: dict[str, Any]) -> None:   # after each command: a call cut short keeps them
    with open(FLAGS.output, "w") as f:
      json.dump(result, f, indent=1, default=str)
  result = measure(save)
  save(result)
  failed = [r.get("command", r["measurement"]) for r in result["runs"] if "error" in r]
  skipped = sum("skipped" in r for r in result["runs"])
  print(f"{len(result['runs'])} commands, {len(failed)} failed, {skipped} skipped for time; "
        f"wrote {FLAGS.output}")
  for command in failed:
    print(f"  failed: {command}")


if __name__ == "__main__":
  errors.run(main)
