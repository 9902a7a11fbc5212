"""The decoder-only language model: its options (rotary positions, grouped-query attention,
RMSNorm, gated feed-forward, no biases), causality and packing, sampling through the KV
cache against recomputation, the task's stream windows and bits per character, and a tiny
training run continued by predict."""

from __future__ import annotations

import gzip
import io
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close

from transformer_jax import LanguageModel, TransformerConfig
from transformer_jax.config import BOS_ID, PAD_ID
from transformer_jax.data.tokenizer import CharVocab
from transformer_jax.errors import UserError
from transformer_jax.inputs import InputError
from transformer_jax.modules.embedding import rotary
from transformer_jax.options import DecodeOptions
from transformer_jax.sampling import compiled_generate, continuations
from transformer_jax.serving.line_policy import escape_line, unescape_line
from transformer_jax.tasks.lm import LanguageModelTask, text_pieces

VOCAB = 30


def lm_config(**overrides) -> TransformerConfig:
  params = dict(vocab_size=VOCAB, d_model=32, num_heads=4, d_ff=64, num_encoder_layers=0,
                num_decoder_layers=2, dropout_rate=0.0, max_len=24, norm_position="pre",
                attention_impl="einsum")
  return TransformerConfig(**{**params, **overrides})


MODERN = dict(positional="rotary", norm_type="rms", gated_ffn=True, activation="silu",
              num_kv_heads=2, use_bias=False)
# Gemma 3's options at toy size (alternating windows, each layer type's rope), and Qwen2's
# with Llama 3.1's rope scaling and a window (tests/test_lm_options.py).
GEMMA = dict(MODERN, norm_type="rms_plus_one", sandwich_norm=True, qk_norm=True,
             scale_embeddings=True, activation="gelu", head_size=16, attention_scale=0.2,
             sliding_window=3, layer_types=("sliding", "full"), local_rope_theta=100.0,
             rope_scaling="linear", rope_scaling_factor=4.0)
QWEN = dict(MODERN, qkv_bias=True, rope_scaling="llama3", rope_scaling_factor=8.0,
            rope_original_max_len=8, sliding_window=4)


def _params(cfg: TransformerConfig, seed: int = 0):
  return LanguageModel(cfg).init(jax.random.key(seed), jnp.ones((1, 4), jnp.int32))["params"]


def _tokens(seed: int, batch: int, length: int) -> np.ndarray:
  return np.random.default_rng(seed).integers(4, VOCAB, (batch, length)).astype(np.int32)


def test_rotary_dot_products_depend_on_relative_position_only():
  rng = np.random.default_rng(0)
  q, k = (jnp.asarray(rng.normal(size=(1, 1, 2, 8)), jnp.float32) for _ in range(2))
  def dot(pq: int, pk: int) -> jax.Array:
    rq = rotary(q, jnp.array([[pq]]), 10000.0)
    rk = rotary(k, jnp.array([[pk]]), 10000.0)
    return jnp.sum(rq * rk, -1)
  assert_close(dot(3, 1), dot(10, 8), atol=1e-5)
  assert_close(dot(0, 0), jnp.sum(q * k, -1), atol=1e-6)     # position 0 rotates nothing
  assert not np.allclose(dot(3, 1), dot(3, 2), atol=1e-3)


@pytest.mark.parametrize("options", [{}, MODERN], ids=["gpt", "modern"])
def test_language_model_is_causal(options):
  cfg = lm_config(**options)
  params, model = _params(cfg), LanguageModel(cfg)
  tokens = _tokens(1, 2, 10)
  changed = tokens.copy()
  changed[:, 6:] = _tokens(2, 2, 4)
  a, b = model.apply({"params": params}, tokens), model.apply({"params": params}, changed)
  assert_close(a[:, :6], b[:, :6], atol=1e-5)
  assert not np.allclose(a[:, 6:], b[:, 6:], atol=1e-3)


@pytest.mark.parametrize("options", [{}, MODERN, GEMMA, QWEN],
                         ids=["gpt", "modern", "gemma", "qwen"])
