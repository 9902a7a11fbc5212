"""The options today's open language models brought (TransformerConfig: sliding windows and
layer types, rope scaling, q/k norms, head_size, qkv biases, Gemma's 1 + w norms and four
norms a layer, the attention scale), each by a property: a window hides exactly the keys it
should, in training masks, the KV cache, splash attention (packed rows: test_lm.py); scaled rotary
frequencies are where Llama 3.1 puts them; the options train from scratch. Against
transformers: tests/test_convert_families.py."""

from __future__ import annotations

import attention_cases as cases
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close
from test_kernels import assert_paths_agree
from test_lm import (  # noqa: F401, F811  (lm_data: a fixture)
  GEMMA,
  MODERN,
  QWEN,
  VOCAB,
  _losses,
  _params,
  _tiny_lm_config,
  _tokens,
  lm_config,
  lm_data,
)

from transformer_jax import TransformerConfig, trees
from transformer_jax.errors import UserError
from transformer_jax.modules import kernels
from transformer_jax.modules.attention import dot_product_attention
from transformer_jax.modules.embedding import rotary_frequencies
from transformer_jax.modules.models import LanguageModel
from transformer_jax.sampling import compiled_generate


def _changed_at(tokens: np.ndarray, position: int) -> np.ndarray:
  changed = tokens.copy()
  changed[:, position] = 4 + (changed[:, position] - 3) % (VOCAB - 4)
  return changed


@pytest.mark.parametrize("attention_impl", ["einsum", "xla"])
def test_a_sliding_window_sees_exactly_its_keys(attention_impl):
  """One sliding layer of window 4: the output at position t moves with the token at t - 3,
  not with the one at t - 4 (the window counts the query itself, as transformers does)."""
  cfg = lm_config(**MODERN, num_decoder_layers=1, sliding_window=4,
                  attention_impl=attention_impl)
  params, model = _params(cfg), LanguageModel(cfg)
  tokens = _tokens(1, 2, 12)
  out = model.apply({"params": params}, tokens)
  far = model.apply({"params": params}, _changed_at(tokens, 5))
  near = model.apply({"params": params}, _changed_at(tokens, 6))
  assert_close(out[:, 9:], far[:, 9:], atol=1e-6)             # 9 - 5 = 4: out of the window
  assert not np.allclose(out[:, 9], near[:, 9], atol=1e-4)    # 9 - 6 = 3: in it
  full = lm_config(**MODERN, num_decoder_layers=1, attention_impl=attention_impl)
  assert not np.allclose(LanguageModel(full).apply({"params": params}, _changed_at(tokens, 5)
                                                   )[:, 9], out[:, 9], atol=1e-4)


def test_full_layers_of_a_mixed_stack_see_every_key():
  """layer_types: a full layer after a sliding one sees the whole prefix; two sliding
  layers of window 3 see 4 tokens back, no further."""
  mixed = lm_config(**GEMMA)
  params, tokens = _params(mixed), _tokens(2, 2, 14)
  out = LanguageModel(mixed).apply({"params": params}, tokens)
  moved = LanguageModel(mixed).apply({"params": params}, _changed_at(tokens, 0))
  assert not np.allclose(out[:, 13], moved[:, 13], atol=1e-4)
  sliding = lm_config(**{**GEMMA, "layer_types": ("sliding", "sliding")})
  out = LanguageModel(sliding).apply({"params": params}, tokens)
  assert_close(out[:, 9:], LanguageModel(sliding).apply({"params": params},
                                                          _changed_at(tokens, 4))[:, 9:],
               atol=1e-6)
  assert not np.allclose(out[:, 9], LanguageModel(sliding).apply(
      {"params": params}, _changed_at(tokens, 5))[:, 9], atol=1e-4)


