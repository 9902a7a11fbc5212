"""The train/eval loop behind `python train.py`."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from tqdm.auto import tqdm

from transformer_jax import checkpoint, decoding, sharding
from transformer_jax.checkpoint import CHECKPOINT_DIR, TrainCheckpoints, tokenizer_item
from transformer_jax.config import TransformerConfig
from transformer_jax.data.sources import make_source
from transformer_jax.inputs import check_inputs
from transformer_jax.metrics import MetricWriter, corpus_bleu, exact_match
from transformer_jax.modules.models import Transformer
from transformer_jax.params import count_params
from transformer_jax.preemption import PreemptionWatcher
from transformer_jax.training.optimizers import make_optimizer, make_schedule
from transformer_jax.training.state import new_train_state
from transformer_jax.training.steps import NONFINITE_POLICIES, make_eval_step, make_train_step
from transformer_jax.training.tasks import Seq2SeqTask

CONFIG_FILE, VOCAB_FILE = "config.json", "vocab.json"


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


def model_config(config: ml_collections.ConfigDict, vocab_size: int) -> TransformerConfig:
  return TransformerConfig.from_dict({**config.model.to_dict(), "vocab_size": vocab_size})


def _decode_texts(model_cfg: TransformerConfig, params: Any, source: Any, vocab: Any,
                  sources: list[str], decode_cfg: Any) -> list[str]:
  """Beam-search `sources` in fixed-shape batches (the last one padded) and detokenize."""
  batch_size = decode_cfg.batch_size
  outputs = []
  for start in range(0, len(sources), batch_size):
    chunk = sources[start:start + batch_size]
    ids = np.zeros((batch_size, source.src_length), np.int32)
    for row, text in enumerate(chunk):
      encoded = vocab.encode(text)
      ids[row, :len(encoded)] = encoded
    ids, _ = check_inputs(model_cfg, ids)
    out = decoding.generate(model_cfg, params, ids, beam_size=decode_cfg.beam_size,
                            alpha=decode_cfg.alpha,
                            max_length=source.tgt_length + decode_cfg.max_extra_length)
    outputs += [vocab.decode(decoding.strip_special(row)) for row in out[:len(chunk)]]
  return outputs


def evaluate(config: Any, model_cfg: TransformerConfig, task: Seq2SeqTask, eval_step: Any,
             params: Any, source: Any, mesh: Any) -> tuple[dict[str, float], list[tuple[str, str, str]]]:
  """Teacher-forced loss/accuracy on held-out pairs, then beam-search exact match and BLEU."""
  pairs = source.eval_examples(config.data.eval_examples)
  totals: dict[str, float] = {}
  rows = sharding.local_rows(config.batch_size)
  for start in range(0, len(pairs), config.batch_size):
    chunk = pairs[start:start + config.batch_size]
    chunk = chunk + [("", "")] * (config.batch_size - len(chunk))   # all-padding rows
    local = {k: v[rows] for k, v in source.encode_batch(chunk).items()}
    sums = jax.device_get(eval_step(params, sharding.to_global(local, mesh)))
    for k, v in sums.items():
      totals[k] = totals.get(k, 0.0) + float(v)
  weight = max(totals["weight"], 1.0)
  metrics = {"eval/loss": totals["loss"] / weight, "eval/accuracy": totals["correct"] / weight,
             "eval/perplexity": float(np.exp(totals["nll"] / weight))}

  decode_pairs = pairs[:config.decode.eval_examples]
  sources = [s for s, _ in decode_pairs]
  references = [t for _, t in decode_pairs]
  predictions = _decode_texts(model_cfg, params, source, source.vocab, sources, config.decode)
  metrics["eval/exact_match"] = exact_match(predictions, references)
  metrics["eval/bleu"] = corpus_bleu(predictions, references)
  return metrics, list(zip(sources, predictions, references))


def _resolved_config(config: Any, model_cfg: TransformerConfig) -> dict[str, Any]:
  resolved = config.to_dict()
  resolved["model"] = model_cfg.to_dict()
  return resolved


def _write_run_files(workdir: str, resolved: dict[str, Any], vocab: Any) -> None:
  os.makedirs(workdir, exist_ok=True)
  if jax.process_index() != 0:    # One writer when hosts share the workdir.
    return
  with open(os.path.join(workdir, CONFIG_FILE), "w") as f:
    json.dump(resolved, f, indent=2, sort_keys=True)
  vocab.save(os.path.join(workdir, VOCAB_FILE))


def _make_checkpoints(config: Any, workdir: str, resolved: dict[str, Any],
                      vocab: Any) -> TrainCheckpoints:
  """Saves every checkpoint_every_steps and at the end; with keep_best_checkpoints, every
  evaluation is saved too, so that the best one is among the checkpoints."""
  every = [config.checkpoint_every_steps]
  if config.keep_best_checkpoints:
    every.append(config.eval_every_steps)
  return TrainCheckpoints(
      os.path.join(workdir, CHECKPOINT_DIR), resolved, tokenizer_item(vocab),
      save_interval_steps=every, final_step=config.num_train_steps,
      keep=config.keep_checkpoints, keep_best=config.keep_best_checkpoints,
      best_metric=config.best_checkpoint_metric, best_mode=config.best_checkpoint_mode)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float]:
  """Trains (resuming from W/checkpoints if present), evaluates, and returns the final eval
  metrics."""
  if config.distributed.initialize:     # before anything touches the devices
    sharding.initialize_distributed(config.distributed.coordinator_address,
                                    config.distributed.num_processes,
                                    config.distributed.process_id)
  validate(config)
  source = make_source(config.data, config.seed)
  model_cfg = model_config(config, source.vocab.vocab_size)
  resolved = _resolved_config(config, model_cfg)
  model = Transformer(model_cfg)
  task = Seq2SeqTask(model, config.label_smoothing)

  schedule = make_schedule(config.optimizer, model_cfg.d_model, config.num_train_steps)
  optimizer = make_optimizer(config.optimizer, schedule)
  mesh = sharding.make_mesh(config.mesh.to_dict())
  sharding.check_batch_fits(config.batch_size // config.grad_accum_steps, mesh,
                            "batch_size/grad_accum_steps")
  first = source.batch("train", 0, config.batch_size)
  # Created under jit with its final shardings: no device ever holds the whole state.
  state, state_sharding = sharding.create_sharded(
      lambda: new_train_state(task.init_params(jax.random.PRNGKey(config.seed), first),
                              optimizer, config.seed), mesh)
  print(f"model: {count_params(state.params):,} parameters; mesh: {dict(mesh.shape)} over "
        f"{jax.device_count()} {jax.default_backend()} devices; workdir: "
        f"{os.path.abspath(workdir)}")

  # Resume before writing anything: a config that cannot continue is refused untouched.
  checkpoints = _make_checkpoints(config, workdir, resolved, source.vocab)
  batches = source.train_batches(config.batch_size)
  # Restored straight into this run's shardings, whatever mesh the checkpoint was saved on.
  restored = checkpoints.restore(state)
  if restored is not None:
    state = restored.state
    batches.set_state(restored.data_state)
    print(f"resumed from step {restored.step}")
  start_step = int(state.step)
  _write_run_files(workdir, resolved, source.vocab)

  batch_sharding = sharding.batch_sharding(mesh)
  train_step = make_train_step(task, optimizer, schedule, config.grad_accum_steps,
                               state_sharding, batch_sharding)
  eval_step = make_eval_step(task, state_sharding.params, batch_sharding)
  # Lines after the resumed step describe training that is being redone: dropped.
  writer = MetricWriter(workdir, enabled=jax.process_index() == 0, resume_step=start_step)
  final_metrics: dict[str, float] = {}
  samples: list[tuple[str, str, str]] = []

  pending: list[tuple[int, Any]] = []        # (step, device metrics) since the last log
  tokens_since_log, time_since_log = 0, time.perf_counter()
  progress = tqdm(total=config.num_train_steps, initial=start_step, desc="train",
                  unit="step", dynamic_ncols=True, disable=jax.process_index() != 0)
  rows = sharding.local_rows(config.batch_size)
  preemption = PreemptionWatcher()
  try:
    preemption.start()   # From here SIGTERM/SIGINT stop after the current step.
    for step in range(start_step + 1, config.num_train_steps + 1):
      local = {k: v[rows] for k, v in next(batches).items()}   # this host's share
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
        writer.write(step, summary)
        progress.set_postfix(loss=f"{summary['train/loss']:.4f}",
                             tok_s=f"{summary['perf/tokens_per_sec']:.0f}")
        pending, tokens_since_log = [], 0
        time_since_log = time.perf_counter()
      evaluated = None
      if (step % config.eval_every_steps == 0 or is_last) and not stop:
        final_metrics, samples = evaluate(config, model_cfg, task, eval_step, state.params,
                                          source, mesh)
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
      final_metrics, samples = evaluate(config, model_cfg, task, eval_step, state.params,
                                        source, mesh)
  finally:
    preemption.stop()
    progress.close()
    checkpoints.close()   # Waits for the last save to be committed.
    writer.close()

  if jax.process_index() == 0:
    _print_samples(samples, config.decode.num_samples)
    print("final: " + ", ".join(f"{k}={v:.4f}" for k, v in final_metrics.items()))
  return final_metrics


def evaluate_saved(config: ml_collections.ConfigDict, workdir: str | None,
                   path: str | None = None) -> dict[str, float]:
  """Evaluates saved parameters with the config's evaluation: those at `path` (a checkpoint
  or an export, e.g. an average), else the workdir's newest, as `predict` picks them."""
  validate(config)
  source = make_source(config.data, config.seed)
  model_cfg = model_config(config, source.vocab.vocab_size)
  task = Seq2SeqTask(Transformer(model_cfg), config.label_smoothing)
  first = source.batch("train", 0, config.batch_size)
  boxed = jax.eval_shape(task.init_params, jax.random.PRNGKey(0), first)
  mesh = sharding.make_mesh(config.mesh.to_dict())
  params_sharding = sharding.shardings_for(boxed, mesh)
  abstract = jax.tree_util.tree_map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      nn.meta.unbox(boxed), params_sharding)     # restored straight onto the mesh
  candidates = [path] if path else checkpoint.models(workdir)
  if not candidates:
    raise FileNotFoundError(f"{workdir} has no checkpoint or export to evaluate")

  def load(candidate: str) -> tuple[checkpoint.Model, Any]:
    model = checkpoint.read_model(candidate)
    if checkpoint.tokenizer_item(model.tokenizer) != tokenizer_item(source.vocab):
      raise checkpoint.IncompatibleCheckpointError(
          f"{candidate} was trained with another tokenizer than config.data builds")
    return model, checkpoint.restore_params(candidate, abstract)

  chosen, (model, params), _ = checkpoint.first_good(candidates, load)
  eval_step = make_eval_step(task, params_sharding, sharding.batch_sharding(mesh))
  metrics, samples = evaluate(config, model_cfg, task, eval_step, params, source, mesh)
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
