"""Helpers on parameter pytrees: counting, and converting between layouts of the same model
(unrolled <-> scanned layers, separate <-> fused query/key/value projections).

The converters take plain parameter trees (nested dicts of arrays, boxes unwrapped with
`flax.linen.meta.unbox`) and return plain nested dicts; they also apply to gradients and to
Adam moments, which have the parameters' structure.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

_LAYER = re.compile(r"layer_(\d+)$")
_QKV = ("query", "key", "value")


def count_params(params: Any) -> int:
  """Number of scalars in a parameter pytree (logical-partitioning boxes are unwrapped)."""
  return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(nn.meta.unbox(params))))


def _rewrite(tree: Any, rewrite: Callable[[str | None, dict], dict], name: str | None = None):
  """Applies `rewrite(name, node)` to every dict node, children first."""
  if not hasattr(tree, "items"):
    return tree
  node = {k: _rewrite(v, rewrite, k) for k, v in nn.meta.unbox(tree).items()}
  return rewrite(name, node)


def stack_layers(params: Any) -> dict:
  """Unrolled layout ("layer_0", "layer_1", ... under a stack) -> scanned layout (one
  "layers" subtree whose leaves have a leading layer axis), for `scan_layers=True`."""
  def rewrite(_, node):
    indices = sorted(int(m.group(1)) for k in node if (m := _LAYER.match(k)))
    if not indices:
      return node
    if indices != list(range(len(indices))):
      raise ValueError(f"layer names must be layer_0..layer_{len(indices) - 1}, got "
                       f"{sorted(k for k in node if _LAYER.match(k))}")
    layers = [node.pop(f"layer_{i}") for i in indices]
    node["layers"] = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *layers)
    return node
  return _rewrite(params, rewrite)


def unstack_layers(params: Any) -> dict:
  """Scanned layout -> unrolled layout (inverse of `stack_layers`)."""
  def rewrite(_, node):
    if "layers" not in node:
      return node
    layers = node.pop("layers")
    count = jax.tree_util.tree_leaves(layers)[0].shape[0]
    for i in range(count):
      node[f"layer_{i}"] = jax.tree_util.tree_map(lambda x: x[i], layers)
    return node
  return _rewrite(params, rewrite)


def fuse_qkv(params: Any) -> dict:
  """Separate self-attention "query"/"key"/"value" projections -> one "qkv" projection
  (kernel (..., D, 3, N, H), bias (..., 3, N, H)), for `fused_qkv=True`. Works on either
  layer layout; cross-attention keeps separate projections."""
  def rewrite(name, node):
    if name != "self_attention" or not all(k in node for k in _QKV):
      return node
    parts = [node.pop(k) for k in _QKV]
    node["qkv"] = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs, axis=-3), *parts)
    return node
  return _rewrite(params, rewrite)


def split_qkv(params: Any) -> dict:
  """Fused "qkv" projection -> separate "query"/"key"/"value" (inverse of `fuse_qkv`)."""
  def rewrite(name, node):
    if name != "self_attention" or "qkv" not in node:
      return node
    qkv = node.pop("qkv")
    for i, k in enumerate(_QKV):
      node[k] = jax.tree_util.tree_map(lambda x: jnp.take(x, i, axis=-3), qkv)
    return node
  return _rewrite(params, rewrite)
