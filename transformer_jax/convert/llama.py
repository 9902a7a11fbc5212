"""Hugging Face Llama (`LlamaForCausalLM`) in and out, and the Llama-shaped families built
on it (`Shape`, `family`): Mistral (mistral.py), Qwen2 and Qwen3 (qwen.py), Gemma 3
(gemma3.py). A save_pretrained directory (config.json, model.safetensors or its shards,
tokenizer.json and tokenizer_config.json, generation_config.json) becomes our language model
(task "lm"), and back. Llama 2, Llama 3.x, TinyLlama, SmolLM and models fine-tuned from
them are of this family.

Llama is our LanguageModel with options: pre-LN with a final norm, RMSNorm
(`rms_norm_eps`), rotary positions in the rotate-half layout (`rope_theta`, scaled
"linear" or "llama3"), SwiGLU (gated_ffn with "silu"), grouped-query attention
(`num_key_value_heads`), an explicit `head_dim`, no biases, token embeddings that are not
scaled, and an output tied to them or not (`tie_word_embeddings`, else `lm_head`). A family
differs in options our config has (q/k/v biases, q/k norms, sliding windows, Gemma's norms):
the tensor names follow from our config (`tensor_names`), the config.json fields from the
family's `Shape`. Its tokenizer is Hugging Face's (data/hf_tokenizer.py): our ids are theirs
with BOS, EOS and UNK first.

torch Linear layers keep (out, in) weights: each is transposed, and head axes folded in and
out. What we cannot compute (another rope scaling, biases elsewhere, a partial rotary
factor) is refused, naming the config field.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

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
  eos_token_id,
  rowless_ids,
  rows_to_ours,
  rows_to_theirs,
  table_rows,
  tokenizer_problem,
)
from transformer_jax.convert.tensors import (
  ConvertError,
  expected_shapes,
  kernel_to_linear,
  linear_to_kernel,
)
from transformer_jax.data.hf_tokenizer import HFTokenizer

LAYOUT = ("a save_pretrained directory of a causal LM has config.json, model.safetensors "
          "(or its shards) and tokenizer.json")
# What --input=NAME downloads from the Hub.
HUB_FILES = ("config.json", "generation_config.json", "*.safetensors",
             "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json", "chat_template.jinja")
# Options of every Llama-shaped config.json that would describe another model than ours.
_MUST_BE = {"mlp_bias": False, "partial_rotary_factor": 1.0, "final_logit_softcapping": None,
            "attn_logit_softcapping": None, "use_bidirectional_attention": False}
# What Llama has only one way, as (our field, its value).
LLAMA_SHAPE: tuple[tuple[str, Any], ...] = (
    ("norm_position", "pre"), ("positional", "rotary"), ("norm_type", "rms"),
    ("gated_ffn", True), ("use_bias", False), ("scale_embeddings", False),
    ("final_logits_bias", False), ("zero_decoder_start", False), ("qkv_bias", False),
    ("qk_norm", False), ("sandwich_norm", False), ("attention_scale", 0.0),
    ("layer_types", ()), ("local_rope_theta", 0.0), ("logit_softcap", 0.0))
NO_WINDOW = (("sliding_window", 0),)   # a family whose layers see every key
PREFIX = "model."   # LlamaForCausalLM's; LlamaModel's checkpoints lack it (and lm_head)
_BUFFERS = r"rotary_emb\.inv_freq$"   # older files keep the rotary frequencies
_LAYER_TYPES = {"sliding_attention": "sliding", "full_attention": "full"}


@dataclasses.dataclass(frozen=True)
class Shape:
  """What a Llama-shaped family is: its model_type and class, the options it has one way
  (`fixed`: (our field, value)), the config.json options that must keep one value, the
  values its configuration class gives the fields a config.json leaves out (`defaults`:
  transformers 4 saved only what differed from them), and two hooks: `options(hf, source)`, our fields read from config.json beyond Llama's (its
  windows, its own norms), and `hf_options(cfg)`, the config.json fields it writes beyond
  Llama's."""
  model_type: str
  architecture: str
  title: str
  fixed: tuple[tuple[str, Any], ...]
  must_be: dict[str, Any] = dataclasses.field(default_factory=dict)
  defaults: dict[str, Any] = dataclasses.field(default_factory=dict)
  options: Callable[[dict, str], dict[str, Any]] = lambda hf, source: {}
  hf_options: Callable[[TransformerConfig], dict[str, Any]] = lambda cfg: {}


