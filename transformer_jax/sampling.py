"""A language model's continuations of its prompts, token by token through the KV cache:
greedy (temperature 0) or sampled, with top-k and top-p (nucleus) cuts. `generate` is what
predict runs and what a served model exports.

Rows are (B, P + max_new_tokens) buffers: the prompt as the model's tokenizer encodes it
(`data.tokenizer.prompt_ids`: BOS first where its texts start with one), then room for the
continuation, padded with PAD; P is the longest prompt kept. The KV cache is as long. The
prompts go through the model at once (prefill: one pass over P positions, which fills the
cache and gives each row's first token); then each step feeds every row the token it drew
last, at that row's own position, and draws the next. Row b draws with a key of the seed and
its own tokens, folded with the position, so its text does not depend on the rows beside it.
With `use_cache=False` each step runs the whole model over the buffer and reads each row's
position: the same outputs, recomputing the prefix (what the cache must equal; a test
checks it).

A served model streams with `prefill` and `step` instead (serving/streaming.py): rows of a
decoding batch that join and leave at any step, each at its own position, each drawing as
`generate` draws for its prompt and seed.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, cast

import jax
import jax.numpy as jnp

from transformer_jax.config import BOS_ID, EOS_ID, PAD_ID, UNK_ID, TransformerConfig
from transformer_jax.data.vocab import strip_special
from transformer_jax.inputs import InputError
from transformer_jax.modules.models import LanguageModel

Array = jax.Array


def banned_ids(config: TransformerConfig) -> tuple[int, ...]:
  """The ids never drawn: PAD, which ends nothing, and the ids the vocabulary has no token
  for. A vocabulary of this project's own never draws BOS (it only starts a text) nor UNK
  (a character outside it: no text) either; an imported one (its absent ids given) draws
  every token it has, its BOS and UNK tokens too, as its source's `generate` does."""
  if config.no_token_ids:
    return tuple(sorted({PAD_ID, *config.no_token_ids}))
  return (PAD_ID, BOS_ID, UNK_ID)


def _without(logits: Array, banned: tuple[int, ...]) -> Array:
  """Logits (..., V) with the `banned` ids at -inf: a select against a (V,) mask, which XLA
  fuses into what reads the logits (a scatter into them would copy a scoring call's)."""
  allowed = jnp.ones((logits.shape[-1],), bool).at[jnp.array(banned)].set(False)
  return jnp.where(allowed, logits, -jnp.inf)


def _per_row(value: Any, rows: int) -> Array:
  """A setting given once or per row (B,) as a (B, 1) column."""
  return jnp.broadcast_to(jnp.asarray(value), (rows,))[:, None]


CANDIDATES = 256   # the likeliest tokens a top-k or top-p cut is looked for among first


