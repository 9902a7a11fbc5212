"""Scoring throughput for lm-evaluation-harness: its requests per second against the server
(`local-completions`: POST /v1/completions with token-id prompts, echo and logprobs) beside
its `hf` model in transformers, on one checkpoint of GPT-2 small's shape (124M parameters:
12 layers, 768 wide, 1,024 positions, 50,257 tokens; random weights), on this machine.

  python -m benchmarks.score_speed [--docs=50] [--batch_size=16] [--rounds=2] [--slots=16] [--json]

The task is multiple_choice, written here from Shakespeare's validation lines
(../shared/data/shakespeare): a context of three lines, four one-line continuations; each
document is 4 loglikelihood requests. The tokenizer is a byte-level BPE trained on the
training lines, its vocabulary filled to GPT-2's 50,257 ids (the output layer's size).
The checkpoint is imported (convert --from=hf) and exported (StableHLO) as a served model;
`serve` runs in its own process. The contenders take turns (--rounds each; the best
round is reported): ours with --batch_size prompts a request and with lm-eval's defaults
(one prompt a request), the hf model with --batch_size rows, all in float32. Requests/s
counts loglikelihood requests over simple_evaluate's wall time, its model already built.
Also reported: whether the two gave every document the same accuracy.
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
import time
from typing import Any

from absl import app, flags

from benchmarks import common

FLAGS = flags.FLAGS
NAME, VOCAB, END = "gpt2-small", 50257, "<|endoftext|>"
SHAKESPEARE = os.path.join(common.ROOT, "..", "shared", "data", "shakespeare")


def define_flags() -> None:
  flags.DEFINE_integer("docs", 50, "Documents of the task (4 requests each).", lower_bound=1)
  FLAGS.set_default("batch_size", 16)   # common's: lm-eval's batch_size here (the hf
                                         # model's rows, the API model's prompts a request)
  flags.DEFINE_integer("rounds", 2, "Turns of each contender.", lower_bound=1)
  flags.DEFINE_integer("slots", 16, "The server's --slots.", lower_bound=1)


def _lines(split: str) -> list[str]:
  with gzip.open(os.path.join(SHAKESPEARE, f"{split}.txt.gz"), "rt", encoding="utf-8") as f:
    return [line.strip() for line in f if len(line.split()) >= 4]


def write_checkpoint(directory: str) -> None:
  """GPT-2 small's shape, random weights, and a GPT-2-format tokenizer of 50,257 ids."""
  import torch
  import transformers
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  tokenizer.train_from_iterator(_lines("train"), trainers.BpeTrainer(
      vocab_size=4000, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tokenizer.model.save(directory)
  path = os.path.join(directory, "vocab.json")
  with open(path, encoding="utf-8") as f:
    vocab = json.load(f)
  vocab.update({f"<unused{i}>": i for i in range(len(vocab), VOCAB - 1)})   # GPT-2's size
  vocab[END] = VOCAB - 1
  with open(path, "w", encoding="utf-8") as f:
    json.dump(vocab, f, ensure_ascii=False)
  transformers.GPT2Tokenizer.from_pretrained(directory).save_pretrained(directory)
  torch.manual_seed(0)
  transformers.GPT2LMHeadModel(transformers.GPT2Config(
      bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)).save_pretrained(directory)


def write_task(directory: str, docs: int) -> tuple[str, int]:
  """The multiple_choice task's files; its name and its requests."""
  text = _lines("val")
  data = os.path.join(directory, "speed_choice.jsonl")
  with open(data, "w", encoding="utf-8") as f:
    for i in range(docs):
      at = 4 * i
      f.write(json.dumps({"context": " ".join(text[at:at + 3]), "gold": 0, "choices": [
          " " + text[at + 3], *(" " + text[(at + 3 + 7 * k) % len(text)] for k in (1, 2, 3))]})
              + "\n")
  with open(os.path.join(directory, "speed_choice.yaml"), "w", encoding="utf-8") as f:
    f.write(f"task: speed_choice\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {data}\ntest_split: test\noutput_type: multiple_choice\n"
            'doc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\n'
            'doc_to_target: "{{gold}}"\nmetric_list: [{metric: acc}]\n')
  return "speed_choice", 4 * docs


def _evaluate(lm: Any, task: str, directory: str) -> tuple[float, list[float]]:
  """simple_evaluate's wall time, and each document's accuracy."""
  import lm_eval
  from lm_eval.tasks import TaskManager
  began = time.perf_counter()
  results = lm_eval.simple_evaluate(model=lm, tasks=[task], log_samples=True,
                                    task_manager=TaskManager(include_path=directory))
  seconds = time.perf_counter() - began
  samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
  return seconds, [s["acc"] for s in samples]


def main(argv: list[str]) -> None:
  del argv
  os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
  from lm_eval.api.registry import get_model

  from benchmarks.serve_process import start_server
  from transformer_jax import convert
  from transformer_jax.export import export_stablehlo
  root = tempfile.mkdtemp(prefix="score_speed_")
  source = os.path.join(root, "gpt2")
  os.makedirs(source)
  write_checkpoint(source)
  convert.run(from_="hf", input=source, workdir=os.path.join(root, "w"))
  artifact = export_stablehlo(os.path.join(root, "w"), None, os.path.join(root, "artifact"),
                              None, None)
  task, requests = write_task(root, FLAGS.docs)
  server = start_server(artifact, max_batch=4, max_wait_ms=5, ready_timeout=600, extra_args=[
      f"--model_name={NAME}", f"--slots={FLAGS.slots}", "--max_inputs=64"])
  try:
    api = {"base_url": server.url + "/v1/completions", "model": NAME, "tokenizer": source,
           "tokenizer_backend": "huggingface", "max_length": 1024}
    contenders = {
        f"served, batch_size={FLAGS.batch_size}": get_model("local-completions")(
            **api, batch_size=FLAGS.batch_size),
        "served, lm-eval's defaults (batch_size=1)": get_model("local-completions")(**api),
        f"transformers (lm-eval hf), batch_size={FLAGS.batch_size}": get_model("hf")(
            pretrained=source, dtype="float32", device="cpu", batch_size=FLAGS.batch_size),
    }
    seconds: dict[str, list[float]] = {name: [] for name in contenders}
    accuracy: dict[str, list[float]] = {}
    for _ in range(FLAGS.rounds):
      for name, lm in contenders.items():
        took, accuracy[name] = _evaluate(lm, task, root)
        seconds[name].append(took)
  finally:
    server.stop()
  result = {"benchmark": "score_speed", "shape": "GPT-2 small (124M), float32",
            "requests": requests, **common.stamp(),
            "requests_per_s": {name: round(requests / min(s), 1) for name, s in seconds.items()},
            "seconds": {name: [round(x, 2) for x in s] for name, s in seconds.items()},
            "same_accuracy_per_document": len({json.dumps(a) for a in accuracy.values()}) == 1}
  common.emit(result, [(name, f"{rate} requests/s")
                       for name, rate in result["requests_per_s"].items()])


if __name__ == "__main__":
  define_flags()
  app.run(main)
