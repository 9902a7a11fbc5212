"""Replaced-token detection (tasks/rtd.py, ELECTRA) as the self-pretraining objective
pretrain.objective="rtd" (training/recipe.py): what the generator's draw may change, the
discriminator's labels, the shared token table, the loss falling on a tiny corpus, and
init_from carrying the discriminator's encoder (not the generator) into a tagger."""

from __future__ import annotations

import copy
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cli_helpers import finish, start
from conftest import tiny_config
from test_bad_inputs import run_user_error
from test_tasks import _lines, _shrink, entity_corpus

from configs import conll2003, sst2
from transformer_jax import checkpoint, tasks
from transformer_jax.config import PAD_ID
from transformer_jax.data.tokenizer import SHAPES, WordVocab
from transformer_jax.data.vocab import SPECIALS
from transformer_jax.errors import UserError
from transformer_jax.inputs import character_ids
from transformer_jax.options import PRETRAIN_OBJECTIVES
from transformer_jax.predict import Predictor
from transformer_jax.tasks.rtd import PROJECTION, ReplacedTokenDetectionTask, replace_tokens
from transformer_jax.training import recipe
from transformer_jax.training.experiment import Experiment

WORDS = ["the", "film", "is", "good", "bad", "dull", "fine", "plot"]
FIRST_WORD = len(SPECIALS) + len(SHAPES)
BYTES = 6   # char_max_length of the tests' tasks


def _task() -> ReplacedTokenDetectionTask:
  vocab = WordVocab.build([WORDS])
  return ReplacedTokenDetectionTask(
      tiny_config(vocab_size=vocab.vocab_size, num_decoder_layers=0), tokenizer=vocab,
      head={"char_features": 8, "char_max_length": BYTES})


