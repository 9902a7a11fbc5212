"""The GPU measurements in one run, written to one JSON file after every command: the
project's own commands, each as a subprocess with --json, with the device, date and versions
(cuDNN's among them).

  python -m benchmarks.gpu_measurements --output=gpu_measurements.json [--target=h100-sxm]
      [--only=self_check,paths,profile,torch,variants,gpt2,train_step,decode,aot_plan,
       multi30k,serve] [--models=base,big] [--attentions=auto,einsum] [--batches=paper]
      [--largest_batch=base=948] [--seeds=0,1,2] [--runs=gpu_runs] [--timeout_s=540]
      [--budget_s=0]
  python -m benchmarks.gpu_measurements --tiny --output=/tmp/m.json   # CPU: tiny shapes

- self_check: tests/test_kernels_gpu.py, each fused attention path against the einsum path
  (values, gradients, finite); its report, RUNS/self_check.json, says which paths passed.
  A path that failed is never timed;
- paths: the train step of WMT14 base, then big, bf16, 96 packed rows of 256 + 256, with
  the einsum attention and with each path that passed the self-check (benchmarks/
  train_step.py; cuDNN's workspaces read from the GPU's own compile);
- profile: the fastest base step's GPU time by kernel family (benchmarks/profile_step.py);
- torch: the base step unpacked, side by side with PyTorch, eager and torch.compile, in one
  process in turns (benchmarks/train_step.py --compare=torch, the fastest path);
- variants: the fastest base step with one lever changed at a time (STEP_VARIANTS below);
- gpt2: GPT-2 small (configs/gpt2_small.py, bf16, 16 x 1,024) beside nanoGPT's model under
  torch.compile, in one process in turns, with einsum and with Pallas if it passed;
- train_step: the step with each of --attentions, at the paper's batch and at the largest
  batch per device that `aot --find_max_batch` plans for the target (or --largest_batch);
- decode: beam-search and greedy decoding throughput (benchmarks/decode.py);
- aot_plan: what `python -m transformer_jax.aot --target=<target>:1` plans for each measured
  train step (memory per device, roofline), to set beside the measurement;
- multi30k: `train.py --config=configs/multi30k.py` for each of --seeds, in RUNS/multi30k_s<seed>:
  wall time, the final val BLEU and test BLEU. A run stopped by --timeout_s is resumed
  exactly by the same command again;
- serve: on RUNS/multi30k_s<first seed>, predict's sentences/s (benchmarks/ctranslate2_speed.py,
  500 val lines) and the StableHLO server's requests/s, p50 and p99 with 8 clients.
A command that fails is recorded with its status and the tail of its stderr; the rest go on.
--budget_s: no command starts once the run has taken that long (the most important go
first), so that a call with a hard time limit ends with its results written.
--tiny runs the same commands on the default config with tiny shapes (the self-check's
Pallas kernel in interpret mode, cuDNN's paths not run), to check the script on a CPU.
"""

from __future__ import annotations

import datetime
import gzip
import json
import os
import sys
from typing import Any, Callable

from absl import flags

from benchmarks import commands, seeds
from transformer_jax import checkpoint, errors

flags.DEFINE_string("output", None, "Where to write the JSON.", required=True)
flags.DEFINE_string("target", "h100-sxm", "aot target kind of this GPU (h100-sxm, h200, "
                    "a100-80gb) for the largest batch and the plan check.")
flags.DEFINE_list("only", ["self_check", "paths", "profile"], "Measurements to take "
                  "(MEASUREMENTS).")
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

MEASUREMENTS = ("self_check", "paths", "profile", "torch", "variants", "gpt2", "train_step",
                "decode", "aot_plan", "multi30k", "serve")
