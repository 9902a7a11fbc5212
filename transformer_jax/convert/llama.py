"""Hugging Face Llama (`LlamaForCausalLM`, and `MistralForCausalLM` without a sliding
window) in and out: a save_pretrained directory (config.json, model.safetensors or its
shards, tokenizer.json and tokenizer_config.json) as our language model (task "lm") and
back. Llama 2, Llama 3, TinyLlama, SmolLM, Mistral 7B v0.2+ and models fine-tuned from them
are of this family.

Llama is our LanguageModel with options: pre-LN with a final norm, RMSNorm
(`rms_norm_eps`), rotary positions in the rotate-half layout (`rope_theta`, no scaling),
SwiGLU (gated_ffn with "silu"), grouped-query attention (`num_key_value_heads`), no biases,
token embeddings that are not scaled, and an output tied to them or not
(`tie_word_embeddings`, else `lm_head`). Its tokenizer is Hugging Face's
(data/hf_tokenizer.py): our ids are theirs with BOS, EOS and UNK first; a prompt starts with
BOS where the tokenizer adds it (Llama's do).

torch Linear layers keep (out, in) weights: each is transposed, and head axes folded in and
out. What we cannot compute (rope scaling, a sliding window, biases, a head_dim other than
hidden_size / num_attention_heads) is refused, naming the config field.
"""

from __future__ import annotations

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
from transformer_jax.convert.tensors import (
  ConvertError,
  expected_shapes,
  kernel_to_linear,
  linear_to_kernel,
)
from transformer_jax.data.hf_tokenizer import HFTokenizer

LAYOUT = ("a Llama save_pretrained directory has config.json, model.safetensors (or its "
          "shards) and tokenizer.json")
# What --input=NAME downloads from the Hub.
HUB_FILES = ("config.json", "generation_config.json", "*.safetensors",
             "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json")
# Options of LlamaConfig (and MistralConfig) that would describe another model than ours.
_MUST_BE = {"attention_bias": False, "mlp_bias": False, "sliding_window": None,
            "partial_rotary_factor": 1.0}
# What Llama has only one way, as (our field, its value).
_LLAMA_SHAPE: tuple[tuple[str, Any], ...] = (
    ("norm_position", "pre"), ("positional", "rotary"), ("norm_type", "rms"),
    ("gated_ffn", True), ("use_bias", False), ("scale_embeddings", False),
    ("final_logits_bias", False), ("zero_decoder_start", False))
_PREFIX = "model."   # LlamaForCausalLM's; LlamaModel's checkpoints lack it (and lm_head)
_BUFFERS = r"rotary_emb\.inv_freq$"   # older files keep the rotary frequencies


# ------------------------------------------------------------------------- config
def _rope_theta(hf: dict, source: str) -> float:
  """The rotary base; rope scaling of any kind (linear, dynamic, llama3, yarn, ...) is
  refused, naming it (transformers v5 writes `rope_parameters`, v4 `rope_scaling`)."""
  theta = hf.get("rope_theta", 10000.0)
  for field in ("rope_scaling", "rope_parameters"):
    rope = hf.get(field) or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
      raise ConvertError(f"{source}: {field} rope_type={kind!r} is an option this project "
                         "lacks (only unscaled rotary positions convert)")
    theta = rope.get("rope_theta", theta)
  return float(theta)


