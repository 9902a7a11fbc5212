"""Orbax checkpoints: W/checkpoints/<step>/ to resume training, W/exports/<name>/ to predict.

A training checkpoint is one Orbax composite checkpoint with the items
  params     (arrays) the model parameters
  train      (arrays) {"step", "opt_state", "rng"}
  data       (JSON)   the training data iterator's get_state()
  config     (JSON)   the resolved run config, as in W/config.json
  tokenizer  (JSON)   the tokenizer file it was trained with, base64
  manifest   (JSON)   {"step", "leaves": {item: {path: {"shape", "dtype", "fingerprint"}}}}
An export has params, config, tokenizer and manifest (with "averaged_steps"), so it loads
without the optimizer state and without the workdir.

Saves are asynchronous: `save` returns once the arrays are copied off the accelerator and
Orbax writes them in a background thread. They are atomic: Orbax writes into
<step>.orbax-checkpoint-tmp-<time>/ and renames it when every item is on disk, so a crash
mid-save leaves no directory that looks complete (and such leftovers are removed at the
next start). Orbax deletes the checkpoints beyond `keep` only after the newer one is
committed.

The manifest gives two checks that do not depend on Orbax's metadata format: a state of a
different structure (another model shape or optimizer) is refused before any array is read,
naming the config fields that differ; and each restored array must match the fingerprint
taken when it was saved. A truncated file fails to read; a flipped bit reads fine and only
the fingerprint notices it. Either way the checkpoint is damaged: training warns, moves it
to W/checkpoints/damaged/ (never deletes it) and falls back to the newest good one.
"""

from __future__ import annotations

import base64
import dataclasses
import logging as std_logging
import os
import tempfile
from typing import Any, Callable, Iterable, Sequence, TypeVar

from absl import logging
from etils import epath
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from transformer_jax import sharding
from transformer_jax.data.text_data import TARGET_VOCAB_FILE, VOCAB_FILE
from transformer_jax.data.tokenizer import load_tokenizer
from transformer_jax.training.state import TrainState

ARRAY_ITEMS = ("params", "train")
CHECKPOINT_DIR, EXPORT_DIR, DAMAGED_DIR = "checkpoints", "exports", "damaged"
T = TypeVar("T")


class IncompatibleCheckpointError(ValueError):
  """The checkpoint holds a state of another structure than the current config builds."""


class DamagedCheckpointError(RuntimeError):
  """A checkpoint could not be read back as it was written."""


# ------------------------------------------------------------------ manifest and fingerprints
def _leaf_fingerprint(x: jax.Array) -> jax.Array:
  """Two uint32 sums of the array's bits, plain and position-weighted (mod 2**32): any single
  flipped bit changes the first; swapped values change the second."""
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.uint8)
  unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
  bits = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32).ravel()
  weights = jnp.arange(1, bits.size + 1, dtype=jnp.uint32)
  return jnp.stack([jnp.sum(bits, dtype=jnp.uint32), jnp.sum(bits * weights, dtype=jnp.uint32)])


# Jitted per leaf rather than over the whole tree: a model has few distinct leaf shapes (and
# the Adam moments repeat the parameters'), so this compiles a few tiny programs instead of
# one large one (seconds on a CPU for the whole state).
_fingerprint = jax.jit(_leaf_fingerprint)


def _paths(tree: Any) -> list[tuple[str, Any]]:
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [(jax.tree_util.keystr(path, simple=True, separator="/"), leaf) for path, leaf in leaves]


def signature(tree: Any) -> dict[str, dict[str, Any]]:
  """{leaf path: {"shape", "dtype"}} of a tree of arrays or ShapeDtypeStructs."""
  return {path: {"shape": list(leaf.shape), "dtype": str(jnp.dtype(leaf.dtype))}
          for path, leaf in _paths(tree)}


def describe(tree: Any) -> dict[str, dict[str, Any]]:
  """signature(tree) plus each leaf's fingerprint (this waits for the arrays)."""
  described = signature(tree)
  paths = _paths(tree)
  # One leaf at a time: several small collective programs in flight at once can deadlock
  # XLA:CPU's in-process all-reduce on a multi-device mesh.
  prints = [jax.device_get(_fingerprint(leaf)) for _, leaf in paths]
  for (path, _), fingerprint in zip(paths, prints):
    described[path]["fingerprint"] = [int(v) for v in fingerprint]
  return described


