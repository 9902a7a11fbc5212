"""The causal LM families of 2026 through `convert --from=hf` (Llama 3's rope scaling and end
ids, Mistral's sliding window, Qwen2's biases, Qwen3's q/k norms, Gemma 3's norms and
alternating windows; tests/families_fixture.py), each checked against transformers itself:
the logits past every window and past the rope scaling's original context, greedy
generation, the export back, predict, the served artifact and its streamed programs."""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")

import jax  # noqa: E402
from families_fixture import FAMILIES, end_ids, model_class, write_family_dir  # noqa: E402
from gpt2_fixture import SHAKESPEARE, hf_logits  # noqa: E402

from transformer_jax import checkpoint, convert, sampling, trees  # noqa: E402
from transformer_jax.config import PAD_ID, TransformerConfig  # noqa: E402
from transformer_jax.data.tokenizer import prompt_ids  # noqa: E402
from transformer_jax.modules.models import LanguageModel  # noqa: E402

pytestmark = pytest.mark.skipif(not os.path.isdir(SHAKESPEARE),
                                reason="needs the text of ../shared/data/shakespeare")
PROMPTS = ["ROMEO:", "To be, or not to be", "First Citizen:\nBefore we proceed any further",
           "été à Paris 🙂 Ô", ""]
LENGTH = 40   # past every window (6, 8) and the llama3 scaling's original context (16)
FORMAT = {"llama3": "hf_llama", "mistral": "hf_mistral", "qwen2": "hf_qwen2",
          "qwen3": "hf_qwen3", "gemma3": "hf_gemma3"}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory) -> dict:
  """A random checkpoint of the family, transformers' model and tokenizer of it, and its
  import by `convert --from=hf`, read back from the parameter snapshot."""
  name = request.param
  directory = str(tmp_path_factory.mktemp(name))
  write_family_dir(directory, name)
  workdir = str(tmp_path_factory.mktemp(f"imported_{name}"))
  message = convert.run(from_="hf", input=directory, workdir=workdir)
  export = os.path.join(workdir, "exports", FORMAT[name])
  record = checkpoint.read_record(export)
  return dict(name=name, directory=directory, workdir=workdir, message=message,
              record=record, model=model_class(name).from_pretrained(directory).eval(),
              hf_tokenizer=transformers.AutoTokenizer.from_pretrained(directory),
              params=jax.tree_util.tree_map(np.asarray, checkpoint.restore_params(export)),
              tokenizer=record.assets.tokenizer,
              cfg=TransformerConfig.from_dict(record.config["model"]))


def test_from_hf_picks_the_family_and_reads_its_options(family):
  cfg, name = family["cfg"], family["name"]
  assert f"exports/{FORMAT[name]}" in family["message"]
  expected = {
      "llama3": dict(rope_scaling="llama3", rope_scaling_factor=8.0, rope_original_max_len=16,
                     rope_theta=500000.0, tie_output=True),
      "mistral": dict(sliding_window=8, layer_types=(), tie_output=False),
      "qwen2": dict(qkv_bias=True, use_bias=False, bos_is_eos=True, tie_output=True),
      "qwen3": dict(qk_norm=True, head_size=16, num_heads=4, d_model=32),
      "gemma3": dict(norm_type="rms_plus_one", sandwich_norm=True, qk_norm=True,
                     scale_embeddings=True, activation="gelu", sliding_window=6,
                     layer_types=("sliding", "sliding", "full"), local_rope_theta=10000.0,
                     rope_theta=1000000.0, rope_scaling="linear", rope_scaling_factor=4.0,
                     attention_scale=24 ** -0.5, head_size=16, tie_output=True)}[name]
  assert {field: getattr(cfg, field) for field in expected} == expected
  if name == "gemma3":   # its last token has no embedding row: never predicted
    last = int(family["tokenizer"].to_ours([family["tokenizer"].size - 1])[0])
    assert last in cfg.no_token_ids and family["params"]["embedding"]["embedding"][last].any() == 0


def test_end_ids_and_decode_defaults_are_generate_s(family):
  """Every eos_token_id ends a text (EOS and end_ids, in our ids); generation_config.json's
  sampling settings are the import's decode defaults (greedy where it does not sample)."""
  theirs = end_ids(family["name"], family["hf_tokenizer"])
  tokenizer, cfg = family["tokenizer"], family["cfg"]
  assert sorted(tokenizer.to_ours(theirs).tolist()) == sorted((2, *cfg.end_ids))
  decode = family["record"].config["decode"]
  expected = {"llama3": {"temperature": 0.6, "top_k": 50, "top_p": 0.9},
              "qwen2": {"temperature": 0.7, "top_k": 20, "top_p": 0.8}}.get(
                  family["name"], {"temperature": 0.0})
  assert {k: decode[k] for k in expected} == expected


