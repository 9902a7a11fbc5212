"""Model FLOPs of the encoder-decoder Transformer, for throughput and MFU figures.

The formula (`model_flops`) counts matrix multiplications only, 2 FLOPs per multiply-add:

  weights:   every token passes through the weight matrices it meets, 2 FLOPs per weight
             forward and 4 backward (gradients of the input and of the weight): 6 * N per
             token in training, 2 * N at inference, with
               N_source = L_enc * (4 d^2 + 2 d d_ff)      encoder self-attention Q,K,V,O + FFN
                        + L_dec * 2 d^2                   cross-attention K,V of the source
               N_target = L_dec * (4 d^2 + 2 d^2 + 2 d d_ff)  self-attn + cross Q,O + FFN
                        + d * V_target                    output projection (tied or not)
             Embedding lookups are gathers (no FLOPs); biases, LayerNorm, softmax and the
             loss are elementwise and not counted.
  attention: per sequence and layer, Q K^T and weights x V cost 2 * T * S * d each forward
             (all heads together), x3 in training:
               encoder self 12 * S^2 * d * L_enc, decoder self 12 * T^2 * d * L_dec,
               cross 12 * T * S * d * L_dec.
             No causal halving: the decoder's T x T scores are counted in full, because the
             XLA attention computes the whole masked matrix.

Lengths are the batch's array lengths (padding included), so the count is the work the
jitted step does; recomputation under remat is not model FLOPs and is not counted.
`matmul_flops` counts the dot products of any traced function instead; for the model
without remat it agrees with the formula exactly (tests/test_flops.py).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.extend.core as jex

from transformer_jax.config import TransformerConfig


def _shape(var: Any) -> tuple[int, ...]:
  """A jaxpr variable's shape (its abstract value is an array's, for the ops counted here)."""
  return tuple(var.aval.shape)


def weights_per_token(cfg: TransformerConfig) -> tuple[int, int]:
  """(N_source, N_target): matmul weights one source / one target token passes through."""
  d, f = cfg.d_model, cfg.d_ff
  source = cfg.num_encoder_layers * (4 * d * d + 2 * d * f) + cfg.num_decoder_layers * 2 * d * d
  target = cfg.num_decoder_layers * (6 * d * d + 2 * d * f) + d * cfg.tgt_vocab_size
  return source, target


def model_flops(cfg: TransformerConfig, batch_size: int, src_length: int, tgt_length: int,
                training: bool = True) -> dict[str, int]:
  """FLOPs of one forward (training=False) or forward+backward (training=True) pass over a
  (batch_size, src_length) source and (batch_size, tgt_length) target batch:
  {"weights", "attention", "total"}."""
  passes = 3 if training else 1            # backward = 2 x forward for every matmul
  n_source, n_target = weights_per_token(cfg)
  weights = 2 * passes * batch_size * (src_length * n_source + tgt_length * n_target)
  s, t, d = src_length, tgt_length, cfg.d_model
  per_sequence = 4 * d * (cfg.num_encoder_layers * s * s
                          + cfg.num_decoder_layers * (t * t + t * s))
  attention = passes * batch_size * per_sequence
  return {"weights": weights, "attention": attention, "total": weights + attention}


def matmul_flops(fn: Callable, *args: Any, **kwargs: Any) -> int:
  """2 x multiply-adds of every dot_general that `fn(*args, **kwargs)` traces to, counting
  a scan body once per iteration (loops with a data-dependent trip count are refused)."""
  return _jaxpr_flops(jax.make_jaxpr(fn)(*args, **kwargs).jaxpr)


def _jaxpr_flops(jaxpr: jex.Jaxpr) -> int:
  total = 0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "dot_general":
      (contract, _), _ = eqn.params["dimension_numbers"]
      lhs = _shape(eqn.invars[0])
      total += 2 * math.prod(_shape(eqn.outvars[0])) * math.prod(lhs[i] for i in contract)
      continue
    if name == "while":
      if any(_jaxpr_flops(j) for j in jex.jaxprs_in_params(eqn.params)):
        raise ValueError("matmul_flops: a while loop with matmuls has no static trip count")
      continue
    inner = [_jaxpr_flops(j) for j in jex.jaxprs_in_params(eqn.params)]
    if not inner:
      continue
    if name == "cond":            # One branch runs; count the dearest.
      total += max(inner)
    else:
      total += sum(inner) * (eqn.params["length"] if name == "scan" else 1)
  return total
