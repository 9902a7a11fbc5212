"""Greedy and beam search over a KV cache (paper §6.1: beam 4, length penalty alpha 0.6).

The encoder runs once per source. The decoder cache holds, per layer, the self-attention
keys/values written so far and the cross-attention keys/values projected once from the
encoder output (Flax's WMT example recomputes those at every step). Each search is a single
`lax.while_loop`, so a batch shape compiles once. With `use_cache=False` each step instead
runs the whole decoder over the (max_length) output buffer and reads the logits at the
current position: the same outputs, at the cost of recomputing the prefix (the baseline of
`benchmarks/decode.py`).

Outputs are (B, max_length) token ids without BOS, ending with EOS where the model emitted
one, padded with PAD after it.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax import sharding
from transformer_jax.config import BOS_ID, EOS_ID, PAD_ID, TransformerConfig

# Shared with the flax-free serving loader; re-exported here, where decoding callers look.
from transformer_jax.data.vocab import strip_special  # noqa: F401
from transformer_jax.modules.models import Transformer

Array = jax.Array
NEG_INF = -1.0e7  # Large finite negative: keeps arithmetic on dead beams NaN-free.


def length_penalty(length: Array, alpha: float) -> Array:
  """GNMT length penalty ((5 + length) / 6) ** alpha (Wu et al., 2016)."""
  return ((5.0 + length) / 6.0) ** alpha


class _Stepper(NamedTuple):
  """One decoding step, with or without the KV cache. `carry` is the cache (or, without it,
  the encoder output); `step(carry, outputs (B', L), last (B',), i)` returns log-probs
  (B', V) float32 for position i and the new carry; `reorder(carry, beams (B, K))` follows
  the beams that survive."""
  carry: Any
  step: Callable[[Any, Array, Array, Array], tuple[Array, Any]]
  reorder: Callable[[Any, Array], Any]


def _cached_stepper(model: Transformer, params: Any, encoded: Array, src: Array,
                    max_length: int, beams: int) -> _Stepper:
  """The decoder's KV cache, created by running it on a dummy full-length target (under jit
  everything except the cross-attention projections is dead code and removed). The cache is
  replicated per beam after the cross projections: they are computed once per source."""
  batch_axis = 1 if model.config.scan_layers else 0   # scanned caches lead with layers
  dummy = jnp.zeros((src.shape[0], max_length), jnp.int32)
  _, variables = model.apply({"params": params}, encoded, src, dummy, decode=True,
                             method=Transformer.decode, mutable=["cache"])
  cache = _map_batch(lambda x: jnp.repeat(x, beams, axis=batch_axis), variables["cache"])
  src = jnp.repeat(src, beams, axis=0)

  def step(cache: Any, outputs: Array, last: Array, i: Array) -> tuple[Array, Any]:
    del outputs  # The cache holds the prefix.
    positions = jnp.full((last.shape[0], 1), i, jnp.int32)
    logits, variables = model.apply(
        {"params": params, "cache": cache}, None, src, last[:, None],
        tgt_positions=positions, decode=True, method=Transformer.decode, mutable=["cache"])
    return jax.nn.log_softmax(logits[:, 0]), variables["cache"]

  def reorder(cache: Any, indices: Array) -> Any:
    return _map_batch(lambda x: _gather_beams(x, indices, batch_axis), cache)

  return _Stepper(cache, step, reorder)


def _recompute_stepper(model: Transformer, params: Any, encoded: Array, src: Array,
                       beams: int) -> _Stepper:
  """No cache: every step decodes BOS + the outputs so far (later positions are PAD, which
  the decoder masks) through all layers, cross-attention projections included."""
  encoded, src = jnp.repeat(encoded, beams, axis=0), jnp.repeat(src, beams, axis=0)

  def step(encoded: Array, outputs: Array, last: Array, i: Array) -> tuple[Array, Array]:
    del last  # Already in `outputs`.
    bos = jnp.full((outputs.shape[0], 1), BOS_ID, jnp.int32)
    inputs = jnp.concatenate([bos, outputs[:, :-1]], axis=1)
    logits = model.apply({"params": params}, encoded, src, inputs,
                         method=Transformer.decode)
    return jax.nn.log_softmax(jax.lax.dynamic_index_in_dim(logits, i, 1, False)), encoded

  # All beams of a source share its encoder output, so reordering beams changes nothing.
  return _Stepper(encoded, step, lambda encoded, indices: encoded)


def _stepper(model: Transformer, params: Any, src: Array, max_length: int, beams: int,
             use_cache: bool) -> _Stepper:
  encoded = cast(Array, model.apply({"params": params}, src, method=Transformer.encode))
  if use_cache:
    return _cached_stepper(model, params, encoded, src, max_length, beams)
  return _recompute_stepper(model, params, encoded, src, beams)


def _map_batch(fn: Callable[[Array], Array], cache: Any) -> Any:
  """Applies fn to every cache array (each has a batch axis)."""
  return jax.tree_util.tree_map(fn, cache)


def _ban_special(log_probs: Array) -> Array:
  """PAD and BOS are never outputs: emitting one would desynchronise the cache from the full
  decoder (which masks PAD keys) and vanish in detokenization. The other entries keep the
  model's own log-probabilities, so scores stay log P(output)."""
  return log_probs.at[:, jnp.array([PAD_ID, BOS_ID])].set(NEG_INF)


