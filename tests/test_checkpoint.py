"""Checkpoints in-process: round trips, damage and fallback, retention, averaging/export,
the data iterator's state, metric logs on resume, and the preemption signal handler. The
runs that must be killed are in test_resume.py."""

from __future__ import annotations

import json
import logging as std_logging
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from transformer_jax import checkpoint
from transformer_jax.checkpoint import (
  DamagedCheckpointError,
  IncompatibleCheckpointError,
  TrainCheckpoints,
)
from transformer_jax.data.synthetic import SyntheticData, make_vocab
from transformer_jax.data.tokenizer import load_tokenizer_item, tokenizer_item
from transformer_jax.data.vocab import SymbolVocab
from transformer_jax.metrics import MetricWriter
from transformer_jax.preemption import PreemptionWatcher
from transformer_jax.training.state import (
  TrainState,
  checkpoint_arrays,
  create_train_state,
  state_from_checkpoint,
)

OPTIMIZER = optax.adam(1e-2)
# Orbax's reader leaves coroutines behind when a damaged file fails to read.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
RUN_CONFIG = {"model": {"d_model": 64}, "num_train_steps": 10}
TOKENIZER = tokenizer_item(make_vocab())


def _state(seed: int, width: int = 64) -> TrainState:
  """A small train state (no model needed): random params, Adam moments after one update,
  so that every leaf of the optimizer state holds distinct values."""
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  params = {"dense": {"kernel": jax.random.normal(k1, (width, width)),
                      "bias": jax.random.normal(k2, (width,))},
            "scale": jnp.ones((), jnp.float32)}
  state = create_train_state(params, OPTIMIZER, seed)
  grads = jax.tree_util.tree_map(lambda p: jnp.sin(p + seed), params)
  updates, opt_state = OPTIMIZER.update(grads, state.opt_state, params)
  return state.replace(step=jnp.array(seed, jnp.int32),
                       params=optax.apply_updates(params, updates), opt_state=opt_state)


def _arrays(seed: int, width: int = 64) -> dict:
  """_state's arrays as a training checkpoint holds them (what the loop saves)."""
  return checkpoint_arrays(_state(seed, width))


def _manager(directory, **kwargs) -> TrainCheckpoints:
  kwargs.setdefault("keep", 3)
  return TrainCheckpoints(str(directory), kwargs.pop("run_config", RUN_CONFIG),
                          kwargs.pop("tokenizer", TOKENIZER), **kwargs)


def _save(directory, steps, **kwargs) -> dict[int, TrainState]:
  states = {step: _state(step) for step in steps}
  manager = _manager(directory, **kwargs)
  for step, state in states.items():
    manager.save(step, checkpoint_arrays(state), {"next_index": step})
  manager.close()
  return states


def _assert_bitwise_equal(a, b) -> None:
  leaves_a, tree_a = jax.tree_util.tree_flatten(a)
  leaves_b, tree_b = jax.tree_util.tree_flatten(b)
  assert tree_a == tree_b
  for x, y in zip(leaves_a, leaves_b):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    assert x.tobytes() == y.tobytes()


# ------------------------------------------------------------------------ round trip
def test_restore_is_bitwise_what_was_saved(tmp_path):
  assert _manager(tmp_path / "empty").restore(_arrays(0)) is None
  saved = _save(tmp_path, [3])[3]
  restored = _manager(tmp_path).restore(_arrays(0))
  assert restored.step == 3 and restored.data_state == {"next_index": 3}
  assert restored.config == RUN_CONFIG
  _assert_bitwise_equal(state_from_checkpoint(restored.arrays), saved)
  with open(tmp_path / "3" / "tokenizer" / "metadata") as f:   # The tokenizer travels along.
    assert load_tokenizer_item(json.load(f)).tokenizer.symbols == make_vocab().symbols


