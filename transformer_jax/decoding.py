"""Greedy and beam search over a KV cache (paper §6.1: beam 4, length penalty alpha 0.6).

The encoder runs once per source. The decoder cache holds, per layer, the self-attention
keys/values written so far and the cross-attention keys/values projected once from the
encoder output (Flax's WMT example recomputes those at every step). Each search is a single
`lax.while_loop`, so a batch shape compiles once.

Outputs are (B, max_length) token ids without BOS, ending with EOS where the model emitted
one, padded with PAD after it.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.config import BOS_ID, EOS_ID, PAD_ID, TransformerConfig
from transformer_jax.modules.models import Transformer

Array = jax.Array
NEG_INF = -1.0e7  # Large finite negative: keeps arithmetic on dead beams NaN-free.


def length_penalty(length: Array, alpha: float) -> Array:
  """GNMT length penalty ((5 + length) / 6) ** alpha (Wu et al., 2016)."""
  return ((5.0 + length) / 6.0) ** alpha


def _init_cache(model: Transformer, params: Any, encoded: Array, src: Array,
                max_length: int) -> Any:
  """Creates the decoder cache. The call runs the decoder on a dummy full-length target;
  under jit everything except the cross-attention projections is dead code and removed."""
  dummy = jnp.zeros((src.shape[0], max_length), jnp.int32)
  _, variables = model.apply({"params": params}, encoded, src, dummy, decode=True,
                             method=Transformer.decode, mutable=["cache"])
  return variables["cache"]


def _step_fn(model: Transformer, params: Any, src: Array) -> Callable:
  """(cache, tokens (B,), position) -> (log-probs (B, V) float32, new cache)."""
  def step(cache: Any, tokens: Array, position: Array) -> tuple[Array, Any]:
    positions = jnp.full((tokens.shape[0], 1), position, jnp.int32)
    logits, variables = model.apply(
        {"params": params, "cache": cache}, None, src, tokens[:, None],
        tgt_positions=positions, decode=True, method=Transformer.decode, mutable=["cache"])
    return jax.nn.log_softmax(logits[:, 0]), variables["cache"]
  return step


def _ban_special(log_probs: Array) -> Array:
  """PAD and BOS are never outputs: emitting one would desynchronise the cache from the full
  decoder (which masks PAD keys) and vanish in detokenization. The other entries keep the
  model's own log-probabilities, so scores stay log P(output)."""
  return log_probs.at[:, jnp.array([PAD_ID, BOS_ID])].set(NEG_INF)


def greedy_search(model: Transformer, params: Any, src: Array,
                  max_length: int) -> Array:
  """Greedy decoding: (B, S) source ids -> (B, max_length) output ids."""
  batch = src.shape[0]
  encoded = model.apply({"params": params}, src, method=Transformer.encode)
  step = _step_fn(model, params, src)

  def cond(state):
    i, _, _, finished, _ = state
    return (i < max_length) & ~finished.all()

  def body(state):
    i, last, output, finished, cache = state
    log_probs, cache = step(cache, last, i)
    log_probs = _ban_special(log_probs)
    token = jnp.where(finished, PAD_ID, jnp.argmax(log_probs, -1).astype(jnp.int32))
    output = output.at[:, i].set(token)
    return i + 1, token, output, finished | (token == EOS_ID), cache

  state = (jnp.array(0), jnp.full((batch,), BOS_ID, jnp.int32),
           jnp.zeros((batch, max_length), jnp.int32), jnp.zeros((batch,), bool),
           _init_cache(model, params, encoded, src, max_length))
  return jax.lax.while_loop(cond, body, state)[2]


def _gather_beams(tree: Any, indices: Array, batch: int, beams_in: int) -> Any:
  """Selects beams along the flattened (B * beams_in) leading axis: indices (B, K)."""
  def gather(x):
    if x.ndim == 0:  # cache_index: shared by all beams.
      return x
    x = x.reshape((batch, beams_in) + x.shape[1:])
    x = jnp.take_along_axis(x, indices.reshape(indices.shape + (1,) * (x.ndim - 2)), axis=1)
    return x.reshape((batch * indices.shape[1],) + x.shape[2:])
  return jax.tree_util.tree_map(gather, tree)


