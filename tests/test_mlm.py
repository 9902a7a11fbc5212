"""The masked-LM pretraining task (tasks/mlm.py) and the pretrain-then-fine-tune recipe
(training/recipe.py): BERT's masking rates, the loss falling on a tiny corpus, init_from
carrying the encoder into a classifier or tagger with a fresh head, and one command running
both stages and resuming."""

from __future__ import annotations

import copy
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_tasks import _lines, _shrink, entity_corpus

from configs import conll2003, sst2
from transformer_jax import checkpoint, sharding
from transformer_jax.data.vocab import SPECIALS
from transformer_jax.errors import UserError
from transformer_jax.predict import Predictor
from transformer_jax.tasks.mlm import MASK_ID, mask_tokens
from transformer_jax.training import recipe
from transformer_jax.training.experiment import Experiment


def test_masking_follows_bert_rates_and_never_touches_specials():
  vocab = 50
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, vocab, (64, 4096)).astype(np.int32)   # specials and pads too
  inputs, chosen, replaced = (np.asarray(a) for a in
                              mask_tokens(jax.random.PRNGKey(1), jnp.asarray(tokens), 0.15, vocab))
  special = tokens < len(SPECIALS)
  assert not chosen[special].any() and (inputs[special] == tokens[special]).all()
  assert abs(chosen[~special].mean() - 0.15) < 0.003
  picked = chosen.sum()
  masked = (inputs == MASK_ID) & chosen
  changed = chosen & ~masked & (inputs != tokens)          # a random draw may repeat the token
  kept = chosen & (inputs == tokens)
  assert abs(masked.sum() / picked - 0.8) < 0.01
  assert abs(changed.sum() / picked - 0.1 * (1 - 1 / (vocab - len(SPECIALS)))) < 0.01
  assert abs(kept.sum() / picked - 0.1 - 0.1 / (vocab - len(SPECIALS))) < 0.01
  assert (inputs[chosen & ~masked] >= len(SPECIALS)).all()  # random ids are real tokens
  assert not (replaced & ~chosen).any() and (replaced >= (masked | changed)).all()
  assert abs(replaced.sum() / picked - 0.9) < 0.01          # whose characters are hidden
  assert not (inputs[~chosen] != tokens[~chosen]).any()     # unchosen positions untouched


@pytest.fixture(scope="module")
def recipe_run(tmp_path_factory):
  """One `train.py` recipe on a tiny CoNLL corpus: 30 masked-LM steps, then 6 of the tagger
  (CRF, character CNN): (config, workdir, final metrics)."""
  data_dir = tmp_path_factory.mktemp("entities")
  entity_corpus(data_dir)
  config = _shrink(conll2003.get_config(), 6, dir=str(data_dir))
  config.update(dict(eval_every_steps=30, checkpoint_every_steps=30))   # both stages: at the end
  config.pretrain.update(dict(enabled=True, num_train_steps=30, warmup_steps=2))
  workdir = str(tmp_path_factory.mktemp("recipe") / "run")
  return config, workdir, recipe.train(config, workdir)


def test_masked_lm_loss_falls_on_a_tiny_corpus(recipe_run):
  _, workdir, _ = recipe_run
  lines = _lines(os.path.join(workdir, "pretrain"))
  train = [l for l in lines if "train/loss" in l]
  assert train[-1]["train/loss"] < 0.8 * train[0]["train/loss"]
  final = [l for l in lines if "eval/loss" in l][-1]
  assert {"eval/loss", "eval/accuracy", "eval/perplexity"} <= set(final)
  assert final["eval/accuracy"] > 0.3   # "visited" and "." are certain, names a 1-in-3 guess


def test_init_from_carries_the_encoder_and_leaves_the_head_fresh(recipe_run, tmp_path):
  config, workdir, _ = recipe_run
  path = os.path.join(workdir, "pretrain", "checkpoints", "30")
  config = copy.deepcopy(config)
  config.pretrain.enabled = False
  config.init_from = path
  experiment = Experiment.create(config, str(tmp_path / "fine"))
  fresh, _ = experiment.init_state()
  params, carried = experiment.initial_params(fresh.params)
  saved = checkpoint.restore_params(path)
  assert carried == ["character_features", "encoder"]
  for name in carried:   # the encoder with its embedding, and the character CNN
    jax.tree_util.tree_map(np.testing.assert_array_equal, params[name], saved[name])
  head = ["classifier", "crf_end", "crf_start", "crf_transitions"]
  assert sorted(set(params) - set(carried)) == head
  for name in head:      # as a fresh initialisation makes them, none from the checkpoint
    assert name not in saved
    jax.tree_util.tree_map(np.testing.assert_array_equal, params[name], fresh.params[name])
  assert "mlm_bias" not in params and experiment.task.head["crf"] is True
  # The vocabulary is the pretraining stage's: the fine-tuning run reuses it.
  assert experiment.data.tokenizer.words == Predictor(
      os.path.join(workdir, "pretrain")).task.tokenizer.words