@pytest.mark.parametrize("options", [GEMMA, QWEN], ids=["gemma", "qwen"])
def test_cached_decoding_past_the_window_equals_recomputing(options):
  """The KV cache keeps every position and reads each layer's window: 16 tokens past
  windows of 3 and 4, greedy and sampled, equal the whole model run over each prefix."""
  cfg = lm_config(**options)
  params = _params(cfg)
  prompts = np.zeros((3, 5), np.int32)
  for b, length in enumerate([0, 2, 5]):
    prompts[b, :length] = _tokens(6 + b, 1, length)[0]
  for temperature in (0.0, 1.0):
    args = (params, prompts, temperature, 0, 1.0, 0)
    cached = np.asarray(compiled_generate(cfg, 16)(*args))
    np.testing.assert_array_equal(cached, np.asarray(
        compiled_generate(cfg, 16, use_cache=False)(*args)))


def test_rotary_frequencies_scale_as_llama_3_1():
  """"llama3": frequencies whose wavelength is below original_max_len / high_freq_factor
  are kept, those above original_max_len / low_freq_factor divided by the factor, the ones
  between in between; "linear" divides all; a sliding layer's local base is unscaled."""
  base = dict(vocab_size=8, d_model=64, num_heads=1, positional="rotary", rope_theta=10000.0)
  plain = rotary_frequencies(TransformerConfig(**base))
  llama3 = rotary_frequencies(TransformerConfig(
      **base, rope_scaling="llama3", rope_scaling_factor=8.0, rope_original_max_len=64))
  wavelengths = 2 * np.pi / plain
  short, long = wavelengths < 64 / 4, wavelengths > 64 / 1
  assert short.any() and long.any() and (~short & ~long).any()
  np.testing.assert_allclose(llama3[short], plain[short], rtol=1e-7)
  np.testing.assert_allclose(llama3[long], plain[long] / 8, rtol=1e-6)
  between = ~short & ~long
  assert np.all(llama3[between] < plain[between]) and np.all(
      llama3[between] > plain[between] / 8)
  linear = TransformerConfig(**base, rope_scaling="linear", rope_scaling_factor=4.0,
                             local_rope_theta=100.0)
  np.testing.assert_allclose(rotary_frequencies(linear), plain / 4, rtol=1e-6)
  np.testing.assert_allclose(rotary_frequencies(linear, sliding=True),
                             100.0 ** (-np.arange(32) / 32), rtol=1e-6)


def test_plus_one_rms_norm_starts_as_rms_norm_and_the_scale_is_the_default_s():
  """Gemma's 1 + w norm with w = 0 is RMSNorm with unit scales (its start); an explicit
  attention_scale of 1/sqrt(H) is the default."""
  rms = lm_config(**dict(GEMMA, norm_type="rms", attention_scale=0.25))
  plus_one = lm_config(**dict(GEMMA, attention_scale=0.0))
  params, tokens = _params(rms), _tokens(7, 2, 9)
  zeros = jax.tree_util.tree_map_with_path(
      lambda path, x: jnp.zeros_like(x) if "norm" in jax.tree_util.keystr(path) else x, params)
  assert_close(LanguageModel(plus_one).apply({"params": zeros}, tokens),
               LanguageModel(rms).apply({"params": params}, tokens), atol=1e-5)


def _shapes(cfg: TransformerConfig) -> dict[str, tuple[int, ...]]:
  return {path: x.shape for path, x in trees.flatten(nn.meta.unbox(_params(cfg))).items()}


def test_the_options_shape_the_parameters():
  gemma, qwen, layer = _shapes(lm_config(**GEMMA)), _shapes(lm_config(**QWEN)), "decoder/layer_0/"
  assert gemma[f"{layer}self_attention/query/kernel"] == (32, 4, 16)        # head_size 16
  assert gemma[f"{layer}self_attention/query_norm/scale"] == (16,)          # qk_norm
  assert f"{layer}feed_forward_output_norm/scale" in gemma                  # sandwich_norm
  assert f"{layer}self_attention/key/bias" in qwen                          # qkv_bias
  assert f"{layer}self_attention/out/bias" not in qwen


