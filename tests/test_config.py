"""TransformerConfig: presets, validation messages that name the field, from_dict/to_dict."""

from __future__ import annotations

import dataclasses
import importlib
import json
import re

import pytest

from transformer_jax import TransformerConfig

V = 100


def _raises_naming(field: str, **kwargs):
  with pytest.raises(ValueError) as info:
    TransformerConfig(**{"vocab_size": V, **kwargs})
  assert re.search(rf"\b{field}\b", str(info.value)), str(info.value)
  return str(info.value)


# ---------------------------------------------------------------------------------- presets
def test_base_preset_is_the_papers_base_model():
  cfg = TransformerConfig.base(37000)
  assert (cfg.vocab_size, cfg.tgt_vocab_size) == (37000, 37000)
  assert (cfg.num_encoder_layers, cfg.num_decoder_layers) == (6, 6)
  assert (cfg.d_model, cfg.d_ff, cfg.num_heads, cfg.head_dim) == (512, 2048, 8, 64)
  assert cfg.dropout_rate == 0.1
  assert (cfg.attention_dropout_rate, cfg.activation_dropout_rate) == (0.0, 0.0)
  assert cfg.share_embeddings and cfg.tie_output
  assert (cfg.norm_position, cfg.positional, cfg.activation) == ("post", "sinusoidal", "relu")
  assert (cfg.dtype, cfg.param_dtype) == ("float32", "float32")


def test_big_preset_is_the_papers_big_model():
  cfg = TransformerConfig.big(37000)
  assert (cfg.num_encoder_layers, cfg.num_decoder_layers) == (6, 6)
  assert (cfg.d_model, cfg.d_ff, cfg.num_heads, cfg.head_dim) == (1024, 4096, 16, 64)
  assert cfg.dropout_rate == 0.3
  assert (cfg.norm_position, cfg.positional) == ("post", "sinusoidal")


def test_small_preset_and_overrides():
  cfg = TransformerConfig.small(V)
  assert (cfg.d_model, cfg.d_ff, cfg.num_heads) == (64, 128, 4)
  assert (cfg.num_encoder_layers, cfg.num_decoder_layers, cfg.max_len) == (2, 2, 128)
  # Overrides win over preset values, in every preset.
  assert TransformerConfig.small(V, d_model=32, num_heads=2).d_model == 32
  assert TransformerConfig.big(V, dropout_rate=0.1).dropout_rate == 0.1
  assert TransformerConfig.base(V, num_encoder_layers=2).num_encoder_layers == 2


def test_presets_are_validated_too():
  with pytest.raises(ValueError, match=r"\bd_model\b"):
    TransformerConfig.big(V, num_heads=12)         # 1024 % 12 != 0


def test_config_is_frozen_and_hashable():
  cfg = TransformerConfig.small(V)
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.d_model = 8
  assert hash(cfg) == hash(TransformerConfig.small(V))
  changed = cfg.replace(d_model=32, num_heads=2)
  assert changed.d_model == 32 and cfg.d_model == 64


def test_replace_is_validated():
  with pytest.raises(ValueError, match=r"\bdropout_rate\b"):
    TransformerConfig.small(V).replace(dropout_rate=1.5)


# ---------------------------------------------------------------------------- validation
@pytest.mark.parametrize("field, value", [
    (field, value)
    for field in ("vocab_size", "d_model", "num_heads", "d_ff", "max_len")
    for value in (0, -1, 2.5, True, "8")
])
def test_positive_integer_fields(field, value):
  _raises_naming(field, **{field: value})


@pytest.mark.parametrize("field", ["num_encoder_layers", "num_decoder_layers"])
@pytest.mark.parametrize("value", [-1, 1.5, None])
def test_layer_counts_must_be_non_negative_integers(field, value):
  _raises_naming(field, **{field: value})


@pytest.mark.parametrize("field", ["num_encoder_layers", "num_decoder_layers"])
def test_zero_layers_are_allowed(field):
  assert getattr(TransformerConfig(vocab_size=V, **{field: 0}), field) == 0


@pytest.mark.parametrize("d_model, num_heads", [(30, 4), (512, 7), (4, 8)])
def test_d_model_must_be_divisible_by_num_heads(d_model, num_heads):
  message = _raises_naming("d_model", d_model=d_model, num_heads=num_heads)
  assert "num_heads" in message


@pytest.mark.parametrize("field", ["dropout_rate", "attention_dropout_rate",
                                   "activation_dropout_rate"])
@pytest.mark.parametrize("value", [-0.1, 1.0, 1.5, float("nan"), "0.1"])
def test_dropout_rates_must_be_in_unit_interval(field, value):
  _raises_naming(field, **{field: value})


@pytest.mark.parametrize("field", ["dropout_rate", "attention_dropout_rate",
                                   "activation_dropout_rate"])
def test_dropout_rate_bounds_that_are_allowed(field):
  assert getattr(TransformerConfig(vocab_size=V, **{field: 0.0}), field) == 0.0
  assert getattr(TransformerConfig(vocab_size=V, **{field: 0.99}), field) == 0.99