# ------------------------------------------------------------------------- config
def rope_fields(rope: dict, field: str, source: str) -> dict[str, Any]:
  """Our rotary fields of one rope description ({"rope_type", "rope_theta", "factor",
  ...}); a scaling we lack ("yarn", "dynamic", "longrope") is refused, naming it."""
  kind = rope.get("rope_type", rope.get("type", "default"))
  fields: dict[str, Any] = {} if "rope_theta" not in rope else {
      "rope_theta": float(rope["rope_theta"])}
  if kind == "default":
    return fields
  if kind not in ("linear", "llama3"):
    raise ConvertError(f"{source}: {field} rope_type={kind!r} is an option this project "
                       "lacks (it has rotary positions unscaled, 'linear' and 'llama3')")
  fields.update(rope_scaling=kind, rope_scaling_factor=float(rope["factor"]))
  if kind == "llama3":
    fields.update(rope_low_freq_factor=float(rope["low_freq_factor"]),
                  rope_high_freq_factor=float(rope["high_freq_factor"]),
                  rope_original_max_len=int(rope["original_max_position_embeddings"]))
  return fields


def rope_of(hf: dict, source: str, layer_type: str = "full_attention") -> dict[str, Any]:
  """Our rotary fields for config.json's rope of `layer_type`'s layers: transformers 5's
  `rope_parameters` (one for all layers, or one per layer type), or 4's `rope_theta` and
  `rope_scaling`."""
  fields = {"rope_theta": float(hf.get("rope_theta", 10000.0))}
  for field in ("rope_scaling", "rope_parameters"):
    rope = hf.get(field) or {}
    if layer_type in rope:
      rope = rope[layer_type]
    fields.update(rope_fields(rope, field, source))
  return fields


def layer_types(hf: dict, source: str) -> tuple[str, ...]:
  """config.json's `layer_types` as ours ("sliding", "full"); () where it has none."""
  kinds = hf.get("layer_types") or ()
  unknown = sorted(set(kinds) - set(_LAYER_TYPES))
  if unknown:
    raise ConvertError(f"{source}: layer_types {unknown[0]!r} is an option this project "
                       f"lacks (it has {sorted(_LAYER_TYPES)})")
  return tuple(_LAYER_TYPES[kind] for kind in kinds)


def window_fields(hf: dict, sliding: Callable[[int], bool], source: str) -> dict[str, Any]:
  """sliding_window and layer_types: config.json's layer_types where it has them, else
  layer i sliding where `sliding(i)` (the family's rule); no window if no layer slides."""
  layers = hf["num_hidden_layers"]
  kinds = layer_types(hf, source) or tuple(
      "sliding" if hf.get("sliding_window") and sliding(i) else "full" for i in range(layers))
  if "sliding" not in kinds:
    return {}
  return {"sliding_window": int(hf["sliding_window"]),
          "layer_types": () if set(kinds) == {"sliding"} else kinds}


def hf_layer_types(cfg: TransformerConfig) -> list[str]:
  """config.json's layer_types of our config."""
  return ["sliding_attention" if cfg.layer_sliding(i) else "full_attention"
          for i in range(cfg.num_decoder_layers)]


