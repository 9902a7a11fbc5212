"""The attention-map command: the weights it draws are the model's (softmax rows, causal
decoder, one map per layer of each stack), and it writes PNGs or names the bad argument."""

from __future__ import annotations

import numpy as np
import pytest
from test_training import tiny_run_config

from transformer_jax import attention_maps
from transformer_jax.predict import Predictor
from transformer_jax.training import loop


@pytest.fixture(scope="module")
def predictor(tmp_path_factory) -> Predictor:
  workdir = str(tmp_path_factory.mktemp("maps") / "run")
  config = tiny_run_config(num_train_steps=4, checkpoint_every_steps=4, eval_every_steps=4)
  config.model.num_decoder_layers = 2
  loop.train_and_evaluate(config, workdir)
  return Predictor(workdir)


def test_weights_are_softmax_rows_and_the_decoder_is_causal(predictor):
  weights, labels = attention_maps.attention_for(predictor, "3 1 4 1 5", beam_size=2)
  cfg = predictor.model_config
  assert [len(weights[k]) for k in attention_maps.KINDS] == [
      cfg.num_encoder_layers, cfg.num_decoder_layers, cfg.num_decoder_layers]
  src, tgt = len(labels["source"]), len(labels["target"])
  assert labels["source"] == "3 1 4 1 5".split() and labels["target"][0] == "<s>"
  shapes = {"encoder": (src, src), "decoder": (tgt, tgt), "cross": (tgt, src)}
  for kind, layers in weights.items():
    for w in layers:
      assert w.shape == (cfg.num_heads,) + shapes[kind]
      np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-5)
  for w in weights["decoder"]:
    assert np.all(np.triu(w, k=1) == 0.0)         # no query sees a later target token


def test_command_writes_one_png_per_kind(predictor, tmp_path):
  paths = attention_maps.write_maps(predictor, "9 8 7", str(tmp_path), layer=-1, beam_size=1)
  assert [p.rsplit("/", 1)[1] for p in paths] == [
      "encoder_layer0.png", "decoder_layer1.png", "cross_layer1.png"]
  for path in paths:
    with open(path, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("kwargs, message", [
    (dict(layer=5), "--layer=5: the encoder stack has 1 layers"),
    (dict(head=7), "--head=7: the model has 2 heads"),
])
def test_bad_layer_or_head_is_named(predictor, tmp_path, kwargs, message):
  with pytest.raises(ValueError, match=message):
    attention_maps.write_maps(predictor, "1 2", str(tmp_path), **kwargs)
