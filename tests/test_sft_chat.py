"""Chat supervised fine-tuning (data.layout="chat", data/chat_data.py, configs/sft_chat.py)
on a tiny random Qwen2 checkpoint whose tokenizer carries Qwen2.5's chat template
(tests/chat_fixture.py), imported with `convert --from=hf`, offline: the weights are 1 on
the assistant's tokens exactly (its contents and each <|im_end|> that closes them), as
transformers' `return_assistant_tokens_mask` marks a template's generation blocks; the ids
are `apply_chat_template`'s; a packed row's loss is the sum of its examples' own; a short
run of the recipe lowers the assistant's loss; bad lines end in one line naming them."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("torch")

import jax  # noqa: E402
from chat_fixture import base_tokenizer, write_chat_tokenizer  # noqa: E402
from test_bad_inputs import run_user_error  # noqa: E402

from transformer_jax import checkpoint, convert  # noqa: E402
from transformer_jax.config import PAD_ID, TransformerConfig  # noqa: E402
from transformer_jax.convert.llama import read_tokenizer  # noqa: E402
from transformer_jax.data import pipeline  # noqa: E402
from transformer_jax.data.chat_data import ChatEncoder, read_chat_jsonl  # noqa: E402
from transformer_jax.data.readers import DataFormatError  # noqa: E402
from transformer_jax.errors import UserError  # noqa: E402
from transformer_jax.tasks.lm import LanguageModelTask  # noqa: E402

SYSTEM = {"role": "system", "content": "Speak as Juliet."}
CONVERSATION = [SYSTEM, {"role": "user", "content": "What light through yonder window?"},
                {"role": "assistant", "content": "It is the east,  and\n\nJuliet is the sun."},
                {"role": "user", "content": "Arise, fair sun"},
                {"role": "assistant", "content": "Kill the envious moon 🙂"}]


def _chat(user: str, reply: str) -> list[dict]:
  return [SYSTEM, {"role": "user", "content": user}, {"role": "assistant", "content": reply}]


TRAIN = [_chat(f"Say {w}", f"{w}, {w}, {w}.") for w in ("love", "night", "rose", "star")]
TRAIN += [CONVERSATION, _chat("Who is there?", "Nay, answer me.")]


@pytest.fixture(scope="module")
def base():
  return base_tokenizer(400)


@pytest.fixture(scope="module")
def imported(base, tmp_path_factory):
  """A random Qwen2ForCausalLM with Qwen2.5's template (eos <|endoftext|>: the end of turn
  <|im_end|> is an ordinary id), its import, the task on it and transformers' tokenizer."""
  import torch
  root = tmp_path_factory.mktemp("sft")
  source, workdir = str(root / "hf"), str(root / "w")
  write_chat_tokenizer(source, "qwen2.5", base, eos_token="<|endoftext|>")
  hf = transformers.AutoTokenizer.from_pretrained(source)
  end = hf.convert_tokens_to_ids("<|endoftext|>")
  torch.manual_seed(0)
  model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
      vocab_size=len(hf), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
      tie_word_embeddings=False, bos_token_id=end, eos_token_id=end))
  with torch.no_grad():   # weights away from 0.02's near-uniform logits, which the frozen
    for name, p in model.named_parameters():   # head keeps under LoRA
      p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
  model.save_pretrained(source)
  convert.run(from_="hf", input=source, workdir=workdir)
  export = os.path.join(workdir, "exports", "hf_qwen2")
  record = checkpoint.read_record(export)
  task = LanguageModelTask(TransformerConfig.from_dict(record.config["model"]),
                           tokenizer=record.assets.tokenizer)
  params = jax.tree_util.tree_map(np.asarray, checkpoint.restore_params(export))
  return dict(export=export, hf=hf, task=task, params=params)


def _weighted_runs(tokens: np.ndarray, weights: np.ndarray) -> list[list[int]]:
  """The runs of consecutive tokens of weight 1."""
  runs: list[list[int]] = []
  previous = 0
  for token, weight in zip(tokens.tolist(), weights.tolist()):
    if weight and not previous:
      runs.append([])
    if weight:
      runs[-1].append(token)
    previous = weight
  return runs


def test_weights_are_the_assistant_contents_and_their_end_of_turn(imported):
  task, hf = imported["task"], imported["hf"]
  tokens, weights = task.chat_encoder.encode_messages(CONVERSATION)
  theirs = task.tokenizer.to_theirs
  texts = [hf.decode(theirs(run).tolist(), skip_special_tokens=False)
           for run in _weighted_runs(tokens, weights)]
  assert texts == [m["content"] + "<|im_end|>" for m in CONVERSATION if m["role"] == "assistant"]
  example = task.featurize({"messages": CONVERSATION, "where": "x"})
  assert (example["inputs"] == tokens[:-1]).all()
  assert (example["targets"] == np.where(weights[1:] > 0, tokens[1:], PAD_ID)).all()