def hf_rope(cfg: TransformerConfig) -> dict[str, Any]:
  """transformers 5's rope_parameters of our full layers."""
  rope: dict[str, Any] = {"rope_type": "default" if cfg.rope_scaling == "none"
                          else cfg.rope_scaling, "rope_theta": cfg.rope_theta}
  if cfg.rope_scaling != "none":
    rope["factor"] = cfg.rope_scaling_factor
  if cfg.rope_scaling == "llama3":
    rope.update(low_freq_factor=cfg.rope_low_freq_factor,
                high_freq_factor=cfg.rope_high_freq_factor,
                original_max_position_embeddings=cfg.rope_original_max_len)
  return rope


def _head_size(hf: dict) -> int:
  """Our head_size of config.json's head_dim: 0 where it is hidden_size / heads."""
  head_dim, heads = hf.get("head_dim"), hf.get("num_attention_heads")
  return 0 if not head_dim or head_dim * heads == hf.get("hidden_size") else int(head_dim)


def _config_from_hf(shape: Shape, hf: dict, tokenizer: HFTokenizer,
                    source: str) -> TransformerConfig:
  """Our config for the family's config.json; refuses, naming it, an option we lack. The
  embedding may have more rows than the tokenizer has tokens (Qwen pads it; the rows past
  the tokens are dropped) or fewer (Gemma 3 1B: the tokens past its rows are absent)."""
  hf = {**shape.defaults, **hf}
  if hf.get("model_type") != shape.model_type:
    raise ConvertError(f"{source}: model_type={hf.get('model_type')!r}; --from=hf_"
                       f"{shape.model_type.split('_')[0]} converts {shape.model_type!r} "
                       "(--from=hf picks the family from model_type)")
  check_options(hf, {**_MUST_BE, **shape.must_be}, source)
  check_vocabulary(hf, tokenizer, source, other_rows=True)
  if tokenizer.bos_is_eos and set(tokenizer.absent_ids) != {0, 1, 3}:
    raise ConvertError(f"{source}: the tokenizer's bos_token is its eos_token but its "
                       "unk_token is a token of its own: an option this project lacks")
  heads = hf.get("num_attention_heads")
  kv_heads = hf.get("num_key_value_heads") or heads
  activation = activation_from_hf(hf.get("hidden_act", hf.get("hidden_activation", "silu")),
                                  source)
  return our_config(source, lambda: dict(
      vocab_size=tokenizer.vocab_size, d_model=hf["hidden_size"], num_heads=heads,
      num_kv_heads=None if kv_heads == heads else kv_heads, d_ff=hf["intermediate_size"],
      head_size=_head_size(hf), num_encoder_layers=0,
      num_decoder_layers=hf["num_hidden_layers"],
      max_len=hf.get("max_position_embeddings", 2048), dropout_rate=0.0,
      attention_dropout_rate=float(hf.get("attention_dropout", 0.0)), activation=activation,
      layer_norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
      tie_output=bool(hf.get("tie_word_embeddings", False)),
      bos_is_eos=tokenizer.bos_is_eos,
      absent_ids=(*tokenizer.absent_ids, *rowless_ids(hf["vocab_size"], tokenizer)),
      **{**dict(shape.fixed), **rope_of(hf, source), **shape.options(hf, source)}))


def _hf_config(shape: Shape, cfg: TransformerConfig, tokenizer: HFTokenizer) -> dict:
  """config.json of the family's model class computing our model."""
  return {
      "architectures": [shape.architecture], "model_type": shape.model_type,
      "vocab_size": table_rows(cfg, tokenizer), "hidden_size": cfg.d_model,
      "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.num_decoder_layers,
      "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.kv_heads,
      "head_dim": cfg.head_dim, "hidden_act": ACTIVATIONS[cfg.activation],
      "max_position_embeddings": cfg.max_len, "rms_norm_eps": cfg.layer_norm_epsilon,
      "rope_theta": cfg.rope_theta, "rope_parameters": hf_rope(cfg),
      "tie_word_embeddings": cfg.tie_output, "attention_bias": False, "mlp_bias": False,
      "attention_dropout": cfg.attention_dropout_rate, "initializer_range": 0.02,
      "bos_token_id": tokenizer.bos_id,
      "eos_token_id": eos_token_id(cfg, tokenizer),
      "use_cache": True, "dtype": "float32", **shape.hf_options(cfg)}


