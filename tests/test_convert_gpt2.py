"""Hugging Face GPT-2 conversion, checked against transformers itself and CTranslate2: a small
random GPT2LMHeadModel with a byte-level BPE trained on Shakespeare (tests/gpt2_fixture.py),
offline; the Hub's gpt2 only where the Hub can be reached."""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")

import jax  # noqa: E402
from gpt2_fixture import (  # noqa: E402
  END,
  ROOT,
  SHAKESPEARE,
  hf_batch,
  hf_greedy,
  hf_logits,
  lines,
  write_gpt2_dir,
)

from transformer_jax import checkpoint, convert, sampling, trees  # noqa: E402
from transformer_jax.config import BOS_ID, EOS_ID, PAD_ID, TransformerConfig  # noqa: E402
from transformer_jax.convert import gpt2  # noqa: E402
from transformer_jax.data.tokenizer import prompt_ids  # noqa: E402
from transformer_jax.modules.models import LanguageModel  # noqa: E402

pytestmark = pytest.mark.skipif(not os.path.isdir(SHAKESPEARE),
                                reason="needs the text of ../shared/data/shakespeare")
PROMPTS = ["ROMEO:", "To be, or not to be", "First Citizen:\nBefore we proceed any further",
           "été à Paris 🙂 Ô"]


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory) -> str:
  directory = str(tmp_path_factory.mktemp("gpt2"))
  write_gpt2_dir(directory)
  return directory


@pytest.fixture(scope="module")
def hf(gpt2_dir):
  return (transformers.GPT2LMHeadModel.from_pretrained(gpt2_dir).eval(),
          transformers.AutoTokenizer.from_pretrained(gpt2_dir))


@pytest.fixture(scope="module")
def imported(gpt2_dir, tmp_path_factory) -> dict:
  workdir = str(tmp_path_factory.mktemp("imported"))
  convert.run(from_="hf_gpt2", input=gpt2_dir, workdir=workdir)
  return _read_import(workdir)


def _read_import(workdir: str) -> dict:
  """An import of `convert.run`, read back from its parameter snapshot."""
  export = os.path.join(workdir, "exports", "hf_gpt2")
  record = checkpoint.read_record(export)
  params = jax.tree_util.tree_map(np.asarray, checkpoint.restore_params(export))
  return dict(workdir=workdir, export=export, params=params, tokenizer=record.assets.tokenizer,
              cfg=TransformerConfig.from_dict(record.config["model"]))


def _ours(ids: np.ndarray, mask: np.ndarray, tokenizer) -> np.ndarray:
  """Our model's rows for GPT-2's: BOS first (it reads <|endoftext|>'s row), PAD after."""
  ours = np.where(mask == 1, tokenizer.to_ours(ids), PAD_ID).astype(np.int32)
  ours[:, 0] = BOS_ID
  return ours


def test_tokenizer_gives_gpt2_tokenizers_ids(gpt2_dir, hf, imported, tmp_path):
  """Ours (tokenizer.json, or vocab.json + merges.txt) encodes as GPT2Tokenizer does, in our
  ids, on 500 lines, non-ASCII and <|endoftext|> included; decoding gives the text back."""
  _, theirs = hf
  texts = lines("val", 500) + PROMPTS + [f"one{END}two", " leading space"]
  copy = str(tmp_path / "no_tokenizer_json")
  shutil.copytree(gpt2_dir, copy)
  os.remove(os.path.join(copy, "tokenizer.json"))
  from_files = gpt2.read_tokenizer(copy)
  ours = imported["tokenizer"]
  assert ours.vocab_size == len(theirs) + 3 == imported["cfg"].vocab_size
  for text in texts:
    expected = ours.to_ours(theirs(text)["input_ids"]).tolist()
    assert ours.encode(text) == from_files.encode(text) == expected, text
    assert ours.decode(expected) == text.replace(END, "")
  assert ours.encode(END) == [EOS_ID]