def filtered_logits(logits: Array, temperature: Any, top_k: Any, top_p: Any,
                    candidates: int = CANDIDATES) -> Array:
  """(B, V) float32 logits (the absent ids already -inf) / temperature, with every token
  outside the `top_k` most likely (0: no cut) and outside the smallest set whose probability
  reaches `top_p` (1: no cut) set to -inf. Each setting is one value or one per row (B,).
  The cuts are thresholds on the logits in descending order, so k and p are values, not
  shapes: one compiled program serves every setting. The order is taken only where a row
  asks for a cut, and of the `candidates` likeliest tokens only (`lax.top_k`) where every
  row's cut lies among them; else of the whole vocabulary: on a CPU, sorting GPT-2's
  50,257 tokens for 16 rows takes 142 ms, the top 256 2.6 ms. A row's cut is the same
  either way."""
  rows, vocab = logits.shape
  temperature, top_k, top_p = (_per_row(x, rows) for x in (temperature, top_k, top_p))
  logits = logits / temperature
  candidates = min(candidates, vocab)

  def threshold(ordered: Array, total: Array) -> Array:
    """The least logit kept, from the likeliest logits in descending order (B, C) and the
    log of the whole vocabulary's exp-sum (B, 1)."""
    at_k = jnp.clip(top_k, 1, ordered.shape[1]) - 1
    kth = jnp.where(top_k > 0, jnp.take_along_axis(ordered, at_k, axis=-1), -jnp.inf)
    probabilities = jnp.exp(ordered - total)
    # A token is kept while the probability of the tokens before it is below top_p.
    before = jnp.cumsum(probabilities, axis=-1) - probabilities
    nucleus = jnp.where(before < top_p, ordered, jnp.inf).min(-1, keepdims=True)
    return jnp.maximum(kth, jnp.where(top_p < 1, nucleus, -jnp.inf))

  def cut(logits: Array) -> Array:
    total = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    likeliest = jax.lax.top_k(logits, candidates)[0]
    mass = jnp.exp(likeliest - total).sum(-1, keepdims=True)
    # The cut is among the candidates: a k within them (the nucleus cannot cut above it),
    # a nucleus their probability reaches (k cannot cut above it either), or no cut.
    within = (((top_k > 0) & (top_k <= candidates)) | ((top_p < 1) & (mass >= top_p))
              | ((top_k == 0) & (top_p >= 1)))

    def from_all() -> Array:
      ordered = jnp.sort(logits, axis=-1)[:, ::-1]
      # A row whose cut lies among its candidates takes it from them here too, so that its
      # cut is the same bits whichever rows are beside it.
      return jnp.where(within, threshold(ordered[:, :candidates], total),
                       threshold(ordered, total))
    least = jax.lax.cond(jnp.all(within), lambda: threshold(likeliest, total), from_all)
    return jnp.where(logits >= least, logits, -jnp.inf)
  return jax.lax.cond(jnp.any((top_k > 0) | (top_p < 1)), cut, lambda x: x, logits)


def _draw(logits: Array, keys: Array, position: Any, temperature: Any, top_k: Any,
          top_p: Any, banned: tuple[int, ...]) -> Array:
  """(B, V) logits -> (B,) tokens: the argmax at temperature 0, else a draw per row with its
  key folded with `position`, the position drawn. Settings and position: one value or one
  per row (B,). Rows draw only where one samples: a draw's random numbers, one per token
  of the vocabulary, cost as much as a small model's step (benchmarks/RESULTS.md, "Serving
  a language model")."""
  rows = logits.shape[0]
  logits = _without(logits, banned)
  greedy = jnp.argmax(logits, -1).astype(jnp.int32)
  temperature = _per_row(temperature, rows)[:, 0]

  def sampled(logits: Array) -> Array:
    cut = filtered_logits(logits, jnp.where(temperature > 0, temperature, 1.0), top_k, top_p)
    step_keys = jax.vmap(jax.random.fold_in)(keys, _per_row(position, rows)[:, 0])
    drawn = jax.vmap(jax.random.categorical)(step_keys, cut)
    return jnp.where(temperature > 0, drawn, greedy).astype(jnp.int32)
  return jax.lax.cond(jnp.any(temperature > 0), sampled, lambda _: greedy, logits)


def _empty_cache(model: LanguageModel, params: Any, rows: Array) -> Any:
  """The KV cache of (B, L) rows, empty (made by the model's first decode call, whose
  output nothing reads)."""
  _, variables = model.apply({"params": params}, jnp.zeros_like(rows), decode=True,
                             mutable=["cache"])
  return variables["cache"]


def _prefill_logits(model: LanguageModel, params: Any, cache: Any, rows: Array,
                    lengths: Array) -> tuple[Any, Array]:
  """Prompts (B, P), each in its first `lengths` (B,) positions, through the model at once,
  their keys and values written into `cache` at positions 0 .. P - 1: the cache, and the
  logits (B, V) after each prompt's last token, which its first new token is drawn from."""
  positions = jnp.broadcast_to(jnp.arange(rows.shape[1], dtype=jnp.int32), rows.shape)
  hidden, variables = model.apply({"params": params, "cache": cache}, rows,
                                  positions=positions, decode=True, return_hidden=True,
                                  mutable=["cache"])
  last = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]    # (B, D)
  return variables["cache"], cast(Array, model.apply({"params": params}, last,
                                                     method=LanguageModel.output_logits))


