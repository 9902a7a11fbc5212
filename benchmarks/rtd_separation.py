"""How well a replaced-token-detection stage's discriminator tells replaced tokens from the
originals, threshold-free: the AUC of its logits (the chance that a replaced token scores
above an original one; 0.5 is blind). The stage's own metrics count hits at a logit of 0,
which cannot tell a blind model that has learnt how rare replacements are from one that ranks
them but stays cautious.

  python -m benchmarks.rtd_separation --workdir=W/pretrain [--step=S] [--batches=4]

Two kinds of replacement at the evaluation's masked positions (mlm.py's fixed evaluation
mask) of the first batches of the dev split: the generator's draws, which the discriminator
was trained on, and entries drawn uniformly from the vocabulary.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from transformer_jax import checkpoint, errors
from transformer_jax.config import PAD_ID
from transformer_jax.errors import UserError
from transformer_jax.tasks.mlm import FIRST_MASKABLE
from transformer_jax.tasks.rtd import ReplacedTokenDetectionTask
from transformer_jax.training.experiment import Experiment

_WORKDIR = flags.DEFINE_string("workdir", None, "The stage's workdir (a run's W/pretrain).")
_STEP = flags.DEFINE_integer("step", 0, "The checkpoint's step (0: the newest).")
_BATCHES = flags.DEFINE_integer("batches", 4, "Dev batches (eval.batch_size rows each).")


def auc(positive: np.ndarray, negative: np.ndarray) -> float:
  """P(a positive's score > a negative's), ties counting one half (Mann-Whitney U)."""
  _, where, counts = np.unique(np.concatenate([positive, negative]), return_inverse=True,
                               return_counts=True)
  ranks = (np.cumsum(counts) - (counts - 1) / 2)[where]     # 1-based; tied scores: their mean
  n = len(positive)
  return float((ranks[:n].sum() - n * (n + 1) / 2) / (n * len(negative)))


def judged(task: ReplacedTokenDetectionTask, params: Any, batch: dict[str, jax.Array],
           key: jax.Array) -> list[tuple[jax.Array, jax.Array]]:
  """The discriminator's logits (B, T) and replaced labels (B, T) for the batch with its
  masked positions drawn by the generator, and the same for uniform draws there."""
  masked, weights, _ = task.masked_inputs(batch, None, False)
  _, drawn = task.generate(params, batch, masked, weights, key, None, False)
  at, tokens = masked["predict_at"], batch["tokens"]
  uniform = jax.random.randint(key, at.shape, FIRST_MASKABLE, task.model_config.vocab_size)
  uniform = jnp.where(weights > 0, uniform.astype(tokens.dtype),
                      jnp.take_along_axis(tokens, at, 1))
  rows = jnp.arange(tokens.shape[0])[:, None]
  return [task.judge(params, batch, changed, None, False)
          for changed in (drawn, tokens.at[rows, at].set(uniform))]


def separation(workdir: str, step: int = 0, batches: int = 4) -> dict[str, dict[str, float]]:
  """For each kind of draw ("generator", "uniform"): the AUC, the replaced and real token
  counts, and the mean logits of the replaced and of the original tokens, over the first
  `batches` dev batches, at checkpoint `step` (0: the newest) of the stage in `workdir`."""
  directory = os.path.join(workdir, checkpoint.CHECKPOINT_DIR)
  steps = checkpoint.checkpoint_steps(directory) if os.path.isdir(directory) else []
  if not steps:
    raise UserError(f"--workdir={workdir!r}: no checkpoints in {directory}; give a replaced-"
                    "token-detection stage's workdir (a run's W/pretrain)")
  step = step or steps[-1]
  if step not in steps:
    raise UserError(f"--step={step}: {directory} holds steps {steps}")
  config = checkpoint.read_record(os.path.join(directory, str(step))).config
  if config.get("task") != ReplacedTokenDetectionTask.name:
    raise UserError(f"--workdir={workdir}: its task is {config.get('task')!r}, not 'rtd'")
  experiment = Experiment.create(config, workdir)
  task = experiment.task
  params = checkpoint.restore_params(os.path.join(directory, str(step)))
  split = experiment.options.data.eval_split
  chosen = experiment.eval_batches(split, batches * experiment.eval.batch_size)[:batches]
  run = jax.jit(lambda p, b, k: judged(task, p, b, k))
  found = {"generator": ([], []), "uniform": ([], [])}
  for i, batch in enumerate(chosen):
    arrays = {k: jnp.asarray(v) for k, v in batch.arrays.items()}
    real = np.asarray(arrays["tokens"] != PAD_ID)
    for name, (logits, replaced) in zip(found, run(params, arrays, jax.random.PRNGKey(i))):
      logits, replaced = np.asarray(logits), np.asarray(replaced)
      found[name][0].append(logits[real & replaced])
      found[name][1].append(logits[real & ~replaced])
  result = {}
  for name, (replaced, original) in found.items():
    replaced, original = np.concatenate(replaced), np.concatenate(original)
    result[name] = {"auc": auc(replaced, original), "replaced": len(replaced),
                    "real": len(replaced) + len(original), "step": step,
                    "replaced_logit": float(replaced.mean()),
                    "original_logit": float(original.mean())}
  return result


def main(argv) -> None:
  del argv
  result = separation(_WORKDIR.value, _STEP.value, _BATCHES.value)
  step = next(iter(result.values()))["step"]
  print(f"{_WORKDIR.value}, step {step}, {_BATCHES.value} dev batches")
  print("draws | replaced tokens | mean logit replaced / original | AUC")
  for name, r in result.items():
    print(f"{name} | {r['replaced']:,} of {r['real']:,} | {r['replaced_logit']:.2f} / "
          f"{r['original_logit']:.2f} | {r['auc']:.3f}")


if __name__ == "__main__":
  flags.mark_flag_as_required("workdir")
  errors.run(main)
