"""Hugging Face Llama conversion, checked against transformers itself and CTranslate2: small
random LlamaForCausalLM models with grouped-query attention, one with an untied lm_head and
a SentencePiece-derived tokenizer (TinyLlama's shape), one tied with a byte-level BPE
(Llama 3.2's), both trained here on Shakespeare (tests/llama_fixture.py), offline."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")

import jax  # noqa: E402
from cli_helpers import ROOT, finish, start  # noqa: E402
from gpt2_fixture import SHAKESPEARE, hf_greedy, hf_logits, lines  # noqa: E402
from llama_fixture import VARIANTS, write_llama_dir  # noqa: E402

from transformer_jax import checkpoint, convert, sampling, trees  # noqa: E402
from transformer_jax.config import EOS_ID, PAD_ID, TransformerConfig  # noqa: E402
from transformer_jax.data.tokenizer import prompt_ids  # noqa: E402
from transformer_jax.modules.models import LanguageModel  # noqa: E402

pytestmark = pytest.mark.skipif(not os.path.isdir(SHAKESPEARE),
                                reason="needs the text of ../shared/data/shakespeare")
PROMPTS = ["ROMEO:", "To be, or not to be", "First Citizen:\nBefore we proceed any further",
           "été à Paris 🙂 Ô", ""]


@pytest.fixture(scope="module", params=VARIANTS)
def llama(request, tmp_path_factory) -> dict:
  """A random Llama directory of the variant, transformers' model and tokenizer of it, and
  its import (convert.run), read back from the parameter snapshot."""
  directory = str(tmp_path_factory.mktemp(f"llama_{request.param}"))
  write_llama_dir(directory, request.param)
  workdir = str(tmp_path_factory.mktemp(f"imported_{request.param}"))
  convert.run(from_="hf_llama", input=directory, workdir=workdir)
  export = os.path.join(workdir, "exports", "hf_llama")
  record = checkpoint.read_record(export)
  return dict(variant=request.param, directory=directory, workdir=workdir, export=export,
              model=transformers.LlamaForCausalLM.from_pretrained(directory).eval(),
              hf_tokenizer=transformers.AutoTokenizer.from_pretrained(directory),
              params=jax.tree_util.tree_map(np.asarray, checkpoint.restore_params(export)),
              tokenizer=record.assets.tokenizer,
              cfg=TransformerConfig.from_dict(record.config["model"]))


def test_the_import_is_the_llama_options(llama):
  cfg = llama["cfg"]
  assert (cfg.num_heads, cfg.kv_heads, cfg.tie_output) == (4, 2, llama["variant"] == "tied")
  assert (cfg.positional, cfg.norm_type, cfg.gated_ffn, cfg.use_bias) == ("rotary", "rms",
                                                                          True, False)
  assert cfg.rope_theta == (500000.0 if llama["variant"] == "tied" else 10000.0)


def test_tokenizer_encodes_prompts_as_the_hf_tokenizer(llama):
  """On 300 lines, the prompts and special tokens in text: our prompt ids are the Hugging
  Face tokenizer's (BOS first, as it adds it), and decoding gives its decode back."""
  theirs, ours = llama["hf_tokenizer"], llama["tokenizer"]
  special = f"one{theirs.eos_token}two {theirs.bos_token} three"
  assert ours.add_bos
  for text in lines("val", 300) + PROMPTS + [special, " leading space"]:
    expected = theirs(text)["input_ids"]
    assert prompt_ids(ours, text) == ours.to_ours(expected).tolist(), text
    assert ours.decode(ours.to_ours(expected)) == theirs.decode(expected,
                                                                skip_special_tokens=True)