def test_the_ids_are_apply_chat_templates(imported):
  task, hf = imported["task"], imported["hf"]
  tokens, _ = task.chat_encoder.encode_messages(CONVERSATION)
  assert task.tokenizer.to_theirs(tokens).tolist() == hf.apply_chat_template(
      CONVERSATION, tokenize=True, return_dict=False)


@pytest.mark.parametrize("name", ["llama3", "gemma3", "zephyr", "training"])
def test_other_templates_ids_and_weights(base, tmp_path, name):
  """Other families' templates: apply_chat_template's ids; weights on each reply and its end
  of turn; on the template that marks replies ({% generation %}), transformers' mask."""
  write_chat_tokenizer(str(tmp_path), name, base)
  hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  tokenizer = read_tokenizer(str(tmp_path))
  tokens, weights = ChatEncoder(tokenizer).encode_messages(CONVERSATION)
  theirs = tokenizer.to_theirs(tokens).tolist()
  assert theirs == hf.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False)
  texts = [hf.decode(tokenizer.to_theirs(run).tolist(), skip_special_tokens=False)
           for run in _weighted_runs(tokens, weights)]
  turn_end = {"llama3": "<|eot_id|>", "gemma3": "<end_of_turn>", "zephyr": "</s>"}
  assert texts == [m["content"] + turn_end.get(name, "<|im_end|>")
                   for m in CONVERSATION if m["role"] == "assistant"]
  if name == "training":
    marked = hf.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True,
                                    return_assistant_tokens_mask=True)
    assert weights.tolist() == marked["assistant_masks"]


def test_a_user_message_changes_no_counted_token(imported):
  """Another user text shifts the tokens but not which of them count; a reply of weight 0
  (OpenAI's field) counts none."""
  encode = imported["task"].chat_encoder.encode_messages
  other = [dict(m, content="Soft! what light") if m["role"] == "user" else m
           for m in CONVERSATION]
  (a, wa), (b, wb) = encode(CONVERSATION), encode(other)
  assert len(a) != len(b) and a[wa > 0].tolist() == b[wb > 0].tolist()
  skipped = [dict(m, weight=0) if i == 2 else m for i, m in enumerate(CONVERSATION)]
  c, wc = encode(skipped)
  assert (c == a).all() and wc.sum() < wa.sum() and (wc <= wa).all()


def _row(example: dict) -> dict:
  n = len(example["inputs"])
  return {"inputs": example["inputs"][None], "targets": example["targets"][None],
          "positions": np.arange(n, dtype=np.int32)[None],
          "segment_ids": np.ones((1, n), np.int32)}


def test_packing_keeps_each_examples_weights_and_loss(imported):
  task, params = imported["task"], imported["params"]
  records = task.prepare_records([{"messages": m, "where": f"x:{i}"}
                                  for i, m in enumerate(TRAIN[3:])])
  alone = [task.featurize(r) for r in records]
  length = sum(len(e["inputs"]) for e in alone) + 3
  batch = next(pipeline.train_iterator(records, task, batch_size=1, max_length=length,
                                       seed=0, num_epochs=1, prefetch=0))
  segments = batch["segment_ids"][0]
  assert sorted(set(segments.tolist()) - {0}) == [1, 2, 3]
  packed = sorted(batch["targets"][0][segments == s].tolist() for s in (1, 2, 3))
  assert packed == sorted(e["targets"].tolist() for e in alone)   # each keeps its own
  loss_sums = jax.jit(lambda batch: task.loss_sums(params, batch, None, train=False))
  sums = jax.device_get(loss_sums(batch))
  each = [jax.device_get(loss_sums(_row(e))) for e in alone]
  assert sums["weight"] == sum(e["weight"] for e in each) == sum(
      int((e["targets"] != PAD_ID).sum()) for e in alone)
  assert sums["loss"] == pytest.approx(sum(float(e["loss"]) for e in each), rel=1e-5)


def _write_jsonl(directory, name: str, conversations: list) -> str:
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(str(directory), name)
  with open(path, "w", encoding="utf-8") as f:
    f.writelines((c if isinstance(c, str) else json.dumps({"messages": c})) + "\n"
                 for c in conversations)
  return path