@pytest.mark.parametrize("padded", [False, True])
def test_import_gives_transformers_logits(hf, imported, padded):
  """Float32 logits on GPT-2's ids equal GPT2LMHeadModel's within 1e-4, on one row and on a
  right-padded batch (HF with its attention mask, ours with PAD); PAD, BOS and UNK get no
  probability, so log-probabilities equal too."""
  model, tokenizer = hf
  texts = lines("val", 4)[1:4] + PROMPTS[1:2] if padded else PROMPTS[2:3]
  ids, mask = hf_batch(tokenizer, texts)
  assert (mask == 0).any() == padded
  theirs = hf_logits(model, ids, mask)
  m = imported
  ours = np.asarray(LanguageModel(m["cfg"]).apply({"params": m["params"]},
                                                  _ours(ids, mask, m["tokenizer"])))
  columns = m["tokenizer"].to_ours(np.arange(theirs.shape[-1]))   # GPT-2's ids in ours
  real = mask == 1
  difference = np.abs(ours[real][:, columns] - theirs[real]).max()
  log_ours = np.asarray(jax.nn.log_softmax(ours[real]))[:, columns]
  log_theirs = np.asarray(jax.nn.log_softmax(theirs[real]))
  print(f"\nlargest logit difference ({'padded' if padded else 'unpadded'}, "
        f"{real.sum()} positions): {difference:.3g}; log-probabilities: "
        f"{np.abs(log_ours - log_theirs).max():.3g}")
  assert np.abs(theirs[real]).max() > 1.0                   # logits that say something
  assert difference <= 1e-4
  assert np.abs(log_ours - log_theirs).max() <= 1e-4


def _greedy_ours(imported, prompts: list[str], count: int) -> list[list[int]]:
  """The prompts as predict encodes them (prompt_ids), continued by sampling.generate at
  temperature 0 (predict's greedy path), in the tokenizer's own ids, up to and with EOS."""
  m = imported
  encoded = [prompt_ids(m["tokenizer"], p) for p in prompts]
  rows = np.zeros((len(prompts), max(map(len, encoded))), np.int32)
  for row, ids in zip(rows, encoded):
    row[:len(ids)] = ids
  out = np.asarray(sampling.generate(LanguageModel(m["cfg"]), m["params"], rows, count, 0.0,
                                     0, 1.0, 0))
  result = []
  for row in out.tolist():
    row = row[:row.index(EOS_ID) + 1] if EOS_ID in row else row
    result.append(m["tokenizer"].to_theirs(row).tolist())
  return result


def test_greedy_generation_equals_generate(hf, imported):
  """20 greedy tokens from each prompt (one padded batch here) equal
  generate(**tokenizer(prompt), do_sample=False): a prompt starts without <|endoftext|>, as
  GPT2Tokenizer encodes it."""
  model, tokenizer = hf
  ours = _greedy_ours(imported, PROMPTS, 20)
  theirs = [hf_greedy(model, tokenizer, p, 20) for p in PROMPTS]
  print(f"\ngreedy ids equal on {sum(a == b for a, b in zip(ours, theirs))} of {len(PROMPTS)} "
        f"prompts ({sum(map(len, theirs))} tokens)")
  assert ours == theirs


def _export(imported, tmp_path, workdir: str | None = None) -> str:
  out = str(tmp_path / "hf_export")
  assert convert.run(to="hf_gpt2", workdir=workdir or imported["workdir"],
                     output=out).startswith("wrote")
  return out


def test_export_loads_in_transformers_with_the_same_logits(hf, imported, tmp_path):
  """Import, export: GPT2LMHeadModel and AutoTokenizer load it, with the original's ids and
  logits on a padded batch, and importing it again gives the same parameters."""
  model, tokenizer = hf
  out = _export(imported, tmp_path)
  back = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
  tokenizer_back = transformers.AutoTokenizer.from_pretrained(out)
  texts = lines("val", 5)[2:5] + PROMPTS
  assert ([tokenizer_back(t)["input_ids"] for t in texts]
          == [tokenizer(t)["input_ids"] for t in texts])
  ids, mask = hf_batch(tokenizer, texts)
  real = mask == 1
  difference = np.abs(hf_logits(back, ids, mask)[real] - hf_logits(model, ids, mask)[real])
  print(f"\nexport: largest logit difference from the original {difference.max():.3g}")
  assert difference.max() <= 1e-4
  _assert_same_params(imported["params"], convert.import_gpt2(out)[1])