def _our_logits(m: dict, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
  rows = np.where(mask == 1, m["tokenizer"].to_ours(ids), PAD_ID).astype(np.int32)
  return np.asarray(LanguageModel(m["cfg"]).apply({"params": m["params"]}, rows))


def _hf_batch(tokenizer, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
  """The tokenizer's ids of each text (BOS first), right-padded, and the attention mask."""
  rows = [tokenizer(t)["input_ids"] for t in texts]
  width = max(map(len, rows))
  return (np.array([r + [0] * (width - len(r)) for r in rows]),
          np.array([[1] * len(r) + [0] * (width - len(r)) for r in rows]))


def _logit_difference(m: dict, model, texts: list[str]) -> tuple[float, float, float]:
  """(largest logit difference from `model`'s, of log-probabilities, largest logit) at the
  real positions of the texts' padded batch."""
  ids, mask = _hf_batch(m["hf_tokenizer"], texts)
  theirs, real = hf_logits(model, ids, mask), mask == 1
  ours = _our_logits(m, ids, mask)[real][:, m["tokenizer"].to_ours(np.arange(theirs.shape[-1]))]
  log_ours, log_theirs = jax.nn.log_softmax(ours), jax.nn.log_softmax(theirs[real])
  return (float(np.abs(ours - theirs[real]).max()),
          float(np.abs(np.asarray(log_ours) - np.asarray(log_theirs)).max()),
          float(np.abs(theirs[real]).max()))


def test_import_gives_transformers_logits_padded_and_not(llama):
  """Float32 logits equal LlamaForCausalLM's within 1e-4 on one row and on a right-padded
  batch (theirs with its attention mask), and so do log-probabilities: the ids the
  vocabulary lacks get no probability."""
  for texts in ([PROMPTS[2]], lines("val", 4)[1:4] + PROMPTS[:2]):
    logits, log_probabilities, largest = _logit_difference(llama, llama["model"], texts)
    print(f"\n{llama['variant']}, {len(texts)} row(s): largest logit difference "
          f"{logits:.3g} (logits up to {largest:.1f}); log-probabilities {log_probabilities:.3g}")
    assert largest > 1.0 and logits <= 1e-4 and log_probabilities <= 1e-4


def _greedy_ours(m: dict, prompts: list[str], count: int) -> list[list[int]]:
  """The prompts as predict encodes them, one padded batch through sampling.generate at
  temperature 0: the new ids in the tokenizer's own, up to and with EOS."""
  encoded = [prompt_ids(m["tokenizer"], p) for p in prompts]
  rows = np.zeros((len(prompts), max(map(len, encoded))), np.int32)
  for row, ids in zip(rows, encoded):
    row[:len(ids)] = ids
  out = np.asarray(sampling.generate(LanguageModel(m["cfg"]), m["params"], rows, count, 0.0,
                                     0, 1.0, 0)).tolist()
  return [m["tokenizer"].to_theirs(row[:row.index(EOS_ID) + 1] if EOS_ID in row else row
                                   ).tolist() for row in out]


def test_greedy_generation_equals_generate(llama):
  """20 greedy tokens from each prompt (the empty one too: BOS alone) equal
  generate(**tokenizer(prompt), do_sample=False)."""
  ours = _greedy_ours(llama, PROMPTS, 20)
  theirs = [hf_greedy(llama["model"], llama["hf_tokenizer"], p, 20) for p in PROMPTS]
  print(f"\n{llama['variant']}: greedy ids equal on "
        f"{sum(a == b for a, b in zip(ours, theirs))} of {len(PROMPTS)} prompts "
        f"({sum(map(len, theirs))} tokens)")
  assert ours == theirs


def _export(workdir: str, output: str) -> str:
  assert convert.run(to="hf_llama", workdir=workdir, output=output).startswith("wrote")
  return output


def test_export_reloads_in_transformers_and_imports_back(llama, tmp_path):
  """The export loads in LlamaForCausalLM and AutoTokenizer with the original's ids and
  logits, and importing it again gives the same parameters."""
  out = _export(llama["workdir"], str(tmp_path / "hf"))
  back = transformers.LlamaForCausalLM.from_pretrained(out).eval()
  tokenizer_back = transformers.AutoTokenizer.from_pretrained(out)
  texts = lines("val", 3) + PROMPTS
  assert ([tokenizer_back(t)["input_ids"] for t in texts]
          == [llama["hf_tokenizer"](t)["input_ids"] for t in texts])
  logits, _, _ = _logit_difference(llama, back, texts)
  print(f"\n{llama['variant']} export: largest logit difference from ours {logits:.3g}")
  assert logits <= 1e-4
  again = trees.flatten(convert.import_llama(out)[1])
  assert sorted(again) == sorted(trees.flatten(llama["params"]))
  for path, value in trees.flatten(llama["params"]).items():
    np.testing.assert_array_equal(value, again[path], err_msg=path)


def test_ctranslate2_generates_the_exports_greedy_ids(llama, tmp_path):
  """ctranslate2's TransformersConverter reads the export, and its greedy generation from
  the tokenizer's tokens (BOS first) equals ours, id for id."""
  ctranslate2 = pytest.importorskip("ctranslate2")
  out = _export(llama["workdir"], str(tmp_path / "hf"))
  ctranslate2.converters.TransformersConverter(out).convert(str(tmp_path / "ct2"))
  generator = ctranslate2.Generator(str(tmp_path / "ct2"), device="cpu", intra_threads=1)
  tokenizer = llama["hf_tokenizer"]
  # One prompt a time: in a batch CTranslate2 forwards only the shortest prompt's length at
  # once, and the rest of longer ones comes back in their results.
  theirs = [generator.generate_batch([tokenizer.convert_ids_to_tokens(tokenizer(p)["input_ids"])],
                                     max_length=20, sampling_topk=1,
                                     include_prompt_in_result=False)[0].sequences_ids[0]
            for p in PROMPTS]
  end = tokenizer.eos_token_id
  # CTranslate2 leaves the end token out of its result.
  assert [row[:-1] if row and row[-1] == end else row
          for row in _greedy_ours(llama, PROMPTS, 20)] == theirs


@pytest.mark.parametrize("llama", ["untied"], indirect=True)
@pytest.mark.parametrize("lora_rank", [0, 4])
def test_fine_tuning_the_import_then_export(llama, lora_rank, tmp_path):
  """Two steps of configs/shakespeare_gpt2.py's recipe with init_from the import (its
  tokenizer, data.tokenizer="hf_tokenizer") change the model; the export of the result loads
  in transformers and computes what our fine-tuned model does. With LoRA (lora.rank=4) the
  workdir holds adapters, and predict and the export both load the merged model."""
  from configs import shakespeare_gpt2
  from transformer_jax.predict import Predictor
  from transformer_jax.training import loop
  config = shakespeare_gpt2.get_config()
  config.init_from = llama["export"]
  config.data.update(dict(dir=SHAKESPEARE, tokenizer="hf_tokenizer", max_length=32,
                          eval_max_length=32))
  config.update(dict(num_train_steps=2, log_every_steps=1, eval_every_steps=100,
                     checkpoint_every_steps=2, batch_size=8))
  config.model.max_len = 64
  config.optimizer.learning_rate = config.optimizer.end_learning_rate = 1e-2
  config.lora.rank = lora_rank
  workdir = str(tmp_path / "ft")
  loop.train_and_evaluate(config, workdir)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    assert len([line for line in f if "train/loss" in line]) == 2
  tuned = Predictor(workdir)
  out = _export(workdir, str(tmp_path / "hf"))
  tuned_model = dict(llama, cfg=tuned.model_config, params=tuned.params)
  logits, _, _ = _logit_difference(tuned_model, transformers.LlamaForCausalLM.from_pretrained(
      out).eval(), PROMPTS)
  print(f"\nfine-tuned, exported: largest logit difference {logits:.3g}")
  assert logits <= 1e-4
  assert _logit_difference(tuned_model, llama["model"], PROMPTS)[0] > 1e-3   # it trained
  if lora_rank:
    _check_peft_adapters(llama, workdir, out, tuned.params, tmp_path)


def _check_peft_adapters(llama: dict, workdir: str, merged_export: str, tuned: dict,
                         tmp_path) -> None:
  """--to=peft: PeftModel.from_pretrained on the original directory computes the merged
  export's logits; --from=peft merges those adapters into the import again, as ours."""
  peft = pytest.importorskip("peft")
  adapters = str(tmp_path / "peft")
  convert.run(to="peft", workdir=workdir, output=adapters)
  with open(os.path.join(adapters, "adapter_config.json")) as f:
    config = json.load(f)
  assert (config["r"], config["base_model_name_or_path"]) == (4, llama["directory"])
  base = transformers.LlamaForCausalLM.from_pretrained(llama["directory"]).eval()
  adapted = peft.PeftModel.from_pretrained(base, adapters).eval()
  ids, mask = _hf_batch(llama["hf_tokenizer"], PROMPTS)
  merged = transformers.LlamaForCausalLM.from_pretrained(merged_export).eval()
  difference = np.abs(hf_logits(adapted, ids, mask) - hf_logits(merged, ids, mask))[mask == 1]
  print(f"PEFT's adapted model against the merged export: largest logit difference "
        f"{difference.max():.3g}")
  assert difference.max() <= 1e-4
  convert.run(from_="peft", input=adapters, like=llama["export"], workdir=str(tmp_path / "in"))
  again = checkpoint.restore_params(str(tmp_path / "in" / "exports" / "peft"))
  for (path, x), (_, y) in zip(trees.named_leaves(again), trees.named_leaves(tuned)):
    np.testing.assert_allclose(x, y, atol=1e-6, err_msg=path)
  # What cannot be converted is named in one line.
  with pytest.raises(convert.ConvertError, match="writes a LoRA run's adapters: .* holds a "
                                                 "whole model, not LoRA adapters"):
    convert.run(to="peft", workdir=llama["workdir"], output=str(tmp_path / "none"))
  with open(os.path.join(adapters, "adapter_config.json"), "w") as f:
    json.dump({**config, "use_dora": True}, f)
  with pytest.raises(convert.ConvertError, match="use_dora=True is not converted"):
    convert.run(from_="peft", input=adapters, like=llama["export"], workdir=str(tmp_path / "x"))


def _served_lines(m: dict) -> tuple[list[str], list[str]]:
  """(the prompts as lines of POST /v1/predict, the tokenizer's decoding of generate's
  continuation of each: what predict and a served artifact of the import write)."""
  from transformer_jax.serving.line_policy import escape_line
  count = m["cfg"].max_len // 2                         # the import's max_new_tokens
  tokenizer = m["hf_tokenizer"]
  expected = [escape_line(tokenizer.decode(hf_greedy(m["model"], tokenizer, p, count),
                                           skip_special_tokens=True)) for p in PROMPTS]
  return [escape_line(p) for p in PROMPTS], expected


@pytest.mark.parametrize("llama", ["tied"], indirect=True)
def test_predict_and_the_served_artifact_continue_as_generate(llama, tmp_path):
  """predict on the import and its StableHLO artifact (POST /v1/predict's encoding) write
  the tokenizer's decoding of generate's continuation of each prompt."""
  from transformer_jax import predict
  from transformer_jax.export import export_stablehlo
  from transformer_jax.serving.lines import Served
  prompts, expected = _served_lines(llama)
  out = io.StringIO()
  predict.predict(llama["workdir"], io.BytesIO("".join(p + "\n" for p in prompts).encode()),
                  out, None, None, 8)
  assert out.getvalue().split("\n")[:-1] == expected
  served = Served.load(export_stablehlo(llama["workdir"], None, str(tmp_path / "lm"), None,
                                        None))
  assert served.predict(prompts) == expected


@pytest.mark.parametrize("llama", ["tied"], indirect=True)
def test_the_export_command_serves_the_import(llama, tmp_path):
  """`python -m transformer_jax.export --format=stablehlo` on the import's workdir (a
  parameter snapshot, no checkpoints) writes an artifact that continues each prompt as
  generate does."""
  from transformer_jax.serving.lines import Served
  output = str(tmp_path / "served")
  status, out = finish(start("-m", "transformer_jax.export", f"--workdir={llama['workdir']}",
                             "--format=stablehlo", f"--output={output}"))
  assert status == 0, out
  assert f"to {output}" in out
  prompts, expected = _served_lines(llama)
  assert Served.load(output).predict(prompts) == expected


@pytest.mark.parametrize("llama", ["tied"], indirect=True)
def test_the_export_command_needs_checkpoints_only_for_orbax_or_a_selection(llama, tmp_path):
  """An orbax export, or a --step/--average selection, of the import's workdir ends with
  status 2 and one line naming its snapshot and --format=stablehlo; nothing is written."""
  before = sorted(os.listdir(llama["workdir"])), sorted(os.listdir(os.path.join(
      llama["workdir"], "exports")))
  for flags in ([], ["--format=stablehlo", "--average=2"]):
    run = subprocess.run([sys.executable, "-m", "transformer_jax.export",
                          f"--workdir={llama['workdir']}", f"--output={tmp_path / 'out'}",
                          *flags], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": ROOT})
    lines_ = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines_) == 1, run.stderr
    assert lines_[0].startswith("error: ") and "no training checkpoints" in lines_[0]
    assert "--format=stablehlo" in lines_[0] and "hf_llama" in lines_[0], lines_[0]
  assert (sorted(os.listdir(llama["workdir"])), sorted(os.listdir(os.path.join(
      llama["workdir"], "exports")))) == before
  assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("llama", ["untied"], indirect=True)
@pytest.mark.parametrize("change, message", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     "rope_scaling rope_type='yarn' is an option this project lacks"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
     "rope_parameters rope_type='dynamic'"),
    ({"sliding_window": 4096}, "sliding_window=4096"),
    ({"attention_bias": True}, "attention_bias=True is an option this project lacks"),
    ({"mlp_bias": True}, "mlp_bias=True"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5 is an option this project"),
    ({"eos_token_id": [7, 8]}, "eos_token_id=[7, 8] does not hold the tokenizer's"),
    ({"vocab_size": 300}, "rows, but config.json's vocab_size is 300"),
    ({"model_type": "qwen2"}, "model_type='qwen2'"),
], ids=["yarn_rope", "dynamic_rope", "sliding_window", "attention_bias", "mlp_bias",
        "partial_rotary", "eos_list", "vocab_size", "model_type"])
def test_what_cannot_be_expressed_is_one_line_naming_it(llama, tmp_path, change, message):
  broken = str(tmp_path / "broken")
  shutil.copytree(llama["directory"], broken)
  with open(os.path.join(broken, "config.json")) as f:
    config = {**json.load(f), **change}
  with open(os.path.join(broken, "config.json"), "w") as f:
    json.dump(config, f)
  with pytest.raises(convert.ConvertError, match=re.escape(message)) as error:
    convert.import_llama(broken)
  assert "\n" not in str(error.value) and "config.json" in str(error.value)


@pytest.mark.parametrize("llama", ["untied"], indirect=True)
def test_export_refuses_what_llama_cannot_express(llama):
  cfg, tokenizer = llama["cfg"], llama["tokenizer"]
  from transformer_jax.convert import llama as llama_format
  from transformer_jax.data.tokenizer import CharVocab
  incompatibility = llama_format.FAMILY.incompatibility
  for change, message in (({"positional": "learned"}, "model.positional='learned'"),
                          ({"use_bias": True}, "model.use_bias=True"),
                          ({"norm_type": "layer"}, "model.norm_type='layer'"),
                          ({"sliding_window": 8}, "model.sliding_window=8"),
                          ({"qk_norm": True}, "model.qk_norm=True")):
    assert message in incompatibility(cfg.replace(**change), tokenizer)
  assert "tokenizer kind 'chars'" in incompatibility(cfg, CharVocab(["a"]))
  assert incompatibility(cfg, tokenizer) is None
