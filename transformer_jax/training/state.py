"""The training state: a plain pytree that a jitted step maps to the next one."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax


@flax.struct.dataclass
class TrainState:
  step: jax.Array          # Number of train steps taken (skipped non-finite ones included).
  params: Any
  opt_state: Any
  rng: jax.Array           # Base PRNG key (raw uint32); dropout keys are fold_in(rng, step).


def new_train_state(params: Any, optimizer: optax.GradientTransformation,
                    seed: int) -> TrainState:
  """The initial state, keeping Flax's logical-partitioning boxes on params (and on the
  optimizer moments that mirror them) so that shardings can be read off it."""
  return TrainState(step=jnp.array(0, jnp.int32), params=params,
                    opt_state=optimizer.init(params),
                    rng=jax.random.PRNGKey(seed + 1))  # seed itself initialised params.


def create_train_state(params: Any, optimizer: optax.GradientTransformation,
                       seed: int) -> TrainState:
  """The initial state as plain arrays (single device; see sharding.create_sharded)."""
  return nn.meta.unbox(new_train_state(params, optimizer, seed))