def _assert_same_params(params: dict, other: dict) -> None:
  flat, flat_other = trees.flatten(params), trees.flatten(other)
  assert sorted(flat) == sorted(flat_other)
  for path in flat:
    np.testing.assert_array_equal(flat[path], flat_other[path], err_msg=path)


def test_ctranslate2_generates_the_exports_greedy_ids(hf, imported, tmp_path):
  """ctranslate2's TransformersConverter reads the export, and its greedy generation equals
  ours, id for id."""
  ctranslate2 = pytest.importorskip("ctranslate2")
  model, tokenizer = hf
  out = _export(imported, tmp_path)
  ctranslate2.converters.TransformersConverter(out).convert(str(tmp_path / "ct2"))
  generator = ctranslate2.Generator(str(tmp_path / "ct2"), device="cpu", intra_threads=1)
  starts = [tokenizer.convert_ids_to_tokens(tokenizer(p)["input_ids"]) for p in PROMPTS]
  results = generator.generate_batch(starts, max_length=20, sampling_topk=1,
                                     include_prompt_in_result=False)
  ours = _greedy_ours(imported, PROMPTS, 20)
  end = tokenizer.convert_tokens_to_ids(END)
  theirs = [r.sequences_ids[0] for r in results]
  print(f"\nctranslate2: {sum(map(len, theirs))} greedy ids from {len(PROMPTS)} prompts")
  # CTranslate2 leaves the end token out of its result.
  assert [row[:-1] if row and row[-1] == end else row for row in ours] == theirs


def test_fine_tuning_the_import_on_shakespeare_then_export(imported, tmp_path):
  """configs/shakespeare_gpt2.py with init_from the import trains on the Shakespeare files in
  GPT-2's tokens; the export of the result loads in transformers and computes what our
  fine-tuned model does."""
  from configs import shakespeare_gpt2
  from transformer_jax.predict import Predictor
  from transformer_jax.training import loop
  config = shakespeare_gpt2.get_config()
  config.init_from = imported["export"]
  config.data.dir = SHAKESPEARE
  config.data.update(dict(max_length=32, eval_max_length=32))
  config.update(dict(num_train_steps=3, log_every_steps=1, eval_every_steps=3,
                     checkpoint_every_steps=3, batch_size=8))
  config.model.max_len = 64
  config.eval.update(dict(batch_size=8, examples=8, num_samples=1))
  config.decode.max_new_tokens = 4
  workdir = str(tmp_path / "ft")
  loop.train_and_evaluate(config, workdir)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    losses = [json.loads(line)["train/loss"] for line in f if "train/loss" in line]
  assert len(losses) == 3 and all(np.isfinite(losses))
  out = _export(imported, tmp_path, workdir)
  back = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
  tokenizer = transformers.AutoTokenizer.from_pretrained(out)
  ids, mask = hf_batch(tokenizer, PROMPTS)
  tuned = Predictor(workdir)
  ours = np.asarray(LanguageModel(tuned.model_config).apply(
      {"params": tuned.params}, _ours(ids, mask, tuned.task.tokenizer)))
  columns = tuned.task.tokenizer.to_ours(np.arange(len(tokenizer)))
  real = mask == 1
  difference = np.abs(ours[real][:, columns] - hf_logits(back, ids, mask)[real]).max()
  print(f"\nfine-tuned, exported: largest logit difference {difference:.3g}")
  assert difference <= 1e-4
  before = np.asarray(LanguageModel(imported["cfg"]).apply(
      {"params": imported["params"]}, _ours(ids, mask, tuned.task.tokenizer)))
  assert np.abs(before - ours)[real].max() > 1e-5                 # the steps changed it