def config_from_hf(hf: dict, tokenizer: HFTokenizer, source: str) -> TransformerConfig:
  """Our config for Llama's config.json; refuses, naming it, an option we lack."""
  if hf.get("model_type") not in ("llama", "mistral"):
    raise ConvertError(f"{source}: model_type={hf.get('model_type')!r}; only 'llama' (and "
                       "'mistral' without a sliding window) converts")
  check_options(hf, _MUST_BE, source)
  check_vocabulary(hf, tokenizer, source)
  if tokenizer.bos_is_eos and set(tokenizer.absent_ids) != {0, 1, 3}:
    raise ConvertError(f"{source}: the tokenizer's bos_token is its eos_token but its "
                       "unk_token is a token of its own: an option this project lacks")
  heads = hf.get("num_attention_heads")
  if hf.get("head_dim") is not None and heads and hf["head_dim"] * heads != hf.get(
      "hidden_size"):
    raise ConvertError(f"{source}: head_dim={hf['head_dim']} is an option this project lacks "
                       f"(only hidden_size / num_attention_heads = "
                       f"{hf.get('hidden_size', 0) // heads} converts)")
  kv_heads = hf.get("num_key_value_heads") or heads
  theta = _rope_theta(hf, source)
  activation = activation_from_hf(hf.get("hidden_act", "silu"), source)
  return our_config(source, lambda: dict(
      vocab_size=tokenizer.vocab_size, d_model=hf["hidden_size"], num_heads=heads,
      num_kv_heads=None if kv_heads == heads else kv_heads, d_ff=hf["intermediate_size"],
      num_encoder_layers=0, num_decoder_layers=hf["num_hidden_layers"],
      max_len=hf.get("max_position_embeddings", 2048), dropout_rate=0.0,
      attention_dropout_rate=float(hf.get("attention_dropout", 0.0)), activation=activation,
      rope_theta=theta, layer_norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
      tie_output=bool(hf.get("tie_word_embeddings", False)),
      bos_is_eos=tokenizer.bos_is_eos, absent_ids=tokenizer.absent_ids, **dict(_LLAMA_SHAPE)))


def hf_config(cfg: TransformerConfig, tokenizer: HFTokenizer) -> dict:
  """config.json of a LlamaForCausalLM computing our model."""
  return {
      "architectures": ["LlamaForCausalLM"], "model_type": "llama",
      "vocab_size": tokenizer.size, "hidden_size": cfg.d_model,
      "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.num_decoder_layers,
      "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.kv_heads,
      "head_dim": cfg.head_dim, "hidden_act": ACTIVATIONS[cfg.activation],
      "max_position_embeddings": cfg.max_len, "rms_norm_eps": cfg.layer_norm_epsilon,
      "rope_theta": cfg.rope_theta,
      "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
      "tie_word_embeddings": cfg.tie_output, "attention_bias": False, "mlp_bias": False,
      "attention_dropout": cfg.attention_dropout_rate, "initializer_range": 0.02,
      "bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.end_id,
      "use_cache": True, "dtype": "float32"}


def incompatibility(cfg: TransformerConfig, tokenizer: object) -> str | None:
  """Why Llama cannot express this (language) model, in one line naming the option; None
  if it can."""
  return (mismatch(cfg, _LLAMA_SHAPE, "Llama")
          or tokenizer_problem(cfg, tokenizer, HFTokenizer, "LlamaForCausalLM's tokenizer is "
                               "a Hugging Face tokenizer.json"))


# ------------------------------------------------------------------------- tensors
def _names(cfg: TransformerConfig) -> list[tuple[str, str, int | None]]:
  """(our path, Llama's key, the Linear's fan-in or None for a norm's weight) of every
  tensor but the token embedding and lm_head."""
  d, attended = cfg.d_model, cfg.num_heads * cfg.head_dim
  names: list[tuple[str, str, int | None]] = [("decoder/final_norm/scale", "norm.weight", None)]
  for i in range(cfg.num_decoder_layers):
    ours, theirs = f"decoder/layer_{i}/", f"layers.{i}."
    names += [(f"{ours}self_attention_norm/scale", f"{theirs}input_layernorm.weight", None),
              (f"{ours}feed_forward_norm/scale", f"{theirs}post_attention_layernorm.weight",
               None),
              (f"{ours}self_attention/query/kernel", f"{theirs}self_attn.q_proj.weight", d),
              (f"{ours}self_attention/key/kernel", f"{theirs}self_attn.k_proj.weight", d),
              (f"{ours}self_attention/value/kernel", f"{theirs}self_attn.v_proj.weight", d),
              (f"{ours}self_attention/out/kernel", f"{theirs}self_attn.o_proj.weight", attended),
              (f"{ours}feed_forward/wi/kernel", f"{theirs}mlp.gate_proj.weight", d),
              (f"{ours}feed_forward/wi_up/kernel", f"{theirs}mlp.up_proj.weight", d),
              (f"{ours}feed_forward/wo/kernel", f"{theirs}mlp.down_proj.weight", cfg.d_ff)]
  return names


