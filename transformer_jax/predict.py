"""Use a trained model: one example per line in, one output per line out.

  python -m transformer_jax.predict --workdir W [--input IN] [--output OUT]
      [--beam_size 4] [--alpha 0.6] [--batch_size 64]

Reads W/config.json, W/vocab.json and the latest parameters in W/checkpoints. Input and
output default to stdin and stdout.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Iterable, TextIO

from absl import app, flags, logging
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax import decoding
from transformer_jax.checkpoint import Checkpointer
from transformer_jax.config import TransformerConfig
from transformer_jax.data.vocab import load_tokenizer
from transformer_jax.inputs import check_inputs
from transformer_jax.modules.models import Transformer
from transformer_jax.training.loop import CHECKPOINT_DIR, CONFIG_FILE, VOCAB_FILE


class Predictor:
  """Loads a workdir once and translates batches of text."""

  def __init__(self, workdir: str):
    missing = [name for name in (CONFIG_FILE, VOCAB_FILE, CHECKPOINT_DIR)
               if not os.path.exists(os.path.join(workdir, name))]
    if not os.path.isdir(workdir):
      raise FileNotFoundError(f"workdir {workdir!r} does not exist; train first with "
                              f"`python train.py --workdir {workdir}`")
    if missing:
      raise FileNotFoundError(f"workdir {workdir!r} is incomplete: missing {missing}; "
                              "was training interrupted before the first checkpoint?")
    with open(os.path.join(workdir, CONFIG_FILE)) as f:
      self.run_config = json.load(f)
    self.model_config = TransformerConfig.from_dict(self.run_config["model"])
    self.vocab = load_tokenizer(os.path.join(workdir, VOCAB_FILE))
    checkpointer = Checkpointer(os.path.join(workdir, CHECKPOINT_DIR))
    if checkpointer.latest_step() is None:
      raise FileNotFoundError(f"no checkpoint in {os.path.join(workdir, CHECKPOINT_DIR)}")
    model = Transformer(self.model_config)
    dummy = jnp.ones((1, 1), jnp.int32)
    abstract = nn.meta.unbox(
        jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), dummy, dummy)))
    self.step = checkpointer.latest_step()
    self.params = checkpointer.restore_params(abstract["params"])
    checkpointer.close()

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


def predict(workdir: str, infile: TextIO, outfile: TextIO, beam_size: int, alpha: float,
            batch_size: int) -> int:
  predictor = Predictor(workdir)
  count = 0
  for batch in _batches(infile, batch_size):
    for line in predictor.translate(batch, beam_size, alpha):
      outfile.write(line + "\n")
      count += 1
  outfile.flush()
  return count


_WORKDIR = flags.DEFINE_string("workdir", None, "Training workdir to load.", required=True)
_INPUT = flags.DEFINE_string("input", "-", "Input file, one example per line ('-': stdin).")
_OUTPUT = flags.DEFINE_string("output", "-", "Output file ('-': stdout).")
_BEAM = flags.DEFINE_integer("beam_size", 4, "Beam size (1 = greedy).")
_ALPHA = flags.DEFINE_float("alpha", 0.6, "Length penalty exponent.")
_BATCH = flags.DEFINE_integer("batch_size", 64, "Lines decoded together.")


def main(argv):
  logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO.
  del argv
  infile = sys.stdin if _INPUT.value == "-" else open(_INPUT.value)
  outfile = sys.stdout if _OUTPUT.value == "-" else open(_OUTPUT.value, "w")
  try:
    predict(_WORKDIR.value, infile, outfile, _BEAM.value, _ALPHA.value, _BATCH.value)
  except (FileNotFoundError, ValueError) as e:  # Bad workdir or input: say what, no trace.
    sys.exit(f"error: {e}")
  finally:
    if infile is not sys.stdin:
      infile.close()
    if outfile is not sys.stdout:
      outfile.close()


if __name__ == "__main__":
  app.run(main)
