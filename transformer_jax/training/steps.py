"""Pure train and eval steps, compiled once with jax.jit."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from transformer_jax import lora, sharding
from transformer_jax.options import LoraOptions
from transformer_jax.training.state import TrainState


def _grads_and_sums(task: Any, params: Any, batch: dict, rng: jax.Array,
                    grad_accum_steps: int, lora_options: LoraOptions | None = None
                    ) -> tuple[Any, dict]:
  """Gradient of the summed loss with respect to the trained parameters (a LoRA state's
  adapters, applied as `lora_options` say: lora.py; else all) and the summed statistics;
  with accumulation, the batch is split into micro-batches scanned in sequence, so the
  result equals the full batch's."""
  def micro(mb, key):
    def loss(trained):
      with lora.applying(lora_options):
        s = task.loss_sums(lora.model_params(lora.with_trainable(params, trained),
                                             lora_options), mb, key, True)
      return s["loss"], s
    (_, sums), grads = jax.value_and_grad(loss, has_aux=True)(lora.trainable(params))
    return grads, sums

  if grad_accum_steps == 1:
    return micro(batch, rng)

  def split(x):
    if x.shape[0] % grad_accum_steps:
      raise ValueError(f"batch size {x.shape[0]} is not divisible by "
                       f"grad_accum_steps={grad_accum_steps}")
    # Micro-batch i takes rows i, i+k, i+2k, ...: with the batch sharded over devices, every
    # device then holds an equal part of every micro-batch (contiguous chunks would leave
    # most devices idle in each micro-step).
    x = x.reshape((x.shape[0] // grad_accum_steps, grad_accum_steps) + x.shape[1:])
    return x.swapaxes(0, 1)

  micro_batches = jax.tree_util.tree_map(split, batch)
  keys = jax.random.split(rng, grad_accum_steps)

  def body(carry, xs):
    grads, sums = micro(*xs)
    return jax.tree_util.tree_map(jnp.add, carry, (grads, sums)), None

  zeros = jax.tree_util.tree_map(
      jnp.zeros_like, jax.eval_shape(lambda: micro(jax.tree_util.tree_map(lambda x: x[0],
                                                                        micro_batches),
                                                   keys[0])))
  (grads, sums), _ = jax.lax.scan(body, zeros, (micro_batches, keys))
  return grads, sums


def _summed_over_replicas(task: Any, grad_accum_steps: int, dtype: str, params_sharding: Any,
                          batch_sharding: Any, split: bool,
                          lora_options: LoraOptions | None) -> Callable:
  """`_grads_and_sums` with each replica's gradient summed explicitly in `dtype` (shard_map
  over the batch axes; the parameters are replicated). With `split` (ZeRO-1) a gradient
  that the optimizer state splits over data is reduce-scattered into that split instead of
  summed whole. Each replica draws its dropout from its own key, so with dropout the masks
  differ from the partitioner's (one key)."""
  def grads_and_sums(params: Any, batch: dict, rng: jax.Array) -> tuple[Any, dict]:
    specs = jax.tree_util.tree_map(lambda s: s.spec, params_sharding)
    trained = lora.trainable(params_sharding)    # the gradients' layout
    out_specs = jax.tree_util.tree_map(lambda s: s.spec, sharding.split_over_data(
        trained, lora.trainable(params)) if split else trained)

    def reduce(g: jax.Array, spec: P) -> jax.Array:
      on = [i for i, axes in enumerate(spec) if axes and "data" in axes]
      if on:     # fsdp = tensor = 1 here: the data ways alone split the dimension
        return jax.lax.psum_scatter(g.astype(dtype), "data", scatter_dimension=on[0],
                                    tiled=True).astype(g.dtype)
      return jax.lax.psum(g.astype(dtype), sharding.BATCH_AXES).astype(g.dtype)

    def local(params: Any, batch: dict, rng: jax.Array) -> tuple[Any, dict]:
      rng = jax.random.fold_in(rng, jax.lax.axis_index("data"))
      with sharding.per_device():
        grads, sums = _grads_and_sums(task, params, batch, rng, grad_accum_steps,
                                      lora_options)
      grads = jax.tree_util.tree_map(reduce, grads, out_specs,
                                     is_leaf=lambda x: isinstance(x, P))
      return grads, jax.lax.psum(sums, sharding.BATCH_AXES)

    # check_vma=False: the model's custom VJPs (the tied projection's) do not track which
    # values vary across replicas; every gradient and sum is reduced here by hand.
    return jax.shard_map(local, mesh=batch_sharding.mesh,
                         in_specs=(specs, batch_sharding.spec, P()),
                         out_specs=(out_specs, P()), check_vma=False)(params, batch, rng)
  return grads_and_sums


def make_train_step(task: Any, optimizer: optax.GradientTransformation,
                    schedule: optax.Schedule, grad_accum_steps: int = 1,
                    state_sharding: Any = None, batch_sharding: Any = None,
                    split_gradients_over_data: bool = False,
                    reduce_gradients_in: str = "auto",
                    lora_options: LoraOptions | None = None) -> Callable:
  """Returns jitted `(state, batch) -> (state, metrics)` with the state buffers donated.
  With shardings (see sharding.py) the state keeps its layout from step to step. With
  `split_gradients_over_data` (ZeRO-1: the optimizer state split over data) the gradients
  take the optimizer state's layout as soon as they are summed, so that each replica
  updates only its share (on TPU the partitioner then reduce-scatters them, as fused
  "all-reduce-scatter"s; on the CPU it all-reduces and slices; with `reduce_gradients_in`
  set, they are reduce-scattered by hand). With
  `reduce_gradients_in` "bfloat16" or "float32" (shardings required, parameters replicated)
  the replicas' gradients are summed explicitly in that dtype (options.MeshOptions). With
  `lora_options` (a LoRA state, lora.py) only the adapters are differentiated: the base gets no
  gradient, and `optimizer` (lora.freeze_base) no update of it.

  A step whose loss or gradient is not finite leaves params and optimizer state unchanged
  and reports metrics["nonfinite"] = 1; the loop decides whether to stop or go on.
  """
  if grad_accum_steps < 1:
    raise ValueError(f"grad_accum_steps={grad_accum_steps}: must be >= 1")
  if reduce_gradients_in == "auto":
    grads_and_sums = lambda params, batch, rng: _grads_and_sums(task, params, batch, rng,
                                                                grad_accum_steps, lora_options)
  else:
    grads_and_sums = _summed_over_replicas(task, grad_accum_steps, reduce_gradients_in,
                                           state_sharding.params, batch_sharding,
                                           split_gradients_over_data, lora_options)

  def step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
    rng = jax.random.fold_in(state.rng, state.step)
    with sharding.activations_split_over_batch(batch_sharding):
      grads, sums = grads_and_sums(state.params, batch, rng)
    weight = jnp.maximum(sums["weight"], 1.0)
    with jax.named_scope("optimizer"):
      grads = jax.tree_util.tree_map(lambda g: g / weight, grads)
    if split_gradients_over_data:
      grads = jax.lax.with_sharding_constraint(
          grads, sharding.split_over_data(lora.trainable(state_sharding.params), grads))
    with jax.named_scope("optimizer"):   # a profile's (and aot.roofline's) family
      grad_norm = optax.tree.norm(grads)
      updates, opt_state = optimizer.update(lora.full_gradient(state.params, grads),
                                            state.opt_state, state.params)
      params = optax.apply_updates(state.params, updates)
      # A select, not a lax.cond: XLA fuses it into the update, while a branch around the
      # update costs copies of the state (XLA's estimate for big on v5p-8: 46.5 ms a step
      # against 41.2 ms; benchmarks/RESULTS.md).
      finite = jnp.isfinite(sums["loss"]) & jnp.isfinite(grad_norm)
      keep = lambda new, old: jax.tree_util.tree_map(lambda n, o: jnp.where(finite, n, o),
                                                     new, old)
      new_state = state.replace(step=state.step + 1, params=keep(params, state.params),
                                opt_state=keep(opt_state, state.opt_state))
    metrics = {
        "loss": sums["loss"] / weight,
        "accuracy": sums["correct"] / weight,
        "perplexity": jnp.exp(sums["nll"] / weight),
        "learning_rate": schedule(state.step),
        "grad_norm": grad_norm,
        "nonfinite": (~finite).astype(jnp.int32),
    }
    return new_state, metrics

  if state_sharding is None:
    return jax.jit(step, donate_argnums=(0,))
  return jax.jit(step, donate_argnums=(0,), in_shardings=(state_sharding, batch_sharding),
                 out_shardings=(state_sharding, None))


def make_eval_step(task: Any, params_sharding: Any = None,
                   batch_sharding: Any = None) -> Callable:
  """Returns jitted `(params, batch) -> sums` without dropout."""
  def fn(params: Any, batch: dict) -> dict:
    with sharding.activations_split_over_batch(batch_sharding):
      return task.loss_sums(params, batch, None, False)
  if params_sharding is None:
    return jax.jit(fn)
  return jax.jit(fn, in_shardings=(params_sharding, batch_sharding))
