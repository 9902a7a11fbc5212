"""A language model's continuations of its prompts, token by token through the KV cache:
greedy (temperature 0) or sampled, with top-k and top-p (nucleus) cuts.

Rows are (B, L) buffers, L the model's max_len: BOS, the prompt, then room for the
continuation, padded with PAD. Every row steps through the same positions together: at step
i it feeds the token at position i (its prompt's, or the one it drew at step i - 1) and,
past its prompt, draws position i + 1. Prompts of different lengths thus share one batch
without padding inside the cache. Row b draws with the key `keys[b]` folded with the
position, so a row's text depends on its seed and prompt alone, not on the rows beside it.
With `use_cache=False` each step runs the whole model over the buffer and reads position i:
the same outputs, recomputing the prefix (what the cache must equal; a test checks it).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from transformer_jax.config import BOS_ID, EOS_ID, PAD_ID, TransformerConfig
from transformer_jax.modules.models import LanguageModel

Array = jax.Array
_BANNED = (PAD_ID, BOS_ID)   # never drawn: PAD ends nothing, BOS only starts a text


def filtered_logits(logits: Array, temperature: Array, top_k: Array, top_p: Array) -> Array:
  """(B, V) float32 logits / temperature, with every token outside the `top_k` most likely
  (0: no cut) and outside the smallest set whose probability reaches `top_p` set to -inf.
  The cuts are thresholds on the sorted logits, so k and p are values, not shapes: one
  compiled program serves every setting."""
  logits = logits.at[:, jnp.array(_BANNED)].set(-jnp.inf) / temperature
  ordered = jnp.sort(logits, axis=-1)[:, ::-1]                                  # descending
  vocab = logits.shape[-1]
  kth = jnp.take(ordered, jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab) - 1, axis=-1)
  probabilities = jax.nn.softmax(ordered, axis=-1)
  # A token is kept while the probability of the tokens before it is below top_p.
  before = jnp.cumsum(probabilities, axis=-1) - probabilities
  nucleus = jnp.where(before < top_p, ordered, jnp.inf).min(-1)     # the least kept logit
  threshold = jnp.maximum(kth, nucleus)[:, None]
  return jnp.where(logits >= threshold, logits, -jnp.inf)


def _draw(logits: Array, keys: Array, position: Array, temperature: Array, top_k: Array,
          top_p: Array) -> Array:
  """(B, V) logits -> (B,) tokens: the argmax at temperature 0, else a draw per row."""
  greedy = jnp.argmax(logits.at[:, jnp.array(_BANNED)].set(-jnp.inf), -1)
  safe_temperature = jnp.where(temperature > 0, temperature, 1.0)
  cut = filtered_logits(logits, safe_temperature, top_k, top_p)
  step_keys = jax.vmap(lambda key: jax.random.fold_in(key, position))(keys)
  drawn = jax.vmap(jax.random.categorical)(step_keys, cut)
  return jnp.where(temperature > 0, drawn, greedy).astype(jnp.int32)


def _cached_logits(model: LanguageModel, params: Any, rows: Array
                   ) -> tuple[Any, Callable[[Any, Array, Array], tuple[Array, Any]]]:
  """The empty cache for (B, L) rows, and step(cache, tokens (B,), i) -> logits (B, V)."""
  _, variables = model.apply({"params": params}, jnp.zeros_like(rows), decode=True,
                             mutable=["cache"])

  def step(cache: Any, tokens: Array, i: Array) -> tuple[Array, Any]:
    positions = jnp.full((tokens.shape[0], 1), i, jnp.int32)
    logits, variables = model.apply({"params": params, "cache": cache}, tokens[:, None],
                                    positions=positions, decode=True, mutable=["cache"])
    return logits[:, 0], variables["cache"]
  return variables["cache"], step


def continue_rows(model: LanguageModel, params: Any, rows: Array, lengths: Array,
                  keys: Array, max_new_tokens: int, temperature: Array, top_k: Array,
                  top_p: Array, use_cache: bool = True) -> Array:
  """rows (B, L): BOS + prompt in the first `lengths` (B,) positions. Returns the rows with
  up to `max_new_tokens` tokens drawn after each prompt (within L); a row that draws EOS
  stops there (PAD after it)."""
  batch, width = rows.shape
  ends = jnp.minimum(lengths + max_new_tokens, width)                # (B,) exclusive
  last_step = ends.max() - 1

  if use_cache:
    carry, cached_step = _cached_logits(model, params, rows)
  else:
    carry = None

  def body(state: tuple) -> tuple:
    i, rows, finished, carry = state
    if use_cache:
      logits, carry = cached_step(carry, rows[:, i], i)
    else:
      logits = jax.lax.dynamic_index_in_dim(model.apply({"params": params}, rows), i, 1,
                                            keepdims=False)
    token = _draw(logits, keys, i + 1, temperature, top_k, top_p)
    drawing = (i + 1 >= lengths) & (i + 1 < ends)
    token = jnp.where(finished, PAD_ID, token)
    rows = jnp.where(drawing[:, None] & (jnp.arange(width) == i + 1)[None], token[:, None], rows)
    finished = finished | (drawing & (token == EOS_ID))
    return i + 1, rows, finished, carry

  state = (jnp.array(0), rows, jnp.zeros((batch,), bool), carry)
  return jax.lax.while_loop(lambda s: s[0] < last_step, body, state)[1]


@functools.lru_cache(maxsize=16)
def compiled_continuation(config: TransformerConfig, max_new_tokens: int,
                          use_cache: bool = True) -> Callable:
  """jax.jit of (params, rows, lengths, keys, temperature, top_k, top_p) -> rows."""
  model = LanguageModel(config)

  def run(params: Any, rows: Array, lengths: Array, keys: Array, temperature: Array,
          top_k: Array, top_p: Array) -> Array:
    return continue_rows(model, params, rows, lengths, keys, max_new_tokens, temperature,
                         top_k, top_p, use_cache)
  return jax.jit(run)


def continuations(rows: Array, lengths: Any) -> list[list[int]]:
  """Each row's drawn tokens: after its prompt, up to (not including) EOS or PAD."""
  out = []
  for row, length in zip(jax.device_get(rows).tolist(), list(lengths)):
    tokens = []
    for token in row[int(length):]:
      if token in (EOS_ID, PAD_ID):
        break
      tokens.append(token)
    out.append(tokens)
  return out


def sample_keys(seed: int, line_numbers: Any) -> Array:
  """One key per prompt line: the seed folded with the line's number in its input."""
  base = jax.random.PRNGKey(seed)
  return jax.vmap(lambda n: jax.random.fold_in(base, n))(jnp.asarray(line_numbers, jnp.uint32))
