"""Checkpoints in and out: Hugging Face MarianMT (OPUS-MT) and torch.nn.Transformer.

  python -m transformer_jax.convert --from=hf_marian --input=DIR --workdir=W [--allow_pickle]
  python -m transformer_jax.convert --to=hf_marian --workdir=W --output=DIR
  python -m transformer_jax.convert --to=torch --workdir=W --output=FILE
  python -m transformer_jax.convert --from=torch --input=FILE --like=MODEL --workdir=W

An import writes a parameters-only export, W/exports/<name>/, in the format of
`python -m transformer_jax.export` (params, run config, tokenizers, manifest), which
`predict`, `attention_maps` and `--eval_only` read. An export writes a `save_pretrained`
directory (model.safetensors, config.json, generation_config.json, source.spm, target.spm,
vocab.json, tokenizer_config.json) that `MarianMTModel` and `MarianTokenizer` load.

MarianMT is the paper's post-LN Transformer with shared, tied embeddings. What differs is
expressed by config fields: sinusoidal_layout="halves" (sin in the first half),
activation="swish", final_logits_bias=True, layer_norm_epsilon=1e-5 (torch's default), and
the special ids, which are permuted (this project fixes PAD 0, BOS 1, EOS 2, UNK 3):

  ours   PAD 0            BOS 1                          EOS 2     UNK 3     4, 5, ...
  Marian (a new row)      pad = decoder_start_token_id   </s>      <unk>     the other ids, in order

Marian starts decoding with its pad token, which is our BOS. Marian has no id that is only
padding, so an import adds one row: a zero embedding with final_logits_bias PAD_LOGIT_BIAS.
An export keeps our ids as they are (PAD stays a row, named JAX_PAD_PIECE) and records in
config.json, under "transformer_jax", what Marian's config cannot say, so that
ours -> HF -> ours gives back the same parameters and config. A model with the paper's
interleaved sinusoids exports exactly too: permuting the model dimensions (every "embed"
axis) turns it into the same function with Marian's layout.

No torch is needed to import from safetensors; `pytorch_model.bin` is unpickled only with
--allow_pickle, and then with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable, Iterator

from absl import app, flags, logging
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax import checkpoint
from transformer_jax.config import BOS_ID, EOS_ID, PAD_ID, UNK_ID, TransformerConfig
from transformer_jax.data.tokenizer import (MarianSentencePiece, SentencePieceTokenizer,
                                            tokenizer_item)
from transformer_jax.modules.embedding import interleaved_to_halves, sinusoidal_table
from transformer_jax.modules.models import Transformer
from transformer_jax import params as param_utils

# The logit bias of the PAD row an import adds: exp(-30) < 1e-13, so log-probabilities over
# Marian's tokens are unchanged to float32 precision, while label smoothing (which puts a
# little mass on every id) still sees a finite loss.
PAD_LOGIT_BIAS = -30.0
JAX_PAD_PIECE = "<jax_pad>"        # vocab.json name of our PAD row in an export
MARKER = "transformer_jax"         # config.json key of what Marian's config cannot say
MARIAN_EPSILON = 1e-5              # MarianMT's LayerNorms use torch's default epsilon
# Ours -> Hugging Face activation names (flax's gelu is the tanh approximation: "gelu_new").
ACTIVATIONS = {"relu": "relu", "gelu": "gelu_new", "swish": "swish", "silu": "silu"}
FROM_HF_ACTIVATION = {"relu": "relu", "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu",
                      "swish": "swish", "silu": "silu"}
# Options of older Marian configs that the model class ignores but that would describe
# another architecture if set; refused rather than silently dropped.
_MUST_BE = {"normalize_before": False, "add_final_layer_norm": False,
            "normalize_embedding": False, "static_position_embeddings": True,
            "add_bias_logits": False, "scale_embedding": True,
            "share_encoder_decoder_embeddings": True, "tie_word_embeddings": True,
            "is_encoder_decoder": True}
_SEP = "/"


class ConvertError(ValueError):
  """Input that cannot be converted; the message names the file, tensor or option."""


# ------------------------------------------------------------------------- tensor naming
def _tree_get(tree: dict, path: str) -> Any:
  for key in path.split(_SEP):
    tree = tree[key]
  return tree


def _tree_set(tree: dict, path: str, value: Any) -> None:
  *parents, leaf = path.split(_SEP)
  for key in parents:
    tree = tree.setdefault(key, {})
  tree[leaf] = value


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
  if not isinstance(tree, dict):
    return {prefix[:-1]: tree}
  out = {}
  for key, value in tree.items():
    out.update(_flat(value, f"{prefix}{key}{_SEP}"))
  return out


# A layer's sublayers: (our name, Marian name, torch.nn.Transformer names per stack).
_SUBLAYERS = {
    "encoder": [("self_attention", "self_attn", "self_attn"),
                ("self_attention_norm", "self_attn_layer_norm", "norm1"),
                ("feed_forward/wi", "fc1", "linear1"), ("feed_forward/wo", "fc2", "linear2"),
                ("feed_forward_norm", "final_layer_norm", "norm2")],
    "decoder": [("self_attention", "self_attn", "self_attn"),
                ("self_attention_norm", "self_attn_layer_norm", "norm1"),
                ("cross_attention", "encoder_attn", "multihead_attn"),
                ("cross_attention_norm", "encoder_attn_layer_norm", "norm2"),
                ("feed_forward/wi", "fc1", "linear1"), ("feed_forward/wo", "fc2", "linear2"),
                ("feed_forward_norm", "final_layer_norm", "norm3")],
}
_QKV = (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj"))


def _sublayer_type(ours: str) -> str:
  return "attention" if ours.endswith("attention") else "norm" if ours.endswith("norm") else "dense"


def _layers(cfg: TransformerConfig) -> Iterator[tuple[str, int, str, str, str]]:
  """(stack, layer index, our sublayer, Marian sublayer, torch sublayer) for every sublayer."""
  for stack, count in (("encoder", cfg.num_encoder_layers), ("decoder", cfg.num_decoder_layers)):
    for i in range(count):
      for ours, marian, torch_name in _SUBLAYERS[stack]:
        yield stack, i, ours, marian, torch_name


# Torch Linear stores (out, in); ours are (in, ...) kernels with head axes split.
def _linear_to_kernel(w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
  return np.ascontiguousarray(w.T).reshape(shape)


def _kernel_to_linear(k: np.ndarray, fan_in: int) -> np.ndarray:
  return np.ascontiguousarray(k.reshape(fan_in, -1).T)


def _layer_tensors(cfg: TransformerConfig, naming: str) -> list[tuple[str, str, Callable,
                                                                       Callable]]:
  """(our path, their key, theirs -> ours, ours -> theirs) for every layer tensor.
  naming "marian": MarianMTModel's state_dict; "torch": torch.nn.Transformer's (fused
  in_proj of query, key and value)."""
  d, n, h = cfg.d_model, cfg.num_heads, cfg.head_dim
  out = []
  for stack, i, ours, marian, torch_name in _layers(cfg):
    mine = f"{stack}/layer_{i}/{ours}"
    theirs = (f"model.{stack}.layers.{i}.{marian}" if naming == "marian"
              else f"transformer.{stack}.layers.{i}.{torch_name}")
    sublayer = _sublayer_type(ours)
    if sublayer == "norm":
      out += [(f"{mine}/scale", f"{theirs}.weight", np.asarray, np.asarray),
              (f"{mine}/bias", f"{theirs}.bias", np.asarray, np.asarray)]
    elif sublayer == "dense":
      out += [(f"{mine}/kernel", f"{theirs}.weight", lambda w: np.ascontiguousarray(w.T),
               lambda k: np.ascontiguousarray(k.T)),
              (f"{mine}/bias", f"{theirs}.bias", np.asarray, np.asarray)]
    else:
      if naming == "marian":
        for q, proj in _QKV:
          out += [(f"{mine}/{q}/kernel", f"{theirs}.{proj}.weight",
                   lambda w: _linear_to_kernel(w, (d, n, h)), lambda k: _kernel_to_linear(k, d)),
                  (f"{mine}/{q}/bias", f"{theirs}.{proj}.bias",
                   lambda b: b.reshape(n, h), lambda b: b.reshape(-1))]
      out += [(f"{mine}/out/kernel", f"{theirs}.out_proj.weight",
               lambda w: _linear_to_kernel(w, (n, h, d)), lambda k: _kernel_to_linear(k, n * h)),
              (f"{mine}/out/bias", f"{theirs}.out_proj.bias", np.asarray, np.asarray)]
  return out


def _check_shape(key: str, value: np.ndarray, shape: tuple[int, ...], source: str) -> None:
  if tuple(value.shape) != tuple(shape):
    raise ConvertError(f"{source}: tensor {key} has shape {tuple(value.shape)}, but the "
                       f"config implies {tuple(shape)} (mismatched shapes)")


def abstract_params(cfg: TransformerConfig) -> Any:
  """The model's parameters as boxed ShapeDtypeStructs (shapes and logical axis names)."""
  dummy = jnp.ones((1, 2), jnp.int32)
  return jax.eval_shape(Transformer(cfg).init, jax.random.PRNGKey(0), dummy, dummy)["params"]


