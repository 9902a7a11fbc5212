"""The training state: a plain pytree that a jitted step maps to the next one, and its
mapping onto the arrays of a training checkpoint."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax

from transformer_jax import lora


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


# The checkpoint layer saves plain pytrees; this is the one place that maps the state onto
# its items (params, and train = everything else), so the on-disk layout stays fixed.
def checkpoint_arrays(state: TrainState) -> dict[str, Any]:
  """The arrays a training checkpoint holds: {"params": ..., "train": {"step", "opt_state",
  "rng"}}. Works on a state of ShapeDtypeStructs too (what to restore into). A LoRA state's
  params item is its adapters alone: its frozen base is init_from's, which the run config
  names (lora.py)."""
  return {"params": lora.trainable(state.params),
          "train": {"step": state.step, "opt_state": state.opt_state, "rng": state.rng}}


def state_from_checkpoint(arrays: dict[str, Any], current: TrainState | None = None
                          ) -> TrainState:
  """The TrainState of a checkpoint's arrays (the inverse of `checkpoint_arrays`);
  `current`: the state they replace, whose LoRA base (if any) they lack."""
  train = arrays["train"]
  params = arrays["params"] if current is None else lora.with_trainable(current.params,
                                                                       arrays["params"])
  return TrainState(step=train["step"], params=params, opt_state=train["opt_state"],
                    rng=train["rng"])
