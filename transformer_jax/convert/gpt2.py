"""Hugging Face GPT-2 (`GPT2LMHeadModel`, `GPT2Tokenizer`) in and out: a save_pretrained
directory (config.json, model.safetensors, and tokenizer.json or vocab.json + merges.txt) as
our language model (task "lm") and back.

GPT-2 is our LanguageModel with options: pre-LN with a final LayerNorm, learned positions,
GELU (the tanh form, "gelu_new"), biases, the output projection tied to token embeddings
that are not scaled (scale_embeddings=False), and its one special token, <|endoftext|>, as
EOS and BOS both (bos_is_eos). The ids are the tokenizer's (data/byte_bpe.py): ours are
GPT-2's + 4, <|endoftext|> is EOS 2; an import adds zero embedding rows for PAD 0, BOS 1
and UNK 3 (never read, never scored), an export drops them (convert/hf_lm.py). A prompt
starts without BOS, as GPT2Tokenizer encodes it.

GPT-2's Conv1D layers keep (in, out) weights, our kernels' layout: only the fused
query-key-value projection (c_attn) is split, and head axes are folded in and out.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from transformer_jax import trees
from transformer_jax.config import TransformerConfig
from transformer_jax.convert.hf import (
  ACTIVATIONS,
  activation_from_hf,
  check_options,
  mismatch,
  need_file,
  optional_json,
  our_config,
)
from transformer_jax.convert.hf_lm import (
  Family,
  StateDict,
  check_vocabulary,
  rows_to_ours,
  rows_to_theirs,
  tokenizer_problem,
)
from transformer_jax.convert.tensors import ConvertError, expected_shapes
from transformer_jax.data.byte_bpe import END_OF_TEXT, ByteLevelBPE
from transformer_jax.data.hf_tokenizer import HFTokenizer, special_piece

LAYOUT = ("a GPT-2 save_pretrained directory has config.json, model.safetensors and "
          "tokenizer.json (or vocab.json and merges.txt)")
# What --input=NAME downloads from the Hub.
HUB_FILES = ("config.json", "model.safetensors", "tokenizer.json", "vocab.json", "merges.txt",
             "tokenizer_config.json")
# Options of GPT2Config that would describe another model than ours.
_MUST_BE = {"scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
            "add_cross_attention": False, "tie_word_embeddings": True}
# What GPT-2 has only one way, as (our field, its value).
_GPT2_SHAPE: tuple[tuple[str, Any], ...] = (
    ("norm_position", "pre"), ("positional", "learned"), ("norm_type", "layer"),
    ("gated_ffn", False), ("use_bias", True), ("tie_output", True), ("scale_embeddings", False),
    ("bos_is_eos", True), ("final_logits_bias", False), ("zero_decoder_start", False),
    ("logit_softcap", 0.0))
_PREFIX = "transformer."   # GPT2LMHeadModel's; GPT2Model's checkpoints (the Hub's gpt2) lack it
_BUFFERS = r"^h\.\d+\.attn\.(masked_)?bias$"   # causal masks older files keep
_QKV = ("query", "key", "value")


# ------------------------------------------------------------------------- config
def config_from_hf(hf: dict, tokenizer: HFTokenizer, source: str) -> TransformerConfig:
  """Our config for GPT-2's config.json; refuses, naming it, an option we lack."""
  if hf.get("model_type") != "gpt2":
    raise ConvertError(f"{source}: model_type={hf.get('model_type')!r}; only 'gpt2' converts")
  check_options(hf, _MUST_BE, source)
  check_vocabulary(hf, tokenizer, source)
  activation = activation_from_hf(hf.get("activation_function", "gelu_new"), source)
  return our_config(source, lambda: dict(
      vocab_size=tokenizer.vocab_size, d_model=hf["n_embd"], num_heads=hf["n_head"],
      d_ff=hf.get("n_inner") or 4 * hf["n_embd"], num_encoder_layers=0,
      num_decoder_layers=hf["n_layer"], max_len=hf["n_positions"],
      dropout_rate=float(hf.get("resid_pdrop", 0.1)),
      attention_dropout_rate=float(hf.get("attn_pdrop", 0.1)), activation=activation,
      layer_norm_epsilon=float(hf.get("layer_norm_epsilon", 1e-5)), **dict(_GPT2_SHAPE)))


def hf_config(cfg: TransformerConfig, tokenizer: HFTokenizer) -> dict:
  """config.json of a GPT2LMHeadModel computing our model."""
  return {
      "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
      "vocab_size": tokenizer.size, "n_positions": cfg.max_len, "n_embd": cfg.d_model,
      "n_layer": cfg.num_decoder_layers, "n_head": cfg.num_heads, "n_inner": cfg.d_ff,
      "activation_function": ACTIVATIONS[cfg.activation], "resid_pdrop": cfg.dropout_rate,
      "embd_pdrop": cfg.dropout_rate, "attn_pdrop": cfg.attention_dropout_rate,
      "layer_norm_epsilon": cfg.layer_norm_epsilon, "initializer_range": 0.02,
      "bos_token_id": tokenizer.end_id, "eos_token_id": tokenizer.end_id,
      "tie_word_embeddings": True, "scale_attn_weights": True, "use_cache": True,
      "dtype": "float32"}


def incompatibility(cfg: TransformerConfig, tokenizer: object) -> str | None:
  """Why GPT-2 cannot express this (language) model, in one line naming the option; None
  if it can."""
  problem = mismatch(cfg, _GPT2_SHAPE, "GPT-2")
  if problem:
    return problem
  if cfg.kv_heads != cfg.num_heads:
    return (f"model.num_kv_heads={cfg.num_kv_heads}: GPT-2 has as many key/value heads as "
            "query heads")
  return tokenizer_problem(cfg, tokenizer, ByteLevelBPE, "GPT2Tokenizer is a byte-level BPE")