def _expected_shapes(cfg: TransformerConfig) -> dict[str, tuple[int, ...]]:
  unboxed = nn.meta.unbox(abstract_params(cfg))
  return {path: tuple(leaf.shape) for path, leaf in _flat(unboxed).items()}


def permute_embed_axes(params: dict, cfg: TransformerConfig, perm: np.ndarray) -> dict:
  """Re-lays every model-dimension ("embed") axis of `params` by `perm`. LayerNorm,
  attention and the tied output are equivariant to it, so the model computes the same
  function when its positional table is re-laid the same way (interleaved <-> halves)."""
  names = _axis_names(cfg)
  out: dict = {}
  for path, value in _flat(params).items():
    value = np.asarray(value)
    for axis, name in enumerate(names[path]):
      if name == "embed":
        value = np.take(value, perm, axis=axis)
    _tree_set(out, path, value)
  return out


def _axis_names(cfg: TransformerConfig) -> dict[str, tuple[str, ...]]:
  boxed = abstract_params(cfg)
  leaves, _ = jax.tree_util.tree_flatten_with_path(
      boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))
  return {jax.tree_util.keystr(p, simple=True, separator=_SEP): leaf.names
          for p, leaf in leaves}


# ------------------------------------------------------------------------- Marian in
def _read_json(path: str) -> dict:
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except json.JSONDecodeError as e:
    raise ConvertError(f"{path}: not valid JSON ({e})") from None


