"""Hugging Face MarianMT conversion, checked against transformers itself and CTranslate2:
a small random MarianMTModel (tests/marian_fixture.py), all offline."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
from marian_fixture import DATA, ROOT, write_marian_dir  # noqa: E402
from marian_fixture import lines as _lines

from transformer_jax import convert, decoding, trees  # noqa: E402
from transformer_jax.config import BOS_ID, EOS_ID, PAD_ID, TransformerConfig  # noqa: E402
from transformer_jax.convert import marian  # noqa: E402
from transformer_jax.data.tokenizer import SentencePieceTokenizer  # noqa: E402
from transformer_jax.modules.models import Transformer  # noqa: E402
from transformer_jax.predict import Predictor  # noqa: E402

pytestmark = pytest.mark.skipif(not os.path.isdir(DATA),
                                reason="needs the Multi30k text in ../shared/data/multi30k")


@pytest.fixture(scope="module")
def marian_dir(tmp_path_factory):
  directory = str(tmp_path_factory.mktemp("marian"))
  write_marian_dir(directory)
  return directory


def _to_ours(order: list[int | None]) -> np.ndarray:
  """Marian id -> our id, for an id order of marian.id_order or marian.opus_mt_order."""
  to_ours = np.zeros(sum(i is not None for i in order), np.int64)
  to_ours[[i for i in order if i is not None]] = [j for j, i in enumerate(order) if i is not None]
  return to_ours


@pytest.fixture(scope="module")
def imported(marian_dir):
  cfg, params, run_config, source, target = convert.import_marian(marian_dir)
  hf = json.load(open(os.path.join(marian_dir, "config.json")))
  vocab = json.load(open(os.path.join(marian_dir, "vocab.json")))
  order, _ = marian.id_order(hf, vocab, {}, marian_dir)
  to_ours = _to_ours(order)
  model = transformers.MarianMTModel.from_pretrained(marian_dir).eval()
  tokenizer = transformers.MarianTokenizer.from_pretrained(marian_dir)
  return dict(cfg=cfg, params=params, run_config=run_config, source=source, target=target,
              order=order, to_ours=to_ours, model=model, tokenizer=tokenizer)


def _ours(ids: torch.Tensor, mask: torch.Tensor, to_ours: np.ndarray) -> np.ndarray:
  """Marian ids -> ours, padding -> our PAD."""
  return np.where(mask.numpy().astype(bool), to_ours[ids.numpy()], PAD_ID).astype(np.int32)


def test_import_gives_transformers_logits_on_a_padded_batch(imported):
  m = imported
  src_texts = _lines("val.de.gz", 6)
  tgt_texts = _lines("val.en.gz", 6)
  batch = m["tokenizer"](src_texts, text_target=tgt_texts, padding=True, return_tensors="pt")
  pad = m["tokenizer"].pad_token_id
  labels = batch["labels"].masked_fill(batch["labels"] == -100, pad)
  start = m["model"].config.decoder_start_token_id
  dec_in = torch.cat([torch.full((labels.shape[0], 1), start), labels[:, :-1]], 1)
  dec_mask = torch.cat([torch.ones((labels.shape[0], 1), dtype=torch.long),
                        (labels[:, :-1] != pad).long()], 1)
  assert (batch["attention_mask"] == 0).any() and (dec_mask == 0).any()   # really padded
  with torch.no_grad():
    theirs = m["model"](input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                        decoder_input_ids=dec_in).logits.numpy()
  src = _ours(batch["input_ids"], batch["attention_mask"], m["to_ours"])
  tgt = _ours(dec_in, dec_mask, m["to_ours"])
  ours = np.asarray(Transformer(m["cfg"]).apply({"params": m["params"]}, src, tgt))
  real = dec_mask.numpy().astype(bool)
  marian_columns = [i for i in m["order"] if i is not None]
  ours_real = ours[real][:, 1:]                       # without the added PAD column
  theirs_real = theirs[real][:, marian_columns]
  assert np.abs(ours_real - theirs_real).max() < 1e-4
  log_ours = jax.nn.log_softmax(ours[real])[:, 1:]
  log_theirs = jax.nn.log_softmax(theirs[real])[:, marian_columns]
  assert np.abs(np.asarray(log_ours) - np.asarray(log_theirs)).max() < 1e-4


def test_greedy_decoding_equals_generate(imported):
  m = imported
  batch = m["tokenizer"](_lines("val.de.gz", 8), padding=True, return_tensors="pt")
  pad = m["model"].config.pad_token_id
  with torch.no_grad():
    theirs = m["model"].generate(**batch, num_beams=1, do_sample=False, max_new_tokens=24,
                                 bad_words_ids=[[pad]]).numpy()[:, 1:]   # drop the start
  src = _ours(batch["input_ids"], batch["attention_mask"], m["to_ours"])
  ours = decoding.generate(m["cfg"], m["params"], src, max_length=24, beam_size=1)
  for row_ours, row_theirs in zip(ours, theirs):
    expected = m["to_ours"][row_theirs].tolist()
    if EOS_ID in expected:
      expected = expected[:expected.index(EOS_ID) + 1]
    assert row_ours[:len(expected)].tolist() == expected


def test_tokenization_equals_marian_tokenizer_on_multi30k_validation(imported):
  m = imported
  sources, targets = _lines("val.de.gz"), _lines("val.en.gz")
  theirs_src = m["tokenizer"](sources)["input_ids"]
  theirs_tgt = m["tokenizer"](text_target=targets)["input_ids"]
  for text, ids in zip(sources, theirs_src):
    assert m["source"].encode(text) == m["to_ours"][ids].tolist(), text
  for text, ids in zip(targets, theirs_tgt):   # MarianTokenizer appends </s>; our pipeline does
    assert m["target"].encode(text) + [EOS_ID] == m["to_ours"][ids].tolist(), text


def _our_model(tmp_path, edit=None, **overrides):
  """An export of a model of this project (paper layout: interleaved sinusoids, epsilon
  1e-6) with a SentencePiece vocabulary trained on Multi30k de+en; `edit(params)` may
  change its parameters first."""
  texts = _lines("train.de.gz", 2000) + _lines("train.en.gz", 2000)
  tokenizer = SentencePieceTokenizer.train(texts, 400)
  cfg = TransformerConfig.small(tokenizer.vocab_size, **overrides)
  dummy = np.ones((1, 4), np.int32)
  params = jax.tree_util.tree_map(np.asarray, nn.meta.unbox(Transformer(cfg).init(
      jax.random.PRNGKey(3), dummy, dummy)["params"]))
  if edit:
    edit(params)
  run_config = {"task": "seq2seq", "model": cfg.to_dict(),
                "decode": {"beam_size": 4, "alpha": 0.6, "max_extra_length": 20}}
  workdir = str(tmp_path / "ours")
  convert.save_params_snapshot(os.path.join(workdir, "exports", "step_0"), params, run_config,
                               tokenizer, tokenizer)
  return workdir, cfg, params, tokenizer


def test_export_loads_in_transformers_and_round_trips_exactly(tmp_path):
  def random_bias(params):
    bias = params["decoder"]["final_logits_bias"]
    params["decoder"]["final_logits_bias"] = np.linspace(-1, 1, bias.size, dtype=np.float32)

  workdir, cfg, params, tokenizer = _our_model(tmp_path, random_bias, final_logits_bias=True)
  out = str(tmp_path / "hf")
  note = convert.run(to="hf_marian", workdir=workdir, output=out)
  assert "layer_norm_epsilon" in note                       # 1e-6 here, 1e-5 in Marian

  model = transformers.MarianMTModel.from_pretrained(out).eval()
  hf_tokenizer = transformers.MarianTokenizer.from_pretrained(out)
  sources, targets = _lines("val.de.gz", 5), _lines("val.en.gz", 5)
  batch = hf_tokenizer(sources, text_target=targets, padding=True, return_tensors="pt")
  # OPUS-MT's layout: </s> 0, <unk> 1, our pieces in order, <pad> (our BOS) last; no PAD.
  to_ours = _to_ours(marian.opus_mt_order(cfg))
  assert model.config.vocab_size == cfg.vocab_size - 1 == len(hf_tokenizer.get_vocab())
  assert model.config.pad_token_id == model.config.decoder_start_token_id == cfg.vocab_size - 2
  assert hf_tokenizer.convert_ids_to_tokens([0, 1, cfg.vocab_size - 2]) == ["</s>", "<unk>",
                                                                            "<pad>"]
  pad = hf_tokenizer.pad_token_id
  for text, ids in zip(sources, batch["input_ids"].tolist()):   # same pieces, + </s>
    assert to_ours[[i for i in ids if i != pad]].tolist() == tokenizer.encode(text) + [EOS_ID]
  src = np.where(batch["attention_mask"].numpy() == 1, to_ours[batch["input_ids"].numpy()],
                 PAD_ID)
  labels = batch["labels"].numpy()
  labels = np.where(labels == -100, pad, labels)
  dec_in = np.concatenate([np.full((len(labels), 1), pad), labels[:, :-1]], 1)
  real = np.concatenate([np.ones((len(labels), 1), bool), labels[:, :-1] != pad], 1)
  assert (~real).any()                                                       # really padded
  with torch.no_grad():
    theirs = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   decoder_input_ids=torch.from_numpy(dec_in)).logits.numpy()
  ours = np.asarray(Transformer(cfg).apply({"params": params}, src.astype(np.int32),
                                           np.where(real, to_ours[dec_in], PAD_ID).astype(np.int32)))
  assert np.abs(ours[real][:, to_ours] - theirs[real]).max() < 1e-4

  cfg_back, params_back, _, source, _ = convert.import_marian(out)
  assert cfg_back == cfg
  flat, flat_back = trees.flatten(params), trees.flatten(params_back)
  assert sorted(flat) == sorted(flat_back)
  for path in flat:
    np.testing.assert_array_equal(np.asarray(flat[path]), flat_back[path], err_msg=path)
  assert source.encode(sources[0]) == tokenizer.encode(sources[0]) + [EOS_ID]


def _padded_batch(tokenizer, sources, targets):
  batch = tokenizer(sources, text_target=targets, padding=True, return_tensors="pt")
  pad = tokenizer.pad_token_id
  labels = batch["labels"].masked_fill(batch["labels"] == -100, pad)
  dec_in = torch.cat([torch.full((labels.shape[0], 1), pad), labels[:, :-1]], 1)
  assert (batch["attention_mask"] == 0).any() and (dec_in[:, 1:] == pad).any()   # padded
  return batch, dec_in


def test_marian_import_then_export_gives_back_the_original(marian_dir, tmp_path):
  """HF -> import -> export: OPUS-MT's layout again (no extra PAD row), the same vocabulary
  and config ids, and the same logits on a padded batch."""
  workdir, out = str(tmp_path / "w"), str(tmp_path / "back")
  convert.run(from_="hf_marian", input=marian_dir, workdir=workdir)
  convert.run(to="hf_marian", workdir=workdir, output=out)
  original = transformers.MarianMTModel.from_pretrained(marian_dir).eval()
  back = transformers.MarianMTModel.from_pretrained(out).eval()
  for field in ("vocab_size", "pad_token_id", "decoder_start_token_id", "eos_token_id"):
    assert getattr(back.config, field) == getattr(original.config, field), field
  with open(os.path.join(marian_dir, "vocab.json")) as f, \
       open(os.path.join(out, "vocab.json")) as g:
    assert json.load(f) == json.load(g)
  tokenizer = transformers.MarianTokenizer.from_pretrained(out)
  sources, targets = _lines("val.de.gz", 6), _lines("val.en.gz", 6)
  batch, dec_in = _padded_batch(tokenizer, sources, targets)
  assert batch["input_ids"].tolist() == transformers.MarianTokenizer.from_pretrained(
      marian_dir)(sources, padding=True, return_tensors="pt")["input_ids"].tolist()
  with torch.no_grad():
    logits = [m(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                decoder_input_ids=dec_in).logits.numpy() for m in (original, back)]
  assert logits[0].shape == logits[1].shape
  assert np.abs(logits[0] - logits[1]).max() < 1e-4


def _ctranslate2_agreement(out: str, ct2_dir: str, cfg, params) -> list[bool]:
  """Per line of 50 Multi30k sources: do CTranslate2 (converting the export `out`) and our
  greedy decoding of (cfg, params) give the same pieces?"""
  ctranslate2 = pytest.importorskip("ctranslate2")
  ctranslate2.converters.TransformersConverter(out).convert(ct2_dir)
  _, _, _, source, target = convert.import_marian(out)      # the export's tokenizers
  lines, length = _lines("val.de.gz", 50), 24
  encoded = [source.encode(line) for line in lines]
  src = np.full((len(lines), max(map(len, encoded))), PAD_ID, np.int32)
  for row, ids in zip(src, encoded):
    row[:len(ids)] = ids
  ours = decoding.generate(cfg, params, src, max_length=length, beam_size=1)
  translator = ctranslate2.Translator(ct2_dir, device="cpu", inter_threads=1, intra_threads=1)
  results = translator.translate_batch([[source.pieces[i] for i in ids] for ids in encoded],
                                       beam_size=1, max_decoding_length=length)
  agree = []
  for row, result in zip(np.asarray(ours).tolist(), results):
    if EOS_ID in row:
      row = row[:row.index(EOS_ID)]
    agree.append([target.pieces[i] for i in row] == result.hypotheses[0])
  return agree


def test_ctranslate2_converts_the_export_and_translates_as_we_do(marian_dir, tmp_path):
  """ctranslate2's TransformersConverter (ct2-transformers-converter) reads our export, and
  its greedy translations of 50 Multi30k lines equal ours token for token. CTranslate2 starts
  Marian's decoder from a zero vector, as Marian itself does; an OPUS-MT model's pad row (our
  BOS row) is zero, and its import keeps it so (zero_decoder_start)."""
  pytest.importorskip("ctranslate2")
  from safetensors.numpy import load_file, save_file
  opus = _broken_copy(marian_dir, tmp_path, "opus")
  weights = os.path.join(opus, "model.safetensors")
  state = load_file(weights)
  state["model.shared.weight"][-1] = 0.0
  save_file(state, weights, metadata={"format": "pt"})
  workdir, out = str(tmp_path / "w"), str(tmp_path / "hf")
  convert.run(from_="hf_marian", input=opus, workdir=workdir)
  convert.run(to="hf_marian", workdir=workdir, output=out)
  cfg, params, _, _, _ = convert.import_marian(out)
  assert cfg.zero_decoder_start
  assert all(_ctranslate2_agreement(out, str(tmp_path / "ct2"), cfg, params))


@pytest.mark.parametrize("zero_start", [True, False])
def test_ctranslate2_translates_a_model_of_ours_when_its_decoder_starts_from_zeros(
    tmp_path, zero_start):
  """A model of this project whose BOS row is not zero (trained or, here, random): with
  model.zero_decoder_start its export translates in CTranslate2 as it does here; without,
  CTranslate2 (starting from zeros) disagrees on some lines (the control)."""
  pytest.importorskip("ctranslate2")
  workdir, cfg, params, _ = _our_model(tmp_path, zero_decoder_start=zero_start)
  assert np.any(params["shared_embedding"]["embedding"][BOS_ID])
  out = str(tmp_path / "hf")
  note = convert.run(to="hf_marian", workdir=workdir, output=out)
  assert ("zero_decoder_start=True" in note) != zero_start
  agree = _ctranslate2_agreement(out, str(tmp_path / "ct2"), cfg, params)
  assert all(agree) if zero_start else not all(agree)


def _cli(*args: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "transformer_jax.convert", *args],
                        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


def test_cli_import_then_predict(marian_dir, imported, tmp_path):
  workdir = str(tmp_path / "w")
  result = _cli("--from=hf_marian", f"--input={marian_dir}", f"--workdir={workdir}")
  assert result.returncode == 0, result.stderr
  lines = _lines("val.de.gz", 3)
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  predicted = subprocess.run(
      [sys.executable, "-m", "transformer_jax.predict", f"--workdir={workdir}",
       "--beam_size=1"], input="\n".join(lines) + "\n", capture_output=True, text=True,
      env=env, cwd=ROOT, timeout=300)
  assert predicted.returncode == 0, predicted.stderr
  assert len(predicted.stdout.splitlines()) == len(lines)
  # Greedy translations that start with transformers' generate, detokenized by MarianTokenizer.
  m = imported
  batch = m["tokenizer"](lines, padding=True, return_tensors="pt")
  with torch.no_grad():
    generated = m["model"].generate(**batch, num_beams=1, do_sample=False,
                                    max_new_tokens=32,   # generation_config's max_length
                                    bad_words_ids=[[m["model"].config.pad_token_id]])
  # predict's budget is at least generation_config's max_length (batch width + it).
  for ours, theirs in zip(predicted.stdout.splitlines(),
                          m["tokenizer"].batch_decode(generated, skip_special_tokens=True)):
    assert theirs and ours.startswith(theirs)


def _broken_copy(marian_dir, tmp_path, name):
  broken = str(tmp_path / name)
  shutil.copytree(marian_dir, broken)
  return broken


@pytest.mark.parametrize("damage, message", [
    ("missing_vocab", "missing vocab.json"),
    ("normalize_before", "normalize_before=True is an option this project lacks"),
    ("shapes", "has shape"),
    ("pickle", "--allow_pickle"),
])
def test_bad_input_is_one_line_naming_the_problem(marian_dir, tmp_path, damage, message):
  broken = _broken_copy(marian_dir, tmp_path, damage)
  config_path = os.path.join(broken, "config.json")
  hf = json.load(open(config_path))
  if damage == "missing_vocab":
    os.remove(os.path.join(broken, "vocab.json"))
  elif damage == "normalize_before":
    hf.update(normalize_before=True, add_final_layer_norm=True)
  elif damage == "shapes":
    hf.update(encoder_ffn_dim=48, decoder_ffn_dim=48)
  else:
    os.rename(os.path.join(broken, "model.safetensors"), os.path.join(broken, "pytorch_model.bin"))
  json.dump(hf, open(config_path, "w"))
  with pytest.raises(convert.ConvertError, match=message.replace("(", r"\(")) as error:
    convert.import_marian(broken)
  assert "\n" not in str(error.value)


def test_cli_error_is_one_line_exit_2(marian_dir, tmp_path):
  broken = _broken_copy(marian_dir, tmp_path, "cli")
  os.remove(os.path.join(broken, "source.spm"))
  result = _cli("--from=hf_marian", f"--input={broken}", f"--workdir={tmp_path / 'w'}")
  assert result.returncode == 2
  assert result.stderr.strip().count("\n") == 0 and "missing source.spm" in result.stderr
  assert "Traceback" not in result.stderr


def test_export_refuses_what_marian_cannot_express(tmp_path):
  workdir, *_ = _our_model(tmp_path, norm_position="pre")
  with pytest.raises(convert.ConvertError, match="model.norm_position='pre'"):
    convert.run(to="hf_marian", workdir=workdir, output=str(tmp_path / "hf"))


def _fine_tuning_config(data_dir: str, init_from: str, steps: int):
  from configs import multi30k
  config = multi30k.get_config()
  config.update(dict(num_train_steps=steps, log_every_steps=1, eval_every_steps=100,
                     checkpoint_every_steps=3, batch_size=8, init_from=init_from,
                     average_checkpoints=0))
  config.data.update(dict(dir=data_dir, eval_split="val", test_split="", max_length=32,
                          eval_max_length=32, prefetch=0))
  config.model.update(dict(dropout_rate=0.0))
  config.optimizer.update(dict(schedule="constant", learning_rate=3e-3, warmup_steps=0))
  config.eval.update(dict(examples=8, batch_size=8))
  config.decode.update(dict(beam_size=1))
  return config


def test_fine_tuning_an_import_lowers_the_loss_and_resumes_exactly(marian_dir, tmp_path):
  """train.py with init_from=<an import> trains the imported model (its architecture and
  tokenizers, a fresh optimizer) on new data; stopped and resumed, it equals the straight run."""
  from transformer_jax.training import loop
  data_dir = tmp_path / "data"
  data_dir.mkdir()
  for split, count in (("train", 64), ("val", 8)):
    for lang in ("de", "en"):
      (data_dir / f"{split}.{lang}").write_text(
          "\n".join(_lines(f"{'train' if split == 'train' else 'val'}.{lang}.gz", count)) + "\n")
  imported = convert.run(from_="hf_marian", input=marian_dir, workdir=str(tmp_path / "hf"))
  export = os.path.join(str(tmp_path / "hf"), "exports", "hf_marian")
  assert os.path.isdir(export), imported

  def train_losses(workdir: str) -> list[float]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      return [json.loads(l)["train/loss"] for l in f if "train/loss" in l]

  straight = str(tmp_path / "straight")
  loop.train_and_evaluate(_fine_tuning_config(str(data_dir), export, 6), straight)
  losses = train_losses(straight)
  assert len(losses) == 6 and np.mean(losses[-2:]) < losses[0]
  resumed = str(tmp_path / "resumed")
  loop.train_and_evaluate(_fine_tuning_config(str(data_dir), export, 3), resumed)
  loop.train_and_evaluate(_fine_tuning_config(str(data_dir), export, 6), resumed)
  assert train_losses(resumed) == losses
  a, b = Predictor(straight).params, Predictor(resumed).params
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