def test_byte_bpe_without_a_pretrained_model_is_refused_in_one_line(tmp_path):
  """GPT-2's tokenizer comes with its model: a run of the config without init_from says so
  before anything is written."""
  from configs import shakespeare_gpt2
  from transformer_jax.errors import UserError
  from transformer_jax.training import loop
  config = shakespeare_gpt2.get_config()
  config.update(dict(init_from="", batch_size=8))
  config.data.dir = SHAKESPEARE
  with pytest.raises(UserError, match="data.tokenizer='byte_bpe' is GPT-2's tokenizer, read "
                     "from a pretrained model") as error:
    loop.train_and_evaluate(config, str(tmp_path / "w"))
  assert "\n" not in str(error.value)
  assert not os.path.exists(tmp_path / "w" / "vocab.json")


def test_predict_and_the_served_artifact_continue_as_generate(hf, imported, tmp_path):
  """predict on the import (greedy, as GPT-2's generation is by default) and its StableHLO
  artifact write generate's continuation of each prompt, decoded by GPT2Tokenizer."""
  from transformer_jax import predict
  from transformer_jax.export import export_stablehlo
  from transformer_jax.serving.line_policy import escape_line
  from transformer_jax.serving.lines import Served
  model, tokenizer = hf
  count = imported["cfg"].max_len // 2                     # the import's max_new_tokens
  prompts = [p.replace("\n", "\\n") for p in PROMPTS]
  out = io.StringIO()
  predict.predict(imported["workdir"], io.BytesIO("".join(p + "\n" for p in prompts).encode()),
                  out, None, None, 8)
  expected = [escape_line(tokenizer.decode(hf_greedy(model, tokenizer, p, count),
                                           skip_special_tokens=True)) for p in PROMPTS]
  assert out.getvalue().split("\n")[:-1] == expected        # (a random model writes \r too)
  served = Served.load(export_stablehlo(imported["workdir"], None, str(tmp_path / "lm"), None,
                                        None))
  assert served.predict(prompts) == expected


def test_export_refuses_what_gpt2_cannot_express(imported):
  m = imported
  for change, message in (({"positional": "rotary"}, "model.positional='rotary'"),
                          ({"scale_embeddings": True}, "model.scale_embeddings=True"),
                          ({"num_kv_heads": 2}, "model.num_kv_heads=2")):
    assert message in gpt2.incompatibility(m["cfg"].replace(**change), m["tokenizer"])
  from transformer_jax.data.tokenizer import CharVocab
  assert "tokenizer kind 'chars'" in gpt2.incompatibility(m["cfg"], CharVocab(["a"]))
  with pytest.raises(convert.ConvertError, match="task='seq2seq' only; this is a task='lm'"):
    convert.run(to="hf_marian", workdir=m["workdir"], output=os.path.join(m["workdir"], "x"))


def test_the_hubs_layout_imports_the_same(gpt2_dir, imported, tmp_path):
  """The Hub's gpt2 files are GPT2Model's: no "transformer." prefix, no lm_head, and the
  causal-mask buffers h.N.attn.bias. They import to the same parameters."""
  from safetensors.numpy import load_file, save_file
  hub = str(tmp_path / "hub_layout")
  shutil.copytree(gpt2_dir, hub)
  path = os.path.join(hub, "model.safetensors")
  state = {k.removeprefix("transformer."): v for k, v in load_file(path).items()
           if k != "lm_head.weight"}
  state.update({f"h.{i}.attn.bias": np.tril(np.ones((1, 1, 64, 64), np.float32))
                for i in range(2)})
  save_file(state, path)
  _assert_same_params(imported["params"], convert.import_gpt2(hub)[1])


