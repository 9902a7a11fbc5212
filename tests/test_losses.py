"""The label-smoothed loss, learning-rate schedules, the metrics and the synthetic data:
the pieces the train step and loop (tests/test_training.py) are built from.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import random_tokens, tiny_config

from configs.default import get_config
from transformer_jax.config import BOS_ID, EOS_ID, PAD_ID
from transformer_jax.data.synthetic import SyntheticData
from transformer_jax.errors import UserError
from transformer_jax.metrics import corpus_bleu, exact_match
from transformer_jax.options import OptimizerOptions
from transformer_jax.tasks.losses import cross_entropy_sums, smoothed_targets, smoothing_entropy
from transformer_jax.training.optimizers import make_optimizer, make_schedule, paper_schedule

# conftest.py puts the repository on sys.path and sets jax_default_matmul_precision=highest.


# ------------------------------------------------------------------------------ loss
# Jitted (one compilation per shape) instead of op by op, which is slower on a CPU.
cross_entropy_sums = jax.jit(cross_entropy_sums, static_argnums=2)

def _random_logits(seed: int, shape) -> jnp.ndarray:
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape) * 2.0, jnp.float32)


@pytest.mark.parametrize("smoothing", [0.1, 0.3])
def test_perfect_model_has_zero_smoothed_loss(smoothing):
  vocab = 7
  targets = jnp.array([[4, 5, 2, 0], [6, 2, 0, 0]], jnp.int32)
  perfect = jnp.log(smoothed_targets(targets, vocab, smoothing))
  sums = cross_entropy_sums(perfect, targets, smoothing)
  assert float(sums["weight"]) == 5.0
  assert abs(float(sums["loss"])) < 1e-5
  # Any other prediction costs more (Gibbs' inequality): the minimum is at the targets.
  other = cross_entropy_sums(perfect + _random_logits(0, perfect.shape), targets, smoothing)
  assert float(other["loss"]) > 1e-3


def test_smoothing_entropy_is_entropy_of_smoothed_targets():
  for vocab, eps in [(5, 0.1), (40, 0.1), (9, 0.5), (9, 0.0)]:
    q = np.asarray(smoothed_targets(jnp.array([3]), vocab, eps), np.float64)[0]
    np.testing.assert_allclose(q.sum(), 1.0, rtol=1e-6)
    assert q[3] == pytest.approx(1.0 - eps)
    entropy = -sum(p * math.log(p) for p in q if p > 0)
    assert smoothing_entropy(vocab, eps) == pytest.approx(entropy, rel=1e-5, abs=1e-6)


def test_unsmoothed_loss_is_nll():
  vocab = 9
  logits = _random_logits(1, (3, 5, vocab))
  targets = jnp.asarray(np.random.default_rng(2).integers(1, vocab, size=(3, 5)), jnp.int32)
  sums = cross_entropy_sums(logits, targets, 0.0)
  log_probs = np.asarray(jax.nn.log_softmax(logits, -1), np.float64)
  nll = -np.take_along_axis(log_probs, np.asarray(targets)[..., None], -1).sum()
  assert float(sums["loss"]) == pytest.approx(nll, rel=1e-5)
  assert float(sums["nll"]) == pytest.approx(nll, rel=1e-5)
  assert float(sums["weight"]) == 15.0
  hits = (np.asarray(logits).argmax(-1) == np.asarray(targets)).sum()
  assert float(sums["correct"]) == hits
  # With smoothing, "nll" is still the plain NLL while "loss" changes.
  smoothed = cross_entropy_sums(logits, targets, 0.1)
  assert float(smoothed["nll"]) == pytest.approx(nll, rel=1e-5)
  assert float(smoothed["loss"]) != pytest.approx(nll, rel=1e-3)


@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.4])
def test_closed_form_loss_equals_the_sum_over_smoothed_targets(smoothing):
  """The loss in closed form (no smoothed-target array) equals sum_k q_k * -log p_k with q
  materialised, as optax computes it, in value and in gradient."""
  vocab = 11
  logits = _random_logits(5, (4, 6, vocab))
  targets = jnp.asarray(np.random.default_rng(6).integers(0, vocab, size=(4, 6)), jnp.int32)
  weights = (targets != PAD_ID).astype(jnp.float32)

  def explicit(z):
    per_token = optax.softmax_cross_entropy(z, smoothed_targets(targets, vocab, smoothing))
    return ((per_token - smoothing_entropy(vocab, smoothing)) * weights).sum()

  closed = lambda z: cross_entropy_sums(z, targets, smoothing)["loss"]
  assert float(closed(logits)) == pytest.approx(float(explicit(logits)), rel=1e-5)
  np.testing.assert_allclose(jax.grad(closed)(logits), jax.grad(explicit)(logits),
                             rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_padding_does_not_contribute(smoothing):
  vocab = 9
  targets = np.array([[4, 5, 2, 0, 0], [6, 2, 0, 0, 0], [7, 8, 5, 2, 0]], np.int32)
  logits = _random_logits(3, targets.shape + (vocab,))
  sums = cross_entropy_sums(logits, jnp.asarray(targets), smoothing)
  assert float(sums["weight"]) == float((targets != PAD_ID).sum()) == 9.0
  # Changing the logits at padded positions changes nothing.
  noise = _random_logits(4, logits.shape) * jnp.asarray(targets == PAD_ID)[..., None]
  changed = cross_entropy_sums(logits + 100.0 * noise, jnp.asarray(targets), smoothing)
  for key in ("loss", "nll", "correct", "weight"):
    assert float(changed[key]) == pytest.approx(float(sums[key]), rel=1e-6), key
  # ... but changing a real position does.
  bump = jnp.zeros_like(logits).at[0, 0, 3].set(5.0)
  assert float(cross_entropy_sums(logits + bump, jnp.asarray(targets), smoothing)["loss"]) != \
      pytest.approx(float(sums["loss"]), rel=1e-4)
  # Same sums as the unpadded rows on their own.
  per_row = [cross_entropy_sums(logits[i:i + 1, :n], jnp.asarray(targets[i:i + 1, :n]),
                                smoothing) for i, n in enumerate((3, 2, 4))]
  assert float(sums["loss"]) == pytest.approx(sum(float(s["loss"]) for s in per_row), rel=1e-5)


# ------------------------------------------------------------------------------ schedules
def opt_cfg(**overrides) -> OptimizerOptions:
  cfg = get_config().optimizer
  cfg.update(overrides)
  return OptimizerOptions.from_dict(cfg.to_dict())


def test_paper_schedule_formula():
  d_model, warmup = 512, 4000
  schedule = paper_schedule(d_model, warmup)
  for count in (0, 1, 9, 999, 3998, 3999, 4000, 4001, 10000, 99999):
    step = count + 1
    expected = d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)
    assert float(schedule(count)) == pytest.approx(expected, rel=1e-5), count
  assert float(paper_schedule(d_model, warmup, scale=2.0)(10)) == \
      pytest.approx(2.0 * float(schedule(10)), rel=1e-6)


@pytest.mark.parametrize("peak", [2e-3, 1e-4])
def test_rsqrt_schedule_peaks_at_learning_rate(peak):
  warmup = 50
  schedule = make_schedule(opt_cfg(schedule="rsqrt", learning_rate=peak, warmup_steps=warmup),
                           d_model=64, num_train_steps=1000)
  values = np.array([float(schedule(c)) for c in range(4 * warmup)])
  assert int(values.argmax()) == warmup - 1           # step = count + 1 = warmup
  assert values.max() == pytest.approx(peak, rel=1e-5)
  assert (np.diff(values[:warmup]) > 0).all() and (np.diff(values[warmup:]) < 0).all()
  # Inverse square root decay after the peak.
  assert values[4 * warmup - 1] == pytest.approx(peak * (warmup / (4 * warmup)) ** 0.5,
                                                 rel=1e-4)


def test_rsqrt_schedule_default_peak_is_the_papers():
  d_model, warmup = 64, 100
  schedule = make_schedule(opt_cfg(schedule="rsqrt", learning_rate=0.0, warmup_steps=warmup),
                           d_model, 1000)
  for count in (0, 50, 99, 500):
    assert float(schedule(count)) == pytest.approx(float(paper_schedule(d_model, warmup)(count)),
                                                   rel=1e-6)
  assert float(schedule(warmup - 1)) == pytest.approx(d_model ** -0.5 * warmup ** -0.5,
                                                      rel=1e-5)


def test_warmup_cosine_schedule():
  peak, warmup, total = 1e-3, 10, 110
  schedule = make_schedule(opt_cfg(schedule="warmup_cosine", learning_rate=peak,
                                    warmup_steps=warmup), 64, total)
  values = np.array([float(schedule(c)) for c in range(total + 1)])
  assert values[0] == pytest.approx(0.0, abs=1e-12)
  assert values[warmup] == pytest.approx(peak, rel=1e-5)
  assert values.max() == pytest.approx(peak, rel=1e-5)
  assert (np.diff(values[:warmup + 1]) > 0).all()                  # linear warmup
  assert (np.diff(values[warmup:]) <= 1e-12).all()                  # then decays
  assert values[warmup + (total - warmup) // 2] == pytest.approx(peak / 2, rel=1e-3)
  assert values[total] == pytest.approx(0.0, abs=1e-9)


def test_constant_schedule():
  peak = 3e-4
  flat = make_schedule(opt_cfg(schedule="constant", learning_rate=peak, warmup_steps=0), 64, 50)
  assert all(float(flat(c)) == pytest.approx(peak) for c in (0, 1, 10, 1000))
  warm = make_schedule(opt_cfg(schedule="constant", learning_rate=peak, warmup_steps=10), 64, 50)
  assert float(warm(0)) == pytest.approx(0.0, abs=1e-12)
  assert float(warm(5)) == pytest.approx(peak / 2, rel=1e-5)
  assert all(float(warm(c)) == pytest.approx(peak) for c in (10, 11, 1000))


def test_invalid_schedule_and_optimizer_settings_name_the_field():
  with pytest.raises(ValueError, match="optimizer.schedule"):
    make_schedule(opt_cfg(schedule="linear"), 64, 100)
  with pytest.raises(ValueError, match="optimizer.warmup_steps"):
    make_schedule(opt_cfg(schedule="warmup_cosine", warmup_steps=-1), 64, 100)
  with pytest.raises(ValueError, match="optimizer.warmup_steps"):
    make_schedule(opt_cfg(schedule="rsqrt", warmup_steps=0), 64, 100)
  with pytest.raises(ValueError, match="optimizer.learning_rate"):
    make_schedule(opt_cfg(schedule="constant", learning_rate=0.0), 64, 100)
  with pytest.raises(ValueError, match="optimizer.name"):
    make_optimizer(opt_cfg(name="sgd"), optax.constant_schedule(1e-3))


def test_adamw_on_matrices_only_decays_no_bias_or_norm():
  """decay_matrices_only: with zero gradients one AdamW step shrinks the weight matrices and
  embeddings alone; biases (attention's are (heads, d_k) matrices), norm scales unchanged."""
  from transformer_jax.modules.models import LanguageModel
  cfg = tiny_config(num_encoder_layers=0, norm_position="pre", positional="learned")
  params = nn.meta.unbox(LanguageModel(cfg).init(jax.random.PRNGKey(0),
                                                 jnp.ones((1, 4), jnp.int32)))["params"]
  tx = make_optimizer(opt_cfg(name="adamw", weight_decay=0.1, decay_matrices_only=True,
                              clip_grad_norm=0.0), optax.constant_schedule(1e-2))
  zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
  updates, _ = tx.update(zeros, tx.init(params), params)
  changed = {jax.tree_util.keystr(path): bool(jnp.any(u != 0))
             for path, u in jax.tree_util.tree_flatten_with_path(updates)[0]}
  assert changed["['embedding']['embedding']"]
  assert changed["['decoder']['layer_0']['self_attention']['query']['kernel']"]
  assert not changed["['decoder']['layer_0']['self_attention']['query']['bias']"]
  for name, moved in changed.items():
    assert moved == (name.endswith("['kernel']") or "embedding']" in name), name


# -------------------------------------------------------------------------- metrics
def test_exact_match():
  assert exact_match(["1 2 3", "4 5"], ["1 2 3", "4 5"]) == 100.0
  assert exact_match(["1 2 3", "4 5"], ["1 2 3", "4 6"]) == 50.0
  assert exact_match(["1  2 ", "x"], ["1 2", "y"]) == 50.0       # whitespace-normalised
  assert exact_match([], []) == 0.0
  with pytest.raises(ValueError):
    exact_match(["a"], ["a", "b"])


def test_corpus_bleu():
  refs = ["the cat sat on the mat", "a quick brown fox jumps over it"]
  assert corpus_bleu(refs, refs) == pytest.approx(100.0)
  partial = corpus_bleu(["the cat sat on a mat", "a quick brown dog jumps over it"], refs)
  assert 0.0 < partial < 100.0
  assert corpus_bleu(["zzz yyy xxx www", "vvv uuu ttt sss"], refs) < partial
  with pytest.raises(ValueError):
    corpus_bleu(refs, refs[:1])


# ---------------------------------------------------------------------- synthetic data
def test_synthetic_batches_are_a_function_of_seed_and_index():
  a, b = SyntheticData("add", 1, 4, seed=7), SyntheticData("add", 1, 4, seed=7)
  for x, y in zip(a.batch("train", 3, 16).values(), b.batch("train", 3, 16).values()):
    np.testing.assert_array_equal(x, y)
  assert a.examples("train", 3, 16) != a.examples("train", 4, 16)
  assert a.examples("train", 3, 16) != SyntheticData("add", 1, 4, seed=8).examples("train", 3, 16)
  assert a.eval_examples(16) != a.examples("train", 0, 16)      # Separate streams.
  it = a.train_iterator(None, 16)
  np.testing.assert_array_equal(next(it)["src"], a.batch("train", 0, 16)["src"])
  it.set_state({"next_index": 3})                               # The state is the position.
  np.testing.assert_array_equal(next(it)["src"], a.batch("train", 3, 16)["src"])
  assert it.get_state() == {"next_index": 4}
  np.testing.assert_array_equal(next(it)["src"], a.batch("train", 4, 16)["src"])


@pytest.mark.parametrize("name", ["reverse", "sort", "add"])
def test_synthetic_targets_are_correct(name):
  task = SyntheticData(name, 1, 6, seed=1)
  pairs = task.examples("train", 0, 200)
  for source, target in pairs:
    symbols = source.split()
    if name == "reverse":
      assert target.split() == symbols[::-1]
    elif name == "sort":
      assert target.split() == sorted(symbols, key=int)
    else:
      plus = symbols.index("+")
      a, b = symbols[:plus], symbols[plus + 1:]
      assert 1 <= len(a) <= 6 and 1 <= len(b) <= 6 and "+" not in b
      assert int("".join(target.split())) == int("".join(a)) + int("".join(b))
    if name != "add":
      assert 1 <= len(symbols) <= 6 and all(s.isdigit() for s in symbols)
  lengths = {len(s.split()) for s, _ in pairs}
  assert len(lengths) > 1                                       # Varied lengths.

  # The id batch is the text, padded: tgt_in = BOS + target, tgt_out = target + EOS.
  batch = task.encode_batch(pairs[:20])
  assert batch["src"].shape == (20, task.src_length)
  assert batch["tgt_in"].shape == batch["tgt_out"].shape == (20, task.tgt_length)
  for row, (source, target) in enumerate(pairs[:20]):
    t = task.vocab.encode(target)
    assert task.vocab.decode(batch["src"][row]) == source
    assert batch["tgt_in"][row, 0] == BOS_ID
    assert list(batch["tgt_in"][row, 1:len(t) + 1]) == t
    assert list(batch["tgt_out"][row, :len(t) + 1]) == t + [EOS_ID]
    assert (batch["tgt_out"][row, len(t) + 1:] == PAD_ID).all()


def test_synthetic_task_rejects_bad_settings():
  with pytest.raises(ValueError, match="data.synthetic_task"):
    SyntheticData("copy", 1, 4, seed=0)
  with pytest.raises(ValueError, match="min_length"):
    SyntheticData("reverse", 0, 4, seed=0)
  with pytest.raises(ValueError, match="max_length"):
    SyntheticData("reverse", 5, 4, seed=0)


@pytest.mark.parametrize("tie_output", [True, False])
def test_the_loss_over_tiles_of_the_targets_is_the_whole_loss_with_its_gradients(tie_output):
  """model.loss_tiles: the output layer and the label-smoothed loss a slice of positions at
  a time give the same sums and the same parameter gradients as one pass over all logits."""
  from transformer_jax import Transformer
  from transformer_jax.tasks.losses import tiled_cross_entropy_sums
  cfg = tiny_config(tie_output=tie_output, share_embeddings=tie_output,
                    target_vocab_size=None if tie_output else 40, final_logits_bias=True)
  model = Transformer(cfg)
  src, tgt = jnp.asarray(random_tokens(0, 3, 7)), jnp.asarray(random_tokens(1, 3, 8))
  targets = jnp.asarray(random_tokens(2, 3, 8)).at[0, 5:].set(0)    # padding is skipped
  params = model.init(jax.random.PRNGKey(0), src, tgt)["params"]
  params = jax.tree_util.tree_map(lambda x: x + 0.05 * jnp.sin(jnp.arange(x.size).reshape(
      x.shape)), params)   # a nonzero final_logits_bias, so that its gradient is compared

  def whole(p):
    return cross_entropy_sums(model.apply({"params": p}, src, tgt, train=True), targets, 0.1)

  def tiled(p):
    hidden = model.apply({"params": p}, src, tgt, train=True, return_hidden=True)
    project = lambda h: model.apply({"params": p}, h, train=True,
                                    method=Transformer.output_logits)
    return tiled_cross_entropy_sums(project, hidden, targets, 0.1, tiles=4)

  want, got = whole(params), tiled(params)
  for key in ("loss", "nll", "correct", "weight"):
    np.testing.assert_allclose(got[key], want[key], rtol=1e-5)
  assert float(want["weight"]) == 21.0
  grads = [jax.grad(lambda p: f(p)["loss"])(params) for f in (whole, tiled)]
  for w, g in zip(*(jax.tree_util.tree_leaves(x) for x in grads)):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)
  with pytest.raises(UserError, match="loss_tiles=3 does not divide the 8 target positions"):
    tiled_cross_entropy_sums(lambda h: h, jnp.zeros((1, 8, 2)), targets[:1], 0.1, tiles=3)
