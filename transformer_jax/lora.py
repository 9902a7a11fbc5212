"""LoRA (Hu et al., 2021) as a pure function of the parameters: no module is patched. A
targeted kernel W acts as W + (alpha / rank) * A @ B; the base is frozen, and only the
low-rank A and B are trained and checkpointed. Training applies the adapters on the
activations, x W + s (x A) B, so a step never forms a merged kernel or a frozen kernel's
weight gradient; inference merges them into W once.

  adapters = init_adapters(base, options, rng)   # B = 0: step 0 is the base exactly
  with applying(options):                        # training: x W + s (x A) B
    model.apply({"params": model_params(adapted(base, adapters), options)}, ...)
  params = merge(base, adapters, options)        # inference: a plain model

Targets are named as the Llama-shaped families name them (PEFT's target_modules), on this
project's kernels: q_proj, k_proj, v_proj, o_proj are self_attention/query, key, value
((D, N, H), (D, K, H), (D, K, H)) and out ((N, H, D)); gate_proj, up_proj and down_proj are
feed_forward/wi (gate) and wi_up (up) of a gated feed-forward, wi (up) of a plain one, and wo.
The adapters mirror the parameters' nesting: the kernel at ".../self_attention/query/kernel"
has {"a": in_shape + (rank,), "b": (rank,) + out_shape} at that path; with scan_layers both
keep the kernels' leading layer axis (a: (L, D, r), b: (L, r, N, H)). A is drawn as PEFT
draws it (kaiming-uniform: U(+-1/sqrt(fan_in))), B is zero.

A training state's parameters are `adapted(base, adapters)`, {"base", "adapters"}: the step
differentiates the adapters only (`trainable`), the optimizer (`freeze_base`) keeps no state
for the base, and a checkpoint holds the adapters and names the base by the run's init_from
(training/state.py). Inference merges once, where a saved model's parameters are read
(checkpoint/snapshots.py): predict, export, serving and convert see a plain model.

`model_params` puts each adapter pair beside its kernel as the parameters "lora_a" and
"lora_b" of the kernel's Dense module (so nn.scan slices them per layer as it slices the
kernel), and `applying` is a Flax method interceptor that adds s (x A) B to the output of
each Dense that has them, with `dropout` on x A's input in training (as PEFT drops it).
Limit: a fused qkv kernel is not adapted.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from transformer_jax import trees
from transformer_jax.errors import UserError
from transformer_jax.options import LoraOptions

# (module, kernel's module) -> (target name, input axes, output axes); feed_forward/wi is
# the gate of a gated feed-forward, else its up projection (see `_target`).
_KERNELS = {
    ("self_attention", "query"): ("q_proj", 1, 2), ("self_attention", "key"): ("k_proj", 1, 2),
    ("self_attention", "value"): ("v_proj", 1, 2), ("self_attention", "out"): ("o_proj", 2, 1),
    ("feed_forward", "wi"): ("gate_proj", 1, 1), ("feed_forward", "wi_up"): ("up_proj", 1, 1),
    ("feed_forward", "wo"): ("down_proj", 1, 1)}
_QKV = ("q_proj", "k_proj", "v_proj")


def _target(path: str, names: set[str]) -> tuple[str, int, int] | None:
  """The target that the kernel at `path` is (`names`: every leaf path), or None."""
  parts = path.split(trees.SEPARATOR)
  if len(parts) < 3 or parts[-1] != "kernel" or tuple(parts[-3:-1]) not in _KERNELS:
    return None
  name, ins, outs = _KERNELS[(parts[-3], parts[-2])]
  if name == "gate_proj" and path.replace("/wi/kernel", "/wi_up/kernel") not in names:
    name = "up_proj"                     # a plain feed-forward's wi is its up projection
  return name, ins, outs


def check(options: LoraOptions, model: Mapping[str, Any]) -> None:
  """What the targets cannot do on a model of these TransformerConfig fields (a run
  config's model group), before anything is built."""
  if model.get("fused_qkv") and set(options.targets) & set(_QKV):
    raise UserError(f"lora.targets={tuple(options.targets)}: the model fuses q_proj, k_proj "
                    "and v_proj into one qkv kernel (model.fused_qkv=True), which LoRA does "
                    "not adapt; leave them out of lora.targets")
  if not model.get("gated_ffn") and set(options.targets) == {"gate_proj"}:
    raise UserError("lora.targets=('gate_proj',): the model's feed-forward is not gated "
                    "(model.gated_ffn=False), so it has no gate_proj; target up_proj")


def targets(params: Any, options: LoraOptions) -> dict[str, tuple[jax.Array, int, int]]:
  """{path: (kernel, input axes, output axes)} of the kernels that `options` targets in a
  tree of (unboxed) parameters or their shapes."""
  leaves = dict(trees.named_leaves(params))
  names, found = set(leaves), {}
  for path, kernel in leaves.items():
    target = _target(path, names)
    if target and target[0] in options.targets:
      found[path] = (kernel, target[1], target[2])
  if not found:
    raise UserError(f"lora.targets={tuple(options.targets)} match no kernel of this model")
  return found


def init_adapters(params: Any, options: LoraOptions, rng: jax.Array) -> dict:
  """The adapters of the targeted kernels of `params` (unboxed): A ~ U(+-1/sqrt(fan_in)),
  as PEFT's kaiming-uniform draws it, and B = 0, in float32 whatever the base's dtype (they
  are small, and Adam's updates of bfloat16 weights lose their low bits)."""
  kernels = targets(params, options)
  flat = {}
  for key, (path, (kernel, ins, outs)) in zip(jax.random.split(rng, len(kernels)),
                                              kernels.items()):
    lead = len(kernel.shape) - ins - outs   # 1 with scan_layers: the layer axis
    fan_in = math.prod(kernel.shape[lead:lead + ins])
    bound = 1 / math.sqrt(fan_in)
    flat[f"{path}/a"] = jax.random.uniform(key, kernel.shape[:lead + ins] + (options.rank,),
                                           jnp.float32, -bound, bound)
    flat[f"{path}/b"] = jnp.zeros(kernel.shape[:lead] + (options.rank,)
                                  + kernel.shape[lead + ins:], jnp.float32)
  return trees.unflatten(flat)


def _merged_kernel(kernel: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
  """kernel + scale * a @ b over the rank, per layer; summed in float32, in the kernel's
  dtype (B = 0 gives the kernel back bit for bit)."""
  lead = a.ndim + b.ndim - 2 - kernel.ndim
  ins, outs = a.ndim - 1 - lead, b.ndim - 1 - lead
  if (lead < 0 or a.shape[:-1] + b.shape[lead + 1:] != kernel.shape
      or b.shape[:lead + 1] != a.shape[:lead] + a.shape[-1:]):
    raise ValueError(f"adapters {a.shape} and {b.shape} do not fit the kernel {kernel.shape}")
  letters = "abcdefghijklmnopqrstuvwxy"         # z: the rank
  layer, i, o = letters[:lead], letters[lead:lead + ins], letters[lead + ins:lead + ins + outs]
  delta = jnp.einsum(f"{layer}{i}z,{layer}z{o}->{layer}{i}{o}", a.astype(jnp.float32),
                     b.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
  return (kernel.astype(jnp.float32) + scale * delta).astype(kernel.dtype)


def merge(base: Any, adapters: Any, options: LoraOptions) -> Any:
  """The parameters the model applies: `base` with each adapted kernel W replaced by
  W + (alpha / rank) * A @ B; the base under stop_gradient (frozen, whoever differentiates
  this). A pure function: it traces under jit and grad. ValueError if an adapter does not
  fit its kernel or names none."""
  scale = options.alpha / options.rank
  flat = dict(trees.named_leaves(adapters))
  kernels = {path[:-2] for path in flat}
  leaves, treedef = jax.tree_util.tree_flatten_with_path(jax.lax.stop_gradient(base))
  merged = []
  for key_path, leaf in leaves:
    path = trees.path_name(key_path)
    if path in kernels:
      leaf = _merged_kernel(leaf, flat[f"{path}/a"], flat[f"{path}/b"], scale)
      kernels.remove(path)
    merged.append(leaf)
  if kernels:
    raise ValueError(f"adapters of {sorted(kernels)[0]}, which the base does not have")
  return jax.tree_util.tree_unflatten(treedef, merged)


def merge_placed(base: Any, adapters: Any, options: LoraOptions) -> Any:
  """`merge` compiled, its result placed as the base's arrays are (so a jitted program that
  takes the base takes it); host arrays are merged on the default device."""
  if not all(hasattr(x, "sharding") for x in jax.tree_util.tree_leaves(base)):
    return merge(base, adapters, options)
  placed = jax.tree_util.tree_map(lambda x: x.sharding, base)
  return jax.jit(merge, static_argnums=2, out_shardings=placed)(base, adapters, options)


# ------------------------------------------------------------------- training state
def adapted(base: Any, adapters: Any) -> dict:
  """A LoRA state's parameters: the frozen base and the trained adapters."""
  return {"base": base, "adapters": adapters}


def is_adapted(params: Any) -> bool:
  """Whether `params` (or a tree of their shardings or shapes) is `adapted`'s pair."""
  return isinstance(params, Mapping) and set(params) == {"base", "adapters"}


def base(params: Any) -> Any:
  """The model's parameters (as the base has them), or `params` if not adapted."""
  return params["base"] if is_adapted(params) else params


def trainable(params: Any) -> Any:
  """What a step differentiates and a checkpoint holds: the adapters, or all `params`."""
  return params["adapters"] if is_adapted(params) else params


def with_trainable(params: Any, trained: Any) -> Any:
  """`params` with `trainable(params)` replaced by `trained`."""
  return adapted(params["base"], trained) if is_adapted(params) else trained


def with_base(params: Any, new_base: Any) -> Any:
  """`params` with the base replaced by `new_base` (all of `params` if not adapted)."""
  return adapted(new_base, params["adapters"]) if is_adapted(params) else new_base


def model_params(params: Any, options: LoraOptions | None) -> Any:
  """The parameters the model applies under `applying(options)`: an adapted pair's base,
  frozen (stop_gradient), with each adapter pair beside its kernel as "lora_a", "lora_b"
  (traceable); else `params`."""
  if not is_adapted(params):
    return params
  if options is None:
    raise ValueError("LoRA parameters are applied by their run's LoRA options; none were given")
  flat = dict(trees.named_leaves(jax.lax.stop_gradient(params["base"])))
  for path, adapter in trees.named_leaves(params["adapters"]):
    module, leaf = path.rsplit(f"{trees.SEPARATOR}kernel{trees.SEPARATOR}", 1)
    if f"{module}{trees.SEPARATOR}kernel" not in flat:
      raise ValueError(f"adapters of {module}, which the base does not have")
    flat[f"{module}{trees.SEPARATOR}lora_{leaf}"] = adapter
  return trees.unflatten(flat)


def _adapted_output(scale: float, dropout: float) -> Callable:
  """A Flax method interceptor: a Dense (General) with "lora_a", "lora_b" among its
  parameters returns x W (+ bias) + scale * (drop(x) A) B, in its compute dtype."""
  def intercept(next_fun: Callable, args: tuple, kwargs: dict,
                context: nn.module.InterceptorContext) -> Any:
    module, y = context.module, next_fun(*args, **kwargs)
    if (context.method_name != "__call__" or not isinstance(module, (nn.Dense, nn.DenseGeneral))
        or not module.has_variable("params", "lora_a")):
      return y
    a: jax.Array = module.get_variable("params", "lora_a")
    b: jax.Array = module.get_variable("params", "lora_b")
    x, ins = args[0], a.ndim - 1            # the kernel's input axes: x's last `ins`
    if dropout and module.has_rng("dropout"):   # training only (evaluation has no rng)
      keep = jax.random.bernoulli(module.make_rng("dropout"), 1 - dropout, x.shape)
      x = jnp.where(keep, x / (1 - dropout), 0)
    dtype = module.dtype or x.dtype
    xa = jnp.tensordot(x.astype(dtype), a.astype(dtype),
                       axes=(tuple(range(x.ndim - ins, x.ndim)), tuple(range(ins))))
    return y + (scale * jnp.tensordot(xa, b.astype(dtype), axes=1)).astype(y.dtype)
  return intercept


def applying(options: LoraOptions | None) -> contextlib.AbstractContextManager:
  """Within it (while a model is traced), the adapters of `model_params` act on the
  activations; nothing happens without options (a run without LoRA)."""
  if options is None:
    return contextlib.nullcontext()
  return nn.intercept_methods(_adapted_output(options.alpha / options.rank, options.dropout))


def full_gradient(params: Any, grads: Any) -> Any:
  """The gradient of all `params` from that of `trainable(params)`: the base's is zero (a
  constant that the optimizer's frozen partition drops, never a computed gradient)."""
  if not is_adapted(params):
    return grads
  return adapted(jax.tree_util.tree_map(jnp.zeros_like, params["base"]), grads)


def freeze_base(optimizer: optax.GradientTransformation) -> optax.GradientTransformation:
  """`optimizer` on the adapters of an adapted pair; the base's updates are zero and it
  has no optimizer state (Optax's partition, with set_to_zero for the frozen part)."""
  return optax.multi_transform({"trained": optimizer, "frozen": optax.set_to_zero()},
                               {"base": "frozen", "adapters": "trained"})