def _batch(m: dict, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
  """Their ids of `texts`, each cut or repeated to LENGTH tokens, the last row right-padded
  from position 30."""
  rows = []
  for text in texts:
    ids = m["hf_tokenizer"](text * 20)["input_ids"][:LENGTH]
    rows.append(ids + [ids[-1]] * (LENGTH - len(ids)))
  ids = np.array(rows, np.int64)
  mask = np.ones_like(ids)
  mask[-1, 30:] = 0
  return ids, mask


def _our_logits(m: dict, ids: np.ndarray, mask: np.ndarray, columns: int) -> np.ndarray:
  """Our logits of their `ids` at their first `columns` ids."""
  rows = np.where(mask == 1, m["tokenizer"].to_ours(ids), PAD_ID).astype(np.int32)
  logits = LanguageModel(m["cfg"]).apply({"params": m["params"]}, rows)
  return np.asarray(logits)[..., m["tokenizer"].to_ours(np.arange(columns))]


def test_logits_are_transformers_past_the_window_and_the_rope_context(family):
  """Float32 logits within 1e-4 of transformers' at 40 tokens, one row right-padded, at
  every token both have (Qwen's padding rows and Gemma's token past its rows aside)."""
  ids, mask = _batch(family, PROMPTS[:3])
  theirs, real = hf_logits(family["model"], ids, mask), mask == 1
  columns = min(theirs.shape[-1], family["tokenizer"].size)
  ours = _our_logits(family, ids, mask, columns)[real]
  difference = float(np.abs(ours - theirs[real][:, :columns]).max())
  print(f"\n{family['name']}: largest logit difference {difference:.3g} "
        f"(logits up to {np.abs(theirs).max():.1f})")
  assert np.abs(theirs).max() > 1.0 and difference <= 1e-4


def _until_end(ids: list[int], ends: list[int]) -> list[int]:
  """`ids` up to and with the first end id."""
  cut = [i for i, token in enumerate(ids) if token in ends]
  return ids[:cut[0] + 1] if cut else ids


def test_greedy_generation_equals_generate(family):
  """20 greedy tokens from each prompt (the empty one too) equal
  generate(**tokenizer(prompt), do_sample=False), up to the first end id."""
  m, ends = family, end_ids(family["name"], family["hf_tokenizer"])
  encoded = [prompt_ids(m["tokenizer"], p) for p in PROMPTS]
  rows = np.zeros((len(PROMPTS), max(map(len, encoded))), np.int32)
  for row, ids in zip(rows, encoded):
    row[:len(ids)] = ids
  out = np.asarray(sampling.generate(LanguageModel(m["cfg"]), m["params"], rows, 20, 0.0, 0,
                                     1.0, 0)).tolist()
  ours = [_until_end(m["tokenizer"].to_theirs([t for t in row if t != PAD_ID]).tolist(), ends)
          for row in out]
  theirs = []
  for prompt in PROMPTS:
    inputs = m["hf_tokenizer"](prompt, return_tensors="pt")
    if not inputs["input_ids"].shape[1]:   # no BOS: ours starts an empty prompt with EOS
      inputs = {"input_ids": torch.tensor([[ends[0]]]), "attention_mask": torch.ones(1, 1)}
    with torch.no_grad():
      new = m["model"].generate(**inputs, do_sample=False, max_new_tokens=20,
                                pad_token_id=ends[0])[0, inputs["input_ids"].shape[1]:]
    theirs.append(_until_end(new.tolist(), ends))
  assert ours == theirs


def test_export_reloads_in_transformers_and_imports_back(family, tmp_path):
  """convert --to=hf writes the family the model came from; its class loads it to the same
  logits within 1e-4 and its config.json reads back to the same options."""
  output = str(tmp_path / "out")
  assert convert.run(to="hf", workdir=family["workdir"], output=output).startswith("wrote")
  with open(os.path.join(output, "config.json")) as f:
    assert json.load(f)["model_type"] == family["model"].config.model_type
  reloaded = model_class(family["name"]).from_pretrained(output).eval()
  ids, mask = _batch(family, PROMPTS[1:3])
  again, before = hf_logits(reloaded, ids, mask), hf_logits(family["model"], ids, mask)
  columns = min(again.shape[-1], before.shape[-1])   # Qwen's padding rows are not written
  difference = np.abs(again[..., :columns] - before[..., :columns])
  assert float(difference[mask == 1].max()) <= 1e-4
  again = convert.run(from_="hf", input=output, workdir=str(tmp_path / "again"))
  assert "parameters" in again
  record = checkpoint.read_record(str(tmp_path / "again" / "exports" / FORMAT[family["name"]]))
  assert TransformerConfig.from_dict(record.config["model"]) == family["cfg"]


# The families whose generation differs (end-id lists and sampled defaults; a window over
# every layer; alternating windows, each with its rope): Qwen's biases and norms change
# only the logits, checked above for every family.
@pytest.mark.parametrize("family", ["llama3", "mistral", "gemma3"], indirect=True)
def test_predict_the_artifact_and_its_streams_continue_alike(family, tmp_path):
  """predict on the import, its StableHLO artifact (POST /v1/predict's path) and the
  artifact's streamed programs (/v1/completions') continue each prompt alike, at the
  import's decode defaults (generation_config.json's: sampled for llama3 and qwen2)."""
  from transformer_jax import predict
  from transformer_jax.export import export_stablehlo
  from transformer_jax.serving.line_policy import escape_line
  from transformer_jax.serving.lines import Served
  from transformer_jax.serving.slots import DecodingBatch
  from transformer_jax.serving.streaming import Sampling, StreamBatcher
  prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3]]   # one line each
  out = io.StringIO()
  predict.predict(family["workdir"], io.BytesIO("".join(p + "\n" for p in prompts).encode()),
                  out, None, None, 8)
  expected = out.getvalue().split("\n")[:-1]
  assert len(expected) == 3 and any(expected)
  served = Served.load(export_stablehlo(family["workdir"], None, str(tmp_path / "lm"), None,
                                        None))
  assert served.end_ids == (2, *family["cfg"].end_ids)
  assert served.predict(prompts) == expected
  streams = StreamBatcher(DecodingBatch(served.streaming, 2), served.tokenizer.decode,
                          served.end_ids, start=False)
  decode = family["record"].config["decode"]
  completion = streams.submit([line.ids for line in served.encode(prompts)], 1, Sampling(
      decode["max_new_tokens"], decode["temperature"], decode.get("top_k", 0),
      decode.get("top_p", 1.0), 0))
  while not streams.idle():
    streams.run_once()
  assert [escape_line(choice.text.sent) for choice in completion.choices] == expected


