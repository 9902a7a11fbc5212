"""The train/eval loop behind `python train.py`."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from tqdm.auto import tqdm

from transformer_jax.checkpoint import Checkpointer
from transformer_jax.config import TransformerConfig
from transformer_jax.data.sources import make_source
from transformer_jax.data.text_data import LABELS_FILE, VOCAB_FILE
from transformer_jax.inputs import check_token_ids
from transformer_jax.metrics import MetricWriter
from transformer_jax.params import count_params
from transformer_jax.training.optimizers import make_optimizer, make_schedule
from transformer_jax.training.state import TrainState, create_train_state
from transformer_jax.training.steps import NONFINITE_POLICIES, make_eval_step, make_train_step
from transformer_jax.training.tasks import make_task

CONFIG_FILE, CHECKPOINT_DIR = "config.json", "checkpoints"


class NonFiniteLossError(RuntimeError):
  """Training produced a NaN or Inf loss or gradient."""


def validate(config: ml_collections.ConfigDict) -> None:
  """Top-level training fields; model fields are checked by TransformerConfig."""
  for field in ("num_train_steps", "log_every_steps", "eval_every_steps",
                "checkpoint_every_steps", "keep_checkpoints", "batch_size", "grad_accum_steps"):
    value = config[field]
    if not isinstance(value, int) or value < 1:
      raise ValueError(f"config.{field}={value!r}: must be a positive integer")
  if config.batch_size % config.grad_accum_steps:
    raise ValueError(f"config.batch_size={config.batch_size} must be divisible by "
                     f"config.grad_accum_steps={config.grad_accum_steps}")
  if config.nonfinite not in NONFINITE_POLICIES:
    raise ValueError(f"config.nonfinite={config.nonfinite!r}: must be one of "
                     f"{NONFINITE_POLICIES}")
  if config.decode.beam_size < 1:
    raise ValueError(f"config.decode.beam_size={config.decode.beam_size}: must be >= 1")


def model_config(config: ml_collections.ConfigDict, data: Any) -> TransformerConfig:
  """The config's model fields with the vocabulary sizes of the data's tokenizers."""
  values = {**config.model.to_dict(), "vocab_size": data.tokenizer.vocab_size}
  if data.target_tokenizer is not data.tokenizer:
    if values["share_embeddings"]:   # Equal sizes or not, id i means different pieces.
      raise ValueError("model.share_embeddings=True needs one vocabulary for source and "
                       "target, but data.shared_vocab=False gives two; set "
                       "--config.model.share_embeddings=False")
    values["target_vocab_size"] = data.target_tokenizer.vocab_size
  return TransformerConfig.from_dict(values)


def build_task(config: Any, model_cfg: TransformerConfig, data: Any) -> Any:
  return make_task(data.kind, model_cfg, label_smoothing=config.label_smoothing,
                   labels=data.labels, tokenizer=data.target_tokenizer, decode=config.decode,
                   pooling=config.get("pooling", "mean"))


def _check_batch(model_cfg: TransformerConfig, batch: dict[str, np.ndarray], what: str) -> None:
  """Token ids and lengths against the model: ids from the tokenizers are in range by
  construction, but a model max_len below the data's lengths is caught here, by name."""
  limits = {"src": model_cfg.vocab_size, "tgt_in": model_cfg.tgt_vocab_size,
            "tokens": model_cfg.vocab_size}
  for key, vocab_size in limits.items():
    if key in batch:
      check_token_ids(batch[key], vocab_size, model_cfg.max_len, f"{what}, {key}")


def _eval_set(data: Any, split: str, config: Any, model_cfg: TransformerConfig,
              limit: int = 0) -> list:
  batches = data.eval_batches(split, config.decode.batch_size, limit)
  for batch in batches:
    _check_batch(model_cfg, batch.arrays, f"{split} data")
  return batches


def evaluate(task: Any, params: Any, batches: list, eval_step: Any,
             prefix: str = "eval") -> tuple[dict[str, float], list[tuple[str, str, str]]]:
  metrics, samples = task.evaluate(params, batches, eval_step)
  return {f"{prefix}/{k}": v for k, v in metrics.items()}, samples


def _write_run_files(workdir: str, config: Any, model_cfg: TransformerConfig) -> None:
  os.makedirs(workdir, exist_ok=True)
  resolved = config.to_dict()
  resolved["model"] = model_cfg.to_dict()
  with open(os.path.join(workdir, CONFIG_FILE), "w") as f:
    json.dump(resolved, f, indent=2, sort_keys=True)


