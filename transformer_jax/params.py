"""Helpers on parameter pytrees."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import flax.linen as nn


def count_params(params: Any) -> int:
  """Number of scalars in a parameter pytree (logical-partitioning boxes are unwrapped)."""
  return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(nn.meta.unbox(params))))
