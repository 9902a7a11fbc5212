"""Use a trained model: one example per line in, one output per line out.

  python -m transformer_jax.predict --workdir W [--input IN] [--output OUT]
      [--beam_size 4] [--alpha 0.6] [--batch_size 64]

Loads the workdir's newest model: the highest-step export in W/exports/ or checkpoint in
W/checkpoints/ (an export wins at the same step; a damaged one is skipped with a warning),
or the export or checkpoint directory given as --checkpoint. The model's config and
tokenizer are read from that checkpoint. Input and output default to stdin and stdout.
"""

from __future__ import annotations

import os
import sys
from typing import Iterable, TextIO

from absl import app, flags, logging
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax import decoding
from transformer_jax import checkpoint
from transformer_jax.config import TransformerConfig
from transformer_jax.inputs import check_inputs
from transformer_jax.modules.models import Transformer


class Predictor:
  """Loads a model once (see the module doc for which) and translates batches of text."""

  def __init__(self, workdir: str | None = None, checkpoint_path: str | None = None):
    if checkpoint_path is not None:
      if not os.path.isdir(checkpoint_path):
        raise FileNotFoundError(f"checkpoint {checkpoint_path!r} does not exist")
      candidates = [checkpoint_path]
    elif workdir is None or not os.path.isdir(workdir):
      raise FileNotFoundError(f"workdir {workdir!r} does not exist; train first with "
                              f"`python train.py --workdir {workdir}`")
    else:
      candidates = checkpoint.models(workdir)
      if not candidates:
        raise FileNotFoundError(f"workdir {workdir!r} has no checkpoint or export; was "
                                "training interrupted before the first checkpoint?")
    self.path, (model, self.params), _ = checkpoint.first_good(candidates, self._load)
    self.step, self.run_config, self.vocab = model.step, model.config, model.tokenizer
    self.model_config = TransformerConfig.from_dict(self.run_config["model"])

  @staticmethod
  def _load(path: str) -> tuple[checkpoint.Model, object]:
    model = checkpoint.read_model(path)
    transformer = Transformer(TransformerConfig.from_dict(model.config["model"]))
    dummy = jnp.ones((1, 1), jnp.int32)
    abstract = nn.meta.unbox(
        jax.eval_shape(lambda: transformer.init(jax.random.PRNGKey(0), dummy, dummy)))
    return model, checkpoint.restore_params(path, abstract["params"])

  def translate(self, lines: list[str], beam_size: int = 4, alpha: float = 0.6,
                max_extra_length: int | None = None) -> list[str]:
    """Decodes each line; all lines of a call are padded to the longest one."""
    if not lines:
      return []
    encoded = [self.vocab.encode(line) for line in lines]
    width = max(1, max(len(e) for e in encoded))
    ids = np.zeros((len(lines), width), np.int32)
    for row, e in enumerate(encoded):
      ids[row, :len(e)] = e
    ids, _ = check_inputs(self.model_config, ids)
    if max_extra_length is None:
      max_extra_length = int(self.run_config.get("decode", {}).get("max_extra_length", 50))
    max_length = min(width + 1 + max_extra_length, self.model_config.max_len)
    out = decoding.generate(self.model_config, self.params, ids, beam_size=beam_size,
                            alpha=alpha, max_length=max_length)
    return [self.vocab.decode(decoding.strip_special(row)) for row in out]


def _batches(lines: Iterable[str], size: int) -> Iterable[list[str]]:
  batch = []
  for line in lines:
    batch.append(line.rstrip("\n"))
    if len(batch) == size:
      yield batch
      batch = []
  if batch:
    yield batch


def predict(workdir: str | None, infile: TextIO, outfile: TextIO, beam_size: int, alpha: float,
            batch_size: int, checkpoint_path: str | None = None) -> int:
  predictor = Predictor(workdir, checkpoint_path)
  count = 0
  for batch in _batches(infile, batch_size):
    for line in predictor.translate(batch, beam_size, alpha):
      outfile.write(line + "\n")
      count += 1
  outfile.flush()
  return count


_WORKDIR = flags.DEFINE_string("workdir", None, "Training workdir: its newest export or "
                               "checkpoint is used.")
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "An export (W/exports/NAME) or checkpoint "
                                  "(W/checkpoints/STEP) directory to use instead.")
_INPUT = flags.DEFINE_string("input", "-", "Input file, one example per line ('-': stdin).")
_OUTPUT = flags.DEFINE_string("output", "-", "Output file ('-': stdout).")
_BEAM = flags.DEFINE_integer("beam_size", 4, "Beam size (1 = greedy).")
_ALPHA = flags.DEFINE_float("alpha", 0.6, "Length penalty exponent.")
_BATCH = flags.DEFINE_integer("batch_size", 64, "Lines decoded together.")


def main(argv):
  logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO.
  del argv
  if _WORKDIR.value is None and _CHECKPOINT.value is None:
    sys.exit("error: give --workdir (a training workdir) or --checkpoint (an export or "
             "checkpoint directory)")
  infile = sys.stdin if _INPUT.value == "-" else open(_INPUT.value)
  outfile = sys.stdout if _OUTPUT.value == "-" else open(_OUTPUT.value, "w")
  try:
    predict(_WORKDIR.value, infile, outfile, _BEAM.value, _ALPHA.value, _BATCH.value,
            _CHECKPOINT.value)
  except (FileNotFoundError, ValueError, checkpoint.DamagedCheckpointError) as e:
    sys.exit(f"error: {e}")  # Bad workdir, checkpoint or input: say what, no trace.
  finally:
    if infile is not sys.stdin:
      infile.close()
    if outfile is not sys.stdout:
      outfile.close()


if __name__ == "__main__":
  app.run(main)