def _need(directory: str, name: str) -> str:
  path = os.path.join(directory, name)
  if not os.path.isfile(path):
    raise ConvertError(f"{directory}: missing {name} (a MarianMT save_pretrained directory "
                       "has config.json, model.safetensors, source.spm, target.spm, vocab.json)")
  return path


def read_state_dict(path: str, allow_pickle: bool) -> dict[str, np.ndarray]:
  """Tensors of a .safetensors file (numpy, no torch) or, with allow_pickle, of a torch
  pickle read with `torch.load(weights_only=True)`; float32 numpy arrays."""
  if path.endswith(".safetensors"):
    from safetensors.numpy import load_file
    tensors = load_file(path)
  elif not allow_pickle:
    raise ConvertError(f"{path} is a pickle; pass --allow_pickle to read it (with "
                       "torch.load(weights_only=True)), or convert it to safetensors")
  else:
    import torch
    loaded = torch.load(path, map_location="cpu", weights_only=True)
    tensors = {k: v.float().numpy() for k, v in loaded.items()}
  return {k: np.asarray(v, np.float32) for k, v in tensors.items()}


def _special_piece(tokenizer_config: dict, name: str, default: str) -> str:
  value = tokenizer_config.get(name, default)
  return value["content"] if isinstance(value, dict) else value   # AddedToken serialised


def _marian_config(hf: dict, marker: dict, source: str) -> TransformerConfig:
  """Our config for a Marian config.json; refuses, naming it, an option we lack."""
  if hf.get("model_type") != "marian":
    raise ConvertError(f"{source}: model_type={hf.get('model_type')!r}; only 'marian' converts")
  for option, value in _MUST_BE.items():
    if option in hf and hf[option] != value:
      raise ConvertError(f"{source}: {option}={hf[option]!r} is an option this project lacks "
                         f"(only {option}={value!r} converts)")
  for ours, enc, dec in (("num_heads", "encoder_attention_heads", "decoder_attention_heads"),
                         ("d_ff", "encoder_ffn_dim", "decoder_ffn_dim")):
    if hf.get(enc) != hf.get(dec):
      raise ConvertError(f"{source}: {enc}={hf.get(enc)} differs from {dec}={hf.get(dec)}; "
                         f"this project has one {ours} for both stacks")
  if hf.get("decoder_vocab_size") not in (None, hf.get("vocab_size")):
    raise ConvertError(f"{source}: decoder_vocab_size={hf['decoder_vocab_size']} differs from "
                       f"vocab_size={hf.get('vocab_size')}: separate vocabularies do not convert")
  activation = hf.get("activation_function", "gelu")
  if activation not in FROM_HF_ACTIVATION:
    raise ConvertError(f"{source}: activation_function={activation!r} is an option this "
                       f"project lacks (it has {sorted(FROM_HF_ACTIVATION)}; Hugging Face's "
                       "'gelu' is exact, ours the tanh approximation)")
  try:
    return TransformerConfig(
        vocab_size=int(hf["vocab_size"]) + (0 if "pad_token_id" in marker else 1),
        d_model=hf["d_model"], num_heads=hf["encoder_attention_heads"],
        d_ff=hf["encoder_ffn_dim"], num_encoder_layers=hf["encoder_layers"],
        num_decoder_layers=hf["decoder_layers"], dropout_rate=float(hf.get("dropout", 0.1)),
        attention_dropout_rate=float(hf.get("attention_dropout", 0.0)),
        activation_dropout_rate=float(hf.get("activation_dropout", 0.0)),
        max_len=hf["max_position_embeddings"],
        activation=marker.get("activation", FROM_HF_ACTIVATION[activation]),
        sinusoidal_layout=marker.get("sinusoidal_layout", "halves"),
        final_logits_bias=marker.get("final_logits_bias", True),
        layer_norm_epsilon=marker.get("layer_norm_epsilon", MARIAN_EPSILON))
  except KeyError as e:
    raise ConvertError(f"{source}: missing {e.args[0]}") from None
  except ValueError as e:
    raise ConvertError(f"{source}: {e}") from None


