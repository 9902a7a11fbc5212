"""Our parameters by name and shape, and how a layer's tensors are named elsewhere.

Pure tables and array reshapes: no file is read or written here. Paths are those of
`transformer_jax.trees` ("decoder/layer_0/cross_attention/query/kernel") over the unrolled,
separate-QKV parameter tree (`scan_layers=False, fused_qkv=False`).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax import trees
from transformer_jax.config import TransformerConfig
from transformer_jax.errors import UserError
from transformer_jax.modules.models import LanguageModel, Transformer


class ConvertError(UserError):
  """Input that cannot be converted; the message names the file, tensor or option."""


# A layer's sublayers: (our name, Marian name, torch.nn.Transformer names per stack).
SUBLAYERS = {
    "encoder": [("self_attention", "self_attn", "self_attn"),
                ("self_attention_norm", "self_attn_layer_norm", "norm1"),
                ("feed_forward/wi", "fc1", "linear1"), ("feed_forward/wo", "fc2", "linear2"),
                ("feed_forward_norm", "final_layer_norm", "norm2")],
    "decoder": [("self_attention", "self_attn", "self_attn"),
                ("self_attention_norm", "self_attn_layer_norm", "norm1"),
                ("cross_attention", "encoder_attn", "multihead_attn"),
                ("cross_attention_norm", "encoder_attn_layer_norm", "norm2"),
                ("feed_forward/wi", "fc1", "linear1"), ("feed_forward/wo", "fc2", "linear2"),
                ("feed_forward_norm", "final_layer_norm", "norm3")],
}
QKV = (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj"))
# (our path, their key, theirs -> ours, ours -> theirs)
TensorName = tuple[str, str, Callable[[np.ndarray], np.ndarray],
                   Callable[[np.ndarray], np.ndarray]]


def sublayer_type(ours: str) -> str:
  return "attention" if ours.endswith("attention") else "norm" if ours.endswith("norm") else "dense"


def layers(cfg: TransformerConfig) -> Iterator[tuple[str, int, str, str, str]]:
  """(stack, layer index, our sublayer, Marian sublayer, torch sublayer) for every sublayer."""
  for stack, count in (("encoder", cfg.num_encoder_layers), ("decoder", cfg.num_decoder_layers)):
    for i in range(count):
      for ours, marian, torch_name in SUBLAYERS[stack]:
        yield stack, i, ours, marian, torch_name


# Torch Linear stores (out, in); ours are (in, ...) kernels with head axes split.
def linear_to_kernel(w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
  return np.ascontiguousarray(w.T).reshape(shape)


def kernel_to_linear(k: np.ndarray, fan_in: int) -> np.ndarray:
  return np.ascontiguousarray(k.reshape(fan_in, -1).T)


def layer_tensors(cfg: TransformerConfig, naming: str) -> list[TensorName]:
  """(our path, their key, theirs -> ours, ours -> theirs) for every layer tensor.
  naming "marian": MarianMTModel's state_dict; "torch": torch.nn.Transformer's (fused
  in_proj of query, key and value, which the caller handles)."""
  d, n, h = cfg.d_model, cfg.num_heads, cfg.head_dim
  out: list[TensorName] = []
  for stack, i, ours, marian, torch_name in layers(cfg):
    mine = f"{stack}/layer_{i}/{ours}"
    theirs = (f"model.{stack}.layers.{i}.{marian}" if naming == "marian"
              else f"transformer.{stack}.layers.{i}.{torch_name}")
    sublayer = sublayer_type(ours)
    if sublayer == "norm":
      out += [(f"{mine}/scale", f"{theirs}.weight", np.asarray, np.asarray),
              (f"{mine}/bias", f"{theirs}.bias", np.asarray, np.asarray)]
    elif sublayer == "dense":
      out += [(f"{mine}/kernel", f"{theirs}.weight", lambda w: np.ascontiguousarray(w.T),
               lambda k: np.ascontiguousarray(k.T)),
              (f"{mine}/bias", f"{theirs}.bias", np.asarray, np.asarray)]
    else:
      if naming == "marian":
        for q, proj in QKV:
          out += [(f"{mine}/{q}/kernel", f"{theirs}.{proj}.weight",
                   lambda w: linear_to_kernel(w, (d, n, h)), lambda k: kernel_to_linear(k, d)),
                  (f"{mine}/{q}/bias", f"{theirs}.{proj}.bias",
                   lambda b: b.reshape(n, h), lambda b: b.reshape(-1))]
      out += [(f"{mine}/out/kernel", f"{theirs}.out_proj.weight",
               lambda w: linear_to_kernel(w, (n, h, d)), lambda k: kernel_to_linear(k, n * h)),
              (f"{mine}/out/bias", f"{theirs}.out_proj.bias", np.asarray, np.asarray)]
  return out


def check_shape(key: str, value: np.ndarray, shape: tuple[int, ...], source: str) -> None:
  if tuple(value.shape) != tuple(shape):
    raise ConvertError(f"{source}: tensor {key} has shape {tuple(value.shape)}, but the "
                       f"config implies {tuple(shape)} (mismatched shapes)")


def abstract_params(cfg: TransformerConfig, decoder_only: bool = False) -> Any:
  """The parameters of the Transformer (or with `decoder_only` the LanguageModel) as boxed
  ShapeDtypeStructs (shapes and logical axis names)."""
  dummy = jnp.ones((1, 2), jnp.int32)
  if decoder_only:
    return jax.eval_shape(LanguageModel(cfg).init, jax.random.PRNGKey(0), dummy)["params"]
  return jax.eval_shape(Transformer(cfg).init, jax.random.PRNGKey(0), dummy, dummy)["params"]


def expected_shapes(cfg: TransformerConfig,
                    decoder_only: bool = False) -> dict[str, tuple[int, ...]]:
  """{our path: shape} of every parameter."""
  unboxed = nn.meta.unbox(abstract_params(cfg, decoder_only))
  return {path: tuple(leaf.shape) for path, leaf in trees.flatten(unboxed).items()}


def zero_params(cfg: TransformerConfig) -> dict:
  """A parameter tree of zeros (for the shapes another layout gives them)."""
  return jax.tree_util.tree_map(lambda s: np.zeros(s.shape, np.float32),
                                nn.meta.unbox(abstract_params(cfg)))


def _axis_names(cfg: TransformerConfig) -> dict[str, tuple[str, ...]]:
  leaves = trees.named_leaves(abstract_params(cfg),
                              is_leaf=lambda x: isinstance(x, nn.Partitioned))
  return {path: leaf.names for path, leaf in leaves}


def permute_embed_axes(params: dict, cfg: TransformerConfig, perm: np.ndarray) -> dict:
  """Re-lays every model-dimension ("embed") axis of `params` by `perm`. LayerNorm,
  attention and the tied output are equivariant to it, so the model computes the same
  function when its positional table is re-laid the same way (interleaved <-> halves)."""
  names = _axis_names(cfg)
  out: dict = {}
  for path, value in trees.flatten(params).items():
    value = np.asarray(value)
    for axis, name in enumerate(names[path]):
      if name == "embed":
        value = np.take(value, perm, axis=axis)
    trees.set_path(out, path, value)
  return out
