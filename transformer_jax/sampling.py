"""A language model's continuations of its prompts, token by token through the KV cache:
greedy (temperature 0) or sampled, with top-k and top-p (nucleus) cuts. `generate` is what
predict runs and what a served model exports.

Rows are (B, L) buffers, L the model's max_len: BOS, the prompt, then room for the
continuation, padded with PAD. Every row steps through the same positions together: at step
i it feeds the token at position i (its prompt's, or the one it drew at step i - 1) and,
past its prompt, draws position i + 1. Prompts of different lengths thus share one batch
without padding inside the cache. Row b draws with a key of the seed and its own tokens,
folded with the position, so its text does not depend on the rows beside it.
With `use_cache=False` each step runs the whole model over the buffer and reads position i:
the same outputs, recomputing the prefix (what the cache must equal; a test checks it).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from transformer_jax.config import BOS_ID, EOS_ID, PAD_ID, UNK_ID, TransformerConfig
from transformer_jax.data.vocab import strip_special
from transformer_jax.inputs import InputError
from transformer_jax.modules.models import LanguageModel

Array = jax.Array
# Never drawn: PAD ends nothing, BOS only starts a text, UNK (a character outside the
# vocabulary) has no text.
_BANNED = (PAD_ID, BOS_ID, UNK_ID)


def filtered_logits(logits: Array, temperature: Array, top_k: Array, top_p: Array) -> Array:
  """(B, V) float32 logits (the absent ids already -inf) / temperature, with every token
  outside the `top_k` most likely (0: no cut) and outside the smallest set whose probability
  reaches `top_p` set to -inf.
  The cuts are thresholds on the sorted logits, so k and p are values, not shapes: one
  compiled program serves every setting."""
  logits = logits / temperature
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
  logits = logits.at[:, jnp.array(_BANNED)].set(-jnp.inf)
  greedy = jnp.argmax(logits, -1)
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


def prompt_rows(prompts: Array, width: int, context: int) -> tuple[Array, Array]:
  """Prompt ids (B, S), right-padded with PAD, no BOS -> rows (B, width) of BOS + each
  prompt's last context - 1 tokens, and their lengths (B,). Static shapes whatever S is
  (an exported function has a symbolic S)."""
  batch = prompts.shape[0]
  count = (prompts != PAD_ID).sum(1).astype(jnp.int32)
  keep = jnp.minimum(count, context - 1)
  padded = jnp.concatenate([prompts.astype(jnp.int32),
                            jnp.zeros((batch, width), jnp.int32)], 1)
  slots = jnp.arange(width - 1)[None]
  body = jnp.take_along_axis(padded, (count - keep)[:, None] + slots, axis=1)
  body = jnp.where(slots < keep[:, None], body, PAD_ID)
  return jnp.concatenate([jnp.full((batch, 1), BOS_ID, jnp.int32), body], 1), keep + 1


def prompt_keys(seed: Array, rows: Array) -> Array:
  """A key per row from the seed and the row's tokens (a polynomial hash mod 2**32): the
  same seed and prompt draw the same text, whichever rows are beside it, in predict and in
  a served model alike."""
  powers = jnp.cumprod(jnp.full((rows.shape[1],), 1000003, jnp.uint32))
  hashes = (rows.astype(jnp.uint32) * powers).sum(1)
  base = jax.random.PRNGKey(seed)
  return jax.vmap(lambda h: jax.random.fold_in(base, h))(hashes)


def continue_rows(model: LanguageModel, params: Any, rows: Array, lengths: Array,
                  keys: Array, max_new_tokens: int, temperature: Array, top_k: Array,
                  top_p: Array, use_cache: bool = True) -> Array:
  """rows (B, L): BOS + prompt in the first `lengths` (B,) positions, lengths + max_new_tokens
  <= L. Returns the rows with `max_new_tokens` tokens drawn after each prompt; a row that
  draws EOS stops there (PAD after it)."""
  batch, width = rows.shape
  ends = lengths + max_new_tokens                                      # (B,) exclusive
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


def generate(model: LanguageModel, params: Any, prompts: Array, max_new_tokens: int,
             temperature: Any, top_k: Any, top_p: Any, seed: Any,
             use_cache: bool = True) -> Array:
  """Prompt ids (B, S) (right-padded, no BOS) -> (B, max_new_tokens) continuation ids, PAD
  after an EOS. The context is the model's max_len: a prompt keeps its last
  max_len - max_new_tokens - 1 tokens after BOS. Traceable with symbolic B and S."""
  width = model.config.max_len
  rows, lengths = prompt_rows(prompts, width, width - max_new_tokens)
  keys = prompt_keys(jnp.asarray(seed, jnp.uint32), rows)
  rows = continue_rows(model, params, rows, lengths, keys, max_new_tokens,
                       jnp.asarray(temperature, jnp.float32), jnp.asarray(top_k, jnp.int32),
                       jnp.asarray(top_p, jnp.float32), use_cache)
  return jnp.take_along_axis(rows, lengths[:, None] + jnp.arange(max_new_tokens)[None], 1)


@functools.lru_cache(maxsize=16)
def compiled_generate(config: TransformerConfig, max_new_tokens: int,
                      use_cache: bool = True) -> Callable:
  """jax.jit of (params, prompts, temperature, top_k, top_p, seed) -> continuations."""
  model = LanguageModel(config)

  def run(params: Any, prompts: Array, temperature: Any, top_k: Any, top_p: Any,
          seed: Any) -> Array:
    return generate(model, params, prompts, max_new_tokens, temperature, top_k, top_p, seed,
                    use_cache)
  return jax.jit(run)


def check_room(config: TransformerConfig, max_new_tokens: int) -> None:
  """max_new_tokens must leave the prompt's BOS room in the model's context."""
  if max_new_tokens >= config.max_len:
    raise InputError(f"max_new_tokens={max_new_tokens}: the model's context is "
                     f"max_len={config.max_len} tokens, the prompt's BOS among them; ask for "
                     f"at most {config.max_len - 1}")


def continuations(out: Any) -> list[list[int]]:
  """Each row's continuation ids up to (not including) EOS or PAD."""
  return [strip_special(row) for row in jax.device_get(out)]
