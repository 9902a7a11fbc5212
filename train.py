"""Train a Transformer: `python train.py` runs the embedded default job offline.

  python train.py --config=configs/NAME.py --config.num_train_steps=500 --workdir=DIR
"""

import os

from absl import app, flags, logging
from ml_collections import config_flags

from transformer_jax.training.loop import train_and_evaluate

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/default.py", "Config file (ml_collections); fields are overridable "
    "as --config.field=value.", lock_config=True)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Output directory (checkpoints, metrics.jsonl, config.json, vocab); "
    "defaults to workdirs/<config name>. An existing workdir is resumed.")


def main(argv):
  logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO.
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  config_path = config_flags.get_config_filename(flags.FLAGS["config"])
  config_name = os.path.splitext(os.path.basename(config_path))[0]
  train_and_evaluate(_CONFIG.value, _WORKDIR.value or os.path.join("workdirs", config_name))


if __name__ == "__main__":
  app.run(main)
