"""LoRA against full fine-tuning at equal steps, on a real shift of domain: a character-level
language model of Shakespeare (the Options-at-equal-steps proxy of configs/shakespeare_char.py:
4 layers, 128 wide, Muon, 1,000 steps) fine-tuned on the English captions of Multi30k
(../shared/data/multi30k train.en, 29,000 sentences; its val.en, 1,014, is the evaluation),
through train.py:

  python -m benchmarks.lora_learning --out=/tmp/lora_learning [--steps=300] [--json]
      [--full_rate=3e-4] [--lora_rate=2e-3] [--rank=16] [--base=CHECKPOINT]

--out gets the base's workdir (unless --base names a checkpoint or export), a folder of
links naming the captions as the lm task reads text (train.txt.gz, val.txt.gz), and one
workdir per fine-tuning. Both fine-tunings start from the same base, see the same batches
(the same seed), and run AdamW at their own peak rate (a warm-up of a tenth of the steps,
then a cosine to a tenth of it); reported: val loss (nats per character) before (the base)
and after each, and the wall time of each run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

from absl import app, flags

flags.DEFINE_string("out", None, "Where the runs go.", required=True)
flags.DEFINE_string("data", "../shared/data", "The shared data folder.")
flags.DEFINE_string("base", "", "The model to fine-tune (default: train the proxy in --out).")
flags.DEFINE_integer("steps", 300, "Fine-tuning steps (each 16 rows of 128 characters).")
flags.DEFINE_float("full_rate", 3e-4, "Full fine-tuning's peak rate.")
flags.DEFINE_float("lora_rate", 2e-3, "LoRA's peak rate.")
flags.DEFINE_integer("rank", 16, "LoRA's rank (alpha = 2 x rank).")
flags.DEFINE_integer("seed", 0, "The runs' seed.")
flags.DEFINE_bool("json", False, "Print one JSON object.")
FLAGS = flags.FLAGS
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROXY = ["--config.model.num_decoder_layers=4", "--config.model.d_model=128",
         "--config.model.num_heads=4", "--config.model.d_ff=352",
         "--config.optimizer.name=muon"]


def _train(workdir: str, *overrides: str) -> tuple[float, float]:
  """(the last eval/loss it prints, seconds) of train.py on configs/shakespeare_char.py."""
  start = time.perf_counter()
  command = [sys.executable, os.path.join(ROOT, "train.py"),
             f"--config={os.path.join(ROOT, 'configs', 'shakespeare_char.py')}",
             f"--workdir={workdir}", f"--config.seed={FLAGS.seed}", *overrides]
  run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
  if run.returncode:
    sys.exit(f"{' '.join(command)}\n{run.stderr}")
  printed = run.stdout
  return float(re.findall(r"eval/loss=([0-9.]+)", printed)[-1]), time.perf_counter() - start


def _captions(out: str) -> str:
  """A folder naming Multi30k's English captions as the lm task's files (links)."""
  folder = os.path.join(out, "captions")
  os.makedirs(folder, exist_ok=True)
  for ours, theirs in (("train.txt.gz", "train.en.gz"), ("val.txt.gz", "val.en.gz")):
    link = os.path.join(folder, ours)
    if not os.path.exists(link):
      os.symlink(os.path.abspath(os.path.join(FLAGS.data, "multi30k", theirs)), link)
  return folder


def main(argv: list[str]) -> None:
  del argv
  out = os.path.abspath(FLAGS.out)
  base = FLAGS.base
  if not base:
    base = os.path.join(out, "base")
    if not os.path.isdir(os.path.join(base, "checkpoints")):
      _train(base, *PROXY, "--config.num_train_steps=1000", "--config.eval_every_steps=1000",
             "--config.checkpoint_every_steps=1000",
             f"--config.data.dir={os.path.join(FLAGS.data, 'shakespeare')}")
    base = os.path.join(base, "checkpoints", "1000")
  captions = _captions(out)
  common = [*PROXY[:-1], "--config.optimizer.name=adamw",   # fine-tuning: AdamW, as measured
            f"--config.init_from={base}", f"--config.data.dir={captions}",
            f"--config.num_train_steps={FLAGS.steps}", f"--config.eval_every_steps={FLAGS.steps}",
            f"--config.checkpoint_every_steps={FLAGS.steps}",
            f"--config.optimizer.warmup_steps={max(1, FLAGS.steps // 10)}",
            "--config.eval.num_samples=0"]
  result: dict = {"data": "multi30k train.en -> val.en", "base": base, "steps": FLAGS.steps,
                  "seed": FLAGS.seed}
  result["base_val_loss"], _ = _train(os.path.join(out, "base_on_captions"), *common,
                                      "--eval_only", f"--checkpoint={base}")
  for name, rank, rate in (("full", 0, FLAGS.full_rate), ("lora", FLAGS.rank, FLAGS.lora_rate)):
    lora = [f"--config.lora.rank={rank}", f"--config.lora.alpha={2.0 * rank}"] if rank else []
    loss, seconds = _train(os.path.join(out, f"{name}_{rate:g}"), *common, *lora,
                           f"--config.optimizer.learning_rate={rate}",
                           f"--config.optimizer.end_learning_rate={rate / 10}")
    result[name] = {"rate": rate, "rank": rank, "val_loss": loss, "seconds": round(seconds, 1)}
  result["lora_minus_full"] = result["lora"]["val_loss"] - result["full"]["val_loss"]
  if FLAGS.json:
    print(json.dumps(result))
    return
  for key, value in result.items():
    print(f"{key}: {value}")


if __name__ == "__main__":
  app.run(main)