# ------------------------------------------------------------------------- tensors
def _their_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
  """A tensor's shape in GPT-2: kernels (in..., out) folded to (in, out), the rest flat."""
  return (int(np.prod(shape[:-1])), shape[-1]) if len(shape) > 1 else (int(np.prod(shape)),)


def _names(cfg: TransformerConfig) -> list[tuple[str, str]]:
  """(our path, GPT-2's key) of every tensor that maps one to one (all but the embedding
  table and c_attn)."""
  names = [("decoder/input_embedding/positional/position_embedding", "wpe.weight"),
           ("decoder/final_norm/scale", "ln_f.weight"), ("decoder/final_norm/bias", "ln_f.bias")]
  for i in range(cfg.num_decoder_layers):
    for ours, theirs, kind in (("self_attention_norm", "ln_1", "scale"),
                               ("feed_forward_norm", "ln_2", "scale"),
                               ("self_attention/out", "attn.c_proj", "kernel"),
                               ("feed_forward/wi", "mlp.c_fc", "kernel"),
                               ("feed_forward/wo", "mlp.c_proj", "kernel")):
      names += [(f"decoder/layer_{i}/{ours}/{kind}", f"h.{i}.{theirs}.weight"),
                (f"decoder/layer_{i}/{ours}/bias", f"h.{i}.{theirs}.bias")]
  return names


def state_to_params(state: dict[str, np.ndarray], cfg: TransformerConfig,
                    tokenizer: HFTokenizer, source: str) -> dict:
  """Our parameter tree from GPT-2's state_dict; names the first missing, unexpected or
  mis-shaped tensor."""
  tensors = StateDict(state, source, _PREFIX, skipped=_BUFFERS)
  shapes = expected_shapes(cfg, decoder_only=True)
  params: dict = {}
  for ours, key in _names(cfg):
    trees.set_path(params, ours,
                   tensors.take(key, _their_shape(shapes[ours])).reshape(shapes[ours]))
  d = cfg.d_model
  for i in range(cfg.num_decoder_layers):
    kernel = np.split(tensors.take(f"h.{i}.attn.c_attn.weight", (d, 3 * d)), 3, axis=1)
    bias = np.split(tensors.take(f"h.{i}.attn.c_attn.bias", (3 * d,)), 3)
    for name, k, b in zip(_QKV, kernel, bias):
      mine = f"decoder/layer_{i}/self_attention/{name}"
      trees.set_path(params, f"{mine}/kernel", k.reshape(shapes[f"{mine}/kernel"]))
      trees.set_path(params, f"{mine}/bias", b.reshape(shapes[f"{mine}/bias"]))
  wte = tensors.take("wte.weight", (tokenizer.size, d))
  trees.set_path(params, "embedding/embedding", rows_to_ours(wte, tokenizer))
  tensors.tied_output("lm_head.weight", "wte.weight",
                      "untied output embeddings are an option this project lacks")
  tensors.check_all_taken()
  return params


def params_to_state(params: dict, cfg: TransformerConfig,
                    tokenizer: HFTokenizer) -> dict[str, np.ndarray]:
  """GPT2LMHeadModel's state_dict (numpy) of our unrolled, separate-QKV parameters; the
  output projection is tied to wte, as transformers saves it."""
  flat = {k: np.asarray(v, np.float32) for k, v in trees.flatten(params).items()}
  state = {key: flat[ours].reshape(_their_shape(flat[ours].shape)) for ours, key in _names(cfg)}
  for i in range(cfg.num_decoder_layers):
    mine = f"decoder/layer_{i}/self_attention"
    state[f"h.{i}.attn.c_attn.weight"] = np.concatenate(
        [flat[f"{mine}/{q}/kernel"].reshape(cfg.d_model, -1) for q in _QKV], axis=1)
    state[f"h.{i}.attn.c_attn.bias"] = np.concatenate(
        [flat[f"{mine}/{q}/bias"].reshape(-1) for q in _QKV])
  state["wte.weight"] = rows_to_theirs(flat["embedding/embedding"], tokenizer)
  return {_PREFIX + k: np.ascontiguousarray(v) for k, v in state.items()}


# ------------------------------------------------------------------------- files
def read_tokenizer(directory: str) -> ByteLevelBPE:
  """The directory's GPT-2 tokenizer: tokenizer.json, else vocab.json and merges.txt."""
  config = optional_json(directory, "tokenizer_config.json")
  end = special_piece(config, "eos_token", END_OF_TEXT)
  assert end is not None
  if os.path.isfile(os.path.join(directory, "tokenizer.json")):
    with open(os.path.join(directory, "tokenizer.json"), encoding="utf-8") as f:
      return ByteLevelBPE(f.read(), end)
  return ByteLevelBPE.from_files(need_file(directory, "vocab.json", LAYOUT),
                                 need_file(directory, "merges.txt", LAYOUT),
                                 bool(config.get("add_prefix_space", False)), end)


FAMILY = Family("hf_gpt2", "GPT-2", LAYOUT, read_tokenizer, config_from_hf, state_to_params,
                incompatibility, hf_config, params_to_state)


# (config, params, run config, tokenizer, tokenizer) of a GPT-2 save_pretrained directory;
# and an export of our model to one (which transformers' model class and AutoTokenizer load).
import_gpt2 = FAMILY.read
write_hf_gpt2 = FAMILY.write
