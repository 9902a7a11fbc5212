"""The initialisers of the model's weights, by `TransformerConfig.weight_init`.

"xavier": Xavier-uniform weight matrices and token embeddings N(0, 1/d_model) (rows of norm
about 1 once scaled by sqrt(d_model)), as Flax's WMT example and fairseq start the paper's model.
"gpt2": GPT-2's scheme, which nanoGPT follows: every weight matrix and embedding N(0, 0.02),
and the two projections that write into the residual stream (attention's output, the
feed-forward's second) N(0, 0.02 / sqrt(2 * layers)), so the stream's variance does not grow
with depth (GPT-2 paper §2.3).
"""

from __future__ import annotations

import math
from typing import Callable

import flax.linen as nn

from transformer_jax.config import TransformerConfig

GPT2_STDDEV = 0.02


def kernel_init(config: TransformerConfig, *, into_residual: bool = False) -> Callable:
  """A weight matrix's initialiser; `into_residual`: its output is added to the residual
  stream (zeros with config.zero_init_residual)."""
  if into_residual and config.zero_init_residual:
    return nn.initializers.zeros_init()
  if config.weight_init == "xavier":
    return nn.initializers.xavier_uniform()
  layers = config.num_encoder_layers + config.num_decoder_layers
  scale = 1 / math.sqrt(2 * layers) if into_residual and layers else 1.0
  return nn.initializers.normal(stddev=GPT2_STDDEV * scale)


def embedding_init(config: TransformerConfig) -> Callable:
  """The token embedding table's initialiser (shared with a tied output projection)."""
  if config.weight_init == "xavier":
    return nn.initializers.normal(stddev=config.d_model ** -0.5)
  return nn.initializers.normal(stddev=GPT2_STDDEV)