def _fast_forward(batches: Any, steps: int) -> None:
  """Moves a fresh training iterator to the data position after `steps` batches by reading
  them (the pipeline is deterministic, so this lands exactly where the run stopped)."""
  for _ in range(steps):
    next(batches)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float]:
  """Trains (resuming from W/checkpoints if present), evaluates, and returns the final eval
  metrics."""
  validate(config)
  os.makedirs(workdir, exist_ok=True)
  data = make_source(config, workdir)      # Trains or reloads the tokenizer in the workdir.
  print(f"data: {data.summary}")
  model_cfg = model_config(config, data)
  _write_run_files(workdir, config, model_cfg)
  task = build_task(config, model_cfg, data)
  eval_batches = _eval_set(data, config.data.get("eval_split", "eval"), config, model_cfg,
                           config.data.eval_examples)

  schedule = make_schedule(config.optimizer, model_cfg.d_model, config.num_train_steps)
  optimizer = make_optimizer(config.optimizer, schedule)
  params = task.init_params(jax.random.PRNGKey(config.seed))
  state = create_train_state(params, optimizer, config.seed)
  print(f"model: {count_params(state.params):,} parameters; workdir: {os.path.abspath(workdir)}")

  checkpointer = Checkpointer(os.path.join(workdir, CHECKPOINT_DIR), config.keep_checkpoints)
  if checkpointer.latest_step() is not None:
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    state = checkpointer.restore(abstract)
    print(f"resumed from step {int(state.step)}")
  start_step = int(state.step)

  train_step = make_train_step(task, optimizer, schedule, config.grad_accum_steps)
  eval_step = make_eval_step(task)
  writer = MetricWriter(workdir, enabled=jax.process_index() == 0)
  final_metrics: dict[str, float] = {}
  samples: list[tuple[str, str, str]] = []

  pending: list[tuple[int, Any]] = []        # (step, device metrics) since the last log
  tokens_since_log, time_since_log = 0, time.perf_counter()
  progress = tqdm(total=config.num_train_steps, initial=start_step, desc="train",
                  unit="step", dynamic_ncols=True, disable=jax.process_index() != 0)
  batches = data.train_iterator(config.batch_size)
  _fast_forward(batches, start_step)
  try:
    for step in range(start_step + 1, config.num_train_steps + 1):
      batch = next(batches)
      if step == start_step + 1:
        _check_batch(model_cfg, batch, "training data")
      tokens_since_log += task.count_tokens(batch)
      state, metrics = train_step(state, batch)
      pending.append((step, metrics))
      progress.update(1)
      is_last = step == config.num_train_steps
      if step % config.log_every_steps == 0 or is_last or step % config.checkpoint_every_steps == 0:
        host = _check_finite(jax.device_get(pending), config.nonfinite)
        elapsed = time.perf_counter() - time_since_log
        summary = {f"train/{k}": float(np.mean([m[k] for _, m in host]))
                   for k in host[-1][1] if k != "nonfinite"}
        summary["train/nonfinite_steps"] = float(sum(m["nonfinite"] for _, m in host))
        summary["perf/tokens_per_sec"] = tokens_since_log / elapsed
        summary["perf/steps_per_sec"] = len(host) / elapsed
        summary.update(batches.stats())
        writer.write(step, summary)
        progress.set_postfix(loss=f"{summary['train/loss']:.4f}",
                             tok_s=f"{summary['perf/tokens_per_sec']:.0f}")
        pending, tokens_since_log = [], 0
        time_since_log = time.perf_counter()
      if step % config.checkpoint_every_steps == 0 or is_last:
        checkpointer.save(state, force=is_last)
      if step % config.eval_every_steps == 0 or is_last:
        final_metrics, samples = evaluate(task, state.params, eval_batches, eval_step)
        writer.write(step, final_metrics)
        progress.write(f"step {step}: " + ", ".join(f"{k}={v:.4f}"
                                                    for k, v in final_metrics.items()))
        time_since_log = time.perf_counter()   # Evaluation time is not training time.
    if start_step >= config.num_train_steps:
      print(f"already trained to step {start_step} (num_train_steps="
            f"{config.num_train_steps}); evaluating the saved model")
      final_metrics, samples = evaluate(task, state.params, eval_batches, eval_step)
    test_split = config.data.get("test_split", "")
    if test_split:
      test_metrics, samples = evaluate(task, state.params,
                                       _eval_set(data, test_split, config, model_cfg),
                                       eval_step, prefix="test")
      writer.write(max(start_step, config.num_train_steps), test_metrics)
      final_metrics.update(test_metrics)
  finally:
    batches.close()
    progress.close()
    checkpointer.wait()
    checkpointer.close()
    writer.close()

  for src, pred, ref in samples[:config.decode.num_samples]:
    print(f"  source: {src}\n  output: {pred}\n  target: {ref}\n")
  if batches.stats():
    print("data read for training: " + ", ".join(f"{k[5:]}={v:,}"
                                                 for k, v in batches.stats().items()))
  print("final: " + ", ".join(f"{k}={v:.4f}" for k, v in final_metrics.items()))
  return final_metrics


def _check_finite(host_metrics: list[tuple[int, dict]], policy: str) -> list[tuple[int, dict]]:
  """With policy "stop", raises at the first step whose loss or gradient was NaN/Inf. That
  step's update was already discarded inside the jitted step, so state and checkpoints only
  ever hold finite parameters."""
  for step, metrics in host_metrics:
    if metrics["nonfinite"] and policy == "stop":
      raise NonFiniteLossError(
          f"non-finite loss or gradient at step {step} (loss={float(metrics['loss'])}); "
          "training stopped and no checkpoint was written after it. Lower the learning rate, "
          "enable gradient clipping, or set --config.nonfinite=skip to skip such steps.")
  return host_metrics
