"""Export what inference loads. By default a *parameter snapshot*: the parameters of a
training checkpoint, or the average of the last N (paper §6.1), with the run's config and
tokenizer (transformer_jax/checkpoint/snapshots.py):

  python -m transformer_jax.export --workdir W                # newest checkpoint
  python -m transformer_jax.export --workdir W --average 5    # mean of the last 5
  python -m transformer_jax.export --workdir W --step best    # best by eval metric

It is written to W/exports/step_<S>[_avg<N>]/ (or --output), loads without the optimizer
state or the workdir, and `predict` prefers it to the checkpoint of the same step.

With --format=stablehlo it writes a serving *artifact* instead (transformer_jax/serving/): the
whole inference function as a serialized `jax.export.Exported` with symbolic batch and
length, the parameters as arrays beside it, tokenizer files, labels and a manifest:

  python -m transformer_jax.export --workdir W --format=stablehlo --output DIR
      [--platforms=cpu,cuda,tpu] [--beam_size 4]

It uses the model predict would (the newest snapshot or checkpoint), or the --step/--average
selection; load it with `Served.load(DIR)` or serve it with `python -m transformer_jax.serve`.

An import's workdir (`python -m transformer_jax.convert --from=hf_llama ... --workdir W`) has
a parameter snapshot, W/exports/hf_llama/, and no training checkpoints: it is already what
predict loads, so there is nothing to export in the orbax format (and no --step/--average to
select); export it with --format=stablehlo to serve it.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from absl import app, flags, logging

from transformer_jax import checkpoint, errors
from transformer_jax.errors import MissingFileError, UserError

FLAGS = flags.FLAGS


def define_flags(flag_values: flags.FlagValues = FLAGS) -> None:
  """The command-line flags, defined only when this module is the program (so that other
  commands can import it); tests pass a FlagValues of their own."""
  define: dict[str, Any] = {"flag_values": flag_values}
  flags.DEFINE_string("workdir", None, "Training workdir.", required=True, **define)
  flags.DEFINE_integer("average", 1, "Average the parameters of this many checkpoints: "
                       "--step and the ones before it.", **define)
  flags.DEFINE_string("step", "latest", "Checkpoint step, 'latest' or 'best' (the best by "
                      "config.best_checkpoint_metric; needs keep_best_checkpoints).", **define)
  flags.DEFINE_string("output", None, "Output directory; default "
                      "W/exports/step_<S>[_avg<N>] (orbax) or W/serving/step_<S>[_avg<N>] "
                      "(stablehlo).", **define)
  flags.DEFINE_enum("format", "orbax", ["orbax", "stablehlo"], "orbax: a parameter "
                    "snapshot for predict; stablehlo: a serving artifact (jax.export).", **define)
  flags.DEFINE_list("platforms", None, "stablehlo: platforms to export for (cpu, cuda, "
                    "rocm, tpu); default: this machine's.", **define)
  flags.DEFINE_integer("beam_size", None, "stablehlo, translation: beam size baked into the "
                       "artifact (1 = greedy); default: the run's decode.beam_size.", **define)


def export_stablehlo(workdir: str, steps: list[int] | None, output: str | None,
                     platforms: list[str] | None, beam_size: int | None) -> str:
  """Writes the served model of `workdir` (the newest model, or the average of `steps`) to
  `output` (default W/serving/<name>); returns the directory."""
  from transformer_jax import serving
  from transformer_jax.predict import Predictor
  with tempfile.TemporaryDirectory() as tmp:
    if steps is None:
      predictor = Predictor(workdir, portable=True)
    else:   # The selection is an orbax export first: the one place that averages.
      directory = os.path.join(workdir, checkpoint.CHECKPOINT_DIR)
      predictor = Predictor(checkpoint_path=checkpoint.write_average(directory, steps,
                                                              os.path.join(tmp, "export")),
                            portable=True)
    name = f"step_{predictor.step}" + (f"_avg{len(steps)}" if steps and len(steps) > 1 else "")
    output = output or os.path.join(workdir, "serving", name)
    decode = predictor.decode_options(beam_size=beam_size)
    serving.write_artifact(predictor.task, predictor.params, decode, output,
                           platforms=platforms, lines=predictor.policy,
                           source={"workdir": os.path.abspath(workdir), "step": predictor.step,
                                   "model": os.path.abspath(predictor.path)})
  return output


def _no_checkpoints(workdir: str, directory: str) -> MissingFileError:
  """The error for an export that needs training checkpoints in a workdir without any: one
  that has parameter snapshots (an import's) says they are what predict loads and that
  --format=stablehlo serves them; one without says to train first."""
  snapshots = checkpoint.models(workdir) if os.path.isdir(workdir) else []
  if not snapshots:
    return MissingFileError(f"{directory} does not exist; train first with "
                            f"`python train.py --workdir {workdir}`")
  names = ", ".join(sorted(os.path.basename(p) for p in snapshots))
  selection = FLAGS.format == "stablehlo"   # with --step/--average
  return MissingFileError(
      ("--step/--average select among training checkpoints, and " if selection else "")
      + f"{workdir} has no training checkpoints to export; its parameter snapshot(s) under "
      f"{os.path.join(workdir, checkpoint.SNAPSHOT_DIR)}/ ({names}) are already what predict "
      f"loads, and `python -m transformer_jax.export --workdir {workdir} --format=stablehlo`"
      + (" (without --step/--average)" if selection else "")
      + " writes a serving artifact from them")


def main(argv):
  logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO.
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  directory = os.path.join(FLAGS.workdir, checkpoint.CHECKPOINT_DIR)
  try:
    if FLAGS.format == "stablehlo" and FLAGS.step == "latest" and FLAGS.average == 1:
      # The model predict uses: the newest snapshot or checkpoint (an import has only the
      # former), so no checkpoints are needed.
      path = export_stablehlo(FLAGS.workdir, None, FLAGS.output, FLAGS.platforms,
                              FLAGS.beam_size)
      print(f"exported the served model (jax.export, StableHLO) to {path}")
      return
    steps = checkpoint.checkpoint_steps(directory) if os.path.isdir(directory) else []
    if not steps and (not os.path.isdir(directory) or checkpoint.models(FLAGS.workdir)):
      raise _no_checkpoints(FLAGS.workdir, directory)
    chosen = checkpoint.select_steps(steps, FLAGS.step, FLAGS.average,
                                     checkpoint.best_step(directory))
    if FLAGS.format == "stablehlo":
      path = export_stablehlo(FLAGS.workdir, chosen, FLAGS.output, FLAGS.platforms,
                              FLAGS.beam_size)
      print(f"exported the served model (jax.export, StableHLO) to {path}")
      return
    name = f"step_{chosen[-1]}" + (f"_avg{len(chosen)}" if len(chosen) > 1 else "")
    output = FLAGS.output or os.path.join(FLAGS.workdir, checkpoint.SNAPSHOT_DIR, name)
    path = checkpoint.write_average(directory, chosen, output)
  except UserError:
    raise
  except (ValueError, FileExistsError) as e:   # a --step or --average that cannot be had
    raise UserError(str(e)) from e
  print(f"exported the parameters of steps {chosen} to {path}")


if __name__ == "__main__":
  define_flags()
  errors.run(main)
