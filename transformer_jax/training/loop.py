"""The train/eval loop behind `python train.py`."""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

import flax.linen as nn
import jax
import ml_collections
import numpy as np
from tqdm.auto import tqdm

from transformer_jax import checkpoint, sharding
from transformer_jax.checkpoint import CHECKPOINT_DIR, TrainCheckpoints, tokenizer_item
from transformer_jax.config import TransformerConfig
from transformer_jax.data.sources import make_source
from transformer_jax.inputs import check_token_ids
from transformer_jax.metrics import MetricWriter
from transformer_jax.params import count_params
from transformer_jax.preemption import PreemptionWatcher
from transformer_jax.training.optimizers import make_optimizer, make_schedule
from transformer_jax.training.state import new_train_state
from transformer_jax.training.steps import NONFINITE_POLICIES, make_eval_step, make_train_step
from transformer_jax.training.tasks import make_task

CONFIG_FILE = "config.json"


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
  if config.batch_size % jax.process_count():
    raise ValueError(f"config.batch_size={config.batch_size} must be divisible by the "
                     f"number of processes ({jax.process_count()})")
  if not isinstance(config.keep_best_checkpoints, int) or config.keep_best_checkpoints < 0:
    raise ValueError(f"config.keep_best_checkpoints={config.keep_best_checkpoints!r}: must be "
                     "an integer >= 0 (0: keep only the most recent)")
  if config.best_checkpoint_mode not in ("max", "min"):
    raise ValueError(f"config.best_checkpoint_mode={config.best_checkpoint_mode!r}: must be "
                     "'max' or 'min'")


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


def evaluate(task: Any, params: Any, batches: list, eval_step: Any,
             prefix: str = "eval") -> tuple[dict[str, float], list[tuple[str, str, str]]]:
  metrics, samples = task.evaluate(params, batches, eval_step)
  return {f"{prefix}/{k}": v for k, v in metrics.items()}, samples


def _resolved_config(config: Any, model_cfg: TransformerConfig) -> dict[str, Any]:
  resolved = config.to_dict()
  resolved["model"] = model_cfg.to_dict()
  return resolved


def _write_run_files(workdir: str, resolved: dict[str, Any]) -> None:
  os.makedirs(workdir, exist_ok=True)
  if jax.process_index() != 0:    # One writer when hosts share the workdir.
    return
  with open(os.path.join(workdir, CONFIG_FILE), "w") as f:
    json.dump(resolved, f, indent=2, sort_keys=True)


def _assets(data: Any) -> dict[str, Any]:
  return tokenizer_item(data.tokenizer, data.target_tokenizer, data.labels)


def _make_checkpoints(config: Any, workdir: str, resolved: dict[str, Any],
                      data: Any) -> TrainCheckpoints:
  """Saves every checkpoint_every_steps and at the end; with keep_best_checkpoints, every
  evaluation is saved too, so that the best one is among the checkpoints."""
  every = [config.checkpoint_every_steps]
  if config.keep_best_checkpoints:
    every.append(config.eval_every_steps)
  return TrainCheckpoints(
      os.path.join(workdir, CHECKPOINT_DIR), resolved, _assets(data),
      save_interval_steps=every, final_step=config.num_train_steps,
      keep=config.keep_checkpoints, keep_best=config.keep_best_checkpoints,
      best_metric=config.best_checkpoint_metric, best_mode=config.best_checkpoint_mode)