def state_to_params(state: dict[str, np.ndarray], cfg: TransformerConfig,
                    tokenizer: HFTokenizer, source: str) -> dict:
  """Our parameter tree from Llama's state_dict; names the first missing, unexpected or
  mis-shaped tensor."""
  tensors = StateDict(state, source, _PREFIX, skipped=_BUFFERS)
  shapes = expected_shapes(cfg, decoder_only=True)
  params: dict = {}
  for ours, key, fan_in in _names(cfg):
    shape = shapes[ours]
    if fan_in is None:
      value = tensors.take(key, shape)
    else:
      value = linear_to_kernel(tensors.take(key, (int(np.prod(shape)) // fan_in, fan_in)),
                               shape)
    trees.set_path(params, ours, value)
  embedding = tensors.take("embed_tokens.weight", (tokenizer.size, cfg.d_model))
  trees.set_path(params, "embedding/embedding", rows_to_ours(embedding, tokenizer))
  if cfg.tie_output:
    tensors.tied_output("lm_head.weight", "embed_tokens.weight",
                        "config.json says tie_word_embeddings=true")
  else:
    head = tensors.take("lm_head.weight", (tokenizer.size, cfg.d_model))
    trees.set_path(params, "decoder/output_projection/kernel", rows_to_ours(head, tokenizer).T)
  tensors.check_all_taken()
  return params


def params_to_state(params: dict, cfg: TransformerConfig,
                    tokenizer: HFTokenizer) -> dict[str, np.ndarray]:
  """LlamaForCausalLM's state_dict (numpy) of our unrolled, separate-QKV parameters (a tied
  lm_head left out, as save_pretrained leaves it)."""
  flat = {k: np.asarray(v, np.float32) for k, v in trees.flatten(params).items()}
  state = {_PREFIX + key: flat[ours] if fan_in is None else kernel_to_linear(flat[ours], fan_in)
           for ours, key, fan_in in _names(cfg)}
  state[_PREFIX + "embed_tokens.weight"] = rows_to_theirs(flat["embedding/embedding"],
                                                          tokenizer)
  if not cfg.tie_output:
    state["lm_head.weight"] = rows_to_theirs(flat["decoder/output_projection/kernel"].T,
                                             tokenizer)
  return {k: np.ascontiguousarray(v) for k, v in state.items()}


# ------------------------------------------------------------------------- files
def read_tokenizer(directory: str) -> HFTokenizer:
  """The directory's tokenizer.json, with tokenizer_config.json (over the special tokens of
  special_tokens_map.json, which older uploads keep apart)."""
  path = need_file(directory, "tokenizer.json", LAYOUT)
  config = {**optional_json(directory, "special_tokens_map.json"),
            **optional_json(directory, "tokenizer_config.json")}
  with open(path, encoding="utf-8") as f:
    return HFTokenizer(f.read(), config)


FAMILY = Family("hf_llama", "Llama", LAYOUT, read_tokenizer, config_from_hf, state_to_params,
                incompatibility, hf_config, params_to_state)


# (config, params, run config, tokenizer, tokenizer) of a Llama save_pretrained directory;
# and an export of our model to one (which transformers' model class and AutoTokenizer load).
import_llama = FAMILY.read
write_hf_llama = FAMILY.write