def _incompatibility(shape: Shape, cfg: TransformerConfig, tokenizer: object) -> str | None:
  """Why the family cannot express this (language) model, in one line naming the option;
  None if it can."""
  return (mismatch(cfg, shape.fixed, shape.title)
          or tokenizer_problem(cfg, tokenizer, HFTokenizer, f"{shape.architecture}'s "
                               "tokenizer is a Hugging Face tokenizer.json"))


# ------------------------------------------------------------------------- tensors
def tensor_names(cfg: TransformerConfig) -> list[tuple[str, str, int | None]]:
  """(our path, the family's key, the Linear's fan-in, or None for a vector: a norm's
  weight, a bias) of every tensor but the token embedding and lm_head. The keys are
  Llama's, with Qwen's q/k/v biases and Qwen3's and Gemma's q/k norms where our config has
  them; with sandwich norms, Gemma's four a layer."""
  d, attended = cfg.d_model, cfg.num_heads * cfg.head_dim
  names: list[tuple[str, str, int | None]] = [("decoder/final_norm/scale", "norm.weight", None)]
  for i in range(cfg.num_decoder_layers):
    ours, theirs = f"decoder/layer_{i}/", f"layers.{i}."
    attention, ffn = f"{ours}self_attention/", f"{ours}feed_forward/"
    if cfg.sandwich_norm:
      norms = [("self_attention_norm", "input_layernorm"),
               ("self_attention_output_norm", "post_attention_layernorm"),
               ("feed_forward_norm", "pre_feedforward_layernorm"),
               ("feed_forward_output_norm", "post_feedforward_layernorm")]
    else:
      norms = [("self_attention_norm", "input_layernorm"),
               ("feed_forward_norm", "post_attention_layernorm")]
    names += [(f"{ours}{a}/scale", f"{theirs}{b}.weight", None) for a, b in norms]
    for projection, key in (("query", "q"), ("key", "k"), ("value", "v")):
      names.append((f"{attention}{projection}/kernel", f"{theirs}self_attn.{key}_proj.weight", d))
      if cfg.qkv_bias:
        names.append((f"{attention}{projection}/bias", f"{theirs}self_attn.{key}_proj.bias",
                      None))
    if cfg.qk_norm:
      names += [(f"{attention}query_norm/scale", f"{theirs}self_attn.q_norm.weight", None),
                (f"{attention}key_norm/scale", f"{theirs}self_attn.k_norm.weight", None)]
    names += [(f"{attention}out/kernel", f"{theirs}self_attn.o_proj.weight", attended),
              (f"{ffn}wi/kernel", f"{theirs}mlp.gate_proj.weight", d),
              (f"{ffn}wi_up/kernel", f"{theirs}mlp.up_proj.weight", d),
              (f"{ffn}wo/kernel", f"{theirs}mlp.down_proj.weight", cfg.d_ff)]
  return names