@pytest.mark.parametrize("family", ["qwen2"], indirect=True)
def test_generation_stops_at_any_end_id(family):
  """A text ends at the first of the config's end ids: made an end id, the token greedy
  decoding draws third ends the text where it is first drawn (PAD after), in generate and
  in continuations."""
  m = family
  row = np.array([prompt_ids(m["tokenizer"], PROMPTS[1])], np.int32)
  free = np.asarray(sampling.generate(LanguageModel(m["cfg"].replace(end_ids=())),
                                      m["params"], row, 8, 0.0, 0, 1.0, 0))[0].tolist()
  end = free[2]
  if end in (0, 1, 2, 3):
    pytest.skip("the third token is special")
  first = free.index(end)
  cfg = m["cfg"].replace(end_ids=(end,))
  stopped = np.asarray(sampling.generate(LanguageModel(cfg), m["params"], row, 8, 0.0, 0,
                                         1.0, 0))[0]
  assert stopped[:first + 1].tolist() == free[:first + 1] and not stopped[first + 1:].any()
  assert sampling.continuations(stopped[None], cfg.end_ids) == [free[:first]]


@pytest.mark.parametrize("family", ["gemma3"], indirect=True)
def test_bf16_sharded_safetensors_read(family, tmp_path):
  """A bf16 checkpoint saved in shards (model.safetensors.index.json) imports to the bf16
  weights, exactly, in float32."""
  directory = str(tmp_path / "bf16")
  model = write_family_dir(directory, "gemma3", dtype=torch.bfloat16, max_shard_size="20KB")
  assert os.path.isfile(os.path.join(directory, "model.safetensors.index.json"))
  workdir = str(tmp_path / "w")
  convert.run(from_="hf", input=directory, workdir=workdir)
  params = checkpoint.restore_params(os.path.join(workdir, "exports", "hf_gemma3"))
  flat = trees.flatten(params)
  norm = model.model.layers[1].post_feedforward_layernorm.weight.detach().float().numpy()
  assert np.array_equal(np.asarray(flat["decoder/layer_1/feed_forward_output_norm/scale"]),
                        norm)
  query = model.model.layers[0].self_attn.q_proj.weight.detach().float().numpy()  # (NH, D)
  ours = np.asarray(flat["decoder/layer_0/self_attention/query/kernel"])     # (D, N, H)
  assert np.array_equal(ours.reshape(ours.shape[0], -1).T, query)


def test_what_a_family_cannot_express_is_one_line_naming_it(tmp_path):
  """A model_type this project lacks, and a Gemma 3 with scaled sliding-layer rope, are
  refused in one line naming the field."""
  directory = str(tmp_path / "gemma")
  write_family_dir(directory, "gemma3")
  path = os.path.join(directory, "config.json")
  with open(path) as f:
    config = json.load(f)
  for change, message in (
      ({"model_type": "phi3"}, "model_type='phi3' is a family this project lacks"),
      ({"rope_parameters": {**config["rope_parameters"], "sliding_attention": {
          "rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
       "rope_parameters.sliding_attention is scaled"),
      ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0")):
    with open(path, "w") as f:
      json.dump({**config, **change}, f)
    with pytest.raises(convert.ConvertError, match=message) as error:
      convert.run(from_="hf", input=directory, workdir=str(tmp_path / "w"))
    assert "\n" not in str(error.value)