def test_fingerprint_sees_every_flipped_bit_and_swapped_values():
  x = np.asarray(jax.random.normal(jax.random.PRNGKey(0), (3, 5)), np.float32)
  reference = checkpoint.describe({"x": x})["x"]["fingerprint"]
  bits = x.view(np.uint32)
  for index in range(x.size):
    for bit in range(32):
      flipped = bits.copy().ravel()
      flipped[index] ^= np.uint32(1 << bit)
      y = flipped.view(np.float32).reshape(x.shape)
      assert checkpoint.describe({"x": y})["x"]["fingerprint"] != reference, (index, bit)
  swapped = x.copy().ravel()
  swapped[[0, 1]] = swapped[[1, 0]]
  assert checkpoint.describe({"x": swapped.reshape(x.shape)})["x"]["fingerprint"] != reference
  # Every dtype a state holds (the RNG is a raw uint32 key).
  for value in (jnp.ones(3, jnp.bfloat16), jnp.arange(3), jnp.array([True, False]),
                jax.random.PRNGKey(1)):
    assert len(checkpoint.describe({"v": value})["v"]["fingerprint"]) == 2


# ---------------------------------------------------------------- incomplete and damaged
def test_incomplete_save_is_ignored_and_cleaned_up(tmp_path):
  """A process killed mid-save leaves <step>.orbax-checkpoint-tmp-*; it is not a checkpoint."""
  saved = _save(tmp_path, [1])[1]
  partial = tmp_path / "2.orbax-checkpoint-tmp-1234567"
  (partial / "params").mkdir(parents=True)
  (partial / "params" / "junk").write_bytes(b"\0" * 100)
  manager = _manager(tmp_path)
  assert manager.steps() == [1]
  restored = manager.restore(_arrays(0))
  manager.close()
  assert restored.step == 1
  _assert_bitwise_equal(state_from_checkpoint(restored.arrays), saved)
  assert not partial.exists()


def test_failed_save_keeps_the_previous_checkpoint(tmp_path):
  """With keep=1 the older checkpoint goes only once the newer one is committed: a save that
  fails while writing in the background (here: a data state that is not JSON) leaves it."""
  saved = _save(tmp_path, [10], keep=1)[10]
  manager = _manager(tmp_path, keep=1)
  manager.save(20, _arrays(20), {"next_index": np.float32(20)})
  with pytest.raises(TypeError, match="JSON serializable"):
    manager.wait()
  assert sorted(p for p in os.listdir(tmp_path) if p.isdigit()) == ["10"]
  restored = _manager(tmp_path, keep=1).restore(_arrays(0))
  assert restored.step == 10
  _assert_bitwise_equal(state_from_checkpoint(restored.arrays), saved)


def _largest_file(directory) -> str:
  files = [os.path.join(root, name) for root, _, names in os.walk(directory) for name in names]
  return max(files, key=os.path.getsize)