def prompt_rows(prompts: Array, width: int, context: int | Array) -> tuple[Array, Array]:
  """Prompt ids (B, S), right-padded with PAD, as `prompt_ids` encodes them -> rows
  (B, width) of each prompt, one longer than `context` cut to its last ids after its BOS (as
  `data.tokenizer.prompt_tail` cuts one), an empty one BOS alone; and their lengths (B,).
  Static shapes whatever S is (an exported function has a symbolic S)."""
  batch = prompts.shape[0]
  prompts = prompts.astype(jnp.int32)
  count = (prompts != PAD_ID).sum(1).astype(jnp.int32)
  keep = jnp.minimum(count, context)
  head = (prompts[:, :1] == BOS_ID).astype(jnp.int32)                  # (B, 1) BOS kept
  padded = jnp.concatenate([prompts, jnp.zeros((batch, width), jnp.int32)], 1)
  slots = jnp.arange(width)[None]
  taken = jnp.where(slots < head, slots, (count - keep)[:, None] + slots)
  rows = jnp.where(slots < keep[:, None], jnp.take_along_axis(padded, taken, axis=1), PAD_ID)
  rows = rows.at[:, 0].set(jnp.where(count > 0, rows[:, 0], BOS_ID))
  return rows, jnp.maximum(keep, 1)


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
  """rows (B, P + max_new_tokens): each prompt in its first `lengths` (B,) <= P positions.
  Returns the (B, max_new_tokens) tokens drawn after each prompt; a row that draws EOS (or
  another of the config's end_ids) stops there (PAD after it), and the loop ends once every row has. The prompts go through
  the model at once, filling the cache (prefill); then each `step` feeds every row its last
  token at its own position. Without the cache each step runs the whole model over the rows
  (what the cache must equal)."""
  batch, width = rows.shape
  settings = (temperature, top_k, top_p)
  if use_cache:
    cache, logits = _prefill_logits(model, params, _empty_cache(model, params, rows),
                                    rows[:, :width - max_new_tokens], lengths)
  else:
    cache, logits = None, _logits_at(cast(Array, model.apply({"params": params}, rows)),
                                     lengths - 1)
  first = _draw(logits, keys, lengths, *settings, banned_ids(model.config))

  def body(state: tuple) -> tuple:
    k, cache, rows, token, finished, out = state
    at = lengths + k - 1                            # (B,) where `token`, drawn last, goes
    if use_cache:
      cache, drawn, _ = step(model, params, cache, token, at, keys, *settings)
    else:
      rows = rows.at[jnp.arange(batch), at].set(token)
      drawn = _draw(_logits_at(cast(Array, model.apply({"params": params}, rows)), at), keys,
                    at + 1, *settings, banned_ids(model.config))
    drawn = jnp.where(finished, PAD_ID, drawn)
    return (k + 1, cache, rows, drawn, finished | ends_text(drawn, model.config),
            out.at[:, k].set(drawn))

  out = jnp.full((batch, max_new_tokens), PAD_ID, jnp.int32).at[:, 0].set(first)
  state = (jnp.array(1), cache, rows, first, ends_text(first, model.config), out)
  return jax.lax.while_loop(lambda s: (s[0] < max_new_tokens) & ~s[4].all(), body, state)[5]


def ends_text(tokens: Array, config: TransformerConfig) -> Array:
  """Whether each token ends its text: EOS, or one of the config's end_ids."""
  return jnp.isin(tokens, jnp.array((EOS_ID, *config.end_ids), jnp.int32))


def _logits_at(logits: Array, positions: Array) -> Array:
  """(B, L, V) logits -> (B, V): each row's at its position (B,)."""
  return jnp.take_along_axis(logits, positions[:, None, None], axis=1)[:, 0]


