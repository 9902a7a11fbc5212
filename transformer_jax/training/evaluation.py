"""Evaluating a split during and after training: the task's metrics over its batches, fed to
the mesh from hosts that each hold every batch whole."""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from transformer_jax import lora, sharding
from transformer_jax.training.experiment import Experiment

Samples = list[tuple[str, str, str]]   # (input, output, reference)


def _global_eval_step(eval_step: Any, mesh: Any) -> Any:
  """eval_step on host batches that every process holds whole: each feeds its own rows.
  Batches are first padded with all-zero rows (padding, which weighs nothing in the sums)
  to a row count that splits evenly over the mesh and the processes."""
  ways = math.lcm(sharding.batch_ways(mesh), jax.process_count())

  def step(params: Any, batch: dict[str, np.ndarray]) -> Any:
    extra = -len(next(iter(batch.values()))) % ways
    batch = {k: np.pad(v, [(0, extra)] + [(0, 0)] * (v.ndim - 1)) for k, v in batch.items()}
    rows = sharding.local_rows(len(next(iter(batch.values()))))
    return eval_step(params, sharding.to_global({k: v[rows] for k, v in batch.items()}, mesh))
  return step


class Evaluator:
  """Evaluation of one split's batches (see Experiment.eval_batches): `__call__(params)`
  gives the task's metrics, prefixed ("eval/", "test/"), and samples. A LoRA state's
  parameters are merged once per call (lora.py), in the base's shardings."""

  def __init__(self, experiment: Experiment, batches: list, eval_step: Any,
               prefix: str = "eval"):
    self.experiment, self.batches, self.prefix = experiment, batches, prefix
    self.eval_step = _global_eval_step(eval_step, experiment.mesh)

  def __call__(self, params: Any) -> tuple[dict[str, float], Samples]:
    e = self.experiment
    if lora.is_adapted(params):
      params = lora.merge_placed(params["base"], params["adapters"], e.lora)
    metrics, samples = e.task.evaluate(params, self.batches, self.eval_step, e.decode)
    return {f"{self.prefix}/{k}": v for k, v in metrics.items()}, samples