def _truncate(step_dir) -> None:
  path = _largest_file(step_dir / "params")
  os.truncate(path, os.path.getsize(path) // 2)


def _flip_bit(step_dir) -> None:
  path = _largest_file(step_dir / "train")
  data = bytearray(open(path, "rb").read())
  data[len(data) // 2] ^= 0x10
  open(path, "wb").write(bytes(data))


def _garble_json(step_dir) -> None:
  (step_dir / "data" / "metadata").write_bytes(b"\x00\xffnot json")


@pytest.mark.parametrize("damage", [_truncate, _flip_bit, _garble_json])
def test_damaged_latest_checkpoint_falls_back_with_a_warning(tmp_path, caplog, damage):
  states = _save(tmp_path, [1, 2])
  damage(tmp_path / "2")
  manager = _manager(tmp_path)
  with caplog.at_level(std_logging.WARNING):
    restored = manager.restore(_arrays(0))
  assert restored.step == 1 and restored.data_state == {"next_index": 1}
  _assert_bitwise_equal(state_from_checkpoint(restored.arrays), states[1])
  warnings = " ".join(r.getMessage() for r in caplog.records if r.levelno >= std_logging.WARNING)
  assert f"{tmp_path / '2'} is damaged" in warnings
  # Set aside, not deleted; out of the way of the next save of that step.
  assert (tmp_path / checkpoint.DAMAGED_DIR / "2").is_dir() and not (tmp_path / "2").exists()
  assert manager.steps() == [1]
  manager.save(2, checkpoint_arrays(states[2]), {"next_index": 2})
  manager.close()
  _assert_bitwise_equal(state_from_checkpoint(_manager(tmp_path).restore(_arrays(0)).arrays),
                        states[2])


def test_no_readable_checkpoint_is_an_error(tmp_path):
  _save(tmp_path, [1, 2])
  _truncate(tmp_path / "1")
  _garble_json(tmp_path / "2")
  with pytest.raises(DamagedCheckpointError, match="none of the checkpoints"):
    _manager(tmp_path).restore(_arrays(0))
  assert (tmp_path / "1").is_dir() and (tmp_path / "2").is_dir()   # Nothing moved or lost.


# ------------------------------------------------------------------------ compatibility
def test_a_different_state_structure_is_refused_naming_the_fields(tmp_path):
  _save(tmp_path, [5])
  wider = {"model": {"d_model": 128}, "num_train_steps": 10}
  with pytest.raises(IncompatibleCheckpointError) as error:
    _manager(tmp_path, run_config=wider).restore(_arrays(0, width=128))
  message = str(error.value)
  assert "model.d_model: 64 -> 128" in message
  assert "params/dense/kernel: float32[64, 64] -> float32[128, 128]" in message
  assert "num_train_steps" not in message                 # Only the fields that differ.

  other_vocab = tokenizer_item(SymbolVocab(list("abc")))
  with pytest.raises(IncompatibleCheckpointError, match="tokenizer differs"):
    _manager(tmp_path, tokenizer=other_vocab).restore(_arrays(0))
  assert _manager(tmp_path).steps() == [5]                 # A refusal changes nothing.


# --------------------------------------------------------------------------- retention
def test_keeps_the_latest_and_the_best(tmp_path):
  options = dict(keep=1, keep_best=1, best_metric="eval/accuracy", best_mode="max")
  manager = _manager(tmp_path, **options)
  accuracies = {1: 0.5, 2: 0.9, 3: None, 4: 0.4}            # Step 3 was not evaluated.
  for step, accuracy in accuracies.items():
    metrics = None if accuracy is None else {"eval/accuracy": accuracy, "eval/loss": 1.0}
    manager.save(step, _arrays(step), {"next_index": step}, metrics=metrics)
  manager.close()
  assert _manager(tmp_path, **options).steps() == [2, 4]
  assert checkpoint.best_step(str(tmp_path)) is None       # The run config names no metric.
  # A restarted manager reads the saved metrics back: 2 stays the best.
  manager = _manager(tmp_path, **options)
  manager.save(5, _arrays(5), {"next_index": 5}, metrics={"eval/accuracy": 0.1})
  manager.close()
  assert checkpoint.checkpoint_steps(str(tmp_path)) == [2, 5]
  with pytest.raises(ValueError, match="best_checkpoint_metric='eval/accuracy'"):
    _manager(tmp_path, **options).save(6, _arrays(6), {"next_index": 6}, metrics={"loss": 1.0})


def test_best_step_uses_the_runs_metric(tmp_path):
  config = {**RUN_CONFIG, "best_checkpoint_metric": "eval/loss", "best_checkpoint_mode": "min"}
  manager = _manager(tmp_path, run_config=config, keep=5, keep_best=1,
                     best_metric="eval/loss", best_mode="min")
  for step, loss in ((1, 3.0), (2, 1.0), (3, 2.0)):
    manager.save(step, _arrays(step), {"next_index": step}, metrics={"eval/loss": loss})
  manager.close()
  assert checkpoint.best_step(str(tmp_path)) == 2


# ---------------------------------------------------------------------- export, average
def test_average_of_two_checkpoints_is_their_mean(tmp_path):
  workdir = tmp_path / "run"
  directory = workdir / checkpoint.CHECKPOINT_DIR
  states = _save(directory, [1, 2])
  out = workdir / checkpoint.SNAPSHOT_DIR / "avg"
  checkpoint.write_average(str(directory), [2, 1], str(out))
  averaged = checkpoint.restore_params(str(out))
  expected = jax.tree_util.tree_map(lambda a, b: (np.asarray(a) + np.asarray(b)) / 2,
                                    states[1].params, states[2].params)
  _assert_bitwise_equal(averaged, expected)
  model = checkpoint.read_record(str(out))
  assert (model.step, model.averaged_steps, model.config) == (2, [1, 2], RUN_CONFIG)
  assert model.assets.tokenizer.symbols == make_vocab().symbols
  # Exporting one checkpoint copies its parameters; an export never overwrites.
  single = workdir / checkpoint.SNAPSHOT_DIR / "single"
  checkpoint.write_average(str(directory), [1], str(single))
  _assert_bitwise_equal(checkpoint.restore_params(str(single)), states[1].params)
  with pytest.raises(FileExistsError):
    checkpoint.write_average(str(directory), [1], str(single))
  # predict's order: newest step first, an export before the checkpoint of its step.
  assert checkpoint.models(str(workdir)) == [str(out), str(directory / "2"), str(single),
                                             str(directory / "1")]


def test_params_that_do_not_fit_the_model_are_refused(tmp_path):
  _save(tmp_path, [1])
  abstract = jax.eval_shape(lambda: _state(0, width=32).params)
  with pytest.raises(IncompatibleCheckpointError,
                     match=r"dense/bias: saved float32\[64\], model float32\[32\]"):
    checkpoint.restore_params(str(tmp_path / "1"), abstract)


def test_export_selects_steps():
  select_steps = checkpoint.select_steps
  assert select_steps([4, 8, 12], "latest", 2, None) == [8, 12]
  assert select_steps([4, 8, 12], "8", 1, None) == [8]
  assert select_steps([4, 8, 12], "best", 2, 8) == [4, 8]
  for step, average, best, message in (("latest", 4, None, "only 3 checkpoints"),
                                       ("5", 1, None, "not a checkpoint"),
                                       ("best", 1, None, "keep_best_checkpoints"),
                                       ("latest", 0, None, "must be >= 1")):
    with pytest.raises(ValueError, match=message):
      select_steps([4, 8, 12], step, average, best)


# -------------------------------------------------------------------- data iterator
def test_synthetic_iterator_state_resumes_the_same_batches():
  task = SyntheticData("reverse", 2, 5, seed=3)
  batches = task.train_iterator(None, 4)   # encodes its own batches: no task needed
  seen = [next(batches) for _ in range(3)]
  for index, batch in enumerate(seen):                     # Batch i is the step-i+1 batch.
    _assert_bitwise_equal(batch, task.batch("train", index, 4))
  state = batches.get_state()
  assert state == {"next_index": 3} and json.loads(json.dumps(state)) == state
  following = next(batches)
  resumed = task.train_iterator(None, 4)
  resumed.set_state(state)
  _assert_bitwise_equal(next(resumed), following)
  for bad in ({"index": 3}, {"next_index": -1}, {"next_index": "3"}, [3]):
    with pytest.raises(ValueError, match="next_index"):
      resumed.set_state(bad)


# ------------------------------------------------------------------------- metric logs
def test_metric_writer_drops_what_was_logged_after_the_resumed_step(tmp_path):
  writer = MetricWriter(str(tmp_path))
  for step in (2, 4, 6):
    writer.write(step, {"train/loss": float(step)})
  writer.close()
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 8, "train/lo')                      # Cut short by a kill.
  writer = MetricWriter(str(tmp_path), resume_step=4)
  writer.write(6, {"train/loss": 60.0})
  writer.close()
  with open(tmp_path / "metrics.jsonl") as f:
    lines = [json.loads(line) for line in f]
  assert lines == [{"step": 2, "train/loss": 2.0}, {"step": 4, "train/loss": 4.0},
                   {"step": 6, "train/loss": 60.0}]


# -------------------------------------------------------------------------- preemption
def test_preemption_watcher_turns_a_signal_into_a_stop_request():
  original, original_int = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
  with PreemptionWatcher() as watcher:
    assert not watcher.should_stop(1)
    assert signal.getsignal(signal.SIGTERM) == watcher._handle   # Else the kill below is fatal.
    signal.raise_signal(signal.SIGTERM)
    assert watcher.should_stop(2) and watcher.signal_name == "SIGTERM"
    # A second signal acts as usual again (a second Ctrl-C interrupts at once).
    assert signal.getsignal(signal.SIGTERM) == original
  assert signal.getsignal(signal.SIGTERM) == original
  assert signal.getsignal(signal.SIGINT) == original_int
