"""Training: the jitted train step
(gradient accumulation, reproducibility, dropout keys, the NaN guard), the train/eval loop
end to end (outputs, resumption, stopping on a non-finite loss). The loss, schedules, metrics
and synthetic data: tests/test_losses.py.

Jitted steps are compiled once per (task, optimizer) and shared between tests; states are
built fresh for every call because the train step donates its state argument.
"""

from __future__ import annotations

import functools
import glob
import json
import math
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from data_wrappers import BatchesWrapper, SourceWrapper
from test_losses import opt_cfg

from configs.default import get_config
from transformer_jax.config import TransformerConfig
from transformer_jax.data.synthetic import SyntheticData
from transformer_jax.options import RunOptions
from transformer_jax.predict import Predictor
from transformer_jax.tasks import Seq2SeqTask
from transformer_jax.training import experiment, loop
from transformer_jax.training.optimizers import make_optimizer
from transformer_jax.training.state import create_train_state
from transformer_jax.training.steps import make_train_step

# conftest.py puts the repository on sys.path and sets jax_default_matmul_precision=highest.


# ------------------------------------------------------------------------ train step
DATA = SyntheticData("reverse", 2, 5, seed=0)
BATCH = 8


def _model_config(dropout: float = 0.0) -> TransformerConfig:
  return TransformerConfig.small(
      vocab_size=DATA.vocab.vocab_size, d_model=32, num_heads=2, d_ff=64,
      num_encoder_layers=1, num_decoder_layers=1, max_len=16, dropout_rate=dropout)


class ScaledLossTask(Seq2SeqTask):
  """Multiplies the loss by the mean of batch["loss_scale"] (one value per example, so
  micro-batching splits it too) when present: NaN there makes a step's loss and gradient
  non-finite on demand, without another compilation."""

  def loss_sums(self, params, batch, rng, train):
    sums = super().loss_sums(params, batch, rng, train)
    if "loss_scale" in batch:
      sums = {**sums, "loss": sums["loss"] * jnp.mean(batch["loss_scale"])}
    return sums


LR = 1e-2
_SCHEDULE = optax.constant_schedule(LR)
_OPTIMIZERS = {
    # The project's optimizer (Adam, gradient clipping).
    "adam": make_optimizer(opt_cfg(name="adam", clip_grad_norm=1.0), _SCHEDULE),
    # Plain SGD + momentum: its update is linear in the gradient. (Adam's first update is
    # about lr * sign(g), which turns float rounding noise in a gradient that is exactly 0
    # in theory, e.g. the attention key bias, into lr-sized differences.)
    "sgd": optax.sgd(1.0, momentum=0.9),
}


@functools.lru_cache(maxsize=None)
def _task(dropout: float) -> ScaledLossTask:
  return ScaledLossTask(_model_config(dropout), label_smoothing=0.1)


def _train_step(dropout: float, grad_accum_steps: int = 1, optimizer: str = "adam"):
  return _cached_train_step(dropout, grad_accum_steps, optimizer)   # One key per step kind.


@functools.lru_cache(maxsize=None)
def _cached_train_step(dropout: float, grad_accum_steps: int, optimizer: str):
  schedule = _SCHEDULE if optimizer == "adam" else optax.constant_schedule(1.0)
  return make_train_step(_task(dropout), _OPTIMIZERS[optimizer], schedule, grad_accum_steps)


_init_fn = jax.jit(lambda key: _task(0.0).init_params(key))


@functools.lru_cache(maxsize=None)
def _initial_params(dropout: float, seed: int):
  del dropout  # The dropout rate does not change the parameters: one compiled init.
  return _init_fn(jax.random.PRNGKey(seed))


def _fresh_state(dropout: float = 0.0, seed: int = 0, optimizer: str = "adam"):
  """A new state with its own buffers (the step donates its input)."""
  params = jax.tree_util.tree_map(jnp.array, _initial_params(dropout, seed))  # copies
  return create_train_state(params, _OPTIMIZERS[optimizer], seed)


def _batch(index: int, loss_scale: float = 1.0) -> dict:
  """Train batch `index`; every batch has the same structure, so each step compiles once."""
  return {**DATA.batch("train", index, BATCH),
          "loss_scale": np.full((BATCH,), loss_scale, np.float32)}


def _np_tree(tree):
  return jax.tree_util.tree_map(np.asarray, jax.device_get(tree))


def _assert_trees_equal(a, b):
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
    np.testing.assert_array_equal(x, y)