def _split_rows(*arrays: Array) -> tuple[Array, ...]:
  """The search's per-source state kept split over the batch inside
  `sharding.activations_split_over_batch` (compiled_search under fsdp): each device then
  ranks only its own rows' candidates, instead of gathering every row's scores each step."""
  return tuple(sharding.constrain_to_batch(x) for x in arrays)


def greedy_search(model: Transformer, params: Any, src: Array, max_length: int,
                  use_cache: bool = True) -> Array:
  """Greedy decoding: (B, S) source ids -> (B, max_length) output ids."""
  batch = src.shape[0]
  stepper = _stepper(model, params, src, max_length, 1, use_cache)

  def cond(state):
    i, _, _, finished, _ = state
    return (i < max_length) & ~finished.all()

  def body(state):
    i, last, output, finished, carry = state
    log_probs, carry = stepper.step(carry, output, last, i)
    log_probs = _ban_special(log_probs)
    token = jnp.where(finished, PAD_ID, jnp.argmax(log_probs, -1).astype(jnp.int32))
    output = output.at[:, i].set(token)
    return (i + 1, *_split_rows(token, output, finished | (token == EOS_ID)), carry)

  state = (jnp.array(0), *_split_rows(jnp.full((batch,), BOS_ID, jnp.int32),
                                      jnp.zeros((batch, max_length), jnp.int32),
                                      jnp.zeros((batch,), bool)), stepper.carry)
  return jax.lax.while_loop(cond, body, state)[2]


def _gather_beams(x: Array, indices: Array, axis: int) -> Array:
  """Selects beams along the flattened (B * beams_in) axis `axis` of x: indices (B, K)."""
  x = jnp.moveaxis(x, axis, 0)
  batch = indices.shape[0]
  x = x.reshape((batch, -1) + x.shape[1:])
  x = jnp.take_along_axis(x, indices.reshape(indices.shape + (1,) * (x.ndim - 2)), axis=1)
  return jnp.moveaxis(x.reshape((batch * indices.shape[1],) + x.shape[2:]), 0, axis)