def beam_search(model: Transformer, params: Any, src: Array, max_length: int,
                beam_size: int = 4, alpha: float = 0.6) -> tuple[Array, Array]:
  """Beam search: (B, S) -> best sequences (B, max_length) and their scores (B,).

  As in fairseq, EOS among the top K candidates moves a hypothesis to the finished set
  with score log P / length_penalty(length); it is never extended again. A source is done
  once it has K finished hypotheses, after which its set is frozen; the loop ends when every
  source is done or at max_length. With K = 1 this is exactly greedy search.
  """
  batch, k = src.shape[0], beam_size
  encoded = model.apply({"params": params}, src, method=Transformer.encode)
  cache = _init_cache(model, params, encoded, src, max_length)
  # Replicate per beam after the cross projections: they are computed once per source.
  cache = jax.tree_util.tree_map(lambda x: x if x.ndim == 0 else jnp.repeat(x, k, axis=0),
                                 cache)
  step = _step_fn(model, params, jnp.repeat(src, k, axis=0))
  max_penalty = length_penalty(jnp.float32(max_length), alpha)

  def is_done(finished_scores):
    return finished_scores[:, -1] > NEG_INF / 2                     # K finished hypotheses

  def cond(state):
    i, finished_scores = state[0], state[4]
    return (i < max_length) & ~is_done(finished_scores).all()

  def body(state):
    i, alive_seqs, alive_logp, finished_seqs, finished_scores, last, cache = state
    log_probs, cache = step(cache, last.reshape(-1), i)                   # (B*K, V)
    log_probs = _ban_special(log_probs)
    vocab = log_probs.shape[-1]
    candidates = (alive_logp[:, :, None] + log_probs.reshape(batch, k, vocab))
    top_logp, top_index = jax.lax.top_k(candidates.reshape(batch, k * vocab), 2 * k)
    top_beam, top_token = top_index // vocab, (top_index % vocab).astype(jnp.int32)
    top_seqs = jnp.take_along_axis(alive_seqs, top_beam[:, :, None], axis=1)
    top_seqs = top_seqs.at[:, :, i].set(top_token)                        # (B, 2K, L)
    is_eos = top_token == EOS_ID

    # Alive: the best K candidates that did not end.
    alive_logp, choice = jax.lax.top_k(jnp.where(is_eos, NEG_INF, top_logp), k)
    alive_seqs = jnp.take_along_axis(top_seqs, choice[:, :, None], axis=1)
    last = jnp.take_along_axis(top_token, choice, axis=1)
    cache = _gather_beams(cache, jnp.take_along_axis(top_beam, choice, axis=1), batch, k)

    # Finished: EOS among the top K candidates of a source that is not done yet.
    can_finish = is_eos & (jnp.arange(2 * k) < k)[None] & ~is_done(finished_scores)[:, None]
    new_scores = jnp.where(can_finish, top_logp / length_penalty(i + 1.0, alpha), NEG_INF)
    scores = jnp.concatenate([finished_scores, new_scores], axis=1)
    seqs = jnp.concatenate([finished_seqs, top_seqs], axis=1)
    finished_scores, keep = jax.lax.top_k(scores, k)
    finished_seqs = jnp.take_along_axis(seqs, keep[:, :, None], axis=1)
    return i + 1, alive_seqs, alive_logp, finished_seqs, finished_scores, last, cache

  init_logp = jnp.tile(jnp.array([0.0] + [NEG_INF] * (k - 1), jnp.float32), (batch, 1))
  state = (jnp.array(0), jnp.zeros((batch, k, max_length), jnp.int32), init_logp,
           jnp.zeros((batch, k, max_length), jnp.int32),
           jnp.full((batch, k), NEG_INF, jnp.float32),
           jnp.full((batch, k), BOS_ID, jnp.int32), cache)
  _, alive_seqs, alive_logp, finished_seqs, finished_scores, _, _ = jax.lax.while_loop(
      cond, body, state)

  # Where a source is not done, hypotheses alive at max_length compete as if they ended.
  alive_score = jnp.where(is_done(finished_scores), NEG_INF, alive_logp[:, 0] / max_penalty)
  use_finished = finished_scores[:, 0] >= alive_score
  best = jnp.where(use_finished[:, None], finished_seqs[:, 0], alive_seqs[:, 0])
  return best, jnp.maximum(finished_scores[:, 0], alive_score)


@functools.lru_cache(maxsize=64)
def _compiled(config: TransformerConfig, beam_size: int, alpha: float,
              max_length: int) -> Callable:
  model = Transformer(config)
  if beam_size == 1:
    fn = lambda params, src: greedy_search(model, params, src, max_length)
  else:
    fn = lambda params, src: beam_search(model, params, src, max_length, beam_size, alpha)[0]
  return jax.jit(fn)


def generate(config: TransformerConfig, params: Any, src: Any, *, max_length: int,
             beam_size: int = 4, alpha: float = 0.6) -> np.ndarray:
  """Jitted decoding of a (B, S) batch of checked source ids; beam_size 1 is greedy.
  Compiles once per (config, beam, alpha, max_length, batch shape)."""
  if max_length > config.max_len:
    raise ValueError(f"max_length={max_length} exceeds the model's max_len={config.max_len}")
  if beam_size < 1:
    raise ValueError(f"beam_size={beam_size}: must be >= 1")
  fn = _compiled(config, int(beam_size), float(alpha), int(max_length))
  return np.asarray(fn(params, jnp.asarray(src, jnp.int32)))


def strip_special(ids: Any) -> list[int]:
  """Token ids up to (not including) the first EOS, without padding."""
  out = []
  for token in np.asarray(ids).tolist():
    if token == EOS_ID:
      break
    if token != PAD_ID:
      out.append(token)
  return out
