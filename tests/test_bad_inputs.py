"""Bad inputs (issue 16): every user error ends with exit status 2 and ONE line on stderr
naming the culprit, without a traceback, and changes nothing saved before (checkpoints,
tokenizer files, predict's old output).

The table-driven cases call the command lines' code in-process (the setup phase fails before
anything is compiled); the few that need a real process (a second trainer, a checkpoint
write failing mid-run, the real `train.py`) spawn one, with tiny models and tmp dirs, in
tests/test_bad_inputs_processes.py.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import os
from typing import Callable

import pytest
from absl import flags
from test_training import tiny_run_config

from configs import conll2003, multi30k, sst2
from transformer_jax import errors, export, predict
from transformer_jax.training import loop

LOCK_FILES = {".lock", ".lock.holder"}


# ----------------------------------------------------------------------------- helpers
def snapshot(*roots: str) -> dict[str, str]:
  """Every file under `roots` (but the workdir lock's) with a hash of its contents."""
  files = {}
  for root in roots:
    for directory, _, names in os.walk(root):
      for name in names:
        path = os.path.join(directory, name)
        if name in LOCK_FILES or not os.path.isfile(path):
          continue
        with open(path, "rb") as f:
          files[path] = hashlib.sha256(f.read()).hexdigest()
  return files


def run_user_error(call: Callable[[], object], capsys) -> tuple[int, list[str]]:
  """(exit status, stderr lines) of `call` run as a command line's main is."""
  capsys.readouterr()
  with pytest.raises(SystemExit) as exit_info:
    errors.user_errors(call)()
  return exit_info.value.code, capsys.readouterr().err.splitlines()


def write(path, text: str | bytes) -> str:
  os.makedirs(os.path.dirname(str(path)), exist_ok=True)
  mode = "wb" if isinstance(text, bytes) else "w"
  with open(path, mode) as f:
    f.write(text)
  return str(path)


def shrink(config, **data):
  config.update(dict(num_train_steps=4, log_every_steps=2, eval_every_steps=4,
                     checkpoint_every_steps=4, batch_size=8, average_checkpoints=0))
  config.data.update({"prefetch": 1, "max_length": 16, "eval_max_length": 16, **data})
  config.model.update(dict(d_model=16, num_heads=2, d_ff=32, num_encoder_layers=1,
                           num_decoder_layers=1, max_len=16))
  return config


TSV = "sentence\tlabel\na good film\tpositive\na bad plot\tnegative\n"
CONLL = "EU B-ORG\nrejects O\n\nPeter B-PER\nsmiles O\n"
PARALLEL = ("ein hund\neine katze\n", "a dog\na cat\n")


def classification(data_dir: str, files: dict[str, str | bytes] | None = None, **over):
  for name, text in (files or {"train.tsv": TSV, "dev.tsv": TSV}).items():
    write(os.path.join(data_dir, name), text)
  return shrink(sst2.get_config(), **{"dir": data_dir, "tokenizer": "words",
                                      "min_word_count": 1, **over})


def tagging(data_dir: str, files: dict[str, str | bytes] | None = None, **over):
  for name, text in (files or {"train.txt": CONLL, "dev.txt": CONLL}).items():
    write(os.path.join(data_dir, name), text)
  return shrink(conll2003.get_config(), dir=data_dir, min_word_count=1, **over)


def translation(data_dir: str, files: dict[str, str | bytes] | None = None, **over):
  default = {"train.de": PARALLEL[0], "train.en": PARALLEL[1], "val.de": PARALLEL[0],
             "val.en": PARALLEL[1]}
  for name, text in (files or default).items():
    write(os.path.join(data_dir, name), text)
  return shrink(multi30k.get_config(), dir=data_dir, test_split="", vocab_size=20, **over)


def gzipped(text: str) -> bytes:
  return gzip.compress(text.encode())


def corrupt_gzip(text: str) -> bytes:
  data = bytearray(gzipped(text * 20))
  data[20:30] = b"\xff" * 10      # the deflate stream, past the header
  return bytes(data)


# ------------------------------------------------------------------- table of training cases
@dataclasses.dataclass
class Case:
  name: str
  config: Callable[[str], object]   # data dir -> run config
  expect: tuple[str, ...]           # all in the error line
  prepare: Callable[[str, str], None] = lambda data_dir, workdir: None


def with_model(make: Callable[..., object], **model) -> Callable[[str], object]:
  """`make`'s config with model-group fields changed (the heads' options)."""
  def build(data_dir: str):
    config = make(data_dir)
    config.model.update(model)
    return config
  return build


def tiny(**overrides) -> Callable[[str], object]:
  return lambda data_dir: tiny_run_config(**overrides)


def edit_after_tokenizer(data_dir: str, workdir: str) -> None:
  """A first run trained the tokenizer on other data (the setup phase alone)."""
  from transformer_jax.training.experiment import Experiment
  Experiment.create(classification(data_dir), workdir)
  write(os.path.join(data_dir, "train.tsv"), TSV + "one more line\tpositive\n")


def traversing_model_file(data_dir: str, workdir: str) -> None:
  write(os.path.join(workdir, "vocab.json"),
        '{"kind": "sentencepiece", "model_file": "../elsewhere.model"}')


def unwritable_checkpoints(data_dir: str, workdir: str) -> None:
  os.makedirs(workdir)
  # sysfs refuses new entries even to root: a real "cannot write", no mount needed.
  os.symlink("/sys/transformer_jax_test", os.path.join(workdir, "checkpoints"))


TRAIN_CASES = [
    # Config fields, the mesh, the metric name, model.max_len against the data.
    Case("batch_size_0", tiny(batch_size=0), ("config.batch_size=0",)),
    Case("dropout_1.5", tiny(**{"model.dropout_rate": 1.5}), ("dropout_rate=1.5",)),
    Case("heads_not_dividing", tiny(**{"model.num_heads": 3}), ("num_heads=3",)),
    Case("unknown_optimizer", tiny(**{"optimizer.name": "sgd"}), ("optimizer.name='sgd'",)),
    Case("unknown_schedule", tiny(**{"optimizer.schedule": "x"}), ("optimizer.schedule='x'",)),
    Case("negative_warmup", tiny(**{"optimizer.warmup_steps": -1}), ("warmup_steps",)),
    Case("pretrained_rate_above_1", tiny(**{"optimizer.pretrained_rate_scale": 2.0}),
         ("optimizer.pretrained_rate_scale=2.0", "(0, 1]")),
    Case("pretrain_dropout_1", tiny(**{"pretrain.dropout_rate": 1.0}),
         ("pretrain.dropout_rate=1.0", "[0, 1)")),
    Case("pretrain_too_long", tiny(**{"pretrain.too_long": "wrap"}),
         ("pretrain.too_long", "wrap")),
    Case("split_seq2seq", lambda d: translation(d, too_long="split"),
         ("data.too_long='split'", "seq2seq", "'truncate'")),
    Case("mesh_vs_devices", tiny(**{"mesh.data": 3}), ("mesh", "needs 3 devices")),
    Case("batch_vs_grad_accum", tiny(grad_accum_steps=3), ("grad_accum_steps=3",)),
    Case("misspelt_best_metric", tiny(keep_best_checkpoints=1,
                                      best_checkpoint_metric="eval/f1"),
         ("best_checkpoint_metric='eval/f1'", "eval/bleu")),
    Case("best_mode", tiny(best_checkpoint_mode="up"), ("best_checkpoint_mode='up'",)),
    Case("label_smoothing", tiny(label_smoothing=1.5), ("label_smoothing=1.5",)),
    Case("nonfinite_policy", tiny(nonfinite="ignore"), ("config.nonfinite='ignore'",)),
    Case("beam_size_0", tiny(**{"decode.beam_size": 0}), ("decode.beam_size=0",)),
    Case("eval_batch_size_0", tiny(**{"eval.batch_size": 0}), ("eval.batch_size=0",)),
    Case("unknown_task", tiny(task="summarize"), ("task='summarize'",)),
    Case("unknown_data_source", tiny(**{"data.source": "s3"}), ("data.source='s3'",)),
    Case("unknown_synthetic_task", tiny(**{"data.synthetic_task": "x"}),
         ("data.synthetic_task='x'",)),
    Case("max_len_below_data", tiny(**{"model.max_len": 4}), ("model.max_len=4",)),
    Case("max_len_below_local_data",
         lambda d: translation(d, max_length=64), ("model.max_len=16", "data.max_length")),
    Case("tokenizer_for_task", lambda d: translation(d, tokenizer="words"),
         ("data.tokenizer='words'", "seq2seq")),
    Case("too_long_policy", lambda d: classification(d, too_long="cut"),
         ("data.too_long='cut'",)),
    Case("one_class_label", lambda d: classification(d, labels="positive"),
         ("data.labels='positive'",)),
    Case("unknown_pooling", with_model(classification, pooling="sum"),
         ("model.pooling='sum'",)),
    Case("chars_of_subwords", with_model(lambda d: classification(d, tokenizer="sentencepiece"),
                                         char_features=16),
         ("model.char_features=16", "data.tokenizer='sentencepiece'")),
    Case("word_dropout_1", with_model(tagging, word_dropout=1.0), ("model.word_dropout=1.0",)),
    Case("char_max_length_0", with_model(tagging, char_max_length=0),
         ("model.char_max_length=0",)),
    # Data: present, non-empty, well-formed, every split.
    Case("missing_data_dir", lambda d: classification(d, dir=d + "/nowhere"),
         ("data.dir=", "nowhere", "no such directory")),
    Case("missing_eval_file", lambda d: classification(d, {"train.tsv": TSV}),
         ("no file 'dev.tsv'",)),
    Case("empty_train_tsv", lambda d: classification(d, {"train.tsv": "", "dev.tsv": TSV}),
         ("no examples in", "train.tsv")),
    Case("blank_train_tsv",
         lambda d: classification(d, {"train.tsv": "\n  \n\n", "dev.tsv": TSV}),
         ("no examples in", "train.tsv")),
    Case("empty_eval_split", lambda d: classification(d, {"train.tsv": TSV, "dev.tsv": ""}),
         ("no examples in", "dev.tsv")),
    Case("tsv_three_fields",
         lambda d: classification(d, {"train.tsv": TSV + "a\tb\tpositive\n", "dev.tsv": TSV}),
         ("train.tsv:4", "2 tab-separated fields")),
    Case("tsv_unknown_label",
         lambda d: classification(d, {"train.tsv": TSV + "meh\tneutral\n", "dev.tsv": TSV}),
         ("train.tsv:4", "unknown label 'neutral'")),
    Case("not_utf8", lambda d: classification(
        d, {"train.tsv": TSV.encode() + b"caf\xe9\tpositive\n", "dev.tsv": TSV}),
         ("train.tsv:4", "not valid UTF-8")),
    Case("truncated_gzip", lambda d: classification(
        d, {"train.tsv.gz": gzipped(TSV)[:-12], "dev.tsv": TSV}),
         ("train.tsv.gz",)),
    Case("corrupt_gzip_body", lambda d: classification(
        d, {"train.tsv.gz": corrupt_gzip(TSV), "dev.tsv": TSV}),
         ("train.tsv.gz",)),
    Case("conll_bad_tag", lambda d: tagging(d, {"train.txt": CONLL + "x PERSON\n",
                                                "dev.txt": CONLL}),
         ("train.txt:6", "'PERSON' is not a BIO tag")),
    Case("conll_missing_tag", lambda d: tagging(d, {"train.txt": "EU\n", "dev.txt": CONLL}),
         ("train.txt:1", "at least 2")),
    Case("conll_blank_only", lambda d: tagging(d, {"train.txt": "\n\n", "dev.txt": CONLL}),
         ("no examples in", "train.txt")),
    Case("conll_unknown_eval_tag", lambda d: tagging(
        d, {"train.txt": CONLL, "dev.txt": "Paris B-LOC\n"}), ("dev.txt:1", "'B-LOC'")),
    Case("parallel_unequal", lambda d: translation(
        d, {"train.de": PARALLEL[0] + "drei\n", "train.en": PARALLEL[1],
            "val.de": PARALLEL[0], "val.en": PARALLEL[1]}), ("train.de:3",)),
    Case("parallel_empty", lambda d: translation(
        d, {"train.de": "", "train.en": "", "val.de": PARALLEL[0], "val.en": PARALLEL[1]}),
         ("no examples in", "train.de")),
    # The workdir: a tokenizer of other data, a tokenizer file pointing outside, checkpoints
    # that cannot be written.
    Case("tokenizer_of_other_data", classification, ("trained on other data", "train.tsv",
                                                     "to start fresh"),
         prepare=edit_after_tokenizer),
    Case("model_file_outside_workdir", lambda d: translation(d), ("model_file='../elsewhere",),
         prepare=traversing_model_file),
    Case("unwritable_checkpoints", tiny(), ("cannot write checkpoint to", "checkpoints")),
]
TRAIN_CASES[-1].prepare = unwritable_checkpoints


@pytest.mark.parametrize("case", TRAIN_CASES, ids=[c.name for c in TRAIN_CASES])
def test_training_refuses_bad_input(case: Case, tmp_path, capsys):
  data_dir, workdir = str(tmp_path / "data"), str(tmp_path / "work")
  config = case.config(data_dir)
  case.prepare(data_dir, workdir)
  before = snapshot(workdir)
  status, lines = run_user_error(lambda: loop.train_and_evaluate(config, workdir), capsys)
  assert status == 2
  assert len(lines) == 1 and lines[0].startswith("error: "), lines
  assert "Traceback" not in lines[0]
  for fragment in case.expect:
    assert fragment in lines[0], (fragment, lines[0])
  assert snapshot(workdir) == before     # no tokenizer, config.json or checkpoint written


def test_a_traceback_when_asked_for(monkeypatch, tmp_path):
  monkeypatch.setenv(errors.TRACEBACK_ENV, "1")
  with pytest.raises(errors.UserError, match="config.batch_size=0"):
    errors.user_errors(loop.train_and_evaluate)(tiny_run_config(batch_size=0), str(tmp_path))


# ----------------------------------------------------------------- a trained workdir: predict
@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> str:
  workdir = str(tmp_path_factory.mktemp("trained") / "w")
  loop.train_and_evaluate(tiny_run_config(num_train_steps=2, checkpoint_every_steps=2,
                                          eval_every_steps=2, log_every_steps=1), workdir)
  return workdir


def run_main(module, argv: list[str], capsys, monkeypatch) -> tuple[int, list[str]]:
  """module.main run with `argv` parsed into flags of its own (not absl's global ones,
  which other test modules' commands define too)."""
  flag_values = flags.FlagValues()
  module.define_flags(flag_values)
  flag_values(["prog", *argv])
  monkeypatch.setattr(module, "FLAGS", flag_values)
  return run_user_error(lambda: module.main(["prog"]), capsys)


PREDICT_CASES = [
    ("no_workdir_flag", [], ("give --workdir",)),
    ("missing_workdir", ["--workdir={tmp}/nowhere"], ("nowhere", "does not exist")),
    ("missing_input", ["--workdir={w}", "--input={tmp}/none.txt"], ("--input=", "none.txt")),
    ("missing_output_dir", ["--workdir={w}", "--input={tmp}/in.txt",
                            "--output={tmp}/no/dir/out.txt"], ("--output=", "does not exist")),
    ("batch_size_0", ["--workdir={w}", "--input={tmp}/in.txt", "--batch_size=0"],
     ("--batch_size=0",)),
    ("beam_size_0", ["--workdir={w}", "--input={tmp}/in.txt", "--beam_size=0"],
     ("--beam_size=0",)),
    ("negative_alpha", ["--workdir={w}", "--input={tmp}/in.txt", "--alpha=-1"],
     ("--alpha=-1",)),
    ("unknown_symbol", ["--workdir={w}", "--input={tmp}/bad.txt", "--output={tmp}/out.txt",
                        "--batch_size=2"], ("input line 3", "unknown symbol 'x'")),
    ("too_long_line", ["--workdir={w}", "--input={tmp}/long.txt", "--output={tmp}/out.txt"],
     ("input line 1", "max_len=16")),
]


@pytest.mark.parametrize("case", PREDICT_CASES, ids=[c[0] for c in PREDICT_CASES])
def test_predict_refuses_bad_input(case, trained, tmp_path, capsys, monkeypatch):
  _, argv, expect = case
  write(tmp_path / "in.txt", "1 2 3\n")
  write(tmp_path / "bad.txt", "1 2\n3 4\n5 x\n")
  write(tmp_path / "long.txt", " ".join(["1"] * 40) + "\n")
  old_output = write(tmp_path / "out.txt", "previous results\n")
  before = snapshot(trained, str(tmp_path))
  argv = [a.format(w=trained, tmp=tmp_path) for a in argv]
  status, lines = run_main(predict, argv, capsys, monkeypatch)
  assert status == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
  for fragment in expect:
    assert fragment in lines[0], (fragment, lines[0])
  assert snapshot(trained, str(tmp_path)) == before
  with open(old_output) as f:
    assert f.read() == "previous results\n"    # replaced only by a complete output


def test_predict_strips_a_byte_order_mark_and_writes_atomically(trained, tmp_path,
                                                                monkeypatch):
  write(tmp_path / "in.txt", "\ufeff1 2 3\n4 5\n")
  flag_values = flags.FlagValues()
  predict.define_flags(flag_values)
  flag_values(["prog", f"--workdir={trained}", f"--input={tmp_path}/in.txt",
               f"--output={tmp_path}/out.txt"])
  monkeypatch.setattr(predict, "FLAGS", flag_values)
  predict.main(["prog"])
  assert len((tmp_path / "out.txt").read_text().splitlines()) == 2
  assert sorted(os.listdir(tmp_path)) == ["in.txt", "out.txt"]   # no temporary left


EXPORT_CASES = [
    ("no_checkpoints", ["--workdir={tmp}/nowhere"], ("checkpoints does not exist",)),
    ("unknown_step", ["--workdir={w}", "--step=999"], ("999",)),
    ("too_many_to_average", ["--workdir={w}", "--average=9"], ("9",)),
]


@pytest.mark.parametrize("case", EXPORT_CASES, ids=[c[0] for c in EXPORT_CASES])
def test_export_refuses_bad_input(case, trained, tmp_path, capsys, monkeypatch):
  _, argv, expect = case
  before = snapshot(trained)
  status, lines = run_main(export, [a.format(w=trained, tmp=tmp_path) for a in argv],
                           capsys, monkeypatch)
  assert status == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
  for fragment in expect:
    assert fragment in lines[0], (fragment, lines[0])
  assert snapshot(trained) == before


def test_eval_only_without_a_checkpoint(tmp_path, capsys):
  status, lines = run_user_error(
      lambda: loop.evaluate_saved(tiny_run_config(), str(tmp_path / "w")), capsys)
  assert status == 2 and len(lines) == 1 and "no checkpoint or snapshot" in lines[0]


# ------------------------------------------------------------------------ never lose a step
def test_a_failing_evaluation_keeps_the_checkpoint_of_its_step(tmp_path, monkeypatch):
  """Evaluation at step 2 fails; step 2 (not a checkpoint step) is saved anyway."""
  def broken(self, params):
    raise RuntimeError("evaluation broke")
  monkeypatch.setattr(loop.Evaluator, "__call__", broken)
  workdir = str(tmp_path / "w")
  config = tiny_run_config(num_train_steps=4, eval_every_steps=2, checkpoint_every_steps=100,
                           log_every_steps=1)
  with pytest.raises(RuntimeError, match="evaluation broke"):
    loop.train_and_evaluate(config, workdir)
  assert os.listdir(os.path.join(workdir, "checkpoints")) == ["2"]


def test_reader_hygiene(tmp_path):
  """A byte-order mark is not data; corrupt gzip names its file."""
  from transformer_jax.data import readers
  bom = "\ufeff"
  tsv = write(tmp_path / "a.tsv", bom + TSV)
  assert readers.read_tsv(tsv, ["negative", "positive"])[0]["text"] == "a good film"
  conll = write(tmp_path / "a.txt", bom + CONLL)
  assert readers.read_conll(conll)[0]["words"][0] == "EU"
  src, tgt = write(tmp_path / "a.de", bom + "eins\n"), write(tmp_path / "a.en", "one\n")
  assert readers.read_parallel(src, tgt) == [{"source": "eins", "target": "one"}]
  broken = write(tmp_path / "b.tsv.gz", corrupt_gzip(TSV))
  with pytest.raises(readers.DataFormatError, match="b.tsv.gz"):
    readers.read_tsv(broken, ["negative", "positive"])


def test_plain_progress_lines_when_stderr_is_not_a_terminal(capsys):
  progress = loop._progress(10, 0)     # pytest's stderr is not a terminal
  progress.update(5)
  progress.set_postfix(loss="1.0000")
  progress.close()
  err = capsys.readouterr().err
  assert err == "train: step 5/10 loss=1.0000\n"
