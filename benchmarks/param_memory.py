"""Per-device memory of the sharded training state under mesh layouts.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m benchmarks.param_memory

Creates the paper's base model (vocabulary 37000) with Adam state directly in its shardings
(sharding.create_sharded) on each layout and reads the bytes that device 0 really holds.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from absl import flags

from transformer_jax import Transformer, TransformerConfig, errors, sharding
from transformer_jax.training.state import new_train_state

LAYOUTS = [dict(data=8), dict(fsdp=8), dict(data=2, tensor=4), dict(data=2, fsdp=2, tensor=2),
           dict(fsdp=2, tensor=4)]
FLAGS = flags.FLAGS


def define_flags() -> None:
  """The command-line flags, defined only when this module is the program (absl flags are
  global: other modules define --vocab_size)."""
  flags.DEFINE_enum("preset", "base", ["base", "big", "small"], "TransformerConfig preset.")
  flags.DEFINE_integer("vocab_size", 37000, "Vocabulary size.", lower_bound=1)


def device0_bytes(tree) -> int:
  device = jax.devices()[0]
  return sum(s.data.nbytes for x in jax.tree_util.tree_leaves(tree)
             for s in x.addressable_shards if s.device == device)


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise errors.UserError(f"unexpected arguments: {' '.join(argv[1:])}")
  needed = math.prod(LAYOUTS[0].values())       # every layout spans the same devices
  if jax.device_count() != needed:
    raise errors.UserError(
        f"the layouts need {needed} devices, found {jax.device_count()} "
        f"({jax.default_backend()}); on a CPU: XLA_FLAGS=--xla_force_host_platform_device_count="
        f"{needed} python -m benchmarks.param_memory")
  cfg = getattr(TransformerConfig, FLAGS.preset)(vocab_size=FLAGS.vocab_size)
  model = Transformer(cfg)
  dummy = jnp.ones((1, 8), jnp.int32)
  init = lambda: new_train_state(model.init(jax.random.PRNGKey(0), dummy, dummy)["params"],
                                 optax.adam(1e-3), 0)
  print(f"{FLAGS.preset} model, vocab {FLAGS.vocab_size}, {jax.device_count()} "
        f"{jax.default_backend()} devices; MiB held by device 0")
  print(f"{'layout':32s} {'params':>10s} {'adam state':>10s} {'total':>10s}")
  for sizes in LAYOUTS:
    state, _ = sharding.create_sharded(init, sharding.make_mesh(sizes))
    p, o = device0_bytes(state.params) / 2**20, device0_bytes(state.opt_state) / 2**20
    print(f"{str(sizes):32s} {p:10.1f} {o:10.1f} {p + o:10.1f}")
    del state


if __name__ == "__main__":
  define_flags()
  errors.run(main)
