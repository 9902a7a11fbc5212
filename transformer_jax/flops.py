"""Model FLOPs of the encoder-decoder Transformer (`model_flops`) and of the decoder-only
language model (`lm_flops`), for throughput and MFU figures.

The formulas count matrix multiplications only, 2 FLOPs per multiply-add:

  weights:   every token passes through the weight matrices it meets, 2 FLOPs per weight
             forward and 4 backward (gradients of the input and of the weight): 6 * N per
             token in training, 2 * N at inference, with A = 2 d^2 + 2 d d_kv the
             self-attention's Q,O + K,V (d_kv = kv_heads * d_k: d without grouped-query
             attention, so A = 4 d^2) and F = 2 d d_ff the FFN (3 d d_ff gated):
               N_source = L_enc * (A + F)                 encoder self-attention + FFN
                        + L_dec * 2 d d_kv                cross-attention K,V of the source
               N_target = L_dec * (A + 2 d^2 + F)         self-attn + cross Q,O + FFN
                        + d * V_target                    output projection (tied or not)
               N_lm     = L_dec * (A + F) + d * V         decoder-only: no cross-attention
             Embedding lookups are gathers (no FLOPs); biases, norms, rotary positions,
             softmax and the loss are elementwise and not counted.
  attention: per sequence and layer, Q K^T and weights x V cost 2 * T * S * d each forward
             (all heads together, grouped-query or not), x3 in training:
               encoder self 12 * S^2 * d * L_enc, decoder self 12 * T^2 * d * L_dec,
               cross 12 * T * S * d * L_dec; a language model's self 12 * T^2 * d * L_dec.
             No causal halving: the T x T scores of a causal self-attention are counted in
             full, because the XLA attention computes the whole masked matrix (the fused
             kernels skip masked blocks, so their programs do somewhat less than counted).

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


def _layer_weights(cfg: TransformerConfig) -> tuple[int, int, int]:
  """(self-attention Q,K,V,O, feed-forward, cross-attention K,V) weights of one layer."""
  d, kv = cfg.d_model, cfg.kv_heads * cfg.head_dim
  ffn = (3 if cfg.gated_ffn else 2) * d * cfg.d_ff
  return 2 * d * d + 2 * d * kv, ffn, 2 * d * kv


def weights_per_token(cfg: TransformerConfig) -> tuple[int, int]:
  """(N_source, N_target): matmul weights one source / one target token passes through."""
  attention, ffn, cross_kv = _layer_weights(cfg)
  d = cfg.d_model
  source = cfg.num_encoder_layers * (attention + ffn) + cfg.num_decoder_layers * cross_kv
  target = (cfg.num_decoder_layers * (attention + 2 * d * d + ffn)
            + d * cfg.tgt_vocab_size)
  return source, target


def lm_weights_per_token(cfg: TransformerConfig) -> int:
  """N_lm: matmul weights one token of the decoder-only language model passes through
  (its num_decoder_layers layers without cross-attention, and the output projection)."""
  attention, ffn, _ = _layer_weights(cfg)
  return cfg.num_decoder_layers * (attention + ffn) + cfg.d_model * cfg.vocab_size


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


def lm_flops(cfg: TransformerConfig, batch_size: int, length: int,
             training: bool = True) -> dict[str, int]:
  """FLOPs of one forward (training=False) or forward+backward pass of the decoder-only
  language model (modules.models.LanguageModel) over a (batch_size, length) batch:
  {"weights", "attention", "total"}. The same terms as `model_flops` without a source:
  `model_flops` of a model with no encoder layers, less its cross-attention."""
  passes = 3 if training else 1
  weights = 2 * passes * batch_size * length * lm_weights_per_token(cfg)
  attention = passes * batch_size * 4 * cfg.d_model * cfg.num_decoder_layers * length * length
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
