"""Orbax checkpoints: W/checkpoints/<step>/ to resume training; parameter snapshots,
W/exports/<name>/ (the directory keeps its name of earlier versions), for predict.

Three words, three things: a *checkpoint* resumes training; a *parameter snapshot* (params,
config, tokenizer, manifest) is what predict and fine-tuning load; an *artifact*
(transformer_jax/serving, written by `python -m transformer_jax.export`) is what a server
loads. A `ModelRecord` is the JSON of a checkpoint or snapshot: path, step, run config,
text assets.

A training checkpoint is one Orbax composite checkpoint with the items
  params     (arrays) the model parameters (a LoRA run's: its adapters; its config's
             init_from names the base, and every reader gets them merged: lora.py)
  train      (arrays) {"step", "opt_state", "rng"}
  data       (JSON)   the training data's position, get_state(): the same on every host
  config     (JSON)   the resolved run config, as in W/config.json
  tokenizer  (JSON)   the tokenizer file it was trained with, base64 (data/tokenizer.py)
  manifest   (JSON)   {"step", "leaves": {item: {path: {"shape", "dtype", "fingerprint"}}}}
A snapshot has params, config, tokenizer and manifest (with "averaged_steps"), so it loads
without the optimizer state and without the workdir. `manifest` checks a checkpoint against
its manifest (structure before reading, fingerprints after); `manager` saves and resumes
training checkpoints (plain pytrees: it knows nothing of the TrainState); `snapshots` writes
snapshots and averages, and finds and loads the model of a workdir for inference; `writing`
says how a save failed and ends the rest of a failed save before the error is reported.
"""

from transformer_jax.checkpoint.manager import (
                                                  DAMAGED_DIR,
                                                  Restored,
                                                  TrainCheckpoints,
                                                  check_writable,
)
from transformer_jax.checkpoint.manifest import (
                                                  DamagedCheckpointError,
                                                  IncompatibleCheckpointError,
                                                  config_differences,
                                                  describe,
                                                  signature,
)
from transformer_jax.checkpoint.snapshots import (
                                                  CHECKPOINT_DIR,
                                                  SNAPSHOT_DIR,
                                                  ModelRecord,
                                                  best_step,
                                                  checkpoint_steps,
                                                  first_good,
                                                  load_newest,
                                                  models,
                                                  read_adapters,
                                                  read_record,
                                                  restore_params,
                                                  select_steps,
                                                  write_average,
                                                  write_snapshot,
)
from transformer_jax.checkpoint.writing import CheckpointWriteError

__all__ = [
    "CHECKPOINT_DIR", "CheckpointWriteError", "DAMAGED_DIR", "SNAPSHOT_DIR",
    "DamagedCheckpointError", "IncompatibleCheckpointError", "ModelRecord", "Restored",
    "TrainCheckpoints", "best_step", "check_writable", "checkpoint_steps",
    "config_differences", "describe", "write_average", "first_good", "load_newest", "models",
    "read_adapters", "read_record", "restore_params", "select_steps", "signature", "write_snapshot",
]
