"""The training checkpoints of a run: W/checkpoints/<step>/, saved and restored as plain
pytrees ({"params": ..., "train": ...}; training/state.py converts its TrainState).

Saves are asynchronous: `save` returns once the arrays are copied off the accelerator and
Orbax writes them in a background thread. They are atomic: Orbax writes into
<step>.orbax-checkpoint-tmp-<time>/ and renames it when every item is on disk, so a crash
mid-save leaves no directory that looks complete (and such leftovers are removed at the
next start). Orbax deletes the checkpoints beyond `keep` only after the newer one is
committed. A checkpoint that fails to read or to match its manifest's fingerprints is
damaged: `restore` warns, moves it to W/checkpoints/damaged/ (never deletes it) and falls
back to the newest good one.

A directory that cannot be written (read-only, no permission, disk full) raises
CheckpointWriteError, one line naming the directory and the reason: before training (a test
write, `check_writable`), or from the save that fails. The checkpoints before it stay
intact. Whatever ends a run, `close` ends Orbax's work first: it waits for the last save, and
the rest of a save that failed is cancelled and waited for when the failure comes out
(writing.Saves), so that no thread of Orbax's runs on after the run's one error line.
"""

from __future__ import annotations

import dataclasses
import logging as std_logging
import os
import uuid
from typing import Any, Iterable, Sequence

import jax
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from transformer_jax import sharding
from transformer_jax.checkpoint.manifest import (
  absolute,
  check_compatible,
  describe,
  read,
  signature,
  verify,
)
from transformer_jax.checkpoint.snapshots import first_good
from transformer_jax.checkpoint.writing import CheckpointWriteError, Saves, write_failure_reason
from transformer_jax.errors import UserError

# The array items of a training checkpoint; its JSON items are data, config, tokenizer and
# manifest. Fixed, so that every checkpoint ever written restores.
ARRAY_ITEMS = ("params", "train")
DAMAGED_DIR = "damaged"


def check_writable(directory: str) -> None:
  """Writes, renames and removes a file in `directory` (created, and removed again, if
  missing); an OSError becomes CheckpointWriteError. Only trying tells: as root, permission
  bits do not stop writes, and os.access does not know every read-only mount."""
  probe = os.path.join(directory, f".write-test-{uuid.uuid4().hex}")
  created = not os.path.isdir(directory)
  try:
    os.makedirs(directory, exist_ok=True)
    with open(probe, "w") as f:
      f.write("ok")
    os.replace(probe, probe + ".renamed")
    os.remove(probe + ".renamed")
    if created:   # Left to the first save: a run refused later leaves no checkpoints/.
      os.rmdir(directory)
  except OSError as e:
    raise CheckpointWriteError(f"cannot write checkpoint to {directory}: "
                               f"{(e.strerror or str(e)).lower()}") from e


@dataclasses.dataclass
class Restored:
  """A restored training checkpoint: its arrays ({"params", "train"}, in the structure and
  shardings asked for), the data iterator's state, and the run config it was saved with."""
  step: int
  arrays: dict[str, Any]
  data_state: dict
  config: dict
  path: str


def _check_items(arrays: dict[str, Any]) -> None:
  if not isinstance(arrays, dict) or sorted(arrays) != sorted(ARRAY_ITEMS):
    given = sorted(arrays) if isinstance(arrays, dict) else type(arrays).__name__
    raise TypeError(f"a training checkpoint's arrays are a dict with the items "
                    f"{list(ARRAY_ITEMS)}, not {given} (see training.state.checkpoint_arrays)")


class _WithoutMissingMetricsWarning(std_logging.Filter):
  """Orbax warns at every save without metrics when it tracks the best checkpoint; here
  only evaluations have metrics, by design."""

  def filter(self, record: std_logging.LogRecord) -> bool:
    return "did not provide metrics" not in record.getMessage()


_MISSING_METRICS_FILTER = _WithoutMissingMetricsWarning()