@pytest.mark.parametrize("damage, message", [
    (["config.json"], "missing config.json"),
    (["tokenizer.json", "vocab.json"], "missing vocab.json"),
    ({"activation_function": "gelu"}, "activation_function='gelu' is an option this project"),
    ({"vocab_size": 402}, "vocab_size=402, but the tokenizer has 401 tokens"),
    ("untied", "lm_head.weight differs from wte.weight"),
], ids=["no_config", "no_tokenizer", "exact_gelu", "vocab_size", "untied"])
def test_bad_input_is_one_line_naming_the_problem(gpt2_dir, tmp_path, damage, message):
  broken = str(tmp_path / "broken")
  shutil.copytree(gpt2_dir, broken)
  if isinstance(damage, dict):                            # options of config.json
    with open(os.path.join(broken, "config.json")) as f:
      hf_config = {**json.load(f), **damage}
    with open(os.path.join(broken, "config.json"), "w") as f:
      json.dump(hf_config, f)
  elif damage == "untied":
    from safetensors.numpy import load_file, save_file
    state = load_file(os.path.join(broken, "model.safetensors"))
    state["lm_head.weight"] = state["transformer.wte.weight"] + 1.0
    save_file(state, os.path.join(broken, "model.safetensors"))
  else:                                                   # files missing
    for name in damage:
      os.remove(os.path.join(broken, name))
  with pytest.raises(convert.ConvertError, match=message) as error:
    convert.import_gpt2(broken)
  assert "\n" not in str(error.value)


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "transformer_jax.convert", *args],
                        capture_output=True, text=True, cwd=ROOT, timeout=600,
                        env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", **env))


def test_hub_name_where_the_hub_cannot_be_reached_is_one_line(tmp_path):
  """--input=gpt2 with the Hub out of reach (offline mode, an empty cache): exit status 2
  and one line saying so."""
  result = _cli("--from=hf_gpt2", "--input=gpt2", f"--workdir={tmp_path / 'w'}",
                HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"))
  assert result.returncode == 2, result.stderr
  lines_ = result.stderr.strip().splitlines()
  assert len(lines_) == 1 and lines_[0].startswith(
      "error: --input=gpt2: no such directory, and the Hugging Face Hub cannot be reached"), \
      result.stderr
  assert not os.path.exists(tmp_path / "w" / "exports")


def _hub_reachable() -> bool:
  try:
    socket.create_connection(("huggingface.co", 443), timeout=3).close()
    return True
  except OSError:
    return False


@pytest.mark.skipif(not _hub_reachable(), reason="the Hugging Face Hub cannot be reached")
def test_the_hubs_gpt2_imports_with_transformers_logits_and_greedy_ids(tmp_path):
  """The real GPT-2 (124M, downloaded): our logits on a sentence equal transformers' (within
  1e-4 of the largest logit's size: GPT-2's are large) and 20 greedy tokens equal
  generate's."""
  workdir = str(tmp_path / "w")
  result = _cli("--from=hf_gpt2", "--input=gpt2", f"--workdir={workdir}")
  assert result.returncode == 0, result.stderr
  from huggingface_hub import snapshot_download
  directory = snapshot_download("gpt2", allow_patterns=list(gpt2.HUB_FILES))
  model = transformers.GPT2LMHeadModel.from_pretrained(directory).eval()
  tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
  m = _read_import(workdir)
  ids, mask = hf_batch(tokenizer, ["Hello, my dog is cute and"])
  theirs = hf_logits(model, ids, mask)[0]
  ours = np.asarray(LanguageModel(m["cfg"]).apply({"params": m["params"]},
                                                  _ours(ids, mask, m["tokenizer"])))[0]
  difference = np.abs(ours[:, m["tokenizer"].to_ours(np.arange(theirs.shape[-1]))] - theirs)
  print(f"\ngpt2: largest logit difference {difference.max():.3g} "
        f"(logits up to {np.abs(theirs).max():.1f})")
  assert difference.max() <= 1e-4 * max(1.0, np.abs(theirs).max())
  prompt = "Hello, my dog is cute and"
  assert _greedy_ours(m, [prompt], 20) == [hf_greedy(model, tokenizer, prompt, 20)]
