"""lm-evaluation-harness against the server (POST /v1/completions with token-id prompts, echo
and logprobs; serving/openai_api.py): its `local-completions` model scores and generates
what its `hf` model does on the same checkpoint in transformers, per sample, on three small
tasks written here from Shakespeare's validation lines: a multiple_choice task, a
loglikelihood_rolling one and a generate_until one with a stop string. The checkpoint is
tests/gpt2_fixture.py's random GPT-2, imported and exported as a served artifact."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gpt2_fixture import lines, write_gpt2_dir  # noqa: E402

NAME, CONTEXT = "tiny-gpt2", 64     # the model's positions (n_positions)
TASKS = {
    "choice": """output_type: multiple_choice
doc_to_text: "{{context}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{gold}}"
metric_list: [{metric: acc}]""",
    "rolling": """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list: [{metric: word_perplexity}]""",
    "until": """output_type: generate_until
doc_to_text: "{{context}}"
doc_to_target: "{{target}}"
generation_kwargs: {until: [","], max_gen_toks: 12, do_sample: false}
metric_list: [{metric: exact_match}]""",
}


def _write_tasks(directory: str) -> list[str]:
  """The three tasks' YAML and JSONL files in `directory`; their names."""
  text = [line.strip() for line in lines("val", 400) if len(line.split()) >= 6][:60]
  docs = {
      "choice": [{"context": " ".join(t.split()[:3]), "gold": 0, "choices": [
          " " + " ".join(t.split()[3:]), *(" " + " ".join(o.split()[3:])
                                           for o in (text[i - 1], text[i - 2]))]}
                 for i, t in enumerate(text[:12])],
      "rolling": [{"text": " ".join(text[i:i + 5])} for i in range(20, 50, 5)],
      "until": [{"context": t[:20], "target": t[20:]} for t in text[50:56]],
  }
  names = []
  for kind, spec in TASKS.items():
    name = f"tjx_{kind}"
    data = os.path.join(directory, f"{name}.jsonl")
    with open(data, "w", encoding="utf-8") as f:
      f.writelines(json.dumps(doc) + "\n" for doc in docs[kind])
    with open(os.path.join(directory, f"{name}.yaml"), "w", encoding="utf-8") as f:
      f.write(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
              f"    test: {data}\ntest_split: test\n{spec}\n")
    names.append(name)
  return names


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  """The random GPT-2 and its served artifact, on a server."""
  pytest.importorskip("transformers")
  pytest.importorskip("lm_eval")
  from benchmarks.serve_process import start_server
  from transformer_jax import convert
  from transformer_jax.export import export_stablehlo
  root = tmp_path_factory.mktemp("lm_eval")
  source = str(root / "gpt2")
  os.makedirs(source)
  write_gpt2_dir(source, n_positions=CONTEXT)
  convert.run(from_="hf", input=source, workdir=str(root / "w"))
  artifact = export_stablehlo(str(root / "w"), None, str(root / "artifact"), None, None)
  running = start_server(artifact, max_batch=4, max_wait_ms=5,
                         extra_args=[f"--model_name={NAME}", "--slots=4"])
  yield source, running
  running.stop()


def _samples(model: str, model_args: dict, tasks: list[str], directory: str) -> dict:
  import lm_eval
  from lm_eval.tasks import TaskManager
  results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks,
                                    task_manager=TaskManager(include_path=directory),
                                    log_samples=True, random_seed=0, numpy_random_seed=0,
                                    torch_random_seed=0, fewshot_random_seed=0)
  return {task: sorted(samples, key=lambda s: s["doc_id"])
          for task, samples in results["samples"].items()}


def test_lm_eval_scores_the_server_as_its_hf_model_scores_the_checkpoint(served, tmp_path):
  source, server = served
  os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
  tasks = _write_tasks(str(tmp_path))
  # The rolling windows are max_length tokens for the hf model, max_length - 2 for the API
  # model (which keeps a position for the token it asks for, and one for the context).
  ours = _samples("local-completions", {
      "base_url": server.url + "/v1/completions", "model": NAME, "tokenizer": source,
      "tokenizer_backend": "huggingface", "max_length": CONTEXT, "max_retries": 1}, tasks,
      str(tmp_path))
  theirs = _samples("hf", {"pretrained": source, "dtype": "float32", "device": "cpu",
                           "max_length": CONTEXT - 2}, tasks, str(tmp_path))
  for task in tasks:
    assert len(ours[task]) == len(theirs[task]) > 0, task
    for mine, hf in zip(ours[task], theirs[task]):
      if task.endswith("until"):
        assert mine["filtered_resps"] == hf["filtered_resps"], (task, mine["doc"])
        continue
      got, expected = (np.array([r[0] if isinstance(r, (list, tuple)) else r
                                 for r in s["filtered_resps"]], np.float64)
                       for s in (mine, hf))
      np.testing.assert_allclose(got, expected, rtol=2e-4, err_msg=f"{task} {mine['doc']}")
  generated = [s["filtered_resps"][0] for s in ours["tjx_until"]]
  assert any(generated) and not any("," in text for text in generated)