class TrainCheckpoints:
  """W/checkpoints: an Orbax CheckpointManager plus the run's config and tokenizer.

  save_interval_steps: save at multiples of each of these, at `final_step`, and at JAX's
  multi-host preemption sync point; `keep` most recent checkpoints are kept, plus the
  `keep_best` best by eval metric `best_metric` ("max" or "min" is better per `best_mode`).
  """

  def __init__(self, directory: str, run_config: dict, tokenizer: dict,
               save_interval_steps: Iterable[int] = (), final_step: int | None = None,
               keep: int = 3, keep_best: int = 0, best_metric: str = "",
               best_mode: str = "max"):
    self.directory = absolute(directory)
    self.run_config, self.tokenizer = run_config, tokenizer
    self.saves = Saves(f"checkpoint to {self.directory}", "the checkpoints before it are intact")
    self._closed = False
    self.best_metric = best_metric if keep_best else ""
    policies = ocp.checkpoint_managers
    when = [policies.FixedIntervalPolicy(n) for n in save_interval_steps]
    when += [policies.SpecificStepsPolicy([final_step])] if final_step else []
    keeps = [policies.LatestN(keep)]
    if self.best_metric:
      std_logging.getLogger("absl").addFilter(_MISSING_METRICS_FILTER)  # Added once.
      keeps.append(policies.BestN(get_metric_fn=self._best_value, reverse=best_mode == "min",
                                  n=keep_best, keep_checkpoints_without_metrics=False))
    with self.saves.failing():
      self.manager = ocp.CheckpointManager(
          self.directory, options=ocp.CheckpointManagerOptions(
              save_decision_policy=policies.AnySavePolicy(
                  when + [policies.PreemptionCheckpointingPolicy()]),
              preservation_policy=policies.AnyPreservationPolicy(keeps),
              # Setting best_fn makes Orbax write each save's metrics, which BestN reads back.
              best_fn=self._best_value if self.best_metric else None,
              best_mode=best_mode, cleanup_tmp_directories=True, create=True))

  @property
  def failed(self) -> bool:
    """Whether a save failed (its error was raised)."""
    return self.saves.failed

  def _best_value(self, metrics: dict) -> float:
    return float(metrics[self.best_metric])

  def steps(self) -> Sequence[int]:
    return self.manager.all_steps()

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def path(self, step: int) -> epath.Path:
    return self.directory / str(step)

  def should_save(self, step: int) -> bool:
    return self.manager.should_save(step)

  def save(self, step: int, arrays: dict[str, Any], data_state: dict,
           metrics: dict[str, float] | None = None) -> None:
    """Starts an asynchronous save of `arrays` ({"params": ..., "train": ...}, pytrees of
    arrays) and the data iterator's `data_state` (JSON) after `step` steps; returns once the
    arrays are copied off the device. `metrics` (an evaluation at this step) rank
    checkpoints for keep_best."""
    _check_items(arrays)
    unknown_metric = (self.best_metric and metrics is not None
                      and self.best_metric not in metrics)
    manifest = {"step": step, "leaves": {k: describe(arrays[k]) for k in ARRAY_ITEMS}}
    items = {k: ocp.args.StandardSave(arrays[k]) for k in ARRAY_ITEMS}
    # Without the metrics it cannot rank: the step is saved all the same, then refused.
    with self.saves.failing():
      self.manager.save(step, force=True, metrics=None if unknown_metric else metrics,
                        args=ocp.args.Composite(**items, data=ocp.args.JsonSave(data_state),
                                                config=ocp.args.JsonSave(self.run_config),
                                                tokenizer=ocp.args.JsonSave(self.tokenizer),
                                                manifest=ocp.args.JsonSave(manifest)))
    if unknown_metric:
      self.wait()
      raise UserError(f"config.best_checkpoint_metric={self.best_metric!r} is not an "
                      f"evaluation metric; they are {sorted(metrics or {})} (step {step} was "
                      "saved without it)")

  def restore(self, abstract_arrays: dict[str, Any]) -> Restored | None:
    """The newest good checkpoint restored into the structure and shardings of
    `abstract_arrays` ({"params", "train"}: trees of arrays or ShapeDtypeStructs), or None
    if there is none. Damaged newer ones are moved to checkpoints/damaged/ with a warning;
    an incompatible one raises IncompatibleCheckpointError."""
    _check_items(abstract_arrays)
    paths = [str(self.path(step)) for step in reversed(self.steps())]
    if not paths:
      return None
    _, restored, damaged = first_good(paths, lambda path: self._restore(path, abstract_arrays))
    for path in damaged:
      self._set_aside(epath.Path(path))
    if damaged:
      logging.warning("resuming from the newest good checkpoint, step %d", restored.step)
    return restored

  def _restore(self, path: str, abstract_arrays: dict[str, Any]) -> Restored:
    path = epath.Path(path)
    json = read(path, manifest=ocp.args.JsonRestore(), config=ocp.args.JsonRestore(),
                tokenizer=ocp.args.JsonRestore(), data=ocp.args.JsonRestore())
    manifest = json["manifest"]
    check_compatible(path, manifest, json["config"], json["tokenizer"],
                     {k: signature(v) for k, v in abstract_arrays.items()}, self.run_config,
                     self.tokenizer)
    arrays = read(path, **{k: ocp.args.StandardRestore(sharding.abstract(v))
                           for k, v in abstract_arrays.items()})
    for item in ARRAY_ITEMS:
      verify(item, arrays[item], manifest, str(path))
    return Restored(step=int(manifest["step"]), arrays={k: arrays[k] for k in ARRAY_ITEMS},
                    data_state=json["data"], config=json["config"], path=str(path))

  def _set_aside(self, path: epath.Path) -> None:
    """Moves a damaged checkpoint out of Orbax's sight (keeping it for inspection), so that
    it is neither resumed from, counted among the recent ones, nor in the way of a new
    save of its step."""
    if jax.process_index() == 0:
      target = self.directory / DAMAGED_DIR / path.name
      suffix = 0
      while target.exists():
        suffix += 1
        target = self.directory / DAMAGED_DIR / f"{path.name}-{suffix}"
      target.parent.mkdir(parents=True, exist_ok=True)
      path.rename(target)
      logging.warning("moved damaged checkpoint %s to %s", path, target)
    if jax.process_count() > 1:
      ocp.multihost.sync_global_processes("transformer_jax:set_aside_damaged_checkpoint")
    self.manager.reload()

  def wait(self) -> None:
    """Blocks until the last save is committed (on disk, renamed into place)."""
    with self.saves.failing():
      self.manager.wait_until_finished()

  def close(self, raise_failure: bool = True) -> None:
    """Ends Orbax's work, as every run does however it ends: waits for the last save, then
    closes the manager (after a failed save, the rest of it was already cancelled). A failure
    of that save is raised; with raise_failure=False (another error is ending the run, and
    stays its one line) it is logged as a warning. Closing again does nothing."""
    if self._closed:
      return
    self._closed = True
    try:
      if not self.failed:
        self.wait()
    except Exception as e:
      if raise_failure:
        raise
      logging.warning("%s", e)
    finally:
      self._close_manager()

  def _close_manager(self) -> None:
    if not self.failed:
      with self.saves.failing():
        self.manager.close()
    elif not self.saves.stuck:   # (else closing would wait for what never ends)
      try:
        self.manager.close()
      except Exception as e:   # A repeat of the failure raised, or new: then said.
        if write_failure_reason(e) is None:
          logging.warning("closing the checkpoints after a failed save: %s", e)