@pytest.mark.parametrize("field, value", [
    ("norm_position", "middle"), ("norm_position", "Pre"),
    ("positional", "rope"), ("positional", None),
    ("activation", "tanh"), ("sinusoidal_layout", "split"),
    ("attention_impl", "flash"),
    ("dtype", "float64"), ("dtype", "bf16"),
    ("param_dtype", "int8"),
    ("remat_policy", "sometimes"), ("remat_policy", None),
    ("weight_init", "normal"),
])
def test_unknown_choices_are_rejected(field, value):
  _raises_naming(field, **{field: value})


@pytest.mark.parametrize("field, value", [
    ("norm_position", "pre"), ("positional", "learned"), ("activation", "gelu"),
    ("attention_impl", "einsum"), ("attention_impl", "cudnn"), ("dtype", "bfloat16"),
    ("remat_policy", "full"), ("remat_policy", "dots"), ("remat_policy", "dots_no_batch"),
    ("scan_layers", True), ("fused_qkv", True),
    ("activation", "swish"), ("activation", "silu"), ("sinusoidal_layout", "halves"),
    ("final_logits_bias", True), ("zero_decoder_start", True), ("weight_init", "gpt2"),
])
def test_known_choices_are_accepted(field, value):
  assert getattr(TransformerConfig(vocab_size=V, **{field: value}), field) == value


def test_share_embeddings_needs_equal_vocabularies():
  message = _raises_naming("share_embeddings", target_vocab_size=V + 1)
  assert str(V) in message and str(V + 1) in message
  cfg = TransformerConfig(vocab_size=V, target_vocab_size=V + 1, share_embeddings=False)
  assert cfg.tgt_vocab_size == V + 1
  assert TransformerConfig(vocab_size=V, target_vocab_size=V).tgt_vocab_size == V
  assert TransformerConfig(vocab_size=V).tgt_vocab_size == V


@pytest.mark.parametrize("value", [0, -3, 2.5, True])
def test_target_vocab_size_must_be_positive(value):
  _raises_naming("target_vocab_size", target_vocab_size=value, share_embeddings=False)


@pytest.mark.parametrize("field", ["scan_layers", "fused_qkv", "final_logits_bias",
                                   "zero_decoder_start"])
@pytest.mark.parametrize("value", [1, "True", None])
def test_speed_flags_must_be_booleans(field, value):
  _raises_naming(field, **{field: value})


@pytest.mark.parametrize("value", [0, -1e-6])
def test_layer_norm_epsilon_must_be_positive(value):
  _raises_naming("layer_norm_epsilon", layer_norm_epsilon=value)


@pytest.mark.parametrize("value", [(2,), (V,), (-1,), "0", 0])
def test_absent_ids_are_ids_of_the_vocabulary_but_eos(value):
  _raises_naming("absent_ids", absent_ids=value)


def test_absent_ids_through_json_stay_a_hashable_tuple():
  """A saved config gives the ids back as a JSON list; the compiled-function caches key on
  the config, so it must hash as the original does."""
  cfg = TransformerConfig.small(V, absent_ids=(0, 3))
  again = TransformerConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
  assert again == cfg and hash(again) == hash(cfg) and again.no_token_ids == (0, 3)
  assert TransformerConfig.small(V, bos_is_eos=True).no_token_ids == (0, 1, 3)


# ------------------------------------------------------------------------- dict round trip
def test_from_dict_names_unknown_keys():
  with pytest.raises(ValueError) as info:
    TransformerConfig.from_dict({"vocab_size": V, "num_layers": 6, "hidden": 3})
  message = str(info.value)
  assert "num_layers" in message and "hidden" in message


def test_from_dict_validates_values():
  with pytest.raises(ValueError, match=r"\bactivation\b"):
    TransformerConfig.from_dict({"vocab_size": V, "activation": "tanh"})


def test_to_dict_from_dict_round_trip():
  cfg = TransformerConfig.big(V, norm_position="pre", positional="learned",
                              target_vocab_size=V + 3, share_embeddings=False)
  values = cfg.to_dict()
  assert set(values) == {f.name for f in dataclasses.fields(TransformerConfig)}
  assert TransformerConfig.from_dict(values) == cfg


@pytest.mark.parametrize("name", ["default", "multi30k", "sst2", "conll2003", "imdb",
                                  "wmt14_ende_base", "wmt14_ende_big"])
def test_every_model_field_can_be_set_from_the_command_line(name):
  """A field a config file does not list cannot be overridden by a flag (ml_collections
  refuses unknown keys), so each config lists every TransformerConfig field."""
  config = importlib.import_module(f"configs.{name}").get_config()
  settable = {f.name for f in dataclasses.fields(TransformerConfig)} - {
      "vocab_size", "target_vocab_size", "max_segments"}     # the data's
  assert settable <= set(config.model.keys()), settable - set(config.model.keys())


@pytest.mark.parametrize("group, options", [
    ("optimizer", "OptimizerOptions"), ("decode", "DecodeOptions"), ("eval", "EvalOptions"),
    ("mesh", "MeshOptions"), ("distributed", "DistributedOptions"), ("lora", "LoraOptions"),
    ("pretrain", "PretrainOptions")])
def test_every_option_of_a_group_can_be_set_from_the_command_line(group, options):
  """The same for the run's option groups: configs/default.py lists each field."""
  from transformer_jax import options as run_options
  fields = {f.name for f in dataclasses.fields(getattr(run_options, options))}
  listed = set(importlib.import_module("configs.default").get_config()[group].keys())
  assert fields <= listed, fields - listed
