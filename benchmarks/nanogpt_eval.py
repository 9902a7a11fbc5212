"""A nanoGPT checkpoint's loss over the whole validation file, measured as our trainer measures
it (tasks/lm.py "stream"), so that the two compare on the same tokens rather than on
nanoGPT's sample of random windows.

  python -m benchmarks.nanogpt_eval --nanogpt=PATH/TO/nanoGPT --ckpt=OUT_DIR/ckpt.pt \
      --data=PATH/TO/nanoGPT/data/shakespeare_ours

Runs nanoGPT's own model code (its model.py, imported from --nanogpt) on val.bin cut into
consecutive windows of the checkpoint's block size: window k's inputs are tokens
[kT, (k+1)T) and its targets [kT + 1, (k+1)T + 1), so every token but the first is predicted
once, from the tokens of its window before it (our rows start with BOS instead, so there the
first token of each window is predicted from BOS alone). Prints the mean loss per token in
nats and in bits.
"""

from __future__ import annotations

import math
import os
import sys

import numpy as np
from absl import flags

from transformer_jax import errors

FLAGS = flags.FLAGS


def define_flags() -> None:
  flags.DEFINE_string("nanogpt", None, "A checkout of karpathy/nanoGPT.", required=True)
  flags.DEFINE_string("ckpt", None, "Its train.py's ckpt.pt.", required=True)
  flags.DEFINE_string("data", None, "The data directory with val.bin.", required=True)
  flags.DEFINE_integer("batch_size", 64, "Windows per forward pass.")


def whole_file_loss(model: object, tokens: np.ndarray, block: int, batch_size: int) -> float:
  """Mean cross-entropy (nats) of every token but the first, consecutive windows."""
  import torch
  import torch.nn.functional as F
  total, count = 0.0, 0
  starts = list(range(0, len(tokens) - 1, block))
  full = [s for s in starts if s + block + 1 <= len(tokens)]
  groups = [full[i:i + batch_size] for i in range(0, len(full), batch_size)]
  groups += [[s] for s in starts if s not in set(full)]          # the last, shorter window
  with torch.no_grad():
    for group in groups:
      length = min(block, len(tokens) - 1 - group[0])
      x = torch.from_numpy(np.stack([tokens[s:s + length] for s in group]).astype(np.int64))
      y = torch.from_numpy(np.stack([tokens[s + 1:s + length + 1] for s in group])
                           .astype(np.int64))
      logits, _ = model(x, y)     # given targets, nanoGPT returns logits at every position
      total += F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1),
                               reduction="sum").item()
      count += y.numel()
  return total / count


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise errors.UserError(f"unexpected arguments: {' '.join(argv[1:])}")
  for flag in ("nanogpt", "ckpt", "data"):
    if not os.path.exists(FLAGS[flag].value):
      raise errors.MissingFileError(f"--{flag}={FLAGS[flag].value}: no such file or directory")
  sys.path.insert(0, FLAGS.nanogpt)
  import torch
  from model import GPT, GPTConfig  # nanoGPT's own model code
  checkpoint = torch.load(FLAGS.ckpt, map_location="cpu")
  model = GPT(GPTConfig(**checkpoint["model_args"]))
  state = {k.removeprefix("_orig_mod."): v for k, v in checkpoint["model"].items()}
  model.load_state_dict(state)
  model.eval()
  tokens = np.memmap(os.path.join(FLAGS.data, "val.bin"), dtype=np.uint16, mode="r")
  block = checkpoint["model_args"]["block_size"]
  loss = whole_file_loss(model, np.asarray(tokens), block, FLAGS.batch_size)
  print(f"iter {checkpoint['iter_num']}: val loss over the whole file ({len(tokens):,} tokens, "
        f"windows of {block}): {loss:.4f} nats per token, {loss / math.log(2):.4f} bits")


if __name__ == "__main__":
  define_flags()
  errors.run(main)
