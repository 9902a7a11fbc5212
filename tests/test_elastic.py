"""Elastic resume: global batch s is the same whatever the number of hosts, so a position
saved by N hosts resumes on M. In process: each host's iterator over local files and TFDS,
seq2seq and encoder-task packing. End to end: train.py on 1 process of 8 CPU devices, resumed
on 2 processes (jax.distributed on 127.0.0.1), resumed on 1 process of 4 devices, with
grad_accum_steps=2: every global batch's fingerprint equals the uninterrupted run's and the
losses agree within 1e-5 relative; a mesh the global batch does not split over is refused
in one line. The same for the pretrain-then-fine-tune recipe (training/recipe.py): resumed
mid-pretraining on 2 processes, which then run both stages on one cluster, and resumed
mid-fine-tuning on 1. Checkpoint averaging on 2 processes gives the model of 1. (A
same-mesh resume is bitwise: tests/test_resume.py.)"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import pytest
import tensorflow_datasets as tfds
from cli_helpers import finish, start
from conftest import featurizing_task
from test_data import DIGITS, digit_records, write
from test_distributed import _env, _finish, _free_port, _metrics
from test_tasks import _DigitWords, _encoder_records, sentiment_corpus
from test_tfds import _aligned_conll, _data

from transformer_jax import checkpoint, tasks
from transformer_jax.checkpoint import Restored
from transformer_jax.data import pipeline
from transformer_jax.data.tfds_source import tfds_corpus
from transformer_jax.errors import UserError
from transformer_jax.training import loop
from transformer_jax.trees import named_leaves

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCHES, RESUME_AT = 8, 3


def _fingerprint(batch: dict) -> list[str]:
  """sha256 of each row (all of its arrays), as tests/fingerprint_train.py writes them."""
  return [hashlib.sha256(b"".join(batch[k][i].tobytes() for k in sorted(batch))).hexdigest()
          for i in range(len(batch[next(iter(batch))]))]


def _global_batches(make, hosts: int, count: int, state: dict | None = None):
  """`count` global batches read by `hosts` hosts (`make(index, count)`: a host's iterator),
  each the hosts' rows joined; and the position after them, which every host agrees on."""
  iterators = [make(i, hosts) for i in range(hosts)]
  for iterator in iterators:
    if state is not None:
      iterator.set_state(json.loads(json.dumps(state)))
  batches = [sum((_fingerprint(next(it)) for it in iterators), []) for _ in range(count)]
  states = [it.get_state() for it in iterators]
  assert all(s == states[0] for s in states)
  for iterator in iterators:
    iterator.close()
  return batches, states[0]


def _check_elastic(make) -> None:
  """N hosts -> M hosts, for (N, M) in (2, 1), (1, 2), (1, 4): the batches after the resume
  are the uninterrupted single host's."""
  straight, _ = _global_batches(make, 1, BATCHES)
  assert len(set(map(tuple, straight))) == BATCHES      # Batches differ: a real order.
  for before, after in ((2, 1), (1, 2), (1, 4)):
    first, state = _global_batches(make, before, RESUME_AT)
    assert state["order"] == pipeline.GLOBAL_ORDER
    rest, _ = _global_batches(make, after, BATCHES - RESUME_AT, state)
    assert first + rest == straight, (before, after)


def _iterator(records, task, **kwargs):
  def make(index: int, count: int) -> pipeline.TrainIterator:
    return pipeline.train_iterator(records, task, batch_size=4, max_length=16, seed=0,
                                   shard_index=index, shard_count=count, **kwargs)
  return make


def test_seq2seq_packing_resumes_on_other_host_counts():
  # 30 records: the 8 batches cross epoch boundaries (each reshuffled).
  _check_elastic(_iterator(digit_records(30), featurizing_task("seq2seq", DIGITS)))


@pytest.mark.parametrize("kind", ["classification", "tagging"])
def test_encoder_task_packing_resumes_on_other_host_counts(kind):
  task = featurizing_task(kind, DIGITS if kind == "classification" else _DigitWords)
  _check_elastic(_iterator(_encoder_records(kind, 24), task, max_segments=3))


class _MockWords:
  """The mock conll2003 words ("w0" ... "w8") as digit ids."""
  vocab_size = DIGITS.vocab_size
  encode_words = staticmethod(lambda words: DIGITS.encode(" ".join(w[1:] for w in words)))


def test_tfds_source_resumes_on_other_host_counts():
  """ArrayRecord through tfds.data_source (mock data), tagging with packing."""
  with tfds.testing.mock_data(as_data_source_fn=_aligned_conll):
    records = tfds_corpus(tasks.TaggingTask, _data(name="conll2003", tokenizer="words")
                          ).split("train")
    _check_elastic(_iterator(records, featurizing_task("tagging", _MockWords),
                             max_segments=3))


def test_old_format_positions_resume_in_their_own_order():
  """A position without "order" (written before elastic resume) continues the per-host order
  on as many hosts (`records[host::hosts]`, each host's own batches), and on one host the
  global order, which is the same there."""
  records, task = digit_records(30), featurizing_task("seq2seq", DIGITS)
  make = _iterator(records, task, prefetch=0)
  fresh = make(0, 1).get_state()
  old_format = {k: v for k, v in fresh.items() if k != "order"}
  # One host: the old order is the global order.
  one = make(0, 1)
  one.set_state(old_format)
  assert _global_batches(make, 1, 2)[0] == [_fingerprint(next(one)) for _ in range(2)]
  assert one.get_state()["order"] == pipeline.GLOBAL_ORDER
  # Two hosts: host 1 reads its own shard in its own batches and saves the old format.
  legacy = make(1, 2)
  legacy.set_state(old_format)
  seen = [next(legacy) for _ in range(3)]
  saved = legacy.get_state()
  assert "order" not in saved
  expected = [next(legacy) for _ in range(3)]
  resumed = make(1, 2)
  resumed.set_state(saved)
  assert [_fingerprint(next(resumed)) for _ in range(3)] == list(map(_fingerprint, expected))
  own_shard = {tuple(DIGITS.encode(r["source"])) for r in records[1::2]}
  packed = [tuple(row[segments == s]) for batch in seen + expected
            for row, segments in zip(batch["src"], batch["src_segment_ids"])
            for s in range(1, segments.max() + 1)]
  assert set(packed) <= own_shard and all(b["src"].shape == (2, 16) for b in seen)


def _restored(data_state: dict, distributed: dict) -> Restored:
  return Restored(step=4, arrays={}, data_state=data_state, path="W/checkpoints/4",
                  config={"distributed": distributed})


def test_old_format_on_another_process_count_is_refused():
  old = {"pipeline": {}, "counts": {}}
  two = {"initialize": True, "coordinator_address": "h:1", "num_processes": 2}
  with pytest.raises(UserError, match=r"cannot resume W/checkpoints/4 on 1 processes: it was "
                     r"written by 2 processes .*resume with 2 processes"):
    loop._check_data_position(_restored(old, two))
  loop._check_data_position(_restored(old, {"initialize": False}))          # 1 -> 1
  loop._check_data_position(_restored({**old, "order": "global"}, two))     # global: any count
  loop._check_data_position(_restored({"next_index": 3}, two))              # synthetic stream


# ------------------------------------------------------------------- train.py, end to end
STEPS, FIRST_RESUME, SECOND_RESUME = 6, 2, 4
RUN_FLAGS = [
    "--config=configs/multi30k.py", f"--config.num_train_steps={STEPS}",
    "--config.log_every_steps=1",
    f"--config.eval_every_steps={STEPS}", "--config.checkpoint_every_steps=2",
    "--config.keep_checkpoints=3", "--config.average_checkpoints=0",
    "--config.batch_size=16", "--config.grad_accum_steps=2",
    "--config.data.max_length=16", "--config.data.eval_max_length=16",
    "--config.data.vocab_size=48", "--config.data.test_split=",
    "--config.eval.examples=4", "--config.eval.batch_size=4", "--config.decode.beam_size=1",
    "--config.decode.max_extra_length=2",
    "--config.model.d_model=32", "--config.model.d_ff=64", "--config.model.num_heads=2",
    "--config.model.num_encoder_layers=1", "--config.model.num_decoder_layers=1",
    "--config.model.max_len=32", "--config.optimizer.schedule=constant",
    "--config.optimizer.warmup_steps=2", "--config.mesh.data=-1",
]


def _corpus(folder) -> str:
  os.makedirs(folder)
  rng = np.random.default_rng(0)
  words = [f"{a}{b}" for a in "bdkmt" for b in "aeiou"]
  for split, count in (("train", 120), ("val", 8)):
    pairs = [" ".join(rng.choice(words, rng.integers(1, 7))) for _ in range(count)]
    write(os.path.join(folder, f"{split}.de"), pairs)
    write(os.path.join(folder, f"{split}.en"), [" ".join(p.split()[::-1]) for p in pairs])
  return str(folder)


def _train(workdir, data: str, devices: int, processes: int = 1, *extra: str,
           flags: list[str] = RUN_FLAGS):
  """train.py (tests/fingerprint_train.py) with `flags` on `processes` processes of `devices`
  CPU devices each; their outputs."""
  port = _free_port()
  cluster = lambda i: ["--config.distributed.initialize=True",
                       f"--config.distributed.coordinator_address=127.0.0.1:{port}",
                       f"--config.distributed.num_processes={processes}",
                       f"--config.distributed.process_id={i}"] if processes > 1 else []
  env = {**_env(devices), "FINGERPRINTS": f"{workdir}.fingerprints"}
  runs = [subprocess.Popen(
      [sys.executable, os.path.join(ROOT, "tests", "fingerprint_train.py"),
       f"--workdir={workdir}", *flags, f"--config.data.dir={data}", *extra, *cluster(i)],
      cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
      for i in range(processes)]
  return [_finish(run) for run in runs]


def _fingerprints(workdir, processes: int) -> list[list[str]]:
  """Each global batch a run fed: the processes' rows joined in process order."""
  per_process = []
  for i in range(processes):
    with open(f"{workdir}.fingerprints.{i}") as f:
      per_process.append([json.loads(line) for line in f])
  return [sum(rows, []) for rows in zip(*per_process, strict=True)]


def _resume_point(source, target, step: int) -> None:
  """A copy of workdir `source` whose newest checkpoint is `step`."""
  shutil.copytree(source, target)
  for name in os.listdir(os.path.join(target, "checkpoints")):
    if name.isdigit() and int(name) > step:
      shutil.rmtree(os.path.join(target, "checkpoints", name))


def test_train_resumes_across_process_and_device_counts(tmp_path):
  """1 process x 8 devices -> (step 2) 2 processes x 4 devices -> (step 4) 1 process x 4
  devices, against 6 uninterrupted steps on 1 x 8."""
  data = _corpus(tmp_path / "data")
  straight, elastic = str(tmp_path / "straight"), str(tmp_path / "elastic")
  _train(straight, data, 8)
  _resume_point(straight, elastic, FIRST_RESUME)
  outputs = _train(elastic, data, 4, 2, f"--config.num_train_steps={SECOND_RESUME}")
  assert f"resumed from step {FIRST_RESUME}" in outputs[0]
  assert "mesh: {'data': 8, 'fsdp': 1, 'tensor': 1} over 8 cpu devices" in outputs[0]
  with open(f"{elastic}.fingerprints.0") as f:
    assert all(len(json.loads(line)) == 8 for line in f)   # half of each global batch
  two_processes = _fingerprints(elastic, 2)
  os.rename(f"{elastic}.fingerprints.0", f"{elastic}.first")
  (output,) = _train(elastic, data, 4)
  assert f"resumed from step {SECOND_RESUME}" in output
  assert "mesh: {'data': 4, 'fsdp': 1, 'tensor': 1} over 4 cpu devices" in output

  expected = _fingerprints(straight, 1)
  assert len(expected) == STEPS and len(set(map(tuple, expected))) == STEPS
  assert two_processes == expected[FIRST_RESUME:SECOND_RESUME]
  assert _fingerprints(elastic, 1) == expected[SECOND_RESUME:]
  ours, theirs = _metrics(elastic), _metrics(straight)
  losses = lambda lines: {m["step"]: m["train/loss"] for m in lines if "train/loss" in m}
  assert sorted(losses(ours)) == list(range(1, STEPS + 1))
  for step, loss in losses(theirs).items():
    assert losses(ours)[step] == pytest.approx(loss, rel=1e-5), step

  # On a mesh that the global batch does not split over: one line, before any restoring.
  code, output = finish(start("train.py", f"--workdir={straight}", *RUN_FLAGS,
                              f"--config.data.dir={data}", env=_env(3)))
  assert code == 2 and "Traceback" not in output and "resumed" not in output, output
  errors = [line for line in output.splitlines() if line.startswith("error:")]
  assert errors == ["error: batch_size/grad_accum_steps=8 is not divisible by mesh "
                    "data*fsdp=3; every device needs an equal share of the batch"], output


# ------------------------------------------------- the recipe: pretraining, then fine-tuning
PRETRAIN, FINE_TUNE, CUT = 4, 4, 2   # steps of each stage; both resumed after step CUT
RECIPE_FLAGS = [
    "--config=configs/sst2.py", "--config.pretrain.enabled=True",
    f"--config.pretrain.num_train_steps={PRETRAIN}", "--config.pretrain.warmup_steps=2",
    f"--config.num_train_steps={FINE_TUNE}", "--config.log_every_steps=1",
    "--config.eval_every_steps=100", f"--config.checkpoint_every_steps={CUT}",
    "--config.average_checkpoints=0", "--config.batch_size=8",
    "--config.data.min_word_count=1", "--config.eval.examples=8", "--config.eval.batch_size=8",
    "--config.model.d_model=32", "--config.model.d_ff=64", "--config.model.num_heads=2",
    "--config.model.num_encoder_layers=1", "--config.model.char_features=16",
    # A schedule that does not depend on num_train_steps: a run told to stop early
    # trains its steps as the full run does.
    "--config.optimizer.schedule=constant", "--config.optimizer.warmup_steps=2",
    "--config.mesh.data=-1",
]


def test_recipe_runs_on_two_processes_and_resumes_across_process_counts(tmp_path):
  """1 process x 4 devices pretrains to step 2 -> 2 processes x 2 devices resume it, finish
  pretraining and fine-tune to step 2 (one cluster for both stages) -> 1 process x 4 devices
  resumes fine-tuning; against the uninterrupted recipe on 1 x 4: the same global batches
  and losses, in each stage."""
  data = tmp_path / "data"
  data.mkdir()
  sentiment_corpus(data)
  straight, elastic = str(tmp_path / "straight"), str(tmp_path / "elastic")
  (output,) = _train(straight, str(data), 4, flags=RECIPE_FLAGS)
  assert "fine-tuning stage from" in output, output[-3000:]
  _resume_point(os.path.join(straight, "pretrain"), os.path.join(elastic, "pretrain"), CUT)

  outputs = _train(elastic, str(data), 2, 2, f"--config.num_train_steps={CUT}",
                   flags=RECIPE_FLAGS)
  pretrained = os.path.join(elastic, "pretrain", "checkpoints", str(PRETRAIN))
  for out in outputs:    # every process: both stages, in order, on the 2-process cluster
    assert out.index(f"pretraining stage ({PRETRAIN} steps") < out.index(
        f"fine-tuning stage from {pretrained}"), out[-3000:]
  assert outputs[0].count("over 4 cpu devices") == 2                  # one mesh per stage
  assert f"resumed from step {CUT}" in outputs[0] and "final:" in outputs[0]
  with open(os.path.join(elastic, "config.json")) as f:
    assert json.load(f)["init_from"] == pretrained
  two_processes = _fingerprints(elastic, 2)
  os.rename(f"{elastic}.fingerprints.0", f"{elastic}.first")
  (output,) = _train(elastic, str(data), 4, flags=RECIPE_FLAGS)
  assert "pretraining stage (" not in output                           # finished: skipped
  assert f"resumed from step {CUT}" in output and "final:" in output

  # Global batches: pretraining's, then fine-tuning's, all different.
  expected = _fingerprints(straight, 1)
  assert len(expected) == PRETRAIN + FINE_TUNE == len(set(map(tuple, expected)))
  assert two_processes == expected[CUT:PRETRAIN + CUT]
  assert _fingerprints(elastic, 1) == expected[PRETRAIN + CUT:]
  losses = lambda lines: {m["step"]: m["train/loss"] for m in lines if "train/loss" in m}
  for stage, steps in (("pretrain", PRETRAIN), ("", FINE_TUNE)):
    ours, theirs = (losses(_metrics(os.path.join(w, stage))) for w in (elastic, straight))
    assert sorted(ours) == sorted(theirs) == list(range(1, steps + 1)), stage
    for step, loss in theirs.items():
      assert ours[step] == pytest.approx(loss, rel=1e-5), (stage, step)


# ------------------------------------------------ checkpoint averaging on several processes
AVERAGED = [2, 4]    # the checkpoints that average_checkpoints=2 averages after 4 steps
AVERAGE_FLAGS = [flag for flag in RECIPE_FLAGS if not flag.startswith(
    ("--config.pretrain.", "--config.average_checkpoints="))] + [
    "--config.average_checkpoints=2"]


def test_checkpoint_averaging_on_two_processes_makes_the_one_process_model(tmp_path):
  """average_checkpoints=2 on 2 processes x 2 devices: process 0 averages steps 2 and 4
  alone while the other waits, then both evaluate the average. The snapshot is the exact
  mean of the run's own checkpoints, and the model (and its evaluation) that 1 process x 4
  devices makes."""
  data = tmp_path / "data"
  data.mkdir()
  sentiment_corpus(data)
  two, one = str(tmp_path / "two"), str(tmp_path / "one")
  outputs = _train(two, str(data), 2, 2, flags=AVERAGE_FLAGS)
  _train(one, str(data), 4, flags=AVERAGE_FLAGS)
  assert f"average of steps {AVERAGED}" in outputs[0] and "final:" in outputs[0], outputs[0]

  snapshot = lambda workdir: os.path.join(workdir, "exports", f"step_{AVERAGED[-1]}_avg2")
  assert checkpoint.read_record(snapshot(two)).averaged_steps == AVERAGED
  ours, theirs = (named_leaves(checkpoint.restore_params(snapshot(w))) for w in (two, one))
  saved = [dict(named_leaves(checkpoint.restore_params(os.path.join(two, "checkpoints",
                                                                      str(s)))))
           for s in AVERAGED]
  assert [name for name, _ in ours] == [name for name, _ in theirs] == list(saved[0])
  for (name, mean), (_, other) in zip(ours, theirs):
    parts = [np.asarray(s[name], np.float64) for s in saved]
    np.testing.assert_array_equal(mean, (sum(parts) / len(parts)).astype(mean.dtype), name)
    # Attention's key bias has a zero gradient (softmax ignores a shift): its gradient is
    # rounding noise, which Adam scales up to steps of the learning rate.
    if not name.endswith("key/bias"):
      np.testing.assert_allclose(mean, other, rtol=1e-5, atol=1e-6, err_msg=name)
  assert any(not np.array_equal(mean, saved[-1][name]) for name, mean in ours)  # a real mean

  final = lambda workdir: [m for m in _metrics(workdir) if "eval/averaged_checkpoints" in m]
  (a,), (b,) = final(two), final(one)
  assert a["eval/averaged_checkpoints"] == b["eval/averaged_checkpoints"] == len(AVERAGED)
  assert a["eval/loss"] == pytest.approx(b["eval/loss"], rel=1e-5)
  assert a["eval/accuracy"] == b["eval/accuracy"]