def marian_id_order(hf: dict, vocab: dict[str, int], tokenizer_config: dict,
                    source: str) -> tuple[list[int | None], int]:
  """(order, Marian vocabulary size): our id j is Marian's id order[j]; None is the PAD row
  an import adds. See the module doc for the permutation."""
  size = int(hf["vocab_size"])
  ids = {name: vocab.get(_special_piece(tokenizer_config, f"{name}_token", default))
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
  pad = hf.get(MARKER, {}).get("pad_token_id")
  taken = {start, eos, unk, pad}
  return [pad, start, eos, unk] + [i for i in range(size) if i not in taken], size


def import_marian(directory: str, allow_pickle: bool = False) -> tuple[TransformerConfig, dict,
                                                                         dict, Any, Any]:
  """(config, params, run config, source tokenizer, target tokenizer) of a MarianMT
  save_pretrained directory."""
  if not os.path.isdir(directory):
    raise ConvertError(f"--input={directory}: no such directory")
  hf = _read_json(_need(directory, "config.json"))
  marker = hf.get(MARKER, {})
  cfg = _marian_config(hf, marker, os.path.join(directory, "config.json"))
  vocab = _read_json(_need(directory, "vocab.json"))
  tok_config_path = os.path.join(directory, "tokenizer_config.json")
  tok_config = _read_json(tok_config_path) if os.path.isfile(tok_config_path) else {}
  if tok_config.get("separate_vocabs"):
    raise ConvertError(f"{tok_config_path}: separate_vocabs=true does not convert (one "
                       "vocabulary is shared by source and target here)")
  order, size = marian_id_order(hf, vocab, tok_config, directory)
  if len(vocab) != size or sorted(vocab.values()) != list(range(size)):
    raise ConvertError(f"{directory}/vocab.json: {len(vocab)} entries, but config.json has "
                       f"vocab_size={size} (ids must be 0..{size - 1}, each once)")

  weights = os.path.join(directory, "model.safetensors")
  if not os.path.isfile(weights):
    weights = os.path.join(directory, "pytorch_model.bin")
    if not os.path.isfile(weights):
      raise ConvertError(f"{directory}: missing model.safetensors (or pytorch_model.bin)")
  state = read_state_dict(weights, allow_pickle)
  params = marian_state_to_params(state, cfg, order, weights)
  if cfg.sinusoidal_layout == "interleaved":   # exported from here: undo the re-laying
    params = permute_embed_axes(params, cfg, np.argsort(interleaved_to_halves(cfg.d_model)))

  pieces_by_id = {i: piece for piece, i in vocab.items()}
  if JAX_PAD_PIECE in vocab and order[0] is None:
    raise ConvertError(f"{directory}/vocab.json: {JAX_PAD_PIECE} is reserved for the PAD row")
  pieces = [JAX_PAD_PIECE if i is None else pieces_by_id[i] for i in order]
  with open(_need(directory, "source.spm"), "rb") as f:
    source = MarianSentencePiece(f.read(), pieces, append_eos=True)
  with open(_need(directory, "target.spm"), "rb") as f:
    target = MarianSentencePiece(f.read(), pieces, append_eos=False)

  generation = {}
  if os.path.isfile(os.path.join(directory, "generation_config.json")):
    generation = _read_json(os.path.join(directory, "generation_config.json"))
  max_length = min(int(generation.get("max_length") or cfg.max_len), cfg.max_len)
  run_config = {"task": "seq2seq", "model": cfg.to_dict(),
                "decode": {"beam_size": int(generation.get("num_beams") or 4), "alpha": 0.6,
                           # predict allows the batch's target width + this:
                           # at least HF's max_length.
                           "max_extra_length": max_length - 1},
                "converted_from": {"format": "hf_marian", "path": os.path.abspath(directory)}}
  return cfg, params, run_config, source, target


def marian_state_to_params(state: dict[str, np.ndarray], cfg: TransformerConfig,
                           order: list[int | None], source: str) -> dict:
  """Our parameter tree from a MarianMTModel state_dict (ids re-ordered by `order`)."""
  shapes = _expected_shapes(cfg)
  size = sum(i is not None for i in order)   # Marian's vocabulary
  params: dict = {}
  used = set()
  for ours, key, to_ours, to_theirs in _layer_tensors(cfg, "marian"):
    if key not in state:
      raise ConvertError(f"{source}: missing tensor {key}")
    _check_shape(key, state[key], to_theirs(np.zeros(shapes[ours], np.float32)).shape, source)
    _tree_set(params, ours, to_ours(state[key]))
    used.add(key)

  tables = [k for k in ("model.shared.weight", "model.encoder.embed_tokens.weight",
                        "model.decoder.embed_tokens.weight", "lm_head.weight") if k in state]
  if not tables:
    raise ConvertError(f"{source}: missing tensor model.shared.weight")
  table = state[tables[0]]
  _check_shape(tables[0], table, (size, cfg.d_model), source)
  for other in tables[1:]:
    if not np.array_equal(state[other], table):
      raise ConvertError(f"{source}: {other} differs from {tables[0]}: untied embeddings are "
                         "an option this project lacks")
  bias = state.get("final_logits_bias", np.zeros((1, size), np.float32))
  _check_shape("final_logits_bias", bias, (1, size), source)
  rows = [np.zeros(cfg.d_model, np.float32) if i is None else table[i] for i in order]
  _tree_set(params, "shared_embedding/embedding", np.stack(rows))
  if cfg.final_logits_bias:
    _tree_set(params, "decoder/final_logits_bias", np.array(
        [PAD_LOGIT_BIAS if i is None else bias[0, i] for i in order], np.float32))
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
  missing = sorted(set(shapes) - set(_flat(params)))
  if missing:
    raise ConvertError(f"{source}: no tensor for our parameter {missing[0]}")
  return params


# ------------------------------------------------------------------------- Marian out
def marian_incompatibility(cfg: TransformerConfig, run_config: dict, tokenizer: Any,
                           target_tokenizer: Any) -> str | None:
  """Why Marian cannot express this model, in one line naming the option; None if it can."""
  task = run_config.get("task", "seq2seq")
  if task != "seq2seq":
    return f"task={task!r}: MarianMT is a translation (seq2seq) model"
  checks = [("norm_position", "post"), ("positional", "sinusoidal"),
            ("share_embeddings", True), ("tie_output", True), ("target_vocab_size", None)]
  for field, value in checks:
    if getattr(cfg, field) != value:
      return (f"model.{field}={getattr(cfg, field)!r}: MarianMT only has "
              f"{field}={value!r}")
  if cfg.num_decoder_layers == 0:
    return "model.num_decoder_layers=0: MarianMT needs a decoder"
  for side in (tokenizer, target_tokenizer):
    if side.kind not in (SentencePieceTokenizer.kind, MarianSentencePiece.kind):
      return (f"tokenizer kind {side.kind!r}: MarianTokenizer needs SentencePiece models")
  if _pieces(tokenizer) != _pieces(target_tokenizer):
    return "separate source and target vocabularies: MarianTokenizer here shares one"
  return None


def _pieces(tokenizer: Any) -> list[str]:
  if isinstance(tokenizer, MarianSentencePiece):
    return list(tokenizer.pieces)
  sp = tokenizer._sp
  return [sp.id_to_piece(i) for i in range(sp.get_piece_size())]


def _marian_vocab(tokenizer: Any) -> dict[str, int]:
  """vocab.json: our ids as they are; the specials named as MarianTokenizer expects (our
  BOS is Marian's pad and decoder start)."""
  pieces = _pieces(tokenizer)
  for i, name in ((PAD_ID, JAX_PAD_PIECE), (BOS_ID, "<pad>"), (EOS_ID, "</s>"),
                  (UNK_ID, "<unk>")):
    pieces[i] = name
  vocab = {piece: i for i, piece in enumerate(pieces)}
  if len(vocab) != len(pieces):
    raise ConvertError("the vocabulary has a piece named like a special token "
                       f"({JAX_PAD_PIECE}, <pad>, </s> or <unk>)")
  return vocab


def params_to_marian_state(params: dict, cfg: TransformerConfig) -> dict[str, np.ndarray]:
  """MarianMTModel's state_dict (numpy) for our unrolled, separate-QKV parameters."""
  if cfg.sinusoidal_layout == "interleaved":
    params = permute_embed_axes(params, cfg, interleaved_to_halves(cfg.d_model))
  state = {key: np.asarray(to_theirs(np.asarray(_tree_get(params, ours), np.float32)))
           for ours, key, _, to_theirs in _layer_tensors(cfg, "marian")}
  state["model.shared.weight"] = np.asarray(_tree_get(params, "shared_embedding/embedding"),
                                            np.float32)
  bias = (np.asarray(params["decoder"]["final_logits_bias"], np.float32)
          if cfg.final_logits_bias else np.zeros(cfg.vocab_size, np.float32))
  state["final_logits_bias"] = bias[None]
  return state


def load_model(workdir: str | None, checkpoint_path: str | None) -> tuple[
    str, TransformerConfig, dict, checkpoint.Model]:
  """(path, config, unrolled separate-QKV numpy params, model) of the model `predict`
  would use: --checkpoint, or the newest export or checkpoint of the workdir."""
  if checkpoint_path:
    candidates = [checkpoint_path]
    if not os.path.isdir(checkpoint_path):
      raise ConvertError(f"--checkpoint={checkpoint_path}: no such directory")
  else:
    if not workdir or not os.path.isdir(workdir):
      raise ConvertError(f"--workdir={workdir}: no such directory")
    candidates = checkpoint.models(workdir)
    if not candidates:
      raise ConvertError(f"--workdir={workdir}: no checkpoint or export")
  path, (model, params), _ = checkpoint.first_good(
      candidates, lambda p: (checkpoint.read_model(p), checkpoint.restore_params(p)))
  cfg = TransformerConfig.from_dict(model.config["model"])
  params = jax.tree_util.tree_map(np.asarray, params)
  if cfg.scan_layers:
    params = param_utils.unstack_layers(params)
  if cfg.fused_qkv:
    params = param_utils.split_qkv(params)
  cfg = cfg.replace(scan_layers=False, fused_qkv=False)
  return path, cfg, params, model


def export_marian(workdir: str | None, output: str, checkpoint_path: str | None = None) -> str:
  """Writes the model as a MarianMT save_pretrained directory; returns a note for the user
  ("" when the conversion is exact)."""
  if os.path.exists(output) and os.listdir(output):
    raise ConvertError(f"--output={output} exists and is not empty; choose another")
  path, cfg, params, model = load_model(workdir, checkpoint_path)
  tokenizer, target = model.assets.tokenizer, model.assets.target_tokenizer
  problem = marian_incompatibility(cfg, model.config, tokenizer, target)
  if problem:
    raise ConvertError(f"{path}: cannot export to MarianMT: {problem}")
  from safetensors.numpy import save_file

  os.makedirs(output, exist_ok=True)
  save_file(params_to_marian_state(params, cfg), os.path.join(output, "model.safetensors"),
            metadata={"format": "pt"})
  vocab = _marian_vocab(tokenizer)
  hf = {
      "architectures": ["MarianMTModel"], "model_type": "marian",
      "vocab_size": cfg.vocab_size, "decoder_vocab_size": cfg.vocab_size,
      "d_model": cfg.d_model, "encoder_layers": cfg.num_encoder_layers,
      "decoder_layers": cfg.num_decoder_layers, "encoder_attention_heads": cfg.num_heads,
      "decoder_attention_heads": cfg.num_heads, "encoder_ffn_dim": cfg.d_ff,
      "decoder_ffn_dim": cfg.d_ff, "activation_function": ACTIVATIONS[cfg.activation],
      "dropout": cfg.dropout_rate, "attention_dropout": cfg.attention_dropout_rate,
      "activation_dropout": cfg.activation_dropout_rate,
      "max_position_embeddings": cfg.max_len, "scale_embedding": True,
      "share_encoder_decoder_embeddings": True, "tie_word_embeddings": True,
      "is_encoder_decoder": True, "pad_token_id": BOS_ID, "decoder_start_token_id": BOS_ID,
      "eos_token_id": EOS_ID, "forced_eos_token_id": None, "bos_token_id": None,
      "encoder_layerdrop": 0.0, "decoder_layerdrop": 0.0, "use_cache": True,
      "dtype": "float32",
      MARKER: {"pad_token_id": PAD_ID, "sinusoidal_layout": cfg.sinusoidal_layout,
               "activation": cfg.activation, "final_logits_bias": cfg.final_logits_bias,
               "layer_norm_epsilon": cfg.layer_norm_epsilon},
  }
  decode = model.config.get("decode", {})
  generation = {"decoder_start_token_id": BOS_ID, "eos_token_id": EOS_ID,
                "pad_token_id": BOS_ID, "max_length": cfg.max_len,
                "num_beams": int(decode.get("beam_size", 4)),
                # Our decoding never emits PAD or BOS (Marian's pad): ban both here too.
                "bad_words_ids": [[BOS_ID], [PAD_ID]]}
  tokenizer_config = {"tokenizer_class": "MarianTokenizer", "model_max_length": cfg.max_len,
                      "separate_vocabs": False, "eos_token": "</s>", "unk_token": "<unk>",
                      "pad_token": "<pad>"}
  files = {"config.json": hf, "generation_config.json": generation, "vocab.json": vocab,
           "tokenizer_config.json": tokenizer_config}
  for name, content in files.items():
    with open(os.path.join(output, name), "w", encoding="utf-8") as f:
      json.dump(content, f, indent=2, ensure_ascii=False)
  for name, side in (("source.spm", tokenizer), ("target.spm", target)):
    with open(os.path.join(output, name), "wb") as f:
      f.write(side.model_proto)
  if cfg.layer_norm_epsilon != MARIAN_EPSILON:
    return (f"note: layer_norm_epsilon={cfg.layer_norm_epsilon:g} becomes MarianMT's fixed "
            f"{MARIAN_EPSILON:g} in transformers (recorded in config.json for the way back)")
  return ""


# ------------------------------------------------------------------------- torch.nn.Transformer
def torch_state_dict(params: dict, cfg: TransformerConfig) -> dict[str, np.ndarray]:
  """The state_dict of `benchmarks.torch_reference.TorchTransformer` (a batch-first
  torch.nn.Transformer with custom stacks, under "transformer.", and one shared token
  embedding "embedding.weight"; learned positions "positions.{encoder,decoder}") holding
  our unrolled, separate-QKV parameters of a shared, tied model."""
  _check_torch_expressible(cfg)
  state = {key: to_theirs(np.asarray(_tree_get(params, ours), np.float32))
           for ours, key, _, to_theirs in _layer_tensors(cfg, "torch")}
  for stack, i, ours, _, torch_name in _layers(cfg):
    if _sublayer_type(ours) == "attention":
      mine = _tree_get(params, f"{stack}/layer_{i}/{ours}")
      prefix = f"transformer.{stack}.layers.{i}.{torch_name}"
      state[f"{prefix}.in_proj_weight"] = np.concatenate(
          [_kernel_to_linear(np.asarray(mine[q]["kernel"]), cfg.d_model) for q, _ in _QKV])
      state[f"{prefix}.in_proj_bias"] = np.concatenate(
          [np.asarray(mine[q]["bias"]).reshape(-1) for q, _ in _QKV])
  state["embedding.weight"] = np.asarray(params["shared_embedding"]["embedding"])
  for stack in ("encoder", "decoder"):
    if cfg.norm_position == "pre":
      state[f"transformer.{stack}.norm.weight"] = np.asarray(params[stack]["final_norm"]["scale"])
      state[f"transformer.{stack}.norm.bias"] = np.asarray(params[stack]["final_norm"]["bias"])
    if cfg.positional == "learned":
      state[f"positions.{stack}"] = np.asarray(
          params[stack]["input_embedding"]["positional"]["position_embedding"])
  return {k: np.asarray(v, np.float32) for k, v in state.items()}


def params_from_torch_state_dict(state: dict[str, np.ndarray], cfg: TransformerConfig,
                                 source: str = "state_dict") -> dict:
  """The inverse of `torch_state_dict`: our parameter tree; names the first missing,
  unexpected or mis-shaped tensor."""
  _check_torch_expressible(cfg)
  expected = torch_state_dict(jax.tree_util.tree_map(
      lambda s: np.zeros(s.shape, np.float32), nn.meta.unbox(abstract_params(cfg))), cfg)
  for key, value in expected.items():
    if key not in state:
      raise ConvertError(f"{source}: missing tensor {key}")
    _check_shape(key, np.asarray(state[key]), value.shape, source)
  unexpected = sorted(set(state) - set(expected))
  if unexpected:
    raise ConvertError(f"{source}: unexpected tensor {unexpected[0]} ({len(unexpected)} in all)")
  params: dict = {}
  for ours, key, to_ours, _ in _layer_tensors(cfg, "torch"):
    _tree_set(params, ours, to_ours(np.asarray(state[key], np.float32)))
  d, n, h = cfg.d_model, cfg.num_heads, cfg.head_dim
  for stack, i, ours, _, torch_name in _layers(cfg):
    if _sublayer_type(ours) == "attention":
      prefix = f"transformer.{stack}.layers.{i}.{torch_name}"
      weights = np.split(np.asarray(state[f"{prefix}.in_proj_weight"], np.float32), 3)
      biases = np.split(np.asarray(state[f"{prefix}.in_proj_bias"], np.float32), 3)
      for (q, _), w, b in zip(_QKV, weights, biases):
        _tree_set(params, f"{stack}/layer_{i}/{ours}/{q}/kernel", _linear_to_kernel(w, (d, n, h)))
        _tree_set(params, f"{stack}/layer_{i}/{ours}/{q}/bias", b.reshape(n, h))
  _tree_set(params, "shared_embedding/embedding", np.asarray(state["embedding.weight"], np.float32))
  for stack in ("encoder", "decoder"):
    if cfg.norm_position == "pre":
      for ours, theirs in (("scale", "weight"), ("bias", "bias")):
        _tree_set(params, f"{stack}/final_norm/{ours}",
                  np.asarray(state[f"transformer.{stack}.norm.{theirs}"], np.float32))
    if cfg.positional == "learned":
      _tree_set(params, f"{stack}/input_embedding/positional/position_embedding",
                np.asarray(state[f"positions.{stack}"], np.float32))
  return params


def _check_torch_expressible(cfg: TransformerConfig) -> None:
  if not (cfg.share_embeddings and cfg.tie_output and cfg.target_vocab_size is None):
    raise ConvertError("torch.nn.Transformer conversion needs share_embeddings=True and "
                       "tie_output=True (one embedding, tied to the output)")
  if cfg.final_logits_bias:
    raise ConvertError("model.final_logits_bias=True: torch.nn.Transformer has no output bias")


# ------------------------------------------------------------------------- export writing
def write_export(path: str, params: dict, run_config: dict, tokenizer: Any,
                 target_tokenizer: Any) -> str:
  """A params-only export at `path`, as `python -m transformer_jax.export` writes it
  (params, config, tokenizer, manifest; step 0)."""
  if os.path.exists(path):
    raise ConvertError(f"{os.path.abspath(path)} already exists; remove it or use another "
                       "--name")
  params = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), params)
  return checkpoint.write_export(path, params, run_config,
                                 tokenizer_item(tokenizer, target_tokenizer), steps=[0])