def test_gradient_accumulation_matches_full_batch():
  initial = _np_tree(create_train_state(_initial_params(0.0, 0), _OPTIMIZERS["sgd"], 0).params)
  batch = _batch(0)
  new1, metrics1 = _train_step(0.0, 1, "sgd")(_fresh_state(optimizer="sgd"), batch)
  new2, metrics2 = _train_step(0.0, 2, "sgd")(_fresh_state(optimizer="sgd"), batch)
  leaves0 = jax.tree_util.tree_leaves(initial)
  leaves1 = jax.tree_util.tree_leaves(_np_tree(new1.params))
  leaves2 = jax.tree_util.tree_leaves(_np_tree(new2.params))
  for x0, x1, x2 in zip(leaves0, leaves1, leaves2, strict=True):
    np.testing.assert_allclose(x2, x1, rtol=1e-5, atol=1e-6)
  # The step moved the parameters well beyond the tolerance, so the check has teeth.
  moved = max(float(np.abs(x1 - x0).max()) for x0, x1 in zip(leaves0, leaves1))
  assert moved > 1e-3
  for key in ("loss", "accuracy", "perplexity", "grad_norm"):
    assert float(metrics2[key]) == pytest.approx(float(metrics1[key]), rel=1e-5), key
  assert int(new1.step) == int(new2.step) == 1


def test_training_is_reproducible_from_the_seed():
  def run():
    state = _fresh_state(dropout=0.1, seed=3)
    losses = []
    for i in range(3):
      state, metrics = _train_step(0.1)(state, _batch(i))
      losses.append(float(metrics["loss"]))
    return _np_tree(state.params), _np_tree(state.opt_state), losses
  params_a, opt_a, losses_a = run()
  params_b, opt_b, losses_b = run()
  _assert_trees_equal(params_a, params_b)
  _assert_trees_equal(opt_a, opt_b)
  assert losses_a == losses_b
  # A different seed gives a different model.
  other = _np_tree(_initial_params(0.1, 4))
  assert not all(np.array_equal(x, y) for x, y in zip(jax.tree_util.tree_leaves(other),
                                                      jax.tree_util.tree_leaves(params_a)))


def _loss_at_step(dropout: float, step: int, optimizer: str = "adam") -> float:
  state = _fresh_state(dropout, optimizer=optimizer)
  state = state.replace(step=jnp.array(step, jnp.int32))
  _, metrics = _train_step(dropout, 1, optimizer)(state, _batch(0))
  return float(metrics["loss"])


def test_dropout_mask_depends_on_step():
  """Same params, batch and base key; only the step number differs -> different dropout
  masks (the key is fold_in(rng, step)) -> different losses. Without dropout the step number
  changes nothing, and the same step repeats exactly."""
  assert _loss_at_step(0.1, 0) == _loss_at_step(0.1, 0)
  assert _loss_at_step(0.1, 0) != _loss_at_step(0.1, 1)
  assert _loss_at_step(0.1, 1) != _loss_at_step(0.1, 7)
  assert _loss_at_step(0.0, 0, "sgd") == _loss_at_step(0.0, 1, "sgd")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_step_leaves_state_unchanged(bad):
  step = _train_step(0.1)
  state, metrics = step(_fresh_state(0.1), _batch(0, loss_scale=1.0))
  assert int(metrics["nonfinite"]) == 0
  before_params, before_opt = _np_tree(state.params), _np_tree(state.opt_state)

  state, metrics = step(state, _batch(1, loss_scale=bad))
  assert int(metrics["nonfinite"]) == 1
  assert not np.isfinite(float(metrics["loss"]))
  assert int(state.step) == 2                      # The skipped step is still counted.
  _assert_trees_equal(_np_tree(state.params), before_params)
  _assert_trees_equal(_np_tree(state.opt_state), before_opt)

  # Training goes on from the kept state with finite updates.
  state, metrics = step(state, _batch(2, loss_scale=1.0))
  assert int(metrics["nonfinite"]) == 0
  leaves = jax.tree_util.tree_leaves(_np_tree(state.params))
  assert all(np.isfinite(x).all() for x in leaves)
  assert any(not np.array_equal(x, y) for x, y in
             zip(leaves, jax.tree_util.tree_leaves(before_params)))