def _setup(config: ml_collections.ConfigDict, workdir: str | None) -> tuple[Any, ...]:
  """The data (tokenizers trained or reloaded in the workdir), model config, task and mesh."""
  validate(config)
  data = make_source(config, workdir)
  if jax.process_index() == 0:
    print(f"data: {data.summary}")
  model_cfg = model_config(config, data)
  task = build_task(config, model_cfg, data)
  return data, model_cfg, task, sharding.make_mesh(config.mesh.to_dict())


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float]:
  """Trains (resuming from W/checkpoints if present), evaluates, and returns the final eval
  metrics."""
  if config.distributed.initialize:     # before anything touches the devices
    sharding.initialize_distributed(config.distributed.coordinator_address,
                                    config.distributed.num_processes,
                                    config.distributed.process_id)
  data, model_cfg, task, mesh = _setup(config, workdir)
  resolved = _resolved_config(config, model_cfg)
  eval_batches = _eval_set(data, config.data.get("eval_split", "eval"), config, model_cfg,
                           config.data.eval_examples)

  schedule = make_schedule(config.optimizer, model_cfg.d_model, config.num_train_steps)
  optimizer = make_optimizer(config.optimizer, schedule)
  sharding.check_batch_fits(config.batch_size // config.grad_accum_steps, mesh,
                            "batch_size/grad_accum_steps")
  # Created under jit with its final shardings: no device ever holds the whole state.
  state, state_sharding = sharding.create_sharded(
      lambda: new_train_state(task.init_params(jax.random.PRNGKey(config.seed)), optimizer,
                              config.seed), mesh)
  if jax.process_index() == 0:
    print(f"model: {count_params(state.params):,} parameters; mesh: {dict(mesh.shape)} over "
          f"{jax.device_count()} {jax.default_backend()} devices; workdir: "
          f"{os.path.abspath(workdir)}")

  # Resume before writing anything: a config that cannot continue is refused untouched.
  checkpoints = _make_checkpoints(config, workdir, resolved, data)
  batches = data.train_iterator(config.batch_size)    # this host's rows of each batch
  # Restored straight into this run's shardings, whatever mesh the checkpoint was saved on.
  restored = checkpoints.restore(state)
  if restored is not None:
    state = restored.state
    batches.set_state(restored.data_state)
    print(f"resumed from step {restored.step}")
  start_step = int(state.step)
  _write_run_files(workdir, resolved)

  batch_sharding = sharding.batch_sharding(mesh)
  train_step = make_train_step(task, optimizer, schedule, config.grad_accum_steps,
                               state_sharding, batch_sharding)
  eval_step = _global_eval_step(make_eval_step(task, state_sharding.params, batch_sharding),
                                mesh)
  # Lines after the resumed step describe training that is being redone: dropped.
  writer = MetricWriter(workdir, enabled=jax.process_index() == 0, resume_step=start_step)
  final_metrics: dict[str, float] = {}
  samples: list[tuple[str, str, str]] = []

  pending: list[tuple[int, Any]] = []        # (step, device metrics) since the last log
  tokens_since_log, time_since_log = 0, time.perf_counter()
  progress = tqdm(total=config.num_train_steps, initial=start_step, desc="train",
                  unit="step", dynamic_ncols=True, disable=jax.process_index() != 0)
  preemption = PreemptionWatcher()
  try:
    preemption.start()   # From here SIGTERM/SIGINT stop after the current step.
    for step in range(start_step + 1, config.num_train_steps + 1):
      local = next(batches)
      if step == start_step + 1:
        _check_batch(model_cfg, local, "training data")
      tokens_since_log += task.count_tokens(local) * jax.process_count()
      state, metrics = train_step(state, sharding.to_global(local, mesh))
      pending.append((step, metrics))
      progress.update(1)
      is_last = step == config.num_train_steps
      stop = preemption.should_stop(step)
      save = stop or checkpoints.should_save(step)
      if step % config.log_every_steps == 0 or is_last or save:
        host = _check_finite(jax.device_get(pending), config.nonfinite)
        elapsed = time.perf_counter() - time_since_log
        summary = {f"train/{k}": float(np.mean([m[k] for _, m in host]))
                   for k in host[-1][1] if k != "nonfinite"}
        summary["train/nonfinite_steps"] = float(sum(m["nonfinite"] for _, m in host))
        summary["perf/tokens_per_sec"] = tokens_since_log / elapsed
        summary["perf/steps_per_sec"] = len(host) / elapsed
        summary.update(batches.stats())    # This host's counts of dropped/truncated data.
        writer.write(step, summary)
        progress.set_postfix(loss=f"{summary['train/loss']:.4f}",
                             tok_s=f"{summary['perf/tokens_per_sec']:.0f}")
        pending, tokens_since_log = [], 0
        time_since_log = time.perf_counter()
      evaluated = None
      if (step % config.eval_every_steps == 0 or is_last) and not stop:
        final_metrics, samples = evaluate(task, state.params, eval_batches, eval_step)
        writer.write(step, final_metrics)
        progress.write(f"step {step}: " + ", ".join(f"{k}={v:.4f}"
                                                    for k, v in final_metrics.items()))
        evaluated = final_metrics
      if save:
        # After the evaluation, so a checkpoint at step s implies all of s's metrics logged.
        started = time.perf_counter()
        checkpoints.save(step, state, batches.get_state(), metrics=evaluated)
        writer.write(step, {"perf/checkpoint_blocking_secs": time.perf_counter() - started})
      if evaluated is not None or save:
        time_since_log = time.perf_counter()   # Evaluating and saving are not training.
      if stop:
        checkpoints.wait()   # Durable before exiting: the scheduler may kill us soon.
        progress.write(f"{preemption.signal_name} received: stopped after step {step} and "
                       f"saved {checkpoints.path(step)}; run the same command to resume.")
        return {}
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
    preemption.stop()
    batches.close()
    progress.close()
    checkpoints.close()   # Waits for the last save to be committed.
    writer.close()

  if jax.process_index() == 0:
    _print_samples(samples, config.decode.num_samples)
    if batches.stats():
      print("data read for training: " + ", ".join(f"{k[5:]}={v:,}"
                                                   for k, v in batches.stats().items()))
    print("final: " + ", ".join(f"{k}={v:.4f}" for k, v in final_metrics.items()))
  return final_metrics