# ------------------------------------------------------------------------- command line
def run(*, from_: str | None = None, to: str | None = None, input: str | None = None,
        output: str | None = None, workdir: str | None = None, checkpoint_path: str | None = None,
        name: str | None = None, like: str | None = None, allow_pickle: bool = False) -> str:
  """Runs one conversion as the command line describes it; returns the lines to print.
  Raises ConvertError (and FileNotFoundError, checkpoint errors) for bad input."""
  if (from_ is None) == (to is None):
    raise ConvertError("give exactly one of --from=FORMAT (import) or --to=FORMAT (export)")
  if from_:
    if not input or not workdir:
      raise ConvertError(f"--from={from_} needs --input and --workdir")
    if from_ == "hf_marian":
      cfg, params, run_config, source, target = import_marian(input, allow_pickle)
    else:
      if not like:
        raise ConvertError("--from=torch needs --like=MODEL (an export, checkpoint or "
                           "workdir with the model's config and tokenizer)")
      model_dir = _is_model_dir(like)
      _, cfg, _, model = load_model(None if model_dir else like, like if model_dir else None)
      if not os.path.isfile(input):
        raise ConvertError(f"--input={input}: no such file")
      params = params_from_torch_state_dict(read_state_dict(input, allow_pickle), cfg, input)
      run_config = dict(model.config, model=cfg.to_dict(),
                        converted_from={"format": "torch", "path": os.path.abspath(input)})
      source, target = model.assets.tokenizer, model.assets.target_tokenizer
    path = write_export(os.path.join(workdir, checkpoint.EXPORT_DIR, name or from_), params,
                        run_config, source, target)
    return f"wrote {path} ({param_utils.count_params(params):,} parameters)"
  if not output:
    raise ConvertError(f"--to={to} needs --output")
  if to == "hf_marian":
    note = export_marian(workdir, output, checkpoint_path)
    return f"wrote {output}" + (f"\n{note}" if note else "")
  if os.path.exists(output):
    raise ConvertError(f"--output={output} exists; choose another")
  path, cfg, params, _ = load_model(workdir, checkpoint_path)
  state = torch_state_dict(params, cfg)
  if output.endswith(".safetensors"):
    from safetensors.numpy import save_file
    save_file(state, output)
  else:
    import torch
    torch.save({k: torch.from_numpy(v) for k, v in state.items()}, output)
  return f"wrote {output} ({len(state)} tensors of {path})"