ATTENTIONS = ("auto", "einsum", "xla", "pallas", "cudnn", "cudnn_dense", "splash")
FUSED = ("pallas", "cudnn", "cudnn_dense")      # the self-check's paths (GPU kernels)
# One lever at a time against the fastest base step: (name, train_step arguments,
# environment), in order of importance (a call cut short keeps the first ones).
STEP_VARIANTS = [
    ("loss over 8 tiles", ["--config.model.loss_tiles=8"], {}),
    ("no dropout", ["--config.model.dropout_rate=0.0"], {}),
    ("dropout bits from rbg", [], {"JAX_DEFAULT_PRNG_IMPL": "rbg"}),
    ("dropout bits from unsafe_rbg", [], {"JAX_DEFAULT_PRNG_IMPL": "unsafe_rbg"}),
    ("cuDNN layer norm", [], {"XLA_FLAGS": "--xla_gpu_enable_cudnn_layer_norm=true"}),
    ("no Triton GEMM", [], {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=false"}),
    ("no command buffers", [], {"XLA_FLAGS": "--xla_gpu_enable_command_buffer="}),
]
# --tiny: the Multi30k recipe at a size that trains in seconds on a CPU.
TINY_MULTI30K = ["--config.num_train_steps=4", "--config.eval_every_steps=4",
                 "--config.checkpoint_every_steps=4", "--config.average_checkpoints=0",
                 "--config.eval.examples=8", "--config.data.tokenizer_max_examples=2000",
                 "--config.data.vocab_size=500", "--config.model.d_model=32",
                 "--config.model.d_ff=64", "--config.model.num_encoder_layers=1",
                 "--config.model.num_decoder_layers=1", "--config.batch_size=8"]
PAPER_ROWS = {"base": 96, "big": 96}      # configs/wmt14_ende_*.py: ~25k + 25k tokens a step
# --tiny: the character-level language model at a size that steps in seconds on a CPU.
TINY_LM = ["--config=benchmarks/configs/shakespeare_char_nanogpt.py", "--vocab_size=40",
           "--length=16", "--batch_size=3", "--config.model.d_model=32",
           "--config.model.d_ff=64", "--config.model.num_heads=2",
           "--config.model.num_decoder_layers=2", "--warmup=1", "--steps=2"]


RUN = commands.Runner(timeout_s=540)    # main() sets the limits from the flags


def _self_check_report() -> str:
  return os.path.abspath(os.path.join(FLAGS.runs, "self_check.json"))


def _self_check(gpu: bool) -> dict[str, Any]:
  """tests/test_kernels_gpu.py, its report in RUNS/self_check.json (on a CPU, --tiny: the
  harness itself, Pallas in interpret mode)."""
  report = _self_check_report()
  if os.path.exists(report):
    os.remove(report)
  env = {"SELF_CHECK_JSON": report, **({} if gpu else {"SELF_CHECK_ON_CPU": "1"})}
  entry = RUN.command([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "tests/test_kernels_gpu.py"], parse_json=False, env=env)
  entry.pop("error", None)    # a path that fails is a finding, recorded in the report
  if os.path.exists(report):
    with open(report) as f:
      entry["result"] = json.load(f)
  elif "skipped" not in entry:
    entry["error"] = "the self-check wrote no report (cut short?): no fused path is timed"
  return {"measurement": "self_check", **entry}


def passed_paths() -> list[str]:
  """The fused attention paths the last self-check passed, in FUSED's order."""
  if not os.path.exists(_self_check_report()):
    return []
  with open(_self_check_report()) as f:
    paths = json.load(f)["paths"]
  return [p for p in FUSED if paths.get(p, {}).get("passed")]


def _step(model: str, attention: str, *args: str, env: dict[str, str] | None = None,
          module: str = "benchmarks.train_step") -> dict[str, Any]:
  """One train-step command of `model` (its packed WMT14 rows; --tiny: the tiny model)."""
  rows = 8 if FLAGS.tiny else PAPER_ROWS[model]
  return {"model": model, "attention": attention, "batch": rows,
          **RUN.module([module, *dict(_models())[model], "--dtype=bfloat16",
                  f"--batch_size={rows}", f"--attention={attention}", *args], env=env)}


def _step_ms(entry: dict[str, Any]) -> float:
  """The step's median time; infinite where it failed or fell back to another path."""
  if "fallbacks" in entry:
    return float("inf")
  return entry.get("result", {}).get("step_time_ms", {}).get("median", float("inf"))


def _paths(runs: list[dict[str, Any]], save: Callable[[], None], model: str,
           attentions: list[str]) -> dict[str, float]:
  """`model`'s step with each of `attentions` in turn: {attention: median ms}."""
  times = {}
  for attention in attentions:
    entry = {"measurement": "paths", **_step(model, attention)}
    runs.append(entry)
    save()
    times[attention] = _step_ms(entry)
  return times


def _variants(runs: list[dict[str, Any]], save: Callable[[], None], attention: str) -> None:
  """STEP_VARIANTS on the first model's step with `attention`, saving after each."""
  model = _models()[0][0]
  for name, args, env in STEP_VARIANTS:
    if FLAGS.tiny and any("loss_tiles" in a for a in args):
      continue    # the default config's model group has no loss_tiles (a WMT14 option)
    runs.append({"measurement": "variant", "variant": name,
                 **_step(model, attention, *args, env=env)})
    save()


def _gpt2(runs: list[dict[str, Any]], save: Callable[[], None]) -> None:
  """GPT-2 small beside nanoGPT's model under torch.compile, in one process in turns."""
  shape = (TINY_LM if FLAGS.tiny else
           ["--config=configs/gpt2_small.py", "--batch_size=16", "--length=1024"])
  for attention in ["einsum"] + (["pallas"] if "pallas" in passed_paths() else []):
    runs.append({"measurement": "gpt2", "attention": attention, **RUN.module(
        ["benchmarks.train_step", *shape, "--dtype=bfloat16", f"--attention={attention}",
         "--compare=torch"], env={"XLA_PYTHON_CLIENT_PREALLOCATE": "false"})})
    save()


def _multi30k(seed: str) -> dict[str, Any]:
  """One seed of the Multi30k recipe: wall time of this call and the final BLEUs."""
  workdir = os.path.join(FLAGS.runs, f"multi30k_s{seed}")
  entry = RUN.command([sys.executable, "train.py", "--config=configs/multi30k.py",
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
  runs = [{"measurement": "predict", **RUN.module(
      ["benchmarks.ctranslate2_speed", f"--checkpoint={os.path.join(checkpoints, last)}",
       f"--inputs={os.path.join(FLAGS.multi30k_dir, 'val.de.gz')}", "--lines=500",
       "--batch_size=32"])}]
  if not os.path.isdir(artifact):
    runs.append({"measurement": "export", **RUN.command(
        [sys.executable, "-m", "transformer_jax.export", f"--workdir={workdir}",
         "--format=stablehlo", f"--output={artifact}"], parse_json=False)})
  runs.append({"measurement": "serve", **RUN.module(
      ["benchmarks.serve_load", f"--model={artifact}", f"--inputs={inputs}",
       f"--requests={20 if FLAGS.tiny else 200}", "--clients=8"])})
  return runs


def _models() -> list[tuple[str, list[str]]]:
  """(name, the config flags and shapes of its train step)."""
  if FLAGS.tiny:
    return [("tiny", ["--config=configs/default.py", "--src_length=16", "--tgt_length=16",
                      "--steps=2", "--warmup=1", "--packed"])]
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
  plan = RUN.module(["transformer_jax.aot", config_flag, f"--target={FLAGS.target}:1",
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
  if gpu:
    from transformer_jax.platforms import cudnn_version
    out["cudnn"] = cudnn_version()
  attentions = [a for a in FLAGS.attentions if gpu or a not in (*FUSED, "splash")]
  runs: list[dict[str, Any]] = []
  out["runs"] = runs
  fastest = "einsum"
  if "self_check" in FLAGS.only:
    runs.append(_self_check(gpu))
    save(out)
  # The first model's step with each path that passed, its fastest profiled, then the other
  # models' with the same paths, fastest first (a budget cuts the slowest).
  first, *others = [name for name, _ in _models()]
  if "paths" in FLAGS.only:
    times = _paths(runs, lambda: save(out), first, ["einsum", *passed_paths()])
    fastest = min(times, key=times.__getitem__)
  if "profile" in FLAGS.only:
    runs.append({"measurement": "profile", **_step(first, fastest,
                                                   module="benchmarks.profile_step")})
    save(out)
  if "paths" in FLAGS.only:
    for model in others:
      _paths(runs, lambda: save(out), model, sorted(times, key=times.__getitem__))
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
                       "attention": attention, **RUN.module([*step, f"--attention={attention}"])})
          save(out)
      if "aot_plan" in FLAGS.only:
        runs.append({"measurement": "aot_plan", "model": name, "batch": label,
                     **RUN.module(["transformer_jax.aot", model[0], f"--target={FLAGS.target}:1",
                             "--config.model.dtype=bfloat16", "--programs=train_step",
                             f"--config.batch_size={rows}"])})
    if "torch" in FLAGS.only and name in ("base", "tiny"):
      runs.append({"measurement": "torch", "model": name, "batch": "paper",
                   "attention": fastest,
                   # Full rows: torch.nn.Transformer takes no segment ids (no --packed).
                   **RUN.module(["benchmarks.train_step", *[f for f in model if f != "--packed"],
                           "--dtype=bfloat16", f"--attention={fastest}",
                           f"--batch_size={batches['paper']}", "--compare=torch"],
                          # JAX would take 75% of the GPU before torch asks for any.
                          env={"XLA_PYTHON_CLIENT_PREALLOCATE": "false"})})
      save(out)
    if "decode" in FLAGS.only:
      runs.append({"measurement": "decode", "model": name,
                   **RUN.module(["benchmarks.decode", model[0]]
                          + (["--max_length=8"] if FLAGS.tiny else []))})
      save(out)
  if "variants" in FLAGS.only:   # after torch: the target against torch.compile comes first
    _variants(runs, lambda: save(out), fastest)
  if "gpt2" in FLAGS.only:
    _gpt2(runs, lambda: save(out))
  if "multi30k" in FLAGS.only:
    for seed in FLAGS.seeds:
      runs.append(_multi30k(seed))
      save(out)
  if "serve" in FLAGS.only:
    runs.extend(_serve(FLAGS.seeds[0]))
  if not gpu:
    out["skipped"] = "the GPU kernels: none runs here (Pallas runs interpreted in the self-check)"
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
  global RUN
  RUN = commands.Runner(FLAGS.timeout_s, FLAGS.budget_s)
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