def test_packed_documents_equal_each_alone(options):
  cfg = lm_config(**options)
  params, model = _params(cfg), LanguageModel(cfg)
  first, second = _tokens(3, 1, 5), _tokens(4, 1, 7)
  row = np.concatenate([first, second, np.zeros((1, 2), np.int32)], 1)
  positions = np.array([list(range(5)) + list(range(7)) + [0, 0]], np.int32)
  segments = np.array([[1] * 5 + [2] * 7 + [0, 0]], np.int32)
  packed = model.apply({"params": params}, row, positions=positions, segment_ids=segments)
  assert_close(packed[:, :5], model.apply({"params": params}, first), atol=1e-5)
  assert_close(packed[:, 5:12], model.apply({"params": params}, second), atol=1e-5)


@pytest.mark.parametrize("attention_impl", ["einsum", "xla"])
def test_grouped_query_attention_is_multi_head_with_shared_keys(attention_impl):
  """GQA with 2 key/value heads for 4 query heads equals MHA whose key and value heads are
  the GQA ones, each repeated for its group of query heads (the einsum and XLA paths read
  the shared heads without repeating them); with as many KV heads as heads it is MHA."""
  gqa = lm_config(num_kv_heads=2, attention_impl=attention_impl)
  params = _params(gqa)
  mha_params = jax.tree_util.tree_map(lambda x: x, params)
  for layer in ("layer_0", "layer_1"):
    attention = mha_params["decoder"][layer]["self_attention"]
    for name in ("key", "value"):
      attention[name] = jax.tree_util.tree_map(
          lambda x: jnp.repeat(x, 2, axis=x.ndim - 2),       # the heads axis of (D,) K, H
          attention[name])
  tokens = _tokens(5, 2, 9)
  assert_close(LanguageModel(gqa).apply({"params": params}, tokens),
               LanguageModel(lm_config()).apply({"params": mha_params}, tokens), atol=1e-5)
  full = lm_config(num_kv_heads=4)
  assert_close(LanguageModel(full).apply({"params": _params(full)}, tokens),
               LanguageModel(lm_config()).apply({"params": _params(lm_config())}, tokens),
               atol=1e-6)


def test_options_shape_the_parameters():
  flat = jax.tree_util.tree_flatten_with_path(_params(lm_config(**MODERN)))[0]
  names = ["/".join(str(getattr(k, "key", k)) for k in path) for path, _ in flat]
  assert not [n for n in names if n.endswith("bias")]                          # use_bias
  assert any("wi_up" in n for n in names)                                      # gated_ffn
  assert not any("position_embedding" in n for n in names)                     # rotary
  key = [x for path, x in flat if "layer_0/self_attention/key" in
         "/".join(str(getattr(k, "key", k)) for k in path)][0]
  assert key.shape == (32, 2, 8)                                               # 2 KV heads
  with pytest.raises(Exception, match="num_kv_heads"):
    lm_config(num_kv_heads=3)