def generate(model: LanguageModel, params: Any, prompts: Array, max_new_tokens: int,
             temperature: Any, top_k: Any, top_p: Any, seed: Any,
             use_cache: bool = True) -> Array:
  """Prompt ids (B, S) (right-padded, as `prompt_ids` encodes them) -> (B, max_new_tokens)
  continuation ids, PAD after an EOS. The context is the model's max_len: a prompt keeps its
  last max_len - max_new_tokens ids (after its BOS). Traceable with symbolic B and S."""
  context = model.config.max_len - max_new_tokens
  width = prompts.shape[1]
  if isinstance(width, int):   # the longest prompt kept (an exported function's S is symbolic)
    width = max(1, min(width, context))
  rows, lengths = prompt_rows(prompts, width + max_new_tokens, context)
  keys = prompt_keys(jnp.asarray(seed, jnp.uint32), rows)
  return continue_rows(model, params, rows, lengths, keys, max_new_tokens,
                       jnp.asarray(temperature, jnp.float32), jnp.asarray(top_k, jnp.int32),
                       jnp.asarray(top_p, jnp.float32), use_cache)


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


# ------------------------------------------------------------------- log-probabilities
TOP_LOGPROBS = 5   # the likeliest tokens a position reports at most (OpenAI's legacy limit)
Reported = tuple[Array, Array, Array]   # a token's log-probability, the top ids, their values


def _log_softmax(logits: Array, banned: tuple[int, ...]) -> Array:
  """The model's log-probabilities over the tokens it may draw: before temperature and any
  cut, as vLLM reports them; the ids without a token excluded, as transformers' model,
  which has no rows for them, excludes them."""
  logits = _without(logits.astype(jnp.float32), banned)
  return jax.nn.log_softmax(logits, axis=-1)


def reported(logits: Array, tokens: Array, wanted: Array,
             banned: tuple[int, ...]) -> Reported:
  """(B, V) logits and the tokens drawn from them (B,) -> each token's log-probability (B,)
  and the TOP_LOGPROBS likeliest ids and their log-probabilities (B, TOP_LOGPROBS); zeros
  unless some row is `wanted` (B,): a step where no row asks skips the vocabulary's top-k."""
  rows = logits.shape[0]

  def compute(logits: Array) -> Reported:
    log_probs = _log_softmax(logits, banned)
    values, ids = jax.lax.top_k(log_probs, TOP_LOGPROBS)
    return (jnp.take_along_axis(log_probs, tokens[:, None], axis=-1)[:, 0],
            ids.astype(jnp.int32), values)

  def nothing(logits: Array) -> Reported:
    return (jnp.zeros((rows,), jnp.float32), jnp.zeros((rows, TOP_LOGPROBS), jnp.int32),
            jnp.zeros((rows, TOP_LOGPROBS), jnp.float32))
  return jax.lax.cond(jnp.any(wanted), compute, nothing, logits)


def score(model: LanguageModel, params: Any, rows: Array, logprobs: Array) -> Reported:
  """Texts (R, S) of token ids, right-padded with PAD, through the model at once: each
  token's log-probability given the tokens before it (R, S; the first token's 0: nothing
  comes before it), and after each position the likeliest next ids and their
  log-probabilities (R, S, TOP_LOGPROBS): position t's predict token t + 1. What a served
  model answers an echoed prompt's logprobs with, as transformers' logits give them. Only
  the likeliest one is looked for (an argmax; the others' values -inf) unless a row's
  `logprobs` (R,) asks for more: a top-k over the vocabulary at every position costs as
  much as the log-softmax itself (GPT-2's, 1,024 positions on a CPU: 400 ms)."""
  logits = cast(Array, model.apply({"params": params}, rows)).astype(jnp.float32)
  logits = _without(logits, banned_ids(model.config))
  total = jax.nn.logsumexp(logits, axis=-1)           # (R, S)
  batch, width = rows.shape
  positions = jnp.arange(width)[None]
  before = jnp.maximum(positions - 1, 0)       # token t's distribution: after token t - 1
  chosen = logits[jnp.arange(batch)[:, None], before, rows] - total[:, before[0]]

  def likeliest() -> tuple[Array, Array]:
    values, ids = jax.lax.top_k(logits, TOP_LOGPROBS)
    return ids.astype(jnp.int32), values

  def likeliest_one() -> tuple[Array, Array]:
    ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)[..., None]
    values = jnp.take_along_axis(logits, ids, axis=-1)
    rest = (*ids.shape[:-1], TOP_LOGPROBS - 1)
    return (jnp.concatenate([ids, jnp.zeros(rest, jnp.int32)], -1),
            jnp.concatenate([values, jnp.full(rest, -jnp.inf)], -1))
  ids, values = jax.lax.cond(jnp.any(logprobs > 1), likeliest, likeliest_one)
  return (jnp.where(positions > 0, chosen, 0.0), ids,
          values - total[..., None])


