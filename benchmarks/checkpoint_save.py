"""How long a checkpoint save blocks the training loop, how long it takes to be on disk, and
how big a checkpoint is, for a model and its Adam state:

  python benchmarks/checkpoint_save.py --model=default          # configs/default.py's model
  python benchmarks/checkpoint_save.py --model=multi30k         # configs/multi30k.py's model
  python benchmarks/checkpoint_save.py --model=base --vocab_size=8000

The state is initialised as training initialises it; each save is timed as the loop calls
it (after the step's arrays are ready), then `wait` until it is committed. The first save
includes one-time compilation (the fingerprint) and is reported separately.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags, logging

from configs import default, multi30k, wmt14_ende_base
from transformer_jax import errors
from transformer_jax.checkpoint import TrainCheckpoints, describe
from transformer_jax.config import TransformerConfig
from transformer_jax.data.synthetic import make_vocab
from transformer_jax.data.tokenizer import tokenizer_item
from transformer_jax.modules.models import Transformer
from transformer_jax.params import count_params
from transformer_jax.training.optimizers import make_optimizer, make_schedule
from transformer_jax.training.state import checkpoint_arrays, create_train_state

_MODEL = flags.DEFINE_enum("model", "default", ["default", "multi30k", "base", "big"],
                           "configs/default.py's or configs/multi30k.py's model, or the "
                           "paper's base/big.")
_VOCAB = flags.DEFINE_integer("vocab_size", 8000, "Vocabulary size for base/big (multi30k: "
                              "its config's data.vocab_size).")
_SAVES = flags.DEFINE_integer("saves", 4, "Number of saves (the first one is warm-up).")
_DIR = flags.DEFINE_string("dir", None, "Where to write (default: a temporary directory).")


def _state(name: str, vocab_size: int):
  if name == "default":
    config = default.get_config()
    model_cfg = TransformerConfig.from_dict({**config.model.to_dict(),
                                             "vocab_size": make_vocab().vocab_size})
  elif name == "multi30k":
    config = multi30k.get_config()
    model_cfg = TransformerConfig.from_dict({**config.model.to_dict(),
                                             "vocab_size": config.data.vocab_size})
  else:
    config = wmt14_ende_base.get_config(big=name == "big")
    model_cfg = getattr(TransformerConfig, name)(vocab_size)
  optimizer = make_optimizer(config.optimizer, make_schedule(
      config.optimizer, model_cfg.d_model, config.num_train_steps))
  dummy = jnp.ones((1, 8), jnp.int32)
  params = jax.jit(Transformer(model_cfg).init)(jax.random.PRNGKey(0), dummy, dummy)["params"]
  state = create_train_state(params, optimizer, 0)

  @jax.jit
  def update(state):
    # One update with random gradients, so that the Adam moments hold values that compress
    # like a trained run's (all-zero moments would shrink the checkpoint unrealistically).
    leaves, tree = jax.tree_util.tree_flatten(state.params)
    keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
    grads = tree.unflatten([1e-3 * jax.random.normal(k, x.shape, x.dtype)
                            for k, x in zip(keys, leaves)])
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    return state.replace(params=jax.tree_util.tree_map(jnp.add, state.params, updates),
                         opt_state=opt_state)

  return update(state), config


def _size(path: str) -> int:
  return sum(os.path.getsize(os.path.join(root, f))
             for root, _, files in os.walk(path) for f in files)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  state, config = _state(_MODEL.value, _VOCAB.value)
  jax.block_until_ready(state)
  state_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(state))
  directory = _DIR.value or tempfile.mkdtemp(prefix="checkpoint_bench_")
  checkpoints = TrainCheckpoints(os.path.join(directory, "checkpoints"), config.to_dict(),
                                 tokenizer_item(make_vocab()), keep=2)
  blocking, total = [], []
  for step in range(1, _SAVES.value + 1):
    state = state.replace(step=jnp.array(step, jnp.int32))
    jax.block_until_ready(state)
    start = time.perf_counter()
    checkpoints.save(step, checkpoint_arrays(state), {"next_index": step})
    blocking.append(time.perf_counter() - start)
    checkpoints.wait()
    total.append(time.perf_counter() - start)
  start = time.perf_counter()
  for arrays in checkpoint_arrays(state).values():
    describe(arrays)
  fingerprint = time.perf_counter() - start
  size = _size(str(checkpoints.path(_SAVES.value)))
  checkpoints.close()

  print(f"model {_MODEL.value}: {count_params(state.params):,} parameters; state (params, "
        f"Adam moments, step, rng) {state_bytes / 2**20:.1f} MiB; "
        f"{jax.device_count()} {jax.devices()[0].platform} device(s)")
  print(f"checkpoint size on disk: {size / 2**20:.1f} MiB ({directory})")
  print(f"first save: blocks {blocking[0]:.3f} s (includes compiling the fingerprint), "
        f"committed after {total[0]:.3f} s")
  print(f"later saves ({len(blocking) - 1}): training blocked median "
        f"{np.median(blocking[1:]):.3f} s (min {min(blocking[1:]):.3f}, max "
        f"{max(blocking[1:]):.3f}); of which fingerprints {fingerprint:.3f} s; committed "
        f"after median {np.median(total[1:]):.3f} s")


if __name__ == "__main__":
  errors.run(main)