def evaluate_saved(config: ml_collections.ConfigDict, workdir: str | None,
                   path: str | None = None) -> dict[str, float]:
  """Evaluates saved parameters with the config's evaluation: those at `path` (a checkpoint
  or an export, e.g. an average), else the workdir's newest, as `predict` picks them."""
  data, model_cfg, task, mesh = _setup(config, workdir)
  boxed = jax.eval_shape(task.init_params, jax.random.PRNGKey(0))
  params_sharding = sharding.shardings_for(boxed, mesh)
  abstract = jax.tree_util.tree_map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      nn.meta.unbox(boxed), params_sharding)     # restored straight onto the mesh
  candidates = [path] if path else checkpoint.models(workdir)
  if not candidates:
    raise FileNotFoundError(f"{workdir} has no checkpoint or export to evaluate")

  def load(candidate: str) -> tuple[checkpoint.Model, Any]:
    model = checkpoint.read_model(candidate)
    if tokenizer_item(model.assets.tokenizer, model.assets.target_tokenizer,
                      model.assets.labels) != _assets(data):
      raise checkpoint.IncompatibleCheckpointError(
          f"{candidate} was trained with another tokenizer or labels than config.data builds")
    return model, checkpoint.restore_params(candidate, abstract)

  chosen, (model, params), _ = checkpoint.first_good(candidates, load)
  eval_step = _global_eval_step(
      make_eval_step(task, params_sharding, sharding.batch_sharding(mesh)), mesh)
  eval_batches = _eval_set(data, config.data.get("eval_split", "eval"), config, model_cfg,
                           config.data.eval_examples)
  metrics, samples = evaluate(task, params, eval_batches, eval_step)
  _print_samples(samples, config.decode.num_samples)
  steps = model.averaged_steps
  averaged = f", the average of steps {steps}" if len(steps) > 1 else ""
  print(f"evaluated {chosen} (step {model.step}{averaged}): "
        + ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
  return metrics


def _print_samples(samples: list[tuple[str, str, str]], count: int) -> None:
  for src, pred, ref in samples[:count]:
    print(f"  source: {src}\n  output: {pred}\n  target: {ref}\n")


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