# -------------------------------------------------------------- a served decoding batch
def prefill(model: LanguageModel, params: Any, prompts: Array, max_new_tokens: Array,
            seeds: Array, choices: Array, temperature: Array, top_k: Array,
            top_p: Array, logprobs: Array) -> tuple[Any, Array, Array, Array, Reported]:
  """New rows of a served model's decoding batch (serving/streaming.py), started as
  `generate` starts its rows: prompts (R, S) as `prompt_ids` encodes them, right-padded,
  each cut to the context its max_new_tokens (R,) leave -> each row's cache over its S
  positions, its first token, its length (where that token goes) and its key, of its seed
  (R,) and its prompt: a served choice draws what predict draws at the same seed. Choice
  c > 0 of a prompt (a request's n) folds c into its key. Settings: one per row (R,); and
  the first token's `Reported` log-probabilities where a row asks for them (logprobs > 0)."""
  width = prompts.shape[1]
  rows, lengths = prompt_rows(prompts, width, model.config.max_len - max_new_tokens)
  keys = jax.vmap(lambda seed, row: prompt_keys(seed, row[None])[0])(
      seeds.astype(jnp.uint32), rows)
  keys = jnp.where((choices > 0)[:, None], jax.vmap(jax.random.fold_in)(keys, choices), keys)
  cache, logits = _prefill_logits(model, params, _empty_cache(model, params, rows), rows,
                                  lengths)
  banned = banned_ids(model.config)
  first = _draw(logits, keys, lengths, temperature, top_k, top_p, banned)
  return cache, first, lengths, keys, reported(logits, first, logprobs > 0, banned)


def step(model: LanguageModel, params: Any, cache: Any, tokens: Array, positions: Array,
         keys: Array, temperature: Array, top_k: Array, top_p: Array,
         logprobs: Array | None = None) -> tuple[Any, Array, Reported]:
  """One step of a served decoding batch: each row feeds its last token (B,) at its own
  position (B,) and draws the next with its key folded with that token's position, as
  `generate` draws it. Settings: one per row (B,); and the drawn tokens' `Reported`
  log-probabilities where a row asks for them (logprobs > 0)."""
  logits, variables = model.apply({"params": params, "cache": cache}, tokens[:, None],
                                  positions=positions[:, None], decode=True,
                                  mutable=["cache"])
  banned = banned_ids(model.config)
  drawn = _draw(logits[:, 0], keys, positions + 1, temperature, top_k, top_p, banned)
  wanted = jnp.zeros_like(tokens, bool) if logprobs is None else logprobs > 0
  return variables["cache"], drawn, reported(logits[:, 0], drawn, wanted, banned)




def check_room(config: TransformerConfig, max_new_tokens: int) -> None:
  """max_new_tokens must leave a prompt's first token (BOS) room in the model's context."""
  if max_new_tokens >= config.max_len:
    raise InputError(f"max_new_tokens={max_new_tokens}: the model's context is "
                     f"max_len={config.max_len} tokens, the prompt's first among them; ask "
                     f"for at most {config.max_len - 1}")


def continuations(out: Any, end_ids: tuple[int, ...] = ()) -> list[list[int]]:
  """Each row's continuation ids up to (not including) EOS, PAD or one of `end_ids` (the
  config's further end tokens)."""
  return [strip_special(row, end_ids) for row in jax.device_get(out)]
