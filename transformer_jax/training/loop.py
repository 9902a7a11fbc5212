"""The train/eval loop behind `python train.py`: `train_and_evaluate` and `evaluate_saved`.
The setup they share (task, data, mesh, optimizer, state shapes) is training/experiment.py."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Sequence

import jax
import numpy as np
from jax.experimental.multihost_utils import sync_global_devices
from tqdm.auto import tqdm

from transformer_jax import checkpoint, sharding
from transformer_jax.checkpoint import CHECKPOINT_DIR, TrainCheckpoints
from transformer_jax.data.pipeline import per_host_position
from transformer_jax.data.tokenizer import tokenizer_item
from transformer_jax.errors import UserError
from transformer_jax.files import atomic_write_json
from transformer_jax.metrics import MetricWriter
from transformer_jax.options import RunOptions
from transformer_jax.params import count_params
from transformer_jax.preemption import PreemptionWatcher
from transformer_jax.training.evaluation import Evaluator, Samples
from transformer_jax.training.experiment import Experiment
from transformer_jax.training.state import checkpoint_arrays, state_from_checkpoint
from transformer_jax.training.timing import RunClock, summary_line
from transformer_jax.training.workdir_lock import WorkdirLock

CONFIG_FILE = "config.json"
TIME_SPLIT_FILE = "time_split.json"   # where the run's wall time went (timing.py)


class NonFiniteLossError(UserError):
  """Training produced a NaN or Inf loss or gradient: most often a learning rate too high for
  the model, so a user error (one line, exit status 2) naming the step and what to lower."""


# ------------------------------------------------------------------------ run files, saving
def _write_run_files(workdir: str, resolved: dict[str, Any]) -> None:
  os.makedirs(workdir, exist_ok=True)
  if jax.process_index() != 0:    # One writer when hosts share the workdir.
    return
  atomic_write_json(os.path.join(workdir, CONFIG_FILE), resolved, indent=2, sort_keys=True)


def _assets(experiment: Experiment) -> dict[str, Any]:
  data = experiment.data
  return tokenizer_item(data.tokenizer, data.target_tokenizer, data.labels)


def _make_checkpoints(experiment: Experiment, workdir: str) -> TrainCheckpoints:
  """Saves every checkpoint_every_steps and at the end; with keep_best_checkpoints, every
  evaluation is saved too, so that the best one is among the checkpoints."""
  train = experiment.train
  every = [train.checkpoint_every_steps]
  if train.keep_best_checkpoints:
    every.append(train.eval_every_steps)
  return TrainCheckpoints(
      os.path.join(workdir, CHECKPOINT_DIR), experiment.resolved_config(), _assets(experiment),
      save_interval_steps=every, final_step=train.num_train_steps,
      keep=train.keep_checkpoints, keep_best=train.keep_best_checkpoints,
      best_metric=train.best_checkpoint_metric, best_mode=train.best_checkpoint_mode)


def _saved_process_count(config: dict) -> int | None:
  """How many processes wrote a checkpoint, from its config (None: the cluster was read from
  the environment, so the config does not say)."""
  distributed = config.get("distributed", {})
  if not distributed.get("initialize"):
    return 1
  return distributed.get("num_processes") or None


def _check_data_position(restored: checkpoint.Restored) -> None:
  """A global data position resumes on any number of processes; a per-host one (written
  before data positions were global) only on as many as wrote it."""
  if not per_host_position(restored.data_state):
    return
  saved, now = _saved_process_count(restored.config), jax.process_count()
  if saved is not None and saved != now:
    raise UserError(
        f"cannot resume {restored.path} on {now} processes: it was written by {saved} "
        f"processes in the old per-process data format, whose data order continues only on "
        f"{saved}; resume with {saved} processes (checkpoints of this version resume on any "
        f"number), or train in a new --workdir")


class _TrainLog:
  """Aggregates the per-step metrics between log lines (kept on the device until then) into
  means, throughput and the data counts, and writes them."""

  def __init__(self, writer: MetricWriter, nonfinite: str):
    self.writer, self.nonfinite = writer, nonfinite
    self.pending: list[tuple[int, Any]] = []        # (step, device metrics) since the last log
    self.tokens = 0
    self.restart_clock()

  def restart_clock(self) -> None:
    """Evaluating and saving are not training: the throughput clock restarts after them."""
    self.since = time.perf_counter()

  def add(self, step: int, metrics: Any, tokens: int) -> None:
    self.pending.append((step, metrics))
    self.tokens += tokens

  def write(self, step: int, data_stats: dict[str, int]) -> dict[str, float]:
    host = _check_finite(jax.device_get(self.pending), self.nonfinite)
    elapsed = time.perf_counter() - self.since
    summary = {f"train/{k}": float(np.mean([m[k] for _, m in host]))
               for k in host[-1][1] if k != "nonfinite"}
    summary["train/nonfinite_steps"] = float(sum(m["nonfinite"] for _, m in host))
    summary["perf/tokens_per_sec"] = self.tokens / elapsed
    summary["perf/steps_per_sec"] = len(host) / elapsed
    summary.update(data_stats)    # The global order's counts of dropped/truncated data.
    self.writer.write(step, summary)
    self.pending, self.tokens = [], 0
    self.restart_clock()
    return summary


class _PlainProgress:
  """tqdm's interface for a log that is not a terminal (CI, nohup, a scheduler): one plain
  line at each log step instead of carriage-return redraws."""

  def __init__(self, total: int, initial: int, desc: str):
    self.total, self.n, self.desc = total, initial, desc

  def update(self, n: int = 1) -> None:
    self.n += n

  def set_postfix(self, **values: str) -> None:
    fields = " ".join(f"{k}={v}" for k, v in values.items())
    print(f"{self.desc}: step {self.n}/{self.total} {fields}", file=sys.stderr, flush=True)

  def write(self, line: str) -> None:
    print(line, flush=True)

  def close(self) -> None:
    pass


def _progress(total: int, initial: int) -> Any:
  if jax.process_index() != 0:
    return tqdm(disable=True)
  if not sys.stderr.isatty():
    return _PlainProgress(total, initial, "train")
  return tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True)


# ------------------------------------------------------------------------------ training
def start_distributed(config: Any) -> None:
  """Joins the cluster that config.distributed names (jax.distributed), if it asks to: before
  anything else uses JAX, and once per process, so that every stage of a recipe runs on the
  cluster its first call started (later calls leave it as it is)."""
  distributed = RunOptions.parse(config).distributed
  if distributed.initialize:
    sharding.initialize_distributed(distributed.coordinator_address,
                                    distributed.num_processes, distributed.process_id)


def train_and_evaluate(config: Any, workdir: str) -> dict[str, float]:
  """Trains (resuming from W/checkpoints if present), evaluates, and returns the final eval
  metrics. Holds the workdir for the run (a second trainer there is refused) and checks
  that checkpoints can be written there before anything else. `config`: the ml_collections
  config (or the RunOptions parsed from one). Ends with the run's time split (timing.py):
  W/time_split.json and the last line of the output."""
  clock = RunClock()
  options = RunOptions.parse(config)
  start_distributed(options)     # before anything touches the devices
  if jax.process_index() != 0:          # Process 0 holds the lock for every host.
    return _train(options, workdir, clock)
  with WorkdirLock(workdir):
    checkpoint.check_writable(os.path.join(workdir, CHECKPOINT_DIR))
    return _train(options, workdir, clock)


def _train(options: RunOptions, workdir: str, clock: RunClock) -> dict[str, float]:
  with clock.measure("data_setup"):   # reading the splits, training or loading the tokenizer
    experiment = Experiment.create(options, workdir)
    eval_batches = experiment.eval_batches(options.data.eval_split, experiment.eval.examples)
  train = experiment.train
  task, mesh = experiment.task, experiment.mesh
  with clock.measure("init"):
    state, state_sharding = experiment.init_state()
    eval_step = experiment.eval_step(state_sharding.params)
    evaluate = Evaluator(experiment, eval_batches, eval_step)
    if jax.process_index() == 0:
      print(f"model: {count_params(state.params):,} parameters; mesh: {dict(mesh.shape)} "
            f"over {jax.device_count()} {jax.default_backend()} devices; workdir: "
            f"{os.path.abspath(workdir)}")

    # Resume before writing anything: a config that cannot continue is refused untouched.
    checkpoints = _make_checkpoints(experiment, workdir)
    batches = experiment.data.train_iterator(task, train.batch_size)  # this host's rows
    # Restored straight into this run's shardings, whatever mesh the checkpoint was saved on.
    restored = checkpoints.restore(checkpoint_arrays(sharding.abstract(state)))
    if restored is not None:
      _check_data_position(restored)
      state = state_from_checkpoint(restored.arrays, state)
      batches.set_state(restored.data_state)
      print(f"resumed from step {restored.step}")
    # Fine-tuning: the pretrained weights, a fresh optimizer; a LoRA run's frozen base on a
    # resume too (its checkpoints hold the adapters and name the base: lora.py).
    if experiment.pretrained and (restored is None or experiment.lora):
      params, carried = experiment.initial_params(state.params)
      state = state.replace(params=params)
      what = f" {', '.join(carried)} (the rest fresh)" if carried else ""
      print(f"{'LoRA of the model' if experiment.lora else 'initialised' + what} from "
            f"{experiment.pretrained.path} (step {experiment.pretrained.step})")
    start_step = int(state.step)
    _write_run_files(workdir, experiment.resolved_config())
    train_step = experiment.train_step(state_sharding)
  # Lines after the resumed step describe training that is being redone: dropped.
  writer = MetricWriter(workdir, enabled=jax.process_index() == 0, resume_step=start_step)
  log = _TrainLog(writer, train.nonfinite)
  final_metrics: dict[str, float] = {}
  samples: Samples = []
  progress = _progress(train.num_train_steps, start_step)
  preemption = PreemptionWatcher()
  try:
    preemption.start()   # From here SIGTERM/SIGINT stop after the current step.
    # "steps" is what the loop's other phases leave: dispatching the steps and waiting for
    # the device where the loop already waits (the log lines' metric fetch). Steps run
    # asynchronously, so the device may be computing during input_wait (the time next()
    # blocks); an evaluation or save that no log line precedes first waits for the steps.
    with clock.measure("steps"):
      for step in range(start_step + 1, train.num_train_steps + 1):
        with clock.measure("input_wait"):
          local = next(batches)
        if step == start_step + 1:
          task.check_batch(local, "training data")
        state, metrics = train_step(state, sharding.to_global(local, mesh))
        log.add(step, metrics, task.count_tokens(local) * jax.process_count())
        progress.update(1)
        is_last = step == train.num_train_steps
        stop = preemption.should_stop(step)
        save = stop or checkpoints.should_save(step)
        if step % train.log_every_steps == 0 or is_last or save:
          summary = log.write(step, batches.stats())
          progress.set_postfix(loss=f"{summary['train/loss']:.4f}",
                               tok_s=f"{summary['perf/tokens_per_sec']:.0f}")
        evaluated = None
        if (step % train.eval_every_steps == 0 or is_last) and not stop:
          try:
            with clock.measure("eval"):
              final_metrics, samples = evaluated = evaluate(state.params)
            writer.write(step, final_metrics)
          except BaseException:
            # The steps trained so far are kept: step's checkpoint first, then the error.
            checkpoints.save(step, checkpoint_arrays(state), batches.get_state())
            checkpoints.wait()
            raise
          progress.write(f"step {step}: " + ", ".join(f"{k}={v:.4f}"
                                                      for k, v in final_metrics.items()))
        if save:
          # After the evaluation, so a checkpoint at step s implies all of s's metrics logged.
          with clock.measure("checkpoint"):   # the blocking part: the save itself is async
            started = time.perf_counter()
            checkpoints.save(step, checkpoint_arrays(state), batches.get_state(),
                             metrics=evaluated and evaluated[0])
            blocked = time.perf_counter() - started
          writer.write(step, {"perf/checkpoint_blocking_secs": blocked})
        if evaluated is not None or save:
          log.restart_clock()
        if stop:
          with clock.measure("checkpoint"):
            checkpoints.wait()   # Durable before exiting: the scheduler may kill us soon.
          progress.write(f"{preemption.signal_name} received: stopped after step {step} "
                         f"and saved {checkpoints.path(step)}; run the same command to "
                         "resume.")
          split = _write_time_split(clock, workdir, step)
          if jax.process_index() == 0:
            print(summary_line(split), flush=True)
          return {}
    last_step = max(start_step, train.num_train_steps)
    final_params = state.params
    if train.average_checkpoints > 1:
      with clock.measure("checkpoint"):
        checkpoints.wait()
      with clock.measure("average"):
        final_params, steps = _average_newest(experiment, workdir, checkpoints.steps(),
                                              train.average_checkpoints)
      with clock.measure("final_eval"):
        final_metrics, samples = evaluate(final_params)
      writer.write(last_step, {**final_metrics, "eval/averaged_checkpoints": len(steps)})
      progress.write(f"average of steps {steps}: " + ", ".join(
          f"{k}={v:.4f}" for k, v in final_metrics.items()))
    elif start_step >= train.num_train_steps:
      print(f"already trained to step {start_step} (num_train_steps="
            f"{train.num_train_steps}); evaluating the saved model")
      with clock.measure("final_eval"):
        final_metrics, samples = evaluate(state.params)
    test_split = options.data.test_split
    if test_split:
      with clock.measure("data_setup"):
        test_batches = experiment.eval_batches(test_split)
      with clock.measure("final_eval"):
        test_metrics, samples = Evaluator(experiment, test_batches, eval_step, "test")(
            final_params)
      writer.write(last_step, test_metrics)
      final_metrics.update(test_metrics)
    with clock.measure("checkpoint"):
      checkpoints.wait()   # the last save committed (close() below then has nothing to wait)
    split = _write_time_split(clock, workdir, last_step)
  except BaseException:
    checkpoints.close(raise_failure=False)   # Orbax's work ends; this error stays the one line
    raise
  finally:
    preemption.stop()
    batches.close()
    progress.close()
    checkpoints.close()   # Waits for the last save to be committed (if not closed above).
    writer.close()

  if jax.process_index() == 0:
    _print_samples(samples, experiment.eval.num_samples)
    if batches.stats():
      print("data read for training: " + ", ".join(f"{k[5:]}={v:,}"
                                                   for k, v in batches.stats().items()))
    print("final: " + ", ".join(f"{k}={v:.4f}" for k, v in final_metrics.items()))
    print(summary_line(split))
  return final_metrics


def _write_time_split(clock: RunClock, workdir: str, step: int) -> dict[str, float]:
  """The run's time split so far, written (process 0) to W/time_split.json, beside
  metrics.jsonl rather than in it: the metrics of a run stay those of its training."""
  split = clock.split()
  if jax.process_index() == 0:
    with open(os.path.join(workdir, TIME_SPLIT_FILE), "w") as f:
      json.dump({"step": step, **split}, f, indent=1)
  return split


def _average_newest(experiment: Experiment, workdir: str, available: Sequence[int],
                    count: int) -> tuple[Any, list[int]]:
  """The mean parameters of the newest `count` checkpoints (paper §6.1), written once as
  the parameter snapshot W/exports/step_<last>_avg<count> (which predict then serves: it is
  the newest model) and restored onto the mesh; and their steps. Process 0 averages alone
  (on the host, whole arrays) while the other processes wait for it; then all of them
  restore the snapshot together."""
  steps = checkpoint.select_steps(list(available), "latest", count, None)
  path = os.path.join(workdir, checkpoint.SNAPSHOT_DIR, f"step_{steps[-1]}_avg{count}")
  if jax.process_index() == 0 and not os.path.exists(path):   # a re-run reuses it
    checkpoint.write_average(os.path.join(workdir, CHECKPOINT_DIR), steps, path)
  sync_global_devices(f"average {path}")
  abstract, _ = experiment.abstract_params()
  return checkpoint.restore_params(path, abstract), steps


def evaluate_saved(config: Any, workdir: str | None,
                   path: str | None = None) -> dict[str, float]:
  """Evaluates saved parameters with the config's evaluation: those at `path` (a checkpoint
  or a parameter snapshot, e.g. an average), else the workdir's newest, as `predict` picks them."""
  experiment = Experiment.create(config, workdir)
  abstract, params_sharding = experiment.abstract_params()   # restored straight onto the mesh

  def load(candidate: str) -> tuple[checkpoint.ModelRecord, Any]:
    model = checkpoint.read_record(candidate)
    if tokenizer_item(model.assets.tokenizer, model.assets.target_tokenizer,
                      model.assets.labels) != _assets(experiment):
      raise checkpoint.IncompatibleCheckpointError(
          f"{candidate} was trained with another tokenizer or labels than config.data builds")
    return model, checkpoint.restore_params(candidate, abstract)

  chosen, (model, params) = checkpoint.load_newest(workdir, load, path)
  evaluate = Evaluator(experiment,
                       experiment.eval_batches(experiment.options.data.eval_split,
                                                 experiment.eval.examples),
                       experiment.eval_step(params_sharding))
  metrics, samples = evaluate(params)
  _print_samples(samples, experiment.eval.num_samples)
  steps = model.averaged_steps
  averaged = f", the average of steps {steps}" if len(steps) > 1 else ""
  print(f"evaluated {chosen} (step {model.step}{averaged}): "
        + ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
  return metrics


def _print_samples(samples: Samples, count: int) -> None:
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
          "training stopped and no checkpoint was written after it. Lower "
          "--config.optimizer.learning_rate, set --config.optimizer.clip_grad_norm, or skip "
          "such steps with --config.nonfinite=skip")
  return host_metrics