def _without_fingerprints(leaves: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
  return {p: {k: v for k, v in d.items() if k != "fingerprint"} for p, d in leaves.items()}


def _differing(a: dict, b: dict) -> list[str]:
  return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def _verify(item: str, tree: Any, manifest: dict, where: str) -> None:
  expected = manifest["leaves"][item]
  bad = _differing(expected, describe(tree))
  if bad:
    raise DamagedCheckpointError(
        f"{where}: {item}/{bad[0]} does not match the fingerprint recorded when it was saved "
        f"({len(bad)} of {len(expected)} arrays differ)")


# ------------------------------------------------------------------------ tokenizer and config
@dataclasses.dataclass
class TextAssets:
  """What turns text into ids and back: the tokenizer(s) and the class or tag names."""
  tokenizer: Any
  target_tokenizer: Any
  labels: list[str] | None


def tokenizer_item(tokenizer: Any, target_tokenizer: Any = None,
                   labels: Sequence[str] | None = None) -> dict[str, Any]:
  """The tokenizers as the files they save (base64 in JSON; a SentencePiece tokenizer saves
  two) and the label names: a checkpoint is usable without its workdir."""
  files = {}
  with tempfile.TemporaryDirectory() as tmp:
    tokenizer.save(os.path.join(tmp, VOCAB_FILE))
    if target_tokenizer is not None and target_tokenizer is not tokenizer:
      target_tokenizer.save(os.path.join(tmp, TARGET_VOCAB_FILE))
    for name in sorted(os.listdir(tmp)):
      with open(os.path.join(tmp, name), "rb") as f:
        files[name] = base64.b64encode(f.read()).decode("ascii")
  return {"files": files, "labels": list(labels) if labels is not None else None}


def load_tokenizer_item(item: dict[str, Any]) -> TextAssets:
  with tempfile.TemporaryDirectory() as tmp:
    for name, data in item["files"].items():
      with open(os.path.join(tmp, os.path.basename(name)), "wb") as f:
        f.write(base64.b64decode(data))
    tokenizer = load_tokenizer(os.path.join(tmp, VOCAB_FILE))
    target_path = os.path.join(tmp, TARGET_VOCAB_FILE)
    target = load_tokenizer(target_path) if os.path.exists(target_path) else tokenizer
  return TextAssets(tokenizer, target, item.get("labels"))


def _flatten(config: dict, prefix: str = "") -> dict[str, Any]:
  flat = {}
  for key, value in config.items():
    if isinstance(value, dict):
      flat.update(_flatten(value, f"{prefix}{key}."))
    else:
      flat[f"{prefix}{key}"] = value
  return flat


def config_differences(saved: dict, current: dict) -> list[str]:
  """'field: saved -> current' for each config field that differs."""
  old, new = _flatten(saved), _flatten(current)
  return [f"{k}: {old.get(k, '<absent>')!r} -> {new.get(k, '<absent>')!r}"
          for k in sorted(set(old) | set(new)) if old.get(k, "<absent>") != new.get(k, "<absent>")]


def _describe_leaf(leaf: dict | None) -> str:
  return "absent" if leaf is None else f"{leaf['dtype']}{leaf['shape']}"


def _check_compatible(path: epath.Path, manifest: dict, saved_config: dict, saved_tokenizer: dict,
                      expected: dict[str, dict], config: dict, tokenizer: dict) -> None:
  """Raises IncompatibleCheckpointError if the checkpoint's arrays or tokenizer differ from
  what the current config builds."""
  problems = []
  for item, leaves in expected.items():
    saved = _without_fingerprints(manifest["leaves"][item])
    differing = _differing(saved, leaves)
    problems += [f"{item}/{p}: {_describe_leaf(saved.get(p))} -> {_describe_leaf(leaves.get(p))}"
                 for p in differing[:3]]
    if len(differing) > 3:
      problems.append(f"... and {len(differing) - 3} more arrays of {item}")
  if saved_tokenizer != tokenizer:
    problems.append("the tokenizer differs from the one the checkpoint was trained with")
  if problems:
    fields = config_differences(saved_config, config) or ["(none)"]
    raise IncompatibleCheckpointError(
        f"cannot resume from {path}: the current config builds a different model or "
        "optimizer state than the one saved there.\nConfig fields that differ from the "
        "checkpoint's (saved -> now):\n  " + "\n  ".join(fields) + "\nWhat differs "
        "(saved -> now):\n  " + "\n  ".join(problems) + "\nResume with the checkpoint's "
        "values of these fields, or train in a new --workdir.")


# ------------------------------------------------------------------------------ reading
def _absolute(path: str | epath.Path) -> epath.Path:
  """Local paths made absolute (Orbax needs that); URLs such as gs://... as they are."""
  return epath.Path(path if "://" in str(path) else os.path.abspath(path))


def _read(path: str | epath.Path, **items: ocp.args.CheckpointArgs) -> Any:
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
    return checkpointer.restore(_absolute(path), args=ocp.args.Composite(**items))


@dataclasses.dataclass
class Model:
  """What inference needs from a checkpoint or an export."""
  path: str
  step: int
  config: dict
  assets: TextAssets
  averaged_steps: list[int]


def read_model(path: str) -> Model:
  """The JSON items of a checkpoint or export (no arrays are read)."""
  json = _read(epath.Path(path), manifest=ocp.args.JsonRestore(), config=ocp.args.JsonRestore(),
               tokenizer=ocp.args.JsonRestore())
  manifest = json["manifest"]
  return Model(path=str(path), step=int(manifest["step"]), config=json["config"],
               assets=load_tokenizer_item(json["tokenizer"]),
               averaged_steps=list(manifest.get("averaged_steps", [manifest["step"]])))


def restore_params(path: str, abstract_params: Any | None = None) -> Any:
  """The verified parameters of a checkpoint or export. With `abstract_params` (a tree of
  ShapeDtypeStructs) they are restored to its structure and shardings, else as saved, on
  the default device."""
  path = epath.Path(path)
  manifest = _read(path, manifest=ocp.args.JsonRestore())["manifest"]
  if abstract_params is not None:
    saved = _without_fingerprints(manifest["leaves"]["params"])
    expected = signature(abstract_params)
    differing = _differing(saved, expected)
    if differing:
      raise IncompatibleCheckpointError(
          f"{path}: the parameters do not fit the model of its config ({len(differing)} "
          f"arrays differ; {differing[0]}: saved {_describe_leaf(saved.get(differing[0]))}, "
          f"model {_describe_leaf(expected.get(differing[0]))})")
  restore = ocp.args.StandardRestore(
      abstract_params, fallback_sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
  params = _read(path, params=restore)["params"]
  _verify("params", params, manifest, str(path))
  return params


def first_good(paths: Sequence[str], load: Callable[[str], T]) -> tuple[str, T, list[str]]:
  """(path, load(path), damaged paths) for the first of `paths` that loads. A path whose
  load raises anything but IncompatibleCheckpointError is damaged: logged and skipped."""
  damaged = []
  for path in paths:
    try:
      return path, load(path), damaged
    except IncompatibleCheckpointError:
      raise
    except Exception as e:  # Unreadable, or not what was written.
      logging.warning("checkpoint %s is damaged and will not be used: %s: %s", path,
                      type(e).__name__, str(e).split("\n")[0][:500])
      damaged.append(path)
  raise DamagedCheckpointError(f"none of the checkpoints {list(paths)} can be restored; see "
                               "the warnings above")


# ------------------------------------------------------------------ training checkpoints
@dataclasses.dataclass
class Restored:
  step: int
  state: TrainState
  data_state: dict
  config: dict


def train_item(state: TrainState) -> dict[str, Any]:
  """The `train` item: everything of the state but the parameters."""
  return {"step": state.step, "opt_state": state.opt_state, "rng": state.rng}


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
    self.directory = _absolute(directory)
    self.run_config, self.tokenizer = run_config, tokenizer
    self.best_metric = best_metric if keep_best else ""
    policies = ocp.checkpoint_managers
    saves = [policies.FixedIntervalPolicy(n) for n in save_interval_steps]
    saves += [policies.SpecificStepsPolicy([final_step])] if final_step else []
    keeps = [policies.LatestN(keep)]
    if self.best_metric:
      std_logging.getLogger("absl").addFilter(_MISSING_METRICS_FILTER)  # Added once.
      keeps.append(policies.BestN(get_metric_fn=self._best_value, reverse=best_mode == "min",
                                  n=keep_best, keep_checkpoints_without_metrics=False))
    self.manager = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(
        save_decision_policy=policies.AnySavePolicy(
            saves + [policies.PreemptionCheckpointingPolicy()]),
        preservation_policy=policies.AnyPreservationPolicy(keeps),
        # Setting best_fn makes Orbax write each save's metrics, which BestN reads back.
        best_fn=self._best_value if self.best_metric else None,
        best_mode=best_mode, cleanup_tmp_directories=True, create=True))

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

  def save(self, step: int, state: TrainState, data_state: dict,
           metrics: dict[str, float] | None = None) -> None:
    """Starts an asynchronous save of the state after `step` steps; returns once the arrays
    are copied off the device. `metrics` (an evaluation at this step) rank checkpoints for
    keep_best."""
    if self.best_metric and metrics is not None and self.best_metric not in metrics:
      raise ValueError(f"config.best_checkpoint_metric={self.best_metric!r} is not an "
                       f"evaluation metric; they are {sorted(metrics)}")
    train = train_item(state)
    manifest = {"step": step, "leaves": {"params": describe(state.params),
                                         "train": describe(train)}}
    self.manager.save(step, force=True, metrics=metrics, args=ocp.args.Composite(
        params=ocp.args.StandardSave(state.params), train=ocp.args.StandardSave(train),
        data=ocp.args.JsonSave(data_state), config=ocp.args.JsonSave(self.run_config),
        tokenizer=ocp.args.JsonSave(self.tokenizer), manifest=ocp.args.JsonSave(manifest)))

  def restore(self, state: TrainState) -> Restored | None:
    """The newest good checkpoint restored into the structure and shardings of `state`, or
    None if there is none. Damaged newer ones are moved to checkpoints/damaged/ with a
    warning; an incompatible one raises IncompatibleCheckpointError."""
    paths = [str(self.path(step)) for step in reversed(self.steps())]
    if not paths:
      return None
    _, restored, damaged = first_good(paths, lambda path: self._restore(path, state))
    for path in damaged:
      self._set_aside(epath.Path(path))
    if damaged:
      logging.warning("resuming from the newest good checkpoint, step %d", restored.step)
    return restored

  def _restore(self, path: str, state: TrainState) -> Restored:
    path = epath.Path(path)
    json = _read(path, manifest=ocp.args.JsonRestore(), config=ocp.args.JsonRestore(),
                 tokenizer=ocp.args.JsonRestore(), data=ocp.args.JsonRestore())
    manifest = json["manifest"]
    trees = {"params": state.params, "train": train_item(state)}
    _check_compatible(path, manifest, json["config"], json["tokenizer"],
                      {k: signature(v) for k, v in trees.items()}, self.run_config,
                      self.tokenizer)
    arrays = _read(path, **{k: ocp.args.StandardRestore(sharding.abstract(v)) for k, v in trees.items()})
    for item in ARRAY_ITEMS:
      _verify(item, arrays[item], manifest, str(path))
    train = arrays["train"]
    return Restored(step=int(manifest["step"]),
                    state=TrainState(step=train["step"], params=arrays["params"],
                                     opt_state=train["opt_state"], rng=train["rng"]),
                    data_state=json["data"], config=json["config"])

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
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()


# ------------------------------------------------------------------------- exports
def select_steps(available: list[int], step: str, average: int, best: int | None) -> list[int]:
  """The `average` checkpoints of `available` ending at `step` ('latest', 'best' or a
  number; `best` is best_step's answer), for `export`; errors name the export CLI's flags."""
  if not available:
    raise ValueError("there are no checkpoints to export")
  if average < 1:
    raise ValueError(f"--average={average}: must be >= 1")
  if step == "latest":
    last = available[-1]
  elif step == "best":
    if best is None:
      raise ValueError("--step=best: no checkpoint has evaluation metrics; train with "
                       "--config.keep_best_checkpoints=N")
    last = best
  elif step.isdigit() and int(step) in available:
    last = int(step)
  else:
    raise ValueError(f"--step={step}: not a checkpoint; the checkpoints are at steps "
                     f"{available}")
  chosen = [s for s in available if s <= last][-average:]
  if len(chosen) < average:
    raise ValueError(f"--average={average}: only {len(chosen)} checkpoints up to step {last} "
                     f"exist ({chosen}); keep more with --config.keep_checkpoints")
  return chosen


def export(checkpoint_dir: str, steps: Sequence[int], output: str) -> str:
  """Writes the parameters of checkpoint `steps` (their mean if several: the paper's
  checkpoint averaging, §6.1) with the newest one's config and tokenizer as a params-only
  checkpoint at `output`. Returns `output`."""
  steps = sorted(steps)
  if not steps:
    raise ValueError("no checkpoints to export")
  output_path = _absolute(output)
  if output_path.exists():
    raise FileExistsError(f"{output_path} already exists; choose another --output")
  paths = [_absolute(checkpoint_dir) / str(s) for s in steps]
  newest = _read(paths[-1], manifest=ocp.args.JsonRestore(), config=ocp.args.JsonRestore(),
                 tokenizer=ocp.args.JsonRestore())
  total = None
  for path in paths:
    params = jax.tree_util.tree_map(np.asarray, restore_params(str(path)))
    if signature(params) != _without_fingerprints(newest["manifest"]["leaves"]["params"]):
      raise IncompatibleCheckpointError(
          f"cannot average {path} with {paths[-1]}: their parameters differ in shape")
    as64 = jax.tree_util.tree_map(lambda x: x.astype(np.float64), params)
    total = as64 if total is None else jax.tree_util.tree_map(np.add, total, as64)
  # The mean is taken in float64 and rounded once to each parameter's dtype.
  mean = jax.tree_util.tree_map(lambda t, p: (t / len(paths)).astype(p.dtype), total, params)
  manifest = {"step": steps[-1], "averaged_steps": steps,
              "leaves": {"params": describe(mean)}}
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
    checkpointer.save(output_path, args=ocp.args.Composite(
        params=ocp.args.StandardSave(mean), config=ocp.args.JsonSave(newest["config"]),
        tokenizer=ocp.args.JsonSave(newest["tokenizer"]), manifest=ocp.args.JsonSave(manifest)))
  return str(output_path)


def _reading_manager(directory: str, best_fn: Callable[[dict], float] | None = None,
                     best_mode: str = "max") -> ocp.CheckpointManager:
  """A manager only used to list steps; it writes nothing (read_only=True would do the same
  but logs a warning each time)."""
  return ocp.CheckpointManager(
      _absolute(directory), options=ocp.CheckpointManagerOptions(
          create=False, best_fn=best_fn, best_mode=best_mode))


def checkpoint_steps(directory: str) -> list[int]:
  """Steps of the complete checkpoints in a checkpoints directory, ascending."""
  with _reading_manager(directory) as manager:
    return list(manager.all_steps())


def best_step(directory: str) -> int | None:
  """The best checkpoint by the run's config.best_checkpoint_metric, among those saved
  with evaluation metrics (keep_best_checkpoints > 0); None if there are none."""
  steps = checkpoint_steps(directory)
  if not steps:
    return None
  config = _read(_absolute(directory) / str(steps[-1]),
                 config=ocp.args.JsonRestore())["config"]
  metric = config.get("best_checkpoint_metric")
  if not metric:
    return None
  with _reading_manager(directory, lambda m: float(m[metric]),
                          config.get("best_checkpoint_mode", "max")) as manager:
    return manager.best_step()


def _is_complete(path: epath.Path) -> bool:
  return path.is_dir() and ocp.step.is_path_finalized(path) and (path / "manifest").exists()


def _export_step(path: epath.Path) -> int:
  try:
    return int(_read(path, manifest=ocp.args.JsonRestore())["manifest"]["step"])
  except Exception:  # An unreadable export ranks last; loading it reports the damage.
    return -1


def models(workdir: str) -> list[str]:
  """The checkpoints and exports of a workdir, best first, as `predict` tries them: by
  training step, newest first, and at the same step an export (e.g. an average) before the
  training checkpoint."""
  ranked = []
  exports = epath.Path(workdir) / EXPORT_DIR
  if exports.is_dir():
    ranked += [(_export_step(p), 1, str(p)) for p in exports.iterdir() if _is_complete(p)]
  checkpoints = epath.Path(workdir) / CHECKPOINT_DIR
  if checkpoints.is_dir():
    ranked += [(step, 0, str(checkpoints / str(step))) for step in checkpoint_steps(checkpoints)]
  return [path for *_, path in sorted(ranked, reverse=True)]