@pytest.mark.parametrize("change, field", [
    (dict(layer_types=("sliding",)), "layer_types"),
    (dict(layer_types=("sliding", "local")), "layer_types"),
    (dict(layer_types=("sliding", "full"), sliding_window=0), "layer_types"),
    (dict(scan_layers=True), "scan_layers"),
    (dict(rope_scaling="yarn"), "rope_scaling"),
    (dict(rope_scaling="llama3", rope_original_max_len=0), "rope_original_max_len"),
    (dict(rope_scaling="linear", rope_scaling_factor=0.5), "rope_scaling_factor"),
    (dict(sliding_window=-1), "sliding_window"),
    (dict(attention_scale=-1.0), "attention_scale"),
    (dict(end_ids=(1,)), "end_ids"),
    (dict(end_ids=(VOCAB,)), "end_ids"),
    (dict(head_size=7), "positional"),
])
def test_bad_option_values_name_the_field(change, field):
  with pytest.raises(UserError, match=f"TransformerConfig.{field}="):
    lm_config(**{**GEMMA, **change})


def _window_case(causal: bool) -> cases.Case:
  rows = [[50, 30, 48], [100]] if causal else [[128], [90]]
  case = cases.make_case(rows, None, t=128, packed=causal, causal=causal)
  return case._replace(mask=case.mask.with_window(17))


@pytest.mark.parametrize("causal", [True, False], ids=["causal_packed", "bidirectional"])
def test_splash_takes_the_sliding_window_natively(causal):
  """Splash attention's local mask (interpret mode) gives the einsum path's output and
  gradients under a window of 17 keys, packed causal rows and padded bidirectional ones."""
  def splash(q, k, v, mask):
    return kernels.splash_attention(q, k, v, mask.query_segments, mask.key_segments,
                                    causal=mask.causal, window=mask.window, interpret=True)
  assert_paths_agree(splash, _window_case(causal))


@pytest.mark.parametrize("implementation", ["pallas", "cudnn"])
def test_kernels_without_a_window_refuse_one_in_one_line(implementation):
  case = _window_case(True)
  with pytest.raises(kernels.KernelError, match=f"sliding_window=17: the {implementation} "
                     "kernel .* has no sliding window") as error:
    dot_product_attention(case.q, case.k, case.v, case.mask, implementation)
  assert "\n" not in str(error.value)


def test_the_options_train_from_scratch(lm_data, tmp_path):  # noqa: F811
  """A language model with Gemma 3's options trains through the trainer from its config
  (finite losses, falling over 30 steps), and its saved config holds them."""
  import json
  import os

  from transformer_jax.training import loop
  config = _tiny_lm_config(lm_data, 30)
  config.model.update(dict(GEMMA, num_decoder_layers=2))
  workdir = str(tmp_path / "run")
  loop.train_and_evaluate(config, workdir)
  losses = list(_losses(workdir).values())
  print(f"\nlosses: first {losses[0]:.3f}, last {losses[-1]:.3f}")
  assert len(losses) == 30 and np.all(np.isfinite(losses))
  assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.1
  with open(os.path.join(workdir, "config.json")) as f:
    model = json.load(f)["model"]
  assert (model["layer_types"], model["sliding_window"]) == (["sliding", "full"], 3)


def test_a_window_with_a_kernel_without_one_is_refused_before_any_data_is_read():
  from configs import default
  from transformer_jax.training.experiment import Experiment
  config = default.get_config()
  config.model.update(dict(attention_impl="pallas", sliding_window=8))
  config.data.source = "local"
  config.data.dir = "/nonexistent"     # never read: the refusal comes first
  with pytest.raises(UserError, match=r"model.sliding_window=8: the pallas kernel"):
    Experiment.create(config, data=False, vocab_sizes=(40, None))