def test_a_finite_step_is_optax_s_update_of_the_mean_gradient():
  """The step's guarded update (a branch on the loss and gradient being finite) equals the
  plain optax update of the gradient of the mean loss, computed here by hand."""
  state = _fresh_state(0.0)
  params, opt_state = _np_tree(state.params), _np_tree(state.opt_state)
  batch = _batch(0)
  task = _task(0.0)

  def mean_loss(p):
    sums = task.loss_sums(p, batch, jax.random.PRNGKey(0), True)   # dropout 0: any key
    return sums["loss"] / jnp.maximum(sums["weight"], 1.0)

  @jax.jit   # one compiled program instead of op-by-op dispatch (seconds, not tens)
  def by_hand(params, opt_state):
    updates, opt_state = _OPTIMIZERS["adam"].update(jax.grad(mean_loss)(params), opt_state,
                                                    params)
    return optax.apply_updates(params, updates), opt_state

  want, want_opt = by_hand(params, opt_state)
  got, metrics = _train_step(0.0)(state, batch)
  assert int(metrics["nonfinite"]) == 0
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(_np_tree(got.params))[0],
                          jax.tree_util.tree_leaves(_np_tree(want))):
    # A key bias's gradient is rounding noise (softmax ignores a shift shared by a query's
    # scores), and Adam's first step is about lr * sign(gradient): not comparable.
    if "['key']['bias']" not in jax.tree_util.keystr(path):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)   # updates are ~LR
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(_np_tree(got.opt_state))[0],
                          jax.tree_util.tree_leaves(_np_tree(want_opt))):
    np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-9, err_msg=jax.tree_util.keystr(path))


def test_check_finite_policies():
  host = [(5, {"nonfinite": 0, "loss": 1.5}), (6, {"nonfinite": 1, "loss": float("nan")}),
          (7, {"nonfinite": 1, "loss": float("nan")})]
  with pytest.raises(loop.NonFiniteLossError, match=r"step 6\b"):
    loop._check_finite(host, "stop")
  assert loop._check_finite(host, "skip") == host
  assert loop._check_finite(host[:1], "stop") == host[:1]


def test_train_step_rejects_bad_accumulation():
  with pytest.raises(ValueError, match="grad_accum_steps"):
    make_train_step(_task(0.0), _OPTIMIZERS["adam"], _SCHEDULE, 0)


# ---------------------------------------------------------------------- train loop
def tiny_run_config(**overrides) -> ml_collections.ConfigDict:
  """configs/default.py shrunk to seconds on a CPU, with the fields the tests rely on
  pinned. The rsqrt schedule does not depend on num_train_steps, so a run extended by
  resuming follows the same learning rates as one run straight through."""
  config = get_config()
  config.seed = 0
  config.num_train_steps = 30
  config.log_every_steps = 10
  config.eval_every_steps = 30
  config.checkpoint_every_steps = 10
  config.keep_checkpoints = 3
  config.batch_size = 16
  config.grad_accum_steps = 1
  config.label_smoothing = 0.0
  config.nonfinite = "stop"
  config.data.update(dict(source="synthetic", synthetic_task="reverse", min_length=2,
                          max_length=5))
  config.decode.update(dict(beam_size=4, alpha=0.6))
  config.eval.update(dict(examples=20, batch_size=20))
  config.model.update(dict(d_model=32, num_heads=2, d_ff=64, num_encoder_layers=1,
                           num_decoder_layers=1, max_len=16, dropout_rate=0.0,
                           attention_dropout_rate=0.0, activation_dropout_rate=0.0))
  config.optimizer.update(dict(name="adam", schedule="rsqrt", learning_rate=3e-3,
                               warmup_steps=10, clip_grad_norm=1.0))
  for key, value in overrides.items():
    target = config
    *parents, leaf = key.split(".")
    for p in parents:
      target = target[p]
    target[leaf] = value
  return config


def _read_metrics(workdir: str) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


def _without_perf(lines: list[dict], after: int) -> list[dict]:
  """Lines after step `after`, without the timing-dependent perf/* values (and without the
  lines that only held those)."""
  stripped = [{k: v for k, v in line.items() if not k.startswith("perf/")}
              for line in lines if line["step"] > after]
  return [line for line in stripped if len(line) > 1]


def _checkpoint_steps(workdir: str) -> list[int]:
  directory = os.path.join(workdir, loop.CHECKPOINT_DIR)
  if not os.path.isdir(directory):
    return []
  return sorted(int(n) for n in os.listdir(directory) if n.isdigit())