def beam_search(model: Transformer, params: Any, src: Array, max_length: int,
                beam_size: int = 4, alpha: float = 0.6,
                use_cache: bool = True) -> tuple[Array, Array]:
  """Beam search: (B, S) -> best sequences (B, max_length) and their scores (B,).

  As in fairseq, EOS among the top K candidates moves a hypothesis to the finished set
  with score log P / length_penalty(length); it is never extended again. A source is done
  once it has K finished hypotheses, after which its set is frozen; the loop ends when every
  source is done or at max_length. With K = 1 this is exactly greedy search.
  """
  batch, k = src.shape[0], beam_size
  stepper = _stepper(model, params, src, max_length, k, use_cache)
  max_penalty = length_penalty(jnp.float32(max_length), alpha)

  def is_done(finished_scores):
    return finished_scores[:, -1] > NEG_INF / 2                     # K finished hypotheses

  def cond(state):
    i, finished_scores = state[0], state[4]
    return (i < max_length) & ~is_done(finished_scores).all()

  def body(state):
    i, alive_seqs, alive_logp, finished_seqs, finished_scores, last, carry = state
    log_probs, carry = stepper.step(carry, alive_seqs.reshape(batch * k, -1), last.reshape(-1),
                                    i)                                    # (B*K, V)
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
    carry = stepper.reorder(carry, jnp.take_along_axis(top_beam, choice, axis=1))

    # Finished: EOS among the top K candidates of a source that is not done yet.
    can_finish = is_eos & (jnp.arange(2 * k) < k)[None] & ~is_done(finished_scores)[:, None]
    new_scores = jnp.where(can_finish, top_logp / length_penalty(i + 1.0, alpha), NEG_INF)
    scores = jnp.concatenate([finished_scores, new_scores], axis=1)
    seqs = jnp.concatenate([finished_seqs, top_seqs], axis=1)
    finished_scores, keep = jax.lax.top_k(scores, k)
    finished_seqs = jnp.take_along_axis(seqs, keep[:, :, None], axis=1)
    return (i + 1, *_split_rows(alive_seqs, alive_logp, finished_seqs, finished_scores, last),
            carry)

  init_logp = jnp.tile(jnp.array([0.0] + [NEG_INF] * (k - 1), jnp.float32), (batch, 1))
  state = (jnp.array(0), *_split_rows(jnp.zeros((batch, k, max_length), jnp.int32), init_logp,
                                      jnp.zeros((batch, k, max_length), jnp.int32),
                                      jnp.full((batch, k), NEG_INF, jnp.float32),
                                      jnp.full((batch, k), BOS_ID, jnp.int32)), stepper.carry)
  _, alive_seqs, alive_logp, finished_seqs, finished_scores, _, _ = jax.lax.while_loop(
      cond, body, state)

  # Where a source is not done, hypotheses alive at max_length compete as if they ended.
  alive_score = jnp.where(is_done(finished_scores), NEG_INF, alive_logp[:, 0] / max_penalty)
  use_finished = finished_scores[:, 0] >= alive_score
  best = jnp.where(use_finished[:, None], finished_seqs[:, 0], alive_seqs[:, 0])
  return best, jnp.maximum(finished_scores[:, 0], alive_score)


@functools.lru_cache(maxsize=64)
def compiled_search(config: TransformerConfig, beam_size: int, alpha: float,
                    max_length: int, use_cache: bool = True,
                    rows: jax.sharding.NamedSharding | None = None) -> Callable:
  """jax.jit of `(params, src) -> outputs`: greedy for beam_size 1, else beam search.
  `rows`: the batch sharding of the mesh the parameters live on. The source rows are then
  split over the batch axes, so each device decodes its share (a host array arrives
  replicated, and every device decoded every row). Under fsdp every layer's output and the
  search's state are kept split too, as in the train step
  (sharding.activations_split_over_batch): left to itself the partitioner split the
  matmuls along the fsdp-split d_model and all-reduced activations at every step."""
  model = Transformer(config)

  def run(params: Any, src: Array) -> Array:
    with sharding.activations_split_over_batch(rows):
      out = search(model, params, sharding.split_over_batch(src, rows), max_length, beam_size,
                   alpha, use_cache)
    # Whole on every device, as the host array came in: each host reads all the outputs.
    return out if rows is None else jax.lax.with_sharding_constraint(
        out, sharding.replicated(rows.mesh))
  return jax.jit(run)


def search(model: Transformer, params: Any, src: Array, max_length: Any, beam_size: int = 4,
           alpha: float = 0.6, use_cache: bool = True) -> Array:
  """(B, S) -> the best outputs (B, max_length): greedy for beam_size 1, else beam search.
  Traceable with symbolic B, S and max_length (jax.export)."""
  if beam_size == 1:
    return greedy_search(model, params, src, max_length, use_cache)
  return beam_search(model, params, src, max_length, beam_size, alpha, use_cache)[0]


def generate(config: TransformerConfig, params: Any, src: Any, *, max_length: int,
             beam_size: int = 4, alpha: float = 0.6, use_cache: bool = True) -> np.ndarray:
  """Jitted decoding of a (B, S) batch of checked source ids; beam_size 1 is greedy.
  Compiles once per (config, beam, alpha, max_length, use_cache, batch shape)."""
  if max_length > config.max_len:
    raise ValueError(f"max_length={max_length} exceeds the model's max_len={config.max_len}")
  if beam_size < 1:
    raise ValueError(f"beam_size={beam_size}: must be >= 1")
  fn = compiled_search(config, int(beam_size), float(alpha), int(max_length), bool(use_cache),
                       sharding.batch_sharding_of(params))
  return np.asarray(fn(params, jnp.asarray(src, jnp.int32)))