def _config(export: str, data_dir: str, steps: int):
  from configs import sft_chat
  config = sft_chat.get_config()
  config.init_from = export
  config.data.update(dict(dir=data_dir, max_length=64, eval_max_length=64))
  config.update(dict(num_train_steps=steps, log_every_steps=1, eval_every_steps=steps,
                     checkpoint_every_steps=steps, batch_size=8))
  config.optimizer.update(dict(learning_rate=1e-2, end_learning_rate=1e-3, warmup_steps=2))
  config.decode.max_new_tokens = 4
  config.eval.num_samples = 1
  return config


def test_the_recipe_lowers_the_assistants_loss(imported, tmp_path):
  from transformer_jax.training import loop
  data = tmp_path / "data"
  _write_jsonl(data, "train.jsonl", TRAIN)
  _write_jsonl(data, "validation.jsonl", TRAIN[:2])
  workdir = str(tmp_path / "w")
  loop.train_and_evaluate(_config(imported["export"], str(data), 20), workdir)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  losses = [r["train/loss"] for r in rows if "train/loss" in r]
  assert len(losses) == 20 and np.mean(losses[-3:]) < 0.7 * np.mean(losses[:3])
  assert [r["eval/loss"] for r in rows if "eval/loss" in r][-1] < losses[0]


BAD_LINES = [("{not json", "not JSON"), ('{"text": "hi"}', 'no "messages" field'),
             ('{"messages": [{"content": "hi"}]}', 'messages[0]: no "role"'),
             ('{"messages": [{"role": "robot", "content": "hi"}]}', "messages[0].role"),
             (json.dumps({"messages": [SYSTEM, {"role": "user", "content": "x"}]}),
              "no assistant message"),
             (json.dumps({"messages": [dict(SYSTEM, weight=0)]}), "messages[0].weight")]


@pytest.mark.parametrize("line,message", BAD_LINES)
def test_a_bad_line_is_named(tmp_path, line, message):
  path = _write_jsonl(tmp_path, "train.jsonl", [CONVERSATION, line])
  with pytest.raises(DataFormatError) as error:
    read_chat_jsonl(path)
  assert str(error.value).startswith(f"{path}:2: ") and message in str(error.value)
  assert "\n" not in str(error.value)


def test_bad_data_ends_the_run_in_one_line(imported, tmp_path, capsys):
  """Before the first step: a malformed line, a conversation the template cannot split
  into turns (Mistral's moves the system message), a tokenizer without a template, a
  layout the tokenizer cannot serve."""
  from transformer_jax.training import loop
  data = tmp_path / "data"
  _write_jsonl(data, "validation.jsonl", TRAIN[:1])
  path = _write_jsonl(data, "train.jsonl", [CONVERSATION, '{"messages": [{"content": ""}]}'])
  status, lines = run_user_error(lambda: loop.train_and_evaluate(
      _config(imported["export"], str(data), 2), str(tmp_path / "w")), capsys)
  assert status == 2 and len(lines) == 1 and f"{path}:2: messages[0]: no \"role\"" in lines[0]
  config = _config(imported["export"], str(data), 2)
  config.data.tokenizer = "chars"
  status, lines = run_user_error(lambda: loop.train_and_evaluate(config, str(tmp_path / "v")),
                                 capsys)
  assert status == 2 and len(lines) == 1 and "data.layout='chat'" in lines[0]


def test_templates_that_cannot_serve_are_named(base, imported, tmp_path):
  write_chat_tokenizer(str(tmp_path), "mistral", base)
  mistral = ChatEncoder(read_tokenizer(str(tmp_path)))
  with pytest.raises(DataFormatError, match=r"^f\.jsonl:7: messages\[2\]: the chat template"):
    mistral.encode({"messages": CONVERSATION, "where": "f.jsonl:7"})
  plain = read_tokenizer(str(tmp_path))
  plain.config.pop("chat_template")
  with pytest.raises(UserError, match="has none"):
    ChatEncoder(plain)


SST2 = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..",
                    "shared", "data", "sst2")


@pytest.mark.skipif(not os.path.isdir(SST2), reason="needs ../shared/data/sst2")
def test_sst2_as_conversations(tmp_path):
  """benchmarks/sst2_chat.py: every sentence a conversation the chat layout reads, its reply
  the label's name; never written into the repository."""
  from benchmarks import sst2_chat
  written = sst2_chat.write_chat_jsonl(SST2, str(tmp_path))
  assert list(written.values()) == [67349, 872]
  [validation] = [p for p in written if p.endswith("validation.jsonl")]
  records = read_chat_jsonl(validation)
  assert {r["text"] for r in records} == {"positive", "negative"}
  assert [m["role"] for m in records[0]["messages"]] == ["system", "user", "assistant"]
  with pytest.raises(UserError, match="inside the repository"):
    sst2_chat.write_chat_jsonl(SST2, os.path.join(sst2_chat.ROOT, "configs", "x"))