def test_train_and_evaluate_writes_outputs_and_resumes(tmp_path):
  workdir = str(tmp_path / "run")
  final = loop.train_and_evaluate(tiny_run_config(), workdir)

  lines = _read_metrics(workdir)
  assert all(isinstance(line["step"], int) for line in lines)
  train_lines = [line for line in lines if "train/loss" in line]
  eval_lines = [line for line in lines if "eval/exact_match" in line]
  assert [line["step"] for line in train_lines] == [10, 20, 30]
  assert [line["step"] for line in eval_lines] == [30]
  for line in train_lines:
    assert {"train/loss", "train/accuracy", "train/learning_rate", "train/grad_norm",
            "perf/tokens_per_sec", "perf/steps_per_sec", "train/nonfinite_steps"} <= set(line)
    assert line["perf/tokens_per_sec"] > 0 and math.isfinite(line["train/loss"])
    assert line["train/nonfinite_steps"] == 0
  # Training learns something: the loss goes down.
  assert train_lines[-1]["train/loss"] < train_lines[0]["train/loss"]
  ev = eval_lines[0]
  assert {"eval/loss", "eval/accuracy", "eval/perplexity", "eval/bleu"} <= set(ev)
  assert 0.0 <= ev["eval/exact_match"] <= 100.0 and 0.0 <= ev["eval/accuracy"] <= 1.0
  assert final == pytest.approx({k: v for k, v in ev.items() if k != "step"})

  with open(os.path.join(workdir, "config.json")) as f:
    saved = json.load(f)
  assert saved["num_train_steps"] == 30
  assert saved["model"]["d_model"] == 32
  assert saved["model"]["vocab_size"] == DATA.vocab.vocab_size   # Resolved from the data.
  with open(os.path.join(workdir, "vocab.json")) as f:
    assert json.load(f)["symbols"] == DATA.vocab.symbols
  events = glob.glob(os.path.join(workdir, "tensorboard", "events*"))
  assert events and all(os.path.getsize(e) > 0 for e in events)
  assert _checkpoint_steps(workdir)[-1] == 30

  # Same workdir, more steps: resumes at 30 instead of starting over.
  loop.train_and_evaluate(tiny_run_config(num_train_steps=40), workdir)
  lines2 = _read_metrics(workdir)
  assert lines2[:len(lines)] == lines                    # Appended, not rewritten.
  new = lines2[len(lines):]
  assert [line["step"] for line in new if "train/loss" in line] == [40]
  assert [line["step"] for line in new if "eval/exact_match" in line] == [40]
  assert _checkpoint_steps(workdir)[-1] == 40
  with open(os.path.join(workdir, "config.json")) as f:
    assert json.load(f)["num_train_steps"] == 40

  # Resuming is invisible: bitwise the same parameters and metrics as 40 steps in one go
  # (the data position, dropout keys and optimizer state all continue where they stopped).
  straight = str(tmp_path / "straight")
  loop.train_and_evaluate(tiny_run_config(num_train_steps=40), straight)
  expected, actual = _without_perf(_read_metrics(straight), 30), _without_perf(new, 30)
  assert [l["step"] for l in actual] == [l["step"] for l in expected] == [40, 40]
  assert actual == expected
  resumed_params, straight_params = Predictor(workdir).params, Predictor(straight).params
  for x, y in zip(jax.tree_util.tree_leaves(resumed_params),
                  jax.tree_util.tree_leaves(straight_params), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_train_and_evaluate_stops_on_nonfinite_loss(tmp_path, monkeypatch):
  """A NaN loss at step 5 (injected through the batch) stops training with an error naming
  step 5; the check runs before each checkpoint, so none is written at or after step 5."""
  bad_step = 5
  real_make_source = experiment.make_source

  class PoisonedBatches(BatchesWrapper):
    def __next__(self):
      step = self.batches.get_state()["next_index"] + 1
      batch = next(self.batches)
      scale = np.nan if step == bad_step else 1.0
      return {**batch, "loss_scale": np.full((len(batch["src"]),), scale, np.float32)}

  monkeypatch.setattr(experiment, "make_source",
                      lambda *a: SourceWrapper(real_make_source(*a), PoisonedBatches))
  monkeypatch.setattr(experiment.tasks, "task_class", lambda name: ScaledLossTask)
  config = tiny_run_config(num_train_steps=12, log_every_steps=100, checkpoint_every_steps=4,
                           eval_every_steps=100)
  workdir = str(tmp_path / "nan")
  with pytest.raises(loop.NonFiniteLossError, match=rf"step {bad_step}\b"):
    loop.train_and_evaluate(config, workdir)
  steps = _checkpoint_steps(workdir)
  assert steps == [4]                      # Saved before the NaN; nothing after it.
  assert all(step < bad_step for step in steps)


def test_validate_rejects_bad_loop_settings(tmp_path):
  with pytest.raises(ValueError, match="config.num_train_steps"):
    loop.train_and_evaluate(tiny_run_config(num_train_steps=0), str(tmp_path))
  with pytest.raises(ValueError, match="grad_accum_steps"):
    RunOptions.from_config(tiny_run_config(batch_size=10, grad_accum_steps=3))
  with pytest.raises(ValueError, match="config.nonfinite"):
    RunOptions.from_config(tiny_run_config(nonfinite="ignore"))