def test_a_lower_rate_for_the_pretrained_encoder_scales_only_its_updates(recipe_run, tmp_path):
  """optimizer.pretrained_rate_scale: from the same state and batch, the first steps move
  the carried encoder by that fraction of the one-rate steps, and the fresh head alike."""
  config, workdir, _ = recipe_run
  steps = {}
  for scale in (1.0, 0.25):
    run = copy.deepcopy(config)
    run.pretrain.enabled = False
    run.init_from = os.path.join(workdir, "pretrain", "checkpoints", "30")
    run.optimizer.pretrained_rate_scale = scale
    experiment = Experiment.create(run, str(tmp_path / f"fine{scale}"))
    state, shardings = experiment.init_state()
    params, carried = experiment.initial_params(state.params)
    state = state.replace(params=params)
    batches = experiment.data.train_iterator(experiment.task, run.batch_size)
    batch = sharding.to_global(next(batches), experiment.mesh)
    batches.close()
    before = jax.device_get(params)            # the step donates the state
    step = experiment.train_step(shardings)
    after, _ = step(*step(state, batch)[:1], batch)   # the warm-up's first rate is 0
    steps[scale] = jax.tree_util.tree_map(lambda a, b: np.asarray(a) - b, after.params, before)
  assert carried == ["character_features", "encoder"]
  for name in steps[1.0]:
    factor = 0.25 if name in carried else 1.0
    jax.tree_util.tree_map(lambda low, full, f=factor: np.testing.assert_allclose(
        low, f * full, rtol=1e-3, atol=5e-7), steps[0.25][name], steps[1.0][name])
  # The steps are far larger than the float32 rounding of the parameters (atol above).
  assert np.abs(steps[1.0]["encoder"]["embedding"]["embedding"]).max() > 1e-5

def test_one_command_pretrains_fine_tunes_a_tagger_resumes_and_predicts(recipe_run):
  config, workdir, final = recipe_run
  assert {"eval/f1", "eval/loss"} <= set(final)
  stage = os.path.join(workdir, "pretrain")
  with open(os.path.join(stage, "config.json")) as f:
    assert json.load(f)["task"] == "mlm"
  with open(os.path.join(workdir, "config.json")) as f:
    assert json.load(f)["init_from"] == os.path.join(stage, "checkpoints", "30")
  # Both stages finished: the same command trains nothing more.
  before = (_lines(stage), [l for l in _lines(workdir) if "train/loss" in l])
  again = recipe.train(config, workdir)
  assert again["eval/f1"] == pytest.approx(final["eval/f1"])
  assert (_lines(stage), [l for l in _lines(workdir) if "train/loss" in l]) == before
  tags = Predictor(workdir).predict_lines(["Smith visited Rome ."])
  assert len(tags[0].split()) == 4


def test_truncation_keeps_head_tail_or_both():
  from transformer_jax.tasks.base import kept_tokens
  x = np.arange(100)
  assert (kept_tokens(x, 8, "head") == np.arange(8)).all()
  assert (kept_tokens(x, 8, "tail") == np.arange(92, 100)).all()
  assert (kept_tokens(x, 8, "head_tail") == np.r_[0:2, 94:100]).all()
  assert (kept_tokens(x[:5], 8, "head_tail") == x[:5]).all()


def test_scoring_only_the_masked_positions_equals_the_full_output_there():
  from conftest import random_tokens, tiny_config

  from transformer_jax.modules.heads import MaskedLanguageModel
  model = MaskedLanguageModel(tiny_config(num_decoder_layers=0))
  tokens = jnp.asarray(random_tokens(0, 2, 12))
  params = model.init(jax.random.PRNGKey(0), tokens)
  at = jnp.asarray([[3, 0, 7], [11, 5, 5]])
  full = model.apply(params, tokens)
  np.testing.assert_allclose(model.apply(params, tokens, predict_at=at),
                             np.take_along_axis(np.asarray(full), np.asarray(at)[..., None], 1),
                             rtol=1e-5, atol=1e-5)


