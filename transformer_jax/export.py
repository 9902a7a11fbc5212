"""Export the parameters of a training checkpoint, or the average of the last N (paper §6.1),
as a params-only checkpoint with the run's config and tokenizer:

  python -m transformer_jax.export --workdir W                # newest checkpoint
  python -m transformer_jax.export --workdir W --average 5    # mean of the last 5
  python -m transformer_jax.export --workdir W --step best    # best by eval metric

It is written to W/exports/step_<S>[_avg<N>]/ (or --output), loads without the optimizer
state or the workdir, and `predict` prefers it to the checkpoint of the same step.
"""

from __future__ import annotations

import os

from absl import app, flags, logging

from transformer_jax import checkpoint, errors
from transformer_jax.errors import MissingFileError, UserError

FLAGS = flags.FLAGS


def define_flags(flag_values: flags.FlagValues = FLAGS) -> None:
  """The command-line flags, defined only when this module is the program (so that other
  commands can import it); tests pass a FlagValues of their own."""
  define = dict(flag_values=flag_values)
  flags.DEFINE_string("workdir", None, "Training workdir.", required=True, **define)
  flags.DEFINE_integer("average", 1, "Average the parameters of this many checkpoints: "
                       "--step and the ones before it.", **define)
  flags.DEFINE_string("step", "latest", "Checkpoint step, 'latest' or 'best' (the best by "
                      "config.best_checkpoint_metric; needs keep_best_checkpoints).", **define)
  flags.DEFINE_string("output", None, "Output directory; default "
                      "W/exports/step_<S>[_avg<N>].", **define)

def main(argv):
  logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO.
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  directory = os.path.join(FLAGS.workdir, checkpoint.CHECKPOINT_DIR)
  if not os.path.isdir(directory):
    raise MissingFileError(f"{directory} does not exist; train first with "
                           f"`python train.py --workdir {FLAGS.workdir}`")
  steps = checkpoint.checkpoint_steps(directory)
  try:
    chosen = checkpoint.select_steps(steps, FLAGS.step, FLAGS.average,
                                     checkpoint.best_step(directory))
    name = f"step_{chosen[-1]}" + (f"_avg{len(chosen)}" if len(chosen) > 1 else "")
    output = FLAGS.output or os.path.join(FLAGS.workdir, checkpoint.EXPORT_DIR, name)
    path = checkpoint.export(directory, chosen, output)
  except (ValueError, FileExistsError) as e:   # a --step or --average that cannot be had
    raise UserError(str(e)) from e
  print(f"exported the parameters of steps {chosen} to {path}")


if __name__ == "__main__":
  define_flags()
  errors.run(main)