def _batch(task: ReplacedTokenDetectionTask, seed: int, words: int = len(WORDS)) -> dict:
  """(16, 24) rows of word ids (the first `words` of WORDS), a few specials among them, and
  padding after each row's own length; each word's bytes as its characters."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(FIRST_WORD, FIRST_WORD + words, (16, 24)).astype(np.int32)
  tokens[rng.random(tokens.shape) < 0.1] = 3                     # <unk>
  for row, length in enumerate(rng.integers(8, 25, 16)):
    tokens[row, length:] = PAD_ID
  chars = np.stack([character_ids([task.tokenizer.decode([int(i)]) for i in row], BYTES)
                    for row in tokens])
  real = tokens != PAD_ID
  positions = np.where(real, np.arange(24)[None], 0).astype(np.int32)
  return {"tokens": jnp.asarray(tokens), "positions": jnp.asarray(positions),
          "segment_ids": jnp.asarray(real.astype(np.int32)), "chars": jnp.asarray(chars)}


def _chosen(at: jax.Array, weights: jax.Array, shape: tuple[int, int]) -> np.ndarray:
  """(B, T): the positions the generator predicts (at, with weight 1)."""
  chosen = np.zeros(shape, bool)
  np.put_along_axis(chosen, np.asarray(at), np.asarray(weights) > 0, 1)
  return chosen


def _cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  return -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]


def test_the_draw_changes_only_chosen_positions_and_never_writes_a_special():
  task = _task()
  batch = _batch(task, 0)
  tokens = np.asarray(batch["tokens"])
  masked, weights, _ = task.masked_inputs(batch, jax.random.PRNGKey(0), train=True)
  at = masked["predict_at"]
  chosen = _chosen(at, weights, tokens.shape)
  assert chosen.sum() > 20 and not chosen[tokens < len(SPECIALS)].any()
  # A generator far surer of the special tokens than of any word: still never drawn.
  vocab = task.model_config.vocab_size
  logits = (jax.random.normal(jax.random.PRNGKey(1), at.shape + (vocab,))
            + 30.0 * (jnp.arange(vocab) < len(SPECIALS)))
  changed = np.asarray(replace_tokens(jax.random.PRNGKey(2), batch["tokens"], logits, at,
                                      weights))
  differs = changed != tokens
  assert differs.any() and not (differs & ~chosen).any()
  special = tokens < len(SPECIALS)                                 # padding and <unk>
  assert (changed[special] == tokens[special]).all()
  assert (changed[chosen] >= len(SPECIALS)).all()


def test_labels_are_exactly_the_tokens_that_differ_from_the_original():
  task = _task()
  batch = _batch(task, 1, words=3)
  tokens = np.asarray(batch["tokens"])
  masked, weights, _ = task.masked_inputs(batch, jax.random.PRNGKey(3), train=True)
  at = masked["predict_at"]
  chosen = _chosen(at, weights, tokens.shape)
  # A generator that draws among the same three words: many draws repeat the original.
  vocab = task.model_config.vocab_size
  few = (jnp.arange(vocab) >= FIRST_WORD) & (jnp.arange(vocab) < FIRST_WORD + 3)
  logits = jnp.broadcast_to(jnp.where(few, 0.0, -1e4), at.shape + (vocab,))
  changed = replace_tokens(jax.random.PRNGKey(4), batch["tokens"], logits, at, weights)
  inputs, labels = task.replaced_batch(batch, changed)
  changed, labels = np.asarray(changed), np.asarray(labels)
  repeated, swapped = chosen & (changed == tokens), chosen & (changed != tokens)
  assert repeated.sum() > 5 and swapped.sum() > 5
  np.testing.assert_array_equal(labels, changed != tokens)
  assert not labels[repeated].any() and labels[swapped].all() and not labels[~chosen].any()
  np.testing.assert_array_equal(inputs["tokens"], changed)
  # A replaced word reads as the drawn word's spelling; every other keeps its own.
  chars = np.asarray(inputs["chars"])
  drawn = [task.tokenizer.decode([int(i)]) for i in changed[swapped]]
  np.testing.assert_array_equal(chars[swapped], character_ids(drawn, BYTES))
  np.testing.assert_array_equal(chars[~swapped], np.asarray(batch["chars"])[~swapped])


def test_a_generator_that_copies_the_original_replaces_nothing(monkeypatch):
  """Through the task's loss: an (untrained) generator's draws replace tokens; one whose
  logits are a one-hot of the original leaves the discriminator the original text, every
  label 0. The loss is the generator's plus lambda x the discriminator's."""
  task = _task()
  params = nn.meta.unbox(task.init_params(jax.random.PRNGKey(0)))
  batch = _batch(task, 2)
  real = float((np.asarray(batch["tokens"]) != PAD_ID).sum())
  seen = []
  discriminate = task.logits
  monkeypatch.setattr(task, "logits", lambda p, b, r, t: seen.append(b) or discriminate(p, b, r, t))
  sums = task.loss_sums(params, batch, jax.random.PRNGKey(5), True)
  assert sums["replaced"] > 5 and sums["replaced"] + sums["original"] == sums["real"] == real

  vocab = task.model_config.vocab_size
  copies = lambda p, masked, r, t: 1e4 * jax.nn.one_hot(
      jnp.take_along_axis(batch["tokens"], masked["predict_at"], 1), vocab)
  monkeypatch.setattr(task, "generator_logits", copies)
  sums = task.loss_sums(params, batch, jax.random.PRNGKey(5), True)
  assert sums["replaced"] == 0 and sums["original"] == real
  np.testing.assert_array_equal(seen[-1]["tokens"], batch["tokens"])
  np.testing.assert_array_equal(seen[-1]["chars"], batch["chars"])
  weight = task.head["discriminator_weight"] * task.head["mask_rate"]
  assert task.head["discriminator_weight"] == 50.0
  np.testing.assert_allclose(sums["loss"], sums["nll"] + weight * sums["discriminator_loss"],
                             rtol=1e-5)


def test_the_generator_is_a_quarter_wide_and_reads_the_discriminators_token_table():
  task = _task()
  params = nn.meta.unbox(task.init_params(jax.random.PRNGKey(0)))
  generator = params["generator"]
  assert "embedding" not in generator["encoder"]                  # no table of its own
  assert generator[PROJECTION].shape == (32, 8)
  assert task.generator.config.d_model == 8 and task.generator.config.d_ff == 16
  batch = _batch(task, 3)
  masked, weights, _ = task.masked_inputs(batch, jax.random.PRNGKey(6), train=True)
  targets = jnp.take_along_axis(batch["tokens"], masked["predict_at"], 1)

  def generator_loss(params):
    logits = task.generator_logits(params, masked, None, False)
    return (_cross_entropy(logits, targets) * weights).sum()
  grads = jax.grad(generator_loss)(params)["encoder"]
  # The generator's loss reaches the discriminator's token table, and nothing else of it.
  assert np.abs(grads.pop("embedding")["embedding"]).max() > 1e-4
  assert all((np.asarray(g) == 0).all() for g in jax.tree_util.tree_leaves(grads))


PRETRAIN = 120    # steps of the recipe's rtd stage


@pytest.fixture(scope="module")
def rtd_recipe(tmp_path_factory):
  """One `train.py` recipe on a tiny CoNLL corpus ("<name> visited <place> ."):
  replaced-token detection, evaluated every 40 steps, then 4 steps of the tagger (CRF,
  character CNN): (config, workdir, final metrics)."""
  data_dir = tmp_path_factory.mktemp("entities")
  entity_corpus(data_dir)
  config = _shrink(conll2003.get_config(), 4, dir=str(data_dir))
  config.update(dict(eval_every_steps=40, checkpoint_every_steps=PRETRAIN))
  config.model.update(dict(char_features=16))
  config.pretrain.update(dict(enabled=True, objective="rtd", num_train_steps=PRETRAIN,
                              warmup_steps=2))
  workdir = str(tmp_path_factory.mktemp("rtd") / "run")
  return config, workdir, recipe.train(config, workdir)


def test_rtd_loss_falls_on_a_tiny_corpus(rtd_recipe):
  _, workdir, final = rtd_recipe
  lines = _lines(os.path.join(workdir, "pretrain"))
  train = [l["train/loss"] for l in lines if "train/loss" in l]
  assert len(train) == PRETRAIN // 2 and np.mean(train[-5:]) < 0.5 * train[0], train
  evaluated = [l for l in lines if "eval/loss" in l]
  assert [l["step"] for l in evaluated] == [40, 80, 120]
  for name in ReplacedTokenDetectionTask.metric_names:
    assert f"eval/{name}" in evaluated[-1]
  for name in ("accuracy", "replaced_accuracy", "original_accuracy"):
    assert 0 <= evaluated[-1][f"eval/{name}"] <= 1
  # Past step 40 (by then the discriminator has learnt how rare replacements are) both
  # models still learn: the generator predicts better, the discriminator tells better.
  first, last = evaluated[0], evaluated[-1]
  assert last["eval/accuracy"] > first["eval/accuracy"]
  assert last["eval/discriminator_loss"] < 0.9 * first["eval/discriminator_loss"]
  assert {"eval/f1", "eval/loss"} <= set(final)                     # the tagger's


def test_separation_ranks_replaced_tokens_above_originals_after_the_stage(rtd_recipe):
  from benchmarks.rtd_separation import auc, separation
  scores = np.random.default_rng(0).integers(0, 4, (2, 40)).astype(float)   # many ties
  pairwise = np.mean([(a > b) + 0.5 * (a == b) for a in scores[0] for b in scores[1]])
  assert auc(scores[0], scores[1]) == pytest.approx(pairwise)
  assert auc(np.array([2.0, 3.0]), np.array([0.0, 1.0])) == 1.0
  _, workdir, _ = rtd_recipe
  found = separation(os.path.join(workdir, "pretrain"), batches=2)
  for kind in ("generator", "uniform"):     # the trained discriminator is not blind
    assert found[kind]["step"] == PRETRAIN and 0 < found[kind]["replaced"] < found[kind]["real"]
    assert found[kind]["auc"] > 0.6, found
    assert found[kind]["replaced_logit"] > found[kind]["original_logit"]
  with pytest.raises(UserError, match="--step=7"):
    separation(os.path.join(workdir, "pretrain"), step=7)
  with pytest.raises(UserError, match="not 'rtd'"):
    separation(workdir)


def test_the_separation_command_reports_a_workdir_without_checkpoints_in_one_line(tmp_path):
  status, output = finish(start("-m", "benchmarks.rtd_separation", f"--workdir={tmp_path}"))
  assert status == 2 and "Traceback" not in output
  assert output.strip().splitlines() == [
      f"error: --workdir={str(tmp_path)!r}: no checkpoints in {tmp_path}/checkpoints; give a "
      "replaced-token-detection stage's workdir (a run's W/pretrain)"]


def test_init_from_carries_the_discriminators_encoder_and_not_the_generator(rtd_recipe,
                                                                           tmp_path):
  config, workdir, _ = rtd_recipe
  path = os.path.join(workdir, "pretrain", "checkpoints", str(PRETRAIN))
  given = config.to_dict()    # the fine-tuning stage alone, from the rtd checkpoint
  fine = {**given, "init_from": path, "pretrain": {**given["pretrain"], "enabled": False}}
  experiment = Experiment.create(fine, str(tmp_path / "fine"))
  fresh = experiment.init_state()[0].params
  params, carried = experiment.initial_params(fresh)
  saved = checkpoint.restore_params(path)
  assert {"generator", "rtd_transform", "rtd_output"} <= set(saved)
  assert carried == ["character_features", "encoder"]
  for name in carried:     # the discriminator's encoder with its embedding, and the CNN
    jax.tree_util.tree_map(np.testing.assert_array_equal, params[name], saved[name])
  head = ["classifier", "crf_end", "crf_start", "crf_transitions"]
  assert sorted(set(params) - set(carried)) == head               # nothing else loaded
  for name in head:        # as a fresh initialisation makes them
    jax.tree_util.tree_map(np.testing.assert_array_equal, params[name], fresh[name])
  assert experiment.model_config.d_model == 32                    # not the generator's 8


def test_one_command_resumes_refuses_another_objective_and_predicts(rtd_recipe, capsys):
  config, workdir, final = rtd_recipe
  stage = os.path.join(workdir, "pretrain")
  with open(os.path.join(stage, "config.json")) as f:
    assert json.load(f)["task"] == "rtd"
  with open(os.path.join(workdir, "config.json")) as f:
    assert json.load(f)["init_from"] == os.path.join(stage, "checkpoints", str(PRETRAIN))
  before = (_lines(stage), [l for l in _lines(workdir) if "train/loss" in l])
  again = recipe.train(config, workdir)          # both stages finished: nothing more trained
  assert again["eval/f1"] == pytest.approx(final["eval/f1"])
  assert (_lines(stage), [l for l in _lines(workdir) if "train/loss" in l]) == before
  other = copy.deepcopy(config)
  other.pretrain.objective = "mlm"
  status, lines = run_user_error(lambda: recipe.train(other, workdir), capsys)
  assert status == 2 and len(lines) == 1 and "pretrain.objective='mlm'" in lines[0], lines
  # The stage's own predict: the line back, each token it judges replaced corrected.
  (line,) = Predictor(stage).predict_lines(["Smith visited Rome ."])
  assert len(line.split()) == 4


def test_every_objective_is_a_pretraining_task_and_others_are_refused(tmp_path, capsys):
  config = sst2.get_config()
  for objective in PRETRAIN_OBJECTIVES:
    config.pretrain.objective = objective
    stage = recipe.pretraining_config(config.to_dict())
    task = tasks.task_class(stage["task"])
    assert task.name == objective and task.pretraining
    assert ("discriminator_weight" in stage["model"]) == (objective == "rtd")
  config.pretrain.update(dict(enabled=True, objective="electra"))
  status, lines = run_user_error(lambda: recipe.train(config, str(tmp_path / "w")), capsys)
  assert status == 2 and len(lines) == 1 and "pretrain.objective='electra'" in lines[0], lines
  with pytest.raises(UserError, match="discriminator_weight"):
    recipe.pretraining_config({**config.to_dict(), "pretrain": {"discriminator_weight": 0}})
