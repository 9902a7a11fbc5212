"""MarianMT's names for our model: its config.json, its vocabulary ids and its state_dict.

Pure tables and array re-orderings; reading and writing the save_pretrained directory is
`marian_files`. The ids (this project fixes PAD 0, BOS 1, EOS 2, UNK 3):

  ours     PAD 0         BOS 1                           EOS 2   UNK 3   4, 5, ..., N-1
  OPUS-MT  (no such id)  <pad> V-1 = decoder start       </s> 0  <unk> 1  2, 3, ..., V-2

Marian starts decoding with its pad token, which is our BOS. Marian has no id that is only
padding, so an import adds one row: a zero embedding with final_logits_bias PAD_LOGIT_BIAS
(N = V + 1). An export drops that row again and writes OPUS-MT's own layout, whatever the
model's origin, so that CTranslate2 and MarianTokenizer read it as they read OPUS-MT; what
Marian's config cannot say (the PAD row among it) goes into config.json under MARKER, so that
ours -> HF -> ours gives back the same parameters and config. A model with the paper's
interleaved sinusoids exports exactly too: permuting the model dimensions (every "embed"
axis) turns it into the same function with Marian's layout.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from transformer_jax import trees
from transformer_jax.config import BOS_ID, EOS_ID, PAD_ID, UNK_ID, TransformerConfig
from transformer_jax.convert.hf import (
  ACTIVATIONS,
  activation_from_hf,
  check_options,
  mismatch,
  our_config,
)
from transformer_jax.convert.tensors import (
  ConvertError,
  check_shape,
  expected_shapes,
  layer_tensors,
  permute_embed_axes,
)
from transformer_jax.data.hf_tokenizer import special_piece
from transformer_jax.data.tokenizer import MarianSentencePiece, SentencePieceTokenizer
from transformer_jax.modules.embedding import interleaved_to_halves, sinusoidal_table

# The logit bias of the PAD row an import adds: exp(-30) < 1e-13, so log-probabilities over
# Marian's tokens are unchanged to float32 precision, while label smoothing (which puts a
# little mass on every id) still sees a finite loss.
PAD_LOGIT_BIAS = -30.0
JAX_PAD_PIECE = "<jax_pad>"        # our PAD row's piece in an import's vocabulary
MARKER = "transformer_jax"         # config.json key of what Marian's config cannot say
MARIAN_EPSILON = 1e-5              # MarianMT's LayerNorms use torch's default epsilon
# Options of older Marian configs that the model class ignores but that would describe
# another architecture if set; refused rather than silently dropped.
_MUST_BE = {"normalize_before": False, "add_final_layer_norm": False,
            "normalize_embedding": False, "static_position_embeddings": True,
            "add_bias_logits": False, "scale_embedding": True,
            "share_encoder_decoder_embeddings": True, "tie_word_embeddings": True,
            "is_encoder_decoder": True}
EMBEDDING_KEYS = ("model.shared.weight", "model.encoder.embed_tokens.weight",
                  "model.decoder.embed_tokens.weight", "lm_head.weight")


# ------------------------------------------------------------------------- config
def config_from_hf(hf: dict, source: str) -> TransformerConfig:
  """Our config for a Marian config.json; refuses, naming it, an option we lack."""
  marker = hf.get(MARKER, {})
  if hf.get("model_type") != "marian":
    raise ConvertError(f"{source}: model_type={hf.get('model_type')!r}; only 'marian' converts")
  check_options(hf, _MUST_BE, source)
  for ours, enc, dec in (("num_heads", "encoder_attention_heads", "decoder_attention_heads"),
                         ("d_ff", "encoder_ffn_dim", "decoder_ffn_dim")):
    if hf.get(enc) != hf.get(dec):
      raise ConvertError(f"{source}: {enc}={hf.get(enc)} differs from {dec}={hf.get(dec)}; "
                         f"this project has one {ours} for both stacks")
  if hf.get("decoder_vocab_size") not in (None, hf.get("vocab_size")):
    raise ConvertError(f"{source}: decoder_vocab_size={hf['decoder_vocab_size']} differs from "
                       f"vocab_size={hf.get('vocab_size')}: separate vocabularies do not convert")
  activation = activation_from_hf(hf.get("activation_function", "gelu"), source)
  return our_config(source, lambda: dict(
      vocab_size=int(hf["vocab_size"]) + (0 if "pad_token_id" in marker else 1),
      d_model=hf["d_model"], num_heads=hf["encoder_attention_heads"],
      d_ff=hf["encoder_ffn_dim"], num_encoder_layers=hf["encoder_layers"],
      num_decoder_layers=hf["decoder_layers"], dropout_rate=float(hf.get("dropout", 0.1)),
      attention_dropout_rate=float(hf.get("attention_dropout", 0.0)),
      activation_dropout_rate=float(hf.get("activation_dropout", 0.0)),
      max_len=hf["max_position_embeddings"],
      activation=marker.get("activation", activation),
      sinusoidal_layout=marker.get("sinusoidal_layout", "halves"),
      final_logits_bias=marker.get("final_logits_bias", True),
      layer_norm_epsilon=marker.get("layer_norm_epsilon", MARIAN_EPSILON),
      zero_decoder_start=bool(marker.get("zero_decoder_start", False))))


def hf_config(cfg: TransformerConfig, pad_row: dict) -> dict:
  """config.json of a MarianMTModel computing our model, in OPUS-MT's id layout; `pad_row`
  (from params_to_state) is kept for the way back."""
  size = cfg.vocab_size - 1          # without our PAD row
  return {
      "architectures": ["MarianMTModel"], "model_type": "marian",
      "vocab_size": size, "decoder_vocab_size": size,
      "d_model": cfg.d_model, "encoder_layers": cfg.num_encoder_layers,
      "decoder_layers": cfg.num_decoder_layers, "encoder_attention_heads": cfg.num_heads,
      "decoder_attention_heads": cfg.num_heads, "encoder_ffn_dim": cfg.d_ff,
      "decoder_ffn_dim": cfg.d_ff, "activation_function": ACTIVATIONS[cfg.activation],
      "dropout": cfg.dropout_rate, "attention_dropout": cfg.attention_dropout_rate,
      "activation_dropout": cfg.activation_dropout_rate,
      "max_position_embeddings": cfg.max_len, "scale_embedding": True,
      "share_encoder_decoder_embeddings": True, "tie_word_embeddings": True,
      "is_encoder_decoder": True, "pad_token_id": size - 1,
      "decoder_start_token_id": size - 1, "eos_token_id": 0, "forced_eos_token_id": None,
      "bos_token_id": None, "encoder_layerdrop": 0.0, "decoder_layerdrop": 0.0,
      "use_cache": True, "dtype": "float32",
      MARKER: {"sinusoidal_layout": cfg.sinusoidal_layout, "activation": cfg.activation,
               "final_logits_bias": cfg.final_logits_bias,
               "zero_decoder_start": cfg.zero_decoder_start,
               "layer_norm_epsilon": cfg.layer_norm_epsilon, **pad_row},
  }


def generation_config(cfg: TransformerConfig, beam_size: int) -> dict:
  """generation_config.json: our decoding's start, end and budget, in OPUS-MT's ids."""
  pad = cfg.vocab_size - 2
  return {"decoder_start_token_id": pad, "eos_token_id": 0, "forced_eos_token_id": None,
          "pad_token_id": pad, "max_length": cfg.max_len, "num_beams": beam_size,
          # Our decoding never emits BOS (Marian's pad): ban it here too.
          "bad_words_ids": [[pad]]}


def tokenizer_config(cfg: TransformerConfig) -> dict:
  return {"tokenizer_class": "MarianTokenizer", "model_max_length": cfg.max_len,
          "separate_vocabs": False, "eos_token": "</s>", "unk_token": "<unk>",
          "pad_token": "<pad>"}


def incompatibility(cfg: TransformerConfig, tokenizer: Any, target_tokenizer: Any) -> str | None:
  """Why Marian cannot express this (translation) model, in one line naming the option;
  None if it can."""
  problem = mismatch(cfg, [("norm_position", "post"), ("positional", "sinusoidal"),
                           ("share_embeddings", True), ("tie_output", True),
                           ("target_vocab_size", None)], "MarianMT")
  if problem:
    return problem
  if cfg.num_decoder_layers == 0:
    return "model.num_decoder_layers=0: MarianMT needs a decoder"
  for side in (tokenizer, target_tokenizer):
    if side.kind not in (SentencePieceTokenizer.kind, MarianSentencePiece.kind):
      return (f"tokenizer kind {side.kind!r}: MarianTokenizer needs SentencePiece models")
  if pieces(tokenizer) != pieces(target_tokenizer):
    return "separate source and target vocabularies: MarianTokenizer here shares one"
  return None


# ------------------------------------------------------------------------- vocabulary
def id_order(hf: dict, vocab: dict[str, int], tokenizer_config: dict,
             source: str) -> tuple[list[int | None], int]:
  """(order, Marian vocabulary size): our id j is Marian's id order[j]; None is the PAD row
  an import adds. See the module doc for the permutation."""
  size = int(hf["vocab_size"])
  ids = {name: vocab.get(special_piece(tokenizer_config, f"{name}_token", default))
         for name, default in (("eos", "</s>"), ("unk", "<unk>"))}
  start, eos, unk = hf.get("decoder_start_token_id"), hf.get("eos_token_id"), ids["unk"]
  for name, value in (("decoder_start_token_id", start), ("eos_token_id", eos),
                      ("the <unk> token", unk)):
    if not isinstance(value, int) or not 0 <= value < size:
      raise ConvertError(f"{source}: {name}={value!r} is not an id of the vocabulary")
  if ids["eos"] != eos:
    raise ConvertError(f"{source}: eos_token_id={eos} but vocab.json has </s> at {ids['eos']}")
  if len({start, eos, unk}) < 3:
    raise ConvertError(f"{source}: decoder start, EOS and UNK ids must differ "
                       f"({start}, {eos}, {unk})")
  pad = hf.get(MARKER, {}).get("pad_token_id")   # set by exports of earlier versions only
  taken = {start, eos, unk, pad}
  return [pad, start, eos, unk] + [i for i in range(size) if i not in taken], size


def opus_mt_order(cfg: TransformerConfig) -> list[int | None]:
  """The id order (as id_order gives it) that an export writes: OPUS-MT's layout."""
  size = cfg.vocab_size - 1
  return [None, size - 1, 0, 1] + list(range(2, size - 1))