def _is_model_dir(path: str) -> bool:
  """An export or checkpoint directory (rather than a workdir)."""
  return os.path.isdir(os.path.join(path, "manifest"))


FLAGS = flags.FLAGS


def define_flags() -> None:
  """The command-line flags, defined only when this module is the program (other commands
  define some of the same names)."""
  flags.DEFINE_enum("from", None, ["hf_marian", "torch"], "Import this format.")
  flags.DEFINE_enum("to", None, ["hf_marian", "torch"], "Export to this format.")
  flags.DEFINE_string("input", None, "Import: a MarianMT save_pretrained directory, or a "
                      "torch state_dict file (.safetensors, or .pt with --allow_pickle).")
  flags.DEFINE_string("output", None, "Export: the directory (hf_marian) or file (torch: "
                      ".safetensors, else torch.save) to write.")
  flags.DEFINE_string("workdir", None, "Import: where to write exports/<name>; export: "
                      "whose newest model to convert.")
  flags.DEFINE_string("checkpoint", None, "Export this export or checkpoint directory "
                      "instead of the workdir's newest.")
  flags.DEFINE_string("name", None, "Import: the export's name (default: the format).")
  flags.DEFINE_string("like", None, "--from=torch: an export, checkpoint or workdir whose "
                      "config and tokenizer the state_dict goes with.")
  flags.DEFINE_bool("allow_pickle", False, "Read pickled torch files (pytorch_model.bin, "
                    ".pt) with torch.load(weights_only=True).")


def main(argv: list[str]) -> None:
  logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO.
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  try:
    message = run(from_=FLAGS["from"].value, to=FLAGS.to, input=FLAGS.input,
                  output=FLAGS.output, workdir=FLAGS.workdir, checkpoint_path=FLAGS.checkpoint,
                  name=FLAGS.name, like=FLAGS.like, allow_pickle=FLAGS.allow_pickle)
  except (ConvertError, FileNotFoundError, FileExistsError,
          checkpoint.DamagedCheckpointError, checkpoint.IncompatibleCheckpointError) as e:
    print(f"error: {' '.join(str(e).split())}", file=sys.stderr)   # one line, no traceback
    sys.exit(2)
  print(message)


if __name__ == "__main__":
  define_flags()
  app.run(main)