def state_to_params(state: dict[str, np.ndarray], cfg: TransformerConfig,
                    tokenizer: HFTokenizer, source: str) -> dict:
  """Our parameter tree from the family's state_dict; names the first missing, unexpected
  or mis-shaped tensor."""
  tensors = StateDict(state, source, PREFIX, skipped=_BUFFERS)
  shapes = expected_shapes(cfg, decoder_only=True)
  params: dict = {}
  for ours, key, fan_in in tensor_names(cfg):
    shape = shapes[ours]
    size = int(np.prod(shape))
    if fan_in is None:
      value = tensors.take(key, (size,)).reshape(shape)
    else:
      value = linear_to_kernel(tensors.take(key, (size // fan_in, fan_in)), shape)
    trees.set_path(params, ours, value)
  # The tables' rows: the tokenizer's tokens, or as config.json's vocab_size says.
  rows, expected = tensors.rows("embed_tokens.weight"), table_rows(cfg, tokenizer)
  if rows < expected or (expected < tokenizer.size and rows != expected):
    raise ConvertError(f"{source}: embed_tokens.weight has {rows} rows, but config.json's "
                       f"vocab_size is {expected}")
  embedding = tensors.take("embed_tokens.weight", (rows, cfg.d_model))
  trees.set_path(params, "embedding/embedding", rows_to_ours(embedding, tokenizer))
  if cfg.tie_output:
    tensors.tied_output("lm_head.weight", "embed_tokens.weight",
                        "config.json says tie_word_embeddings=true")
  else:
    head = tensors.take("lm_head.weight", (rows, cfg.d_model))
    trees.set_path(params, "decoder/output_projection/kernel", rows_to_ours(head, tokenizer).T)
  tensors.check_all_taken()
  return params


def params_to_state(params: dict, cfg: TransformerConfig,
                    tokenizer: HFTokenizer) -> dict[str, np.ndarray]:
  """The family's state_dict (numpy) of our unrolled, separate-QKV parameters (a tied
  lm_head left out, as save_pretrained leaves it)."""
  flat = {k: np.asarray(v, np.float32) for k, v in trees.flatten(params).items()}
  state = {PREFIX + key: flat[ours].reshape(-1) if fan_in is None
           else kernel_to_linear(flat[ours], fan_in) for ours, key, fan_in in tensor_names(cfg)}
  rows = table_rows(cfg, tokenizer)
  state[PREFIX + "embed_tokens.weight"] = rows_to_theirs(flat["embedding/embedding"],
                                                          tokenizer, rows)
  if not cfg.tie_output:
    state["lm_head.weight"] = rows_to_theirs(flat["decoder/output_projection/kernel"].T,
                                             tokenizer, rows)
  return {k: np.ascontiguousarray(v) for k, v in state.items()}


# ------------------------------------------------------------------------- files
def read_tokenizer(directory: str) -> HFTokenizer:
  """The directory's tokenizer.json, with tokenizer_config.json (over the special tokens of
  special_tokens_map.json, which older uploads keep apart) and its chat template
  (data/chat_template.py)."""
  path = need_file(directory, "tokenizer.json", LAYOUT)
  config = {**optional_json(directory, "special_tokens_map.json"),
            **optional_json(directory, "tokenizer_config.json")}
  template = os.path.join(directory, "chat_template.jinja")   # transformers 5 saves it here
  if os.path.isfile(template):    # and reads it before tokenizer_config.json's
    with open(template, encoding="utf-8") as f:
      config["chat_template"] = f.read()
  with open(path, encoding="utf-8") as f:
    return HFTokenizer(f.read(), config)


def family(shape: Shape) -> Family:
  """The import and export of a Llama-shaped family."""
  return Family(
      f"hf_{shape.model_type.split('_')[0]}", shape.title, LAYOUT, read_tokenizer,
      lambda hf, tokenizer, source: _config_from_hf(shape, hf, tokenizer, source),
      state_to_params, lambda cfg, tokenizer: _incompatibility(shape, cfg, tokenizer),
      lambda cfg, tokenizer: _hf_config(shape, cfg, tokenizer), params_to_state)


# Llama: no sliding window (Mistral's is mistral.py's).
LLAMA = Shape("llama", "LlamaForCausalLM", "Llama", LLAMA_SHAPE + NO_WINDOW,
              must_be={"attention_bias": False, "sliding_window": None})
FAMILY = family(LLAMA)

# (config, params, run config, tokenizer, tokenizer) of a Llama save_pretrained directory;
# and an export of our model to one (which transformers' model class and AutoTokenizer load).
import_llama = FAMILY.read
write_hf_llama = FAMILY.write
