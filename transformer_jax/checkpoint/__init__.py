"""Orbax checkpoints: W/checkpoints/<step>/ to resume training, W/exports/<name>/ to predict.

A training checkpoint is one Orbax composite checkpoint with the items
  params     (arrays) the model parameters
  train      (arrays) {"step", "opt_state", "rng"}
  data       (JSON)   the training data iterator's get_state()
  config     (JSON)   the resolved run config, as in W/config.json
  tokenizer  (JSON)   the tokenizer file it was trained with, base64 (data/tokenizer.py)
  manifest   (JSON)   {"step", "leaves": {item: {path: {"shape", "dtype", "fingerprint"}}}}
An export has params, config, tokenizer and manifest (with "averaged_steps"), so it loads
without the optimizer state and without the workdir. `manifest` checks a checkpoint against
its manifest (structure before reading, fingerprints after); `manager` saves and resumes
training checkpoints (plain pytrees: it knows nothing of the TrainState); `exports` writes
exports, averages, and finds and loads the model of a workdir for inference.
"""

from transformer_jax.checkpoint.exports import (CHECKPOINT_DIR, EXPORT_DIR, Model, best_step,
                                                checkpoint_steps, export, first_good,
                                                load_newest, models, read_model,
                                                restore_params, select_steps, write_export)
from transformer_jax.checkpoint.manager import (DAMAGED_DIR, CheckpointWriteError, Restored,
                                                TrainCheckpoints, check_writable)
from transformer_jax.checkpoint.manifest import (DamagedCheckpointError,
                                                 IncompatibleCheckpointError,
                                                 config_differences, describe, signature)

__all__ = [
    "CHECKPOINT_DIR", "CheckpointWriteError", "DAMAGED_DIR", "EXPORT_DIR",
    "DamagedCheckpointError", "IncompatibleCheckpointError", "Model", "Restored",
    "TrainCheckpoints", "best_step", "check_writable", "checkpoint_steps",
    "config_differences", "describe", "export", "first_good", "load_newest", "models",
    "read_model", "restore_params", "select_steps", "signature", "write_export",
]