def test_mlm_reads_the_text_of_a_classification_set_plus_extra_lines(tmp_path):
  from test_data import write

  from transformer_jax.options import DataOptions
  from transformer_jax.tasks.mlm import MaskedLMTask
  write(tmp_path / "train.tsv", ["sentence\tlabel", "good<br /><br />film\t1", "bad\t0"], gz=True)
  write(tmp_path / "dev.tsv", ["sentence\tlabel", "fine\t1"], gz=False)
  write(tmp_path / "unsup.txt", ["an unlabelled <br />review", "", "another"], gz=True)
  data = DataOptions(source="local", dir=str(tmp_path), labels="neg,pos", eval_split="dev",
                     text_of="classification", extra_text="unsup.txt", br_tags="space")
  loaders, labels = MaskedLMTask.local_splits(str(tmp_path), ["train", "dev"], data)
  assert labels is None
  assert [r["text"] for r in loaders["train"]()] == [
      "good film", "bad", "an unlabelled review", "another"]
  assert [r["text"] for r in loaders["dev"]()] == ["fine"]
  # Another data set's file: a path relative to data.dir, or an absolute one.
  (tmp_path / "sst2").mkdir()
  for name in ("train.tsv", "dev.tsv"):
    (tmp_path / "sst2" / name).write_text("sentence\tlabel\nshort one\t1\n")
  for path in ("../unsup.txt", str(tmp_path / "unsup.txt")):
    loaders, _ = MaskedLMTask.local_splits(
        str(tmp_path / "sst2"), ["train"], dataclasses.replace(data, extra_text=path))
    assert [r["text"] for r in loaders["train"]()] == [
        "short one", "an unlabelled review", "another"]
  with pytest.raises(UserError, match="data.text_of"):
    MaskedLMTask.local_splits(str(tmp_path), ["train"], DataOptions(source="local"))


def test_eval_batches_bounded_by_tokens_keep_every_example():
  from conftest import featurizing_task

  from transformer_jax.data import pipeline
  from transformer_jax.data.tokenizer import WordVocab
  vocab = WordVocab.build([["w"]])
  task = featurizing_task("classification", vocab, labels=("a", "b"))
  records = [{"text": " ".join(["w"] * n), "label": 0} for n in range(1, 120, 3)]
  batches, counts = pipeline.eval_batches(records, task, batch_size=16, max_length=64,
                                          truncate="head_tail", batch_tokens=128)
  assert counts.too_long == sum(n > 64 for n in range(1, 120, 3))
  assert sorted(len(r["text"].split()) for b in batches for r in b.records) == list(range(1, 120, 3))
  for batch in batches:
    rows, length = batch.arrays["tokens"].shape
    assert rows * length <= max(128, length) and rows <= 16


def test_pretraining_and_init_from_together_are_refused(tmp_path):
  config = sst2.get_config()
  config.pretrain.enabled = True
  config.init_from = str(tmp_path)
  with pytest.raises(UserError, match="pretrain.enabled"):
    recipe.train(config, str(tmp_path / "run"))


def test_the_pretraining_stage_has_its_own_dropout_row_length_and_long_text_policy():
  config = sst2.get_config().to_dict()
  config["pretrain"].update(dropout_rate=0.0, attention_dropout_rate=0.05, max_length=32,
                            too_long="split")
  stage = recipe.pretraining_config(config)
  assert stage["task"] == "mlm"
  assert (stage["model"]["dropout_rate"], stage["model"]["attention_dropout_rate"]) == (0.0, 0.05)
  assert stage["data"]["max_length"] == stage["data"]["eval_max_length"] == 32
  assert stage["data"]["too_long"] == "split"
  # The fine-tuning run keeps its own settings; max_length 0 and too_long "" mean the run's.
  assert (config["model"]["dropout_rate"], config["data"]["max_length"]) == (0.3, 64)
  config["pretrain"].update(max_length=0, too_long="")
  stage = recipe.pretraining_config(config)
  assert (stage["data"]["max_length"], stage["data"]["too_long"]) == (64, "truncate")
