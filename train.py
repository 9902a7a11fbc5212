"""Train a Transformer: `python train.py` runs the embedded default job offline.

  python train.py --config=configs/NAME.py --config.num_train_steps=500 --workdir=DIR
"""

import time

_STARTED = time.perf_counter()   # before the imports: the time split's "startup" counts them

import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from transformer_jax import errors
from transformer_jax.renamed_fields import renamed_overrides
from transformer_jax.training import timing
from transformer_jax.training.loop import evaluate_saved
from transformer_jax.training.recipe import train

# The default config is found next to this file, so `python path/to/train.py` works from any
# directory; --config=PATH is relative to the current directory as usual.
_DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "default.py")

if renamed_overrides(sys.argv[1:]):   # Fields that moved: say where to, before absl's "unknown".
  errors.exit_with(errors.UserError("; ".join(renamed_overrides(sys.argv[1:]))))
try:
  _CONFIG = config_flags.DEFINE_config_file(
      "config", _DEFAULT_CONFIG, "Config file (ml_collections); fields are overridable "
      "as --config.field=value.", lock_config=True)
except (AttributeError, KeyError) as e:  # ml_collections applies overrides here, at define time.
  errors.exit_with(errors.unknown_config_field(e))
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Output directory (checkpoints, metrics.jsonl, config.json, vocab); "
    "defaults to workdirs/<config name>. An existing workdir is resumed from its newest "
    "good checkpoint. SIGTERM/SIGINT stop after the current step with a checkpoint.")
_EVAL_ONLY = flags.DEFINE_bool(
    "eval_only", False, "Do not train: evaluate the workdir's newest parameter snapshot or checkpoint "
    "(or --checkpoint) with the config's evaluation.")
_CHECKPOINT = flags.DEFINE_string(
    "checkpoint", None, "With --eval_only: a parameter snapshot (W/exports/NAME, e.g. an average) or "
    "checkpoint (W/checkpoints/STEP) directory to evaluate.")
_COMPILATION_CACHE_DIR = flags.DEFINE_string(
    "compilation_cache_dir", os.environ.get("JAX_COMPILATION_CACHE_DIR", ""),
    "Keep compiled programs in this directory (JAX's persistent compilation cache), so that "
    "a later run of the same config on the same kind of machine loads them instead of "
    "compiling; default $JAX_COMPILATION_CACHE_DIR, \"\" = off.")


def main(argv):
  logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO.
  timing.command_started(_STARTED)
  if _COMPILATION_CACHE_DIR.value:   # before the first compile, which reads the setting
    timing.use_compilation_cache(_COMPILATION_CACHE_DIR.value)
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  config_path = config_flags.get_config_filename(flags.FLAGS["config"])
  if not os.path.isfile(config_path):
    raise errors.MissingFileError(f"--config={config_path}: no such file")
  config_name = os.path.splitext(os.path.basename(config_path))[0]
  workdir = _WORKDIR.value or os.path.join("workdirs", config_name)
  if _CHECKPOINT.value and not _EVAL_ONLY.value:
    raise app.UsageError("--checkpoint is for --eval_only; training resumes from the "
                         "workdir's newest checkpoint")
  if _EVAL_ONLY.value:
    evaluate_saved(_CONFIG.value, workdir, _CHECKPOINT.value)
  else:
    train(_CONFIG.value, workdir)   # with config.pretrain.enabled, pretraining first


if __name__ == "__main__":
  errors.run(main)   # A user error (UserError): one line on stderr, exit status 2.