def pieces(tokenizer: Any) -> list[str]:
  """The tokenizer's pieces by our id."""
  if isinstance(tokenizer, MarianSentencePiece):
    return list(tokenizer.pieces)
  sp = tokenizer._sp
  return [sp.id_to_piece(i) for i in range(sp.get_piece_size())]


def vocab(tokenizer: Any, order: list[int | None]) -> dict[str, int]:
  """vocab.json: our piece j at Marian id order[j] (PAD has none); the specials named as
  MarianTokenizer expects (our BOS is Marian's pad and decoder start)."""
  names = pieces(tokenizer)
  for i, name in ((BOS_ID, "<pad>"), (EOS_ID, "</s>"), (UNK_ID, "<unk>")):
    names[i] = name
  out = {names[j]: i for j, i in enumerate(order) if i is not None}
  if len(out) != len(names) - 1:
    raise ConvertError("the vocabulary has a piece named like a special token "
                       "(<pad>, </s> or <unk>) or twice")
  return out


# ------------------------------------------------------------------------- tensors
def state_to_params(state: dict[str, np.ndarray], cfg: TransformerConfig,
                    order: list[int | None], source: str, pad_row: dict | None = None) -> dict:
  """Our parameter tree from a MarianMTModel state_dict (ids re-ordered by `order`); the PAD
  row an import adds is `pad_row` (params_to_state's, kept in config.json) or else zero."""
  pad_row = pad_row or {}
  shapes = expected_shapes(cfg)
  size = sum(i is not None for i in order)   # Marian's vocabulary
  params: dict = {}
  used = set()
  for ours, key, to_ours, to_theirs in layer_tensors(cfg, "marian"):
    if key not in state:
      raise ConvertError(f"{source}: missing tensor {key}")
    check_shape(key, state[key], to_theirs(np.zeros(shapes[ours], np.float32)).shape, source)
    trees.set_path(params, ours, to_ours(state[key]))
    used.add(key)

  tables = [k for k in EMBEDDING_KEYS if k in state]
  if not tables:
    raise ConvertError(f"{source}: missing tensor model.shared.weight")
  table = state[tables[0]]
  check_shape(tables[0], table, (size, cfg.d_model), source)
  for other in tables[1:]:
    if not np.array_equal(state[other], table):
      raise ConvertError(f"{source}: {other} differs from {tables[0]}: untied embeddings are "
                         "an option this project lacks")
  bias = state.get("final_logits_bias", np.zeros((1, size), np.float32))
  check_shape("final_logits_bias", bias, (1, size), source)
  pad_embedding = np.asarray(pad_row.get("pad_embedding", np.zeros(cfg.d_model)), np.float32)
  check_shape(f"config.json {MARKER}.pad_embedding", pad_embedding, (cfg.d_model,), source)
  rows = [pad_embedding if i is None else table[i] for i in order]
  trees.set_path(params, "shared_embedding/embedding", np.stack(rows))
  if cfg.final_logits_bias:
    pad_bias = pad_row.get("pad_logit_bias", PAD_LOGIT_BIAS)
    trees.set_path(params, "decoder/final_logits_bias", np.array(
        [pad_bias if i is None else bias[0, i] for i in order], np.float32))
  elif np.any(bias):
    raise ConvertError(f"{source}: final_logits_bias is nonzero but the config says "
                       "final_logits_bias=false")
  used.update(tables + ["final_logits_bias"])

  positions = sinusoidal_table(cfg.max_len, cfg.d_model, "halves")
  for stack in ("encoder", "decoder"):
    key = f"model.{stack}.embed_positions.weight"
    if key in state:   # older save_pretrained files store the (fixed) sinusoids
      used.add(key)
      if state[key].shape != positions.shape or not np.allclose(state[key], positions,
                                                                 atol=1e-5):
        raise ConvertError(f"{source}: {key} are not Marian's sinusoids; learned positions "
                           "do not convert from Marian")
  unexpected = sorted(set(state) - used)
  if unexpected:
    raise ConvertError(f"{source}: unexpected tensor {unexpected[0]} ({len(unexpected)} in "
                       "all): an option this project lacks")
  missing = sorted(set(shapes) - set(trees.flatten(params)))
  if missing:
    raise ConvertError(f"{source}: no tensor for our parameter {missing[0]}")
  if cfg.sinusoidal_layout == "interleaved":   # exported from here: undo the re-laying
    params = permute_embed_axes(params, cfg, np.argsort(interleaved_to_halves(cfg.d_model)))
  return params