@pytest.mark.parametrize("options", [{}, dict(MODERN, scan_layers=True)], ids=["gpt", "scan"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cached_sampling_equals_recomputing_the_prefix(options, temperature):
  cfg = lm_config(**options)
  params = _params(cfg)
  prompts = np.zeros((3, 6), np.int32)
  for b, length in enumerate([0, 3, 6]):
    prompts[b, :length] = _tokens(6 + b, 1, length)[0]
  args = (params, prompts, temperature, 5, 0.9, 0)
  cached = np.asarray(compiled_generate(cfg, 12)(*args))
  recomputed = np.asarray(compiled_generate(cfg, 12, use_cache=False)(*args))
  np.testing.assert_array_equal(cached, recomputed)
  assert cached.shape == (3, 12)
  assert all(0 < len(c) <= 12 for c in continuations(cached))     # EOS may end one early


def test_cache_rows_at_their_own_positions_equal_the_whole_model():
  """The KV cache writes each row at its own positions, as a served batch's rows are: one
  call writes 8 tokens of each row (past each row's length, other tokens: what a padded
  prompt leaves), then each row steps a token at a time from its own length, overwriting
  them. The logits are the whole model's over each row (rotary positions, grouped keys,
  scanned layers: the cache's rows are its second axis)."""
  cfg = lm_config(**MODERN, scan_layers=True)
  params, model = _params(cfg), LanguageModel(cfg)
  rows, lengths, width = _tokens(9, 3, 12), np.array([3, 7, 5]), 8
  first = np.where(np.arange(width) < lengths[:, None], rows[:, :width], _tokens(10, 3, width))
  whole = jax.jit(model.apply)({"params": params}, rows)
  cached = jax.jit(lambda variables, tokens, positions: model.apply(
      variables, tokens, positions=positions, decode=True, mutable=["cache"]))
  variables = jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(
      lambda: model.apply({"params": params}, jnp.zeros((3, cfg.max_len), jnp.int32),
                          decode=True, mutable=["cache"])[1]))
  logits, variables = cached({"params": params, **variables}, first,
                             np.tile(np.arange(width), (3, 1)))
  for b, length in enumerate(lengths):
    assert_close(logits[b, :length], whole[b, :length], atol=1e-5)
  for step in range(4):
    positions = lengths + step
    logits, variables = cached({"params": params, **variables},
                               rows[np.arange(3), positions][:, None], positions[:, None])
    assert_close(logits[:, 0], whole[np.arange(3), positions], atol=1e-5)


def _task(cfg: TransformerConfig) -> LanguageModelTask:
  return LanguageModelTask(cfg, tokenizer=CharVocab(list("abcdefghijklmnopqrstuvwxyz")))


def test_same_seed_same_text_and_rows_independent():
  cfg = lm_config()
  task, params = _task(cfg), _params(cfg)
  decode = DecodeOptions(max_new_tokens=10, temperature=1.0, seed=7)
  prompts = [np.array([5, 6]), np.array([], np.int32), np.array([7])]
  once = task.continue_prompts(params, prompts, decode)
  assert once == task.continue_prompts(params, prompts, decode)
  assert once[1:] == task.continue_prompts(params, prompts[1:], decode)   # rows alone
  assert once[::-1] == task.continue_prompts(params, prompts[::-1], decode)
  other = task.continue_prompts(params, prompts, DecodeOptions(max_new_tokens=10,
                                                                temperature=1.0, seed=8))
  assert other != once


def test_long_prompt_keeps_its_last_tokens():
  cfg = lm_config()
  task, params = _task(cfg), _params(cfg)
  decode = DecodeOptions(max_new_tokens=6, temperature=0.0)
  tail = _tokens(9, 1, cfg.max_len - 6 - 1)[0]
  long_prompt = np.concatenate([_tokens(8, 1, 30)[0], tail])
  assert (task.continue_prompts(params, [long_prompt], decode)
          == task.continue_prompts(params, [tail], decode))
  with pytest.raises(InputError, match="max_new_tokens"):
    task.continue_prompts(params, [tail], DecodeOptions(max_new_tokens=cfg.max_len))


def test_stream_windows_predict_every_token_once_and_bits_per_character():
  text = "To be, or not to be:\nthat is the question.\n\n\nWhether 'tis nobler\n"
  records = text_pieces(text)
  assert "".join(r["text"] for r in records) == text and len(records) == 2
  vocab = CharVocab.build([text])
  assert vocab.decode(vocab.encode(text)) == text
  task = LanguageModelTask(lm_config(vocab_size=vocab.vocab_size), tokenizer=vocab)
  batches = task.eval_windows(records, batch_size=2, length=16)
  targets = np.concatenate([b.arrays["targets"].reshape(-1) for b in batches])
  assert vocab.decode(targets[targets != PAD_ID]) == text
  inputs = batches[0].arrays["inputs"]
  assert (inputs[:, 0] == BOS_ID).all()
  np.testing.assert_array_equal(inputs[0, 1:], batches[0].arrays["targets"][0, :-1])
  params = _params(task.model_config)

  def eval_step(params, arrays):
    return task.loss_sums(params, arrays, None, train=False)
  metrics, _ = task.evaluate(params, batches, eval_step,
                             DecodeOptions(max_new_tokens=4, temperature=0.0))
  assert math.isclose(metrics["bits_per_character"], metrics["loss"] / math.log(2),
                      rel_tol=1e-5)


def test_loss_over_tiles_equals_one_pass_with_its_gradients():
  """model.loss_tiles for the lm task: the output layer a slice of positions at a time gives
  the task's loss sums and parameter gradients of one pass (padding skipped); a tile count
  that is not a positive integer is one line naming the field."""
  cfg = lm_config(**MODERN)
  tokens = _tokens(3, 2, 12)
  targets = np.concatenate([tokens[:, 1:], np.full((2, 1), PAD_ID, np.int32)], axis=1)
  targets[1, 7:] = PAD_ID
  batch = {"inputs": tokens, "targets": targets,
           "positions": np.broadcast_to(np.arange(12, dtype=np.int32), (2, 12)),
           "segment_ids": (targets != PAD_ID).astype(np.int32) | 1}
  params, rng = _params(cfg), jax.random.key(1)   # no dropout: the key is unused
  tasks = [LanguageModelTask(cfg, tokenizer=CharVocab(list("abc")), label_smoothing=0.1,
                             head={"loss_tiles": tiles}) for tiles in (1, 4)]
  sums = [t.loss_sums(params, batch, rng, train=True) for t in tasks]
  for key in ("loss", "nll", "correct", "weight"):
    assert_close(sums[1][key], sums[0][key], rtol=1e-5)
  assert float(sums[0]["weight"]) == 11 + 7
  grads = [jax.grad(lambda p, t=t: t.loss_sums(p, batch, rng, train=True)["loss"])(params)
           for t in tasks]
  for whole, tiled in zip(*(jax.tree_util.tree_leaves(g) for g in grads)):
    assert_close(tiled, whole, rtol=1e-4, atol=1e-6)
  for bad in (0, 1.5, True):
    with pytest.raises(UserError, match=f"model.loss_tiles={bad!r}: must be an integer"):
      LanguageModelTask(cfg, tokenizer=CharVocab(list("abc")), head={"loss_tiles": bad})


def test_prompt_lines_escape_newlines_and_backslashes():
  for text in ["a\nb", "back\\slash\\n", "", "\\\n", "cr\r\nlf\\r"]:
    assert unescape_line(escape_line(text)) == text
    assert len(escape_line(text).splitlines()) <= 1


@pytest.fixture(scope="module")
def lm_data(tmp_path_factory) -> str:
  """A made-up text's train.txt.gz and val.txt.gz."""
  data = tmp_path_factory.mktemp("lm_data")
  words = "the king and the queen spoke of the crown and the sword\n".split(" ")
  rng = np.random.default_rng(0)
  for split, count in (("train", 3000), ("val", 300)):
    with gzip.open(data / f"{split}.txt.gz", "wt") as f:
      f.write(" ".join(rng.choice(words, count)))
  return str(data)


@pytest.fixture(scope="module")
def trained_lm(tmp_path_factory, lm_data):
  """A tiny character LM trained a few steps on the made-up text (stream layout)."""
  from configs import shakespeare_char
  from transformer_jax.training import loop
  config = shakespeare_char.get_config()
  config.data.dir = lm_data
  config.num_train_steps = 4
  config.eval_every_steps = 4
  config.checkpoint_every_steps = 4
  config.batch_size = 8
  config.data.max_length = config.data.eval_max_length = 16
  config.decode.max_new_tokens = 6
  config.model.update(dict(d_model=32, num_heads=2, d_ff=64, num_decoder_layers=1, max_len=16,
                           **MODERN))
  workdir = str(tmp_path_factory.mktemp("lm_run"))
  loop.train_and_evaluate(config, workdir)
  return workdir


def test_trained_lm_predicts_one_line_per_prompt(trained_lm):
  from transformer_jax import predict
  out = io.StringIO()
  lines = b"the king\\n\n\nqueen\n"
  count = predict.predict(trained_lm, io.BytesIO(lines), out, None, None, 8,
                          max_new_tokens=5, temperature=1.0, seed=3)
  assert count == 3 and len(out.getvalue().splitlines()) == 3
  again = io.StringIO()
  predict.predict(trained_lm, io.BytesIO(lines), again, None, None, 1, max_new_tokens=5,
                  temperature=1.0, seed=3)
  assert again.getvalue() == out.getvalue()                  # batch-independent, seeded


def test_served_artifact_answers_as_predict(trained_lm, tmp_path):
  """The StableHLO artifact continues prompts as predict does (same seed, same text), an
  empty prompt from BOS, with the same escapes; a character outside the vocabulary is
  refused by both."""
  from transformer_jax import predict
  from transformer_jax.export import export_stablehlo
  from transformer_jax.serving.lines import Served
  artifact = export_stablehlo(trained_lm, None, str(tmp_path / "lm"), None, None)
  served = Served.load(artifact)
  prompts = ["the king\\n", "", "queen and the", "and\\nthe"]
  out = io.StringIO()
  predict.predict(trained_lm, io.BytesIO("".join(p + "\n" for p in prompts).encode()), out,
                  None, None, 8)
  assert served.predict(prompts) == out.getvalue().splitlines()
  assert all(served.predict(prompts))
  with pytest.raises(InputError, match="not in the model's vocabulary"):
    served.predict(["the Z"])


def _tiny_lm_config(data_dir: str, steps: int):
  from configs import shakespeare_char
  config = shakespeare_char.get_config()
  config.data.dir = data_dir
  config.update(dict(num_train_steps=steps, eval_every_steps=100, checkpoint_every_steps=3,
                     log_every_steps=1, batch_size=8))
  config.data.max_length = config.data.eval_max_length = 16
  config.decode.max_new_tokens = 4
  config.eval.num_samples = 0
  config.model.update(dict(d_model=16, num_heads=2, d_ff=32, num_decoder_layers=1,
                           max_len=16))
  return config


def _losses(workdir: str) -> dict[int, float]:
  import json
  import os
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def test_stream_training_resumes_exactly(lm_data, tmp_path):
  """Six steps straight, and three then three more from the checkpoint, give the same
  losses: the window order is part of the checkpoint."""
  from transformer_jax.training import loop
  data_dir = lm_data
  straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
  loop.train_and_evaluate(_tiny_lm_config(data_dir, 6), straight)
  loop.train_and_evaluate(_tiny_lm_config(data_dir, 3), resumed)
  loop.train_and_evaluate(_tiny_lm_config(data_dir, 6), resumed)
  assert _losses(straight) == pytest.approx(_losses(resumed), rel=1e-6)
  assert len(_losses(straight)) == 6


def test_missing_train_file_is_one_line(tmp_path, capsys):
  from test_bad_inputs import run_user_error

  from transformer_jax.training import loop
  (tmp_path / "data").mkdir()
  (tmp_path / "data" / "val.txt").write_text("some text\n")
  status, lines = run_user_error(
      lambda: loop.train_and_evaluate(_tiny_lm_config(str(tmp_path / "data"), 2),
                                      str(tmp_path / "w")), capsys)
  assert status == 2 and len(lines) == 1
  assert "train.txt" in lines[0] and lines[0].startswith("error:")


def test_lm1b_documents_from_tfds_mock_data(tmp_path):
  """TFDS's lm1b (mock data) as documents packed with segment ids: trains and evaluates."""
  import tensorflow_datasets as tfds

  from transformer_jax.training import loop
  config = _tiny_lm_config("", 2)
  config.data.update(dict(source="tfds", name="lm1b", eval_split="test", layout="documents",
                          too_long="split"))
  with tfds.testing.mock_data(num_examples=24):
    metrics = loop.train_and_evaluate(config, str(tmp_path / "w"))
  assert np.isfinite(metrics["eval/bits_per_character"])
