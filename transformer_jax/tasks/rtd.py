"""Replaced-token detection (ELECTRA: Clark et al., "ELECTRA: Pre-training Text Encoders as
Discriminators Rather Than Generators", ICLR 2020): the second self-pretraining objective
beside the masked LM (tasks/mlm.py), on the same records and the same masking.

A generator, a small masked LM (a quarter of the encoder's width, feed-forward width and
heads; the same depth and vocabulary), predicts the chosen positions of the masked text;
a token drawn from its output (a categorical draw, never a special token) takes each
chosen position's place. The encoder, as the discriminator, reads the text so changed and
says of every real token whether it is the original or a replacement. A drawn token equal
to the original counts as original. No gradient flows through the draw: the generator
learns from its masked-LM loss alone.

Loss: the generator's masked-LM loss per chosen position + `model.discriminator_weight`
(lambda, 50 in the paper) x the discriminator's binary cross-entropy per real token. The
train step divides summed statistics by one count, the chosen positions, so the
discriminator's sum enters scaled by `mask_rate` (the expected ratio of chosen to real
tokens): its mean per real token in expectation, and sums that add across devices and
micro-batches.

Shared embeddings (ELECTRA shares them; its narrower generator projects them to its width):
the generator's token table is the discriminator's (V, D) times a learned (D, D/4)
projection, `generator/embedding_projection`, on the way in and, tied, on the way out
(logits h (E P)^T = (h P^T) E^T). Positions are sinusoidal by default (no parameters); with
learned ones each model has its own.

Parameters: the discriminator's encoder and character CNN carry the names of
EncoderClassifier and TokenClassifier (`encoder`, `character_features`), so a fine-tuning
run's init_from takes exactly them; the head (`rtd_transform`, `rtd_output`) and the
generator (`generator`) stay behind. With character features, a replaced word's are the
spelling of the drawn vocabulary entry (digits as the vocabulary keeps them; none for a
word-shape id), so the spelling does not give the replacement away.

Metrics: loss (combined), accuracy and perplexity (the generator's, on the chosen
positions), replaced_accuracy and original_accuracy (the discriminator's, on the replaced
and on the original real tokens), discriminator_loss (per real token).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from transformer_jax.config import PAD_ID, TransformerConfig
from transformer_jax.data.tokenizer import SHAPES
from transformer_jax.data.vocab import SPECIALS
from transformer_jax.errors import UserError
from transformer_jax.inputs import character_ids
from transformer_jax.modules.heads import MaskedLanguageModel, _encode_words
from transformer_jax.options import DecodeOptions
from transformer_jax.sharding import partitioned
from transformer_jax.tasks.base import (
  Batch,
  EvalBatch,
  EvalStep,
  Samples,
  loss_metrics,
  teacher_forced_sums,
)
from transformer_jax.tasks.losses import cross_entropy_sums
from transformer_jax.tasks.mlm import FIRST_MASKABLE, MASK_ID, MaskedLMTask

GENERATOR_SHARE = 4     # the generator's widths: 1/4 of the discriminator's (the paper's best
                        # generators are 1/4 to 1/2 its size)
PROJECTION = "embedding_projection"   # the generator's (D, D/4) view of the shared table
_EVAL_DRAW_KEY = 1      # the one key of every evaluation's draws (the mask has mlm.py's)


def generator_config(config: TransformerConfig) -> TransformerConfig:
  """The generator's architecture: the discriminator's with a quarter of its model and
  feed-forward widths and of its heads (at least one, dividing the width)."""
  width = max(1, config.d_model // GENERATOR_SHARE)
  heads = math.gcd(width, max(1, config.num_heads // GENERATOR_SHARE))
  return config.replace(d_model=width, d_ff=max(1, config.d_ff // GENERATOR_SHARE),
                        num_heads=heads)


def _without_specials(logits: jax.Array) -> jax.Array:
  """The generator's logits (..., V) with the special tokens ruled out: a <pad> put inside
  a text would end it."""
  return jnp.where(jnp.arange(logits.shape[-1]) < FIRST_MASKABLE, -jnp.inf, logits)


def replace_tokens(rng: jax.Array, tokens: jax.Array, logits: jax.Array, at: jax.Array,
                   weights: jax.Array) -> jax.Array:
  """tokens (B, T) with a draw from the generator's `logits` (B, K, V) at the positions
  `at` (B, K) whose `weights` are set; other positions keep their token. The draw never
  yields a special token, and takes no gradient."""
  logits = _without_specials(jax.lax.stop_gradient(logits).astype(jnp.float32))
  drawn = jax.random.categorical(rng, logits).astype(tokens.dtype)            # (B, K)
  drawn = jnp.where(weights > 0, drawn, jnp.take_along_axis(tokens, at, 1))
  return tokens.at[jnp.arange(tokens.shape[0])[:, None], at].set(drawn)


def discriminator_sums(logits: jax.Array, replaced: jax.Array,
                       real: jax.Array) -> dict[str, jax.Array]:
  """Sums over the `real` tokens (B, T) of the discriminator's binary cross-entropy against
  `replaced` (B, T), and its hits (a logit > 0 says "replaced") on the replaced and on the
  original ones, with their counts."""
  real = real.astype(jnp.float32)
  target = replaced.astype(jnp.float32)
  says_replaced = (logits > 0).astype(jnp.float32)
  bce = optax.sigmoid_binary_cross_entropy(logits, target)
  return {"discriminator_loss": (bce * real).sum(), "real": real.sum(),
          "replaced": (target * real).sum(),
          "replaced_correct": (says_replaced * target * real).sum(),
          "original": ((1 - target) * real).sum(),
          "original_correct": ((1 - says_replaced) * (1 - target) * real).sum()}


class Discriminator(nn.Module):
  """The encoder (with its character CNN) and ELECTRA's per-token head: dense, GELU, one
  logit per token (> 0: replaced) -> (B, T) float32."""

  config: TransformerConfig
  char_features: int = 0    # width of the character CNN; 0: words only

  @nn.compact
  def __call__(self, tokens: jax.Array, *, chars: jax.Array | None = None,
               positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
               train: bool = False) -> jax.Array:
    cfg = self.config
    x = _encode_words(self, tokens, chars, positions, segment_ids, train)         # (B, T, D)
    x = nn.gelu(nn.Dense(cfg.d_model, dtype=cfg.compute_dtype, param_dtype=cfg.params_dtype,
                         name="rtd_transform",
                         kernel_init=partitioned(nn.initializers.xavier_uniform(),
                                                 ("embed", "mlp")),
                         bias_init=partitioned(nn.initializers.zeros_init(), ("mlp",)))(x))
    logit = nn.Dense(1, dtype=cfg.compute_dtype, param_dtype=cfg.params_dtype,
                     name="rtd_output",
                     kernel_init=partitioned(nn.initializers.xavier_uniform(), ("mlp", None)),
                     bias_init=partitioned(nn.initializers.zeros_init(), (None,)))(x)
    return logit[..., 0].astype(jnp.float32)


class ReplacedTokenDetectionTask(MaskedLMTask):
  """Records, featurizing, masking and data as the masked LM's (MaskedLMTask)."""

  name = "rtd"
  metric_names = ("loss", "accuracy", "perplexity", "replaced_accuracy", "original_accuracy",
                  "discriminator_loss")
  head_options = {**MaskedLMTask.head_options, "discriminator_weight": 50.0}

  def __init__(self, *args: Any, **kwargs: Any):
    super().__init__(*args, **kwargs)
    self.generator = MaskedLanguageModel(generator_config(self.model_config))
    self.spellings = self._spellings()
    # What predict (mlm.py's) decodes: the line with each token the discriminator judges
    # replaced swapped for the generator's likeliest one there.
    self._argmax = jax.jit(self._corrected)

  @classmethod
  def check_head(cls, head: Mapping[str, Any], tokenizer_kind: str | None) -> None:
    super().check_head(head, tokenizer_kind)
    weight = head["discriminator_weight"]
    if not isinstance(weight, (int, float)) or isinstance(weight, bool) or not weight > 0:
      raise UserError(f"model.discriminator_weight={weight!r}: must be a number > 0")

  def _spellings(self) -> np.ndarray | None:
    """(V, char_max_length): the bytes of each vocabulary entry, which a replaced word's
    character features become; none for the specials and word shapes (no one spelling)."""
    if not self.head["char_features"]:
      return None
    vocab, first_word = self.model_config.vocab_size, len(SPECIALS) + len(SHAPES)
    words = [""] * vocab
    if self.tokenizer is not None:   # without one (a run planned ahead) only shapes matter
      words = [self.tokenizer.decode([i]) if i >= first_word else "" for i in range(vocab)]
    return character_ids(words, self.head["char_max_length"])

  # --------------------------------------------------------------------- model
  def build_model(self, model_config: TransformerConfig) -> Discriminator:
    return Discriminator(model_config, char_features=self.head["char_features"])

  def init_params(self, rng: jax.Array) -> Any:
    """The discriminator's parameters plus `generator`: the small masked LM's, without a
    token table of its own (it reads the discriminator's through PROJECTION)."""
    rng, generator_rng, projection_rng = jax.random.split(rng, 3)
    generator = dict(self.generator.init(generator_rng, jnp.ones((1, 4), jnp.int32))["params"])
    generator["encoder"] = {k: v for k, v in generator["encoder"].items() if k != "embedding"}
    width = self.generator.config.d_model
    # Rows of the projected table start at the scale of a table made at the generator's width.
    generator[PROJECTION] = partitioned(nn.initializers.normal(stddev=width ** -0.5),
                                        ("embed", None))(
        projection_rng, (self.model_config.d_model, width), self.model_config.params_dtype)
    return {**super().init_params(rng), "generator": generator}

  def generator_logits(self, params: Any, masked: Batch, rng: jax.Array | None,
                       train: bool) -> jax.Array:
    """The generator's logits (B, K, V) at masked["predict_at"] (all positions, (B, T, V),
    without it), its token table the discriminator's projected to its width."""
    generator = dict(params["generator"])
    table = nn.meta.unbox(params["encoder"]["embedding"]["embedding"])             # (V, D)
    table = table @ nn.meta.unbox(generator.pop(PROJECTION))                       # (V, D/4)
    generator["encoder"] = {**generator["encoder"], "embedding": {"embedding": table}}
    return self.generator.apply({"params": generator}, masked["tokens"],
                                positions=masked["positions"],
                                segment_ids=masked["segment_ids"],
                                predict_at=masked.get("predict_at"), train=train,
                                rngs={"dropout": rng} if train else {})

  def replaced_batch(self, batch: Batch, changed: jax.Array) -> tuple[Batch, jax.Array]:
    """The discriminator's input: the batch with the tokens `changed` (B, T) (a replaced
    word spelled as its vocabulary entry); and its labels, the tokens that differ from
    the original (B, T)."""
    replaced = changed != batch["tokens"]
    out = {**batch, "tokens": changed}
    if self.spellings is not None:
      spelled = jnp.take(jnp.asarray(self.spellings), changed, axis=0)
      out["chars"] = jnp.where(replaced[..., None], spelled, batch["chars"])
    return out, replaced

  def generate(self, params: Any, batch: Batch, masked: Batch, weights: jax.Array,
               draw_rng: jax.Array, rng: jax.Array | None,
               train: bool) -> tuple[jax.Array, jax.Array]:
    """The generator's logits (B, K, V) at the chosen positions of `masked` (the batch with
    them masked; `weights` (B, K) marks the real ones), and the batch's tokens (B, T) with
    a draw from them there."""
    logits = self.generator_logits(params, masked, rng, train)
    return logits, replace_tokens(draw_rng, batch["tokens"], logits, masked["predict_at"],
                                  weights)

  def judge(self, params: Any, batch: Batch, changed: jax.Array, rng: jax.Array | None,
            train: bool) -> tuple[jax.Array, jax.Array]:
    """The discriminator's logits (B, T) on the batch with the tokens `changed` (B, T), and
    its labels, the tokens that differ from the original (B, T)."""
    inputs, replaced = self.replaced_batch(batch, changed)
    return self.logits(params, inputs, rng, train), replaced

  def loss_sums(self, params: Any, batch: Batch, rng: jax.Array | None,
                train: bool) -> dict[str, jax.Array]:
    masked, weights, rng = self.masked_inputs(batch, rng, train)
    if train:
      draw_rng, generator_rng, discriminator_rng = jax.random.split(rng, 3)
    else:
      draw_rng, generator_rng, discriminator_rng = jax.random.PRNGKey(_EVAL_DRAW_KEY), None, None
    logits, changed = self.generate(params, batch, masked, weights, draw_rng, generator_rng,
                                    train)                                        # (B, K, V)
    original = jnp.take_along_axis(batch["tokens"], masked["predict_at"], 1)         # (B, K)
    sums = cross_entropy_sums(logits, original, self.label_smoothing if train else 0.0,
                              weights=weights)
    judged = discriminator_sums(*self.judge(params, batch, changed, discriminator_rng, train),
                                batch["tokens"] != PAD_ID)
    weight = self.head["discriminator_weight"] * self.head["mask_rate"]
    return {**sums, **judged, "loss": sums["loss"] + weight * judged["discriminator_loss"]}

  def _extra_inputs(self, batch: Mapping[str, Any]) -> dict[str, Any]:
    return {}     # the discriminator scores every position

  def _corrected(self, params: Any, batch: Batch) -> jax.Array:
    """The tokens (B, T) with each one the discriminator judges replaced swapped for the
    generator's likeliest token there, given the text with those positions masked."""
    tokens = batch["tokens"]
    flagged = (self.logits(params, batch, None, False) > 0) & (tokens >= FIRST_MASKABLE)
    masked = {**batch, "tokens": jnp.where(flagged, MASK_ID, tokens)}
    best = jnp.argmax(_without_specials(self.generator_logits(params, masked, None, False)), -1)
    return jnp.where(flagged, best.astype(tokens.dtype), tokens)

  def serving_function(self, decode: DecodeOptions) -> Callable[..., jax.Array]:
    def corrected(params: Any, tokens: jax.Array, chars: jax.Array | None = None) -> jax.Array:
      batch = self._serving_batch(tokens)
      if chars is not None:
        batch["chars"] = chars
      return self._corrected(params, batch).astype(jnp.int32)
    return corrected

  # ---------------------------------------------------------------- evaluation
  def evaluate(self, params: Any, batches: Sequence[EvalBatch], eval_step: EvalStep,
               decode: DecodeOptions) -> tuple[dict[str, float], Samples]:
    """The generator's loss, accuracy and perplexity over the chosen positions (the loss
    combined), the discriminator's accuracy on replaced and on original tokens and its
    loss per real token; no samples."""
    totals = teacher_forced_sums(eval_step, params, batches)
    share = lambda part, whole: totals.get(part, 0.0) / max(totals.get(whole, 0.0), 1.0)
    return {**loss_metrics(totals),
            "replaced_accuracy": share("replaced_correct", "replaced"),
            "original_accuracy": share("original_correct", "original"),
            "discriminator_loss": share("discriminator_loss", "real")}, []