def params_to_state(params: dict, cfg: TransformerConfig) -> tuple[dict[str, np.ndarray], dict]:
  """(MarianMTModel's state_dict (numpy) in OPUS-MT's id layout, our PAD row) for our
  unrolled, separate-QKV parameters. The PAD row has no place in Marian's tables:
  {"pad_embedding", "pad_logit_bias"} (JSON lists and floats) go into config.json."""
  if cfg.sinusoidal_layout == "interleaved":
    params = permute_embed_axes(params, cfg, interleaved_to_halves(cfg.d_model))
  state = {key: np.asarray(to_theirs(np.asarray(trees.get_path(params, ours), np.float32)))
           for ours, key, _, to_theirs in layer_tensors(cfg, "marian")}
  table = np.array(trees.get_path(params, "shared_embedding/embedding"), np.float32)
  if cfg.zero_decoder_start:
    # Our decoder reads zeros for BOS (Marian's <pad>, its decoder start), as Marian does;
    # the row only scores <pad> as an output, which Marian's generation never allows.
    table[BOS_ID] = 0.0
  bias = (np.asarray(params["decoder"]["final_logits_bias"], np.float32)
          if cfg.final_logits_bias else np.zeros(cfg.vocab_size, np.float32))
  order = opus_mt_order(cfg)
  ours_of = np.argsort(np.array([-1 if i is None else i for i in order]))[1:]  # Marian id -> ours
  state["model.shared.weight"] = table[ours_of]
  state["final_logits_bias"] = bias[ours_of][None]
  pad_row: dict[str, Any] = {"pad_embedding": [float(x) for x in table[PAD_ID]]}
  if cfg.final_logits_bias:
    pad_row["pad_logit_bias"] = float(bias[PAD_ID])
  return state, pad_row
