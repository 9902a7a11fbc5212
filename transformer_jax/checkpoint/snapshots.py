"""Parameter snapshots and discovery: what inference reads from a workdir.

A parameter snapshot (W/exports/<name>/; the directory keeps its earlier name) has the
items params, config, tokenizer and manifest (with "averaged_steps"): the parameters of one training checkpoint, or the mean of several (the
paper's checkpoint averaging, §6.1), loadable without the optimizer state and without the
workdir. `models` lists a workdir's checkpoints and snapshots best first; `first_good` takes
the first that loads, skipping damaged ones with a warning; `load_newest` is the two
together, as predict, convert and `train.py --eval_only` choose their model.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Sequence, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from transformer_jax import lora
from transformer_jax.checkpoint.manifest import (
  DamagedCheckpointError,
  IncompatibleCheckpointError,
  absolute,
  checkpointer,
  describe,
  describe_leaf,
  differing,
  read,
  signature,
  verify,
  without_fingerprints,
)
from transformer_jax.checkpoint.writing import Saves
from transformer_jax.data.tokenizer import TextAssets, load_tokenizer_item
from transformer_jax.errors import MissingFileError
from transformer_jax.options import LoraOptions, TrainOptions
from transformer_jax.renamed_fields import upgrade
from transformer_jax.trees import unflatten

CHECKPOINT_DIR, SNAPSHOT_DIR = "checkpoints", "exports"
T = TypeVar("T")


# ------------------------------------------------------------------------------ reading
@dataclasses.dataclass
class ModelRecord:
  """The record of a saved model (a checkpoint or a snapshot): what inference needs to
  load it, without its arrays."""
  path: str
  step: int
  config: dict
  assets: TextAssets
  averaged_steps: list[int]
  modules: list[str]          # the top-level parameter modules ("encoder", "classifier", ...)


def read_record(path: str) -> ModelRecord:
  """The JSON items of a checkpoint or snapshot (no arrays are read): its ModelRecord."""
  json = read(epath.Path(path), manifest=ocp.args.JsonRestore(), config=ocp.args.JsonRestore(),
              tokenizer=ocp.args.JsonRestore())
  manifest, adapted = json["manifest"], _lora_of(json["config"], path)
  return ModelRecord(path=str(path), step=int(manifest["step"]), config=json["config"],
               assets=load_tokenizer_item(json["tokenizer"]),
               averaged_steps=list(manifest.get("averaged_steps", [manifest["step"]])),
               modules=read_record(adapted[1]).modules if adapted else
               sorted({leaf.split("/")[0] for leaf in manifest["leaves"]["params"]}))


# A LoRA run's checkpoint holds its adapters and names its base (lora.py): whatever reads a
# saved model's parameters gets them merged into that base, so inference sees a plain model.
def _lora_of(config: dict, where: Any = None) -> tuple[LoraOptions, str] | None:
  """(the LoRA options, the base's path) of a LoRA run's config (`where`: its checkpoint's
  path, whose base must exist), else None."""
  config = upgrade(config)
  options = LoraOptions.from_dict(config.get("lora"))
  if not options.rank:
    return None
  base = TrainOptions.from_dict(config).init_from
  if where is not None and "://" not in base and not os.path.isdir(base):
    raise IncompatibleCheckpointError(f"{where} holds LoRA adapters of the model at "
                                      f"init_from={base!r}, which is gone; put it back there")
  return options, base


def without_lora(config: dict) -> dict:
  """A run config whose parameters are plain (merged): its LoRA off."""
  return {**config, "lora": {**config["lora"], "rank": 0}} if _lora_of(config) else config


def _merged(path: epath.Path, base: Any, adapters: Any, options: LoraOptions) -> Any:
  try:
    return lora.merge_placed(base, adapters, options)
  except ValueError as e:
    raise IncompatibleCheckpointError(f"{path}: its LoRA adapters do not fit the base its "
                                      f"config names (init_from): {e}") from None


def restore_params(path: str, abstract_params: Any | None = None) -> Any:
  """The verified parameters of a checkpoint or snapshot. With `abstract_params` (a tree of
  ShapeDtypeStructs) they are restored to its structure and shardings, else as saved, on
  the default device. A LoRA run's are its adapters merged into its base."""
  path = epath.Path(path)
  json = read(path, manifest=ocp.args.JsonRestore(), config=ocp.args.JsonRestore())
  manifest, adapted = json["manifest"], _lora_of(json["config"], path)
  if adapted:   # the adapters replicated where the base's arrays are
    base = restore_params(adapted[1], abstract_params)
    placed = getattr(jax.tree_util.tree_leaves(base)[0], "sharding",   # host arrays: none
                     jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    if isinstance(placed, jax.sharding.NamedSharding):
      placed = jax.sharding.NamedSharding(placed.mesh, jax.sharding.PartitionSpec())
    adapters = _verified_params(path, manifest, _saved_shapes(manifest, placed), alone=False)
    return _merged(path, base, adapters, adapted[0])
  if abstract_params is not None:
    saved = without_fingerprints(manifest["leaves"]["params"])
    expected = signature(abstract_params)
    paths = differing(saved, expected)
    if paths:
      raise IncompatibleCheckpointError(
          f"{path}: the parameters do not fit the model of its config ({len(paths)} "
          f"arrays differ; {paths[0]}: saved {describe_leaf(saved.get(paths[0]))}, "
          f"model {describe_leaf(expected.get(paths[0]))})")
  return _verified_params(path, manifest, abstract_params, alone=False)


def _host_arrays(path: str) -> tuple[Any, tuple[LoraOptions, str] | None]:
  """(the verified parameters of a checkpoint or snapshot as saved, `_lora_of` its config),
  read by process 0 alone. Each array is read whole onto one of its devices: with the
  sharding it was saved with, part of it would belong to the other processes, which are not
  reading along."""
  path = epath.Path(path)
  json = read(path, alone=True, manifest=ocp.args.JsonRestore(), config=ocp.args.JsonRestore())
  manifest, adapted = json["manifest"], _lora_of(json["config"], path)
  here = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return _verified_params(path, manifest, _saved_shapes(manifest, here), alone=True), adapted


def _host_params(path: str) -> Any:
  """`_host_arrays`' parameters as numpy arrays; a LoRA run's merged into its base."""
  params, adapted = _host_arrays(path)
  if adapted:
    params = _merged(epath.Path(path), _host_params(adapted[1]), params, adapted[0])
  return jax.tree_util.tree_map(np.asarray, params)


def read_adapters(path: str) -> tuple[Any, LoraOptions, str]:
  """(the adapters, as numpy arrays, the LoRA options, the base's path) of a LoRA run's
  checkpoint or snapshot (lora.py); IncompatibleCheckpointError for a plain model."""
  adapters, adapted = _host_arrays(path)
  if not adapted:
    raise IncompatibleCheckpointError(f"{path} holds a whole model, not LoRA adapters "
                                      "(its config's lora.rank is 0)")
  return jax.tree_util.tree_map(np.asarray, adapters), *adapted


def _saved_shapes(manifest: dict, placed: jax.sharding.Sharding) -> Any:
  """The saved parameters' shapes, placed as `placed` says."""
  return unflatten({name: jax.ShapeDtypeStruct(leaf["shape"], jnp.dtype(leaf["dtype"]),
                                               sharding=placed)
                    for name, leaf in manifest["leaves"]["params"].items()})


def _verified_params(path: epath.Path, manifest: dict, target: Any | None, alone: bool) -> Any:
  restore = ocp.args.StandardRestore(
      target, fallback_sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
  params = read(path, alone=alone, params=restore)["params"]
  verify("params", params, manifest, str(path))
  return params


def first_good(paths: Sequence[str], load: Callable[[str], T]) -> tuple[str, T, list[str]]:
  """(path, load(path), damaged paths) for the first of `paths` that loads. A path whose
  load raises anything but IncompatibleCheckpointError is damaged: logged and skipped."""
  damaged: list[str] = []
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


# ----------------------------------------------------------------------- snapshots
def select_steps(available: list[int], step: str, average: int, best: int | None) -> list[int]:
  """The `average` checkpoints of `available` ending at `step` ('latest', 'best' or a
  number; `best` is best_step's answer), for the export command (python -m
  transformer_jax.export), whose flags the errors name."""
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


def write_average(checkpoint_dir: str, steps: Sequence[int], output: str) -> str:
  """Writes the parameters of checkpoint `steps` (their mean if several: the paper's
  checkpoint averaging, §6.1) with the newest one's config and tokenizer as a parameter
  snapshot at `output`. Returns `output`. In a cluster, process 0 calls it alone (the
  others wait for it): it reads and writes by itself."""
  steps = sorted(steps)
  if not steps:
    raise ValueError("no checkpoints to export")
  output_path = absolute(output)
  if output_path.exists():
    raise FileExistsError(f"{output_path} already exists; choose another --output")
  paths = [absolute(checkpoint_dir) / str(s) for s in steps]
  newest = read(paths[-1], alone=True, manifest=ocp.args.JsonRestore(),
                config=ocp.args.JsonRestore(), tokenizer=ocp.args.JsonRestore())
  total, shapes = None, None
  for path in paths:
    params = _host_params(str(path))   # a LoRA run's: merged, so the snapshot is plain
    shapes = shapes or signature(params)
    if signature(params) != shapes:
      raise IncompatibleCheckpointError(
          f"cannot average {path} with {paths[0]}: their parameters differ in shape")
    as64 = jax.tree_util.tree_map(lambda x: x.astype(np.float64), params)
    total = as64 if total is None else jax.tree_util.tree_map(np.add, total, as64)
  # The mean is taken in float64 and rounded once to each parameter's dtype.
  mean = jax.tree_util.tree_map(lambda t, p: (t / len(paths)).astype(p.dtype), total, params)
  return write_snapshot(str(output_path), mean, without_lora(newest["config"]),
                        newest["tokenizer"], steps, alone=True)


def write_snapshot(output: str, params: Any, run_config: dict, tokenizer: dict,
                   steps: Sequence[int], alone: bool = False) -> str:
  """A parameter snapshot at `output` (which must not exist): `params` (host arrays), the
  run config, the tokenizer item (data.tokenizer.tokenizer_item) and a manifest saying which
  training `steps` it comes from (their mean if several). Returns `output`. `alone`:
  written by process 0 by itself (manifest.checkpointer). A write the file system refuses
  raises CheckpointWriteError once the rest of the save has ended (writing.Saves)."""
  output_path = absolute(output)
  if output_path.exists():
    raise FileExistsError(f"{output_path} already exists; choose another --output")
  manifest = {"step": steps[-1], "averaged_steps": list(steps),
              "leaves": {"params": describe(params)}}
  saves = Saves(f"parameter snapshot {output_path}", "the checkpoints are intact")
  with checkpointer(alone) as writer, saves.failing():
    writer.save(output_path, args=ocp.args.Composite(
        params=ocp.args.StandardSave(params), config=ocp.args.JsonSave(run_config),
        tokenizer=ocp.args.JsonSave(tokenizer), manifest=ocp.args.JsonSave(manifest)))
  return str(output_path)


# ------------------------------------------------------------------------ discovery
def _reading_manager(directory: str, best_fn: Callable[[dict], float] | None = None,
                     best_mode: str = "max") -> ocp.CheckpointManager:
  """A manager only used to list steps; it writes nothing (read_only=True would do the same
  but logs a warning each time)."""
  return ocp.CheckpointManager(
      absolute(directory), options=ocp.CheckpointManagerOptions(
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
  saved = read(absolute(directory) / str(steps[-1]), config=ocp.args.JsonRestore())["config"]
  train = TrainOptions.from_dict(upgrade(saved))
  metric = train.best_checkpoint_metric
  if not metric:
    return None
  with _reading_manager(directory, lambda m: float(m[metric]),
                        train.best_checkpoint_mode) as manager:
    return manager.best_step()


def _is_complete(path: epath.Path) -> bool:
  return path.is_dir() and ocp.step.is_path_finalized(path) and (path / "manifest").exists()


def _snapshot_step(path: epath.Path) -> int:
  try:
    return int(read(path, manifest=ocp.args.JsonRestore())["manifest"]["step"])
  except Exception:  # An unreadable snapshot ranks last; loading it reports the damage.
    return -1


def models(workdir: str) -> list[str]:
  """The checkpoints and snapshots of a workdir, best first, as `predict` tries them: by
  training step, newest first, and at the same step a snapshot (e.g. an average) before the
  training checkpoint."""
  ranked = []
  exports = epath.Path(workdir) / SNAPSHOT_DIR
  if exports.is_dir():
    ranked += [(_snapshot_step(p), 1, str(p)) for p in exports.iterdir() if _is_complete(p)]
  checkpoints = epath.Path(workdir) / CHECKPOINT_DIR
  if checkpoints.is_dir():
    ranked += [(step, 0, str(checkpoints / str(step))) for step in checkpoint_steps(checkpoints)]
  return [path for *_, path in sorted(ranked, reverse=True)]


def load_newest(workdir: str | None, load: Callable[[str], T],
                path: str | None = None) -> tuple[str, T]:
  """(path, load(path)) of the model that inference uses: `path` (a checkpoint or snapshot
  directory) when given, else the first of the workdir's `models` that loads (a damaged one
  is skipped with a warning). A missing directory, or a workdir without a model, is a
  MissingFileError naming it."""
  if path is not None:
    if not os.path.isdir(path):
      raise MissingFileError(f"checkpoint {path!r} does not exist")
    candidates = [path]
  elif workdir is None or not os.path.isdir(workdir):
    raise MissingFileError(f"workdir {workdir!r} does not exist; train first with "
                           f"`python train.py --workdir {workdir}`")
  else:
    candidates = models(workdir)
    if not candidates:
      raise MissingFileError(f"workdir {workdir!r} has no checkpoint or snapshot; was "
                             "training interrupted before the first checkpoint?")
  chosen, loaded, _ = first_good(candidates, load)
  return chosen, loaded
