"""convert beyond MarianMT: the torch.nn.Transformer state_dict both ways, and models of other
tasks refused in one line."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402

from transformer_jax import convert, trees  # noqa: E402
from transformer_jax.config import PAD_ID, TransformerConfig  # noqa: E402
from transformer_jax.data.tokenizer import SentencePieceTokenizer  # noqa: E402
from transformer_jax.modules.models import Transformer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "..", "shared", "data", "multi30k")


def _cli(*args: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "transformer_jax.convert", *args],
                        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


def test_torch_state_dict_round_trip_and_same_function(tmp_path):
  from benchmarks.torch_reference import TorchTransformer
  cfg = TransformerConfig.small(40, norm_position="pre", positional="learned")
  dummy = np.ones((1, 4), np.int32)
  params = jax.tree_util.tree_map(np.asarray, nn.meta.unbox(
      Transformer(cfg).init(jax.random.PRNGKey(1), dummy, dummy)["params"]))
  state = convert.torch_state_dict(params, cfg)
  back = convert.params_from_torch_state_dict(state, cfg)
  for path, value in trees.flatten(params).items():
    np.testing.assert_array_equal(value, trees.flatten(back)[path], err_msg=path)
  model = TorchTransformer(cfg, 0.0).eval()      # the layout is exactly its state_dict
  model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
  # The same function: torch.nn.Transformer with the converted state_dict computes our
  # logits, on padded sources and targets of different lengths.
  rng = np.random.default_rng(0)
  src = rng.integers(4, cfg.vocab_size, (3, 7)).astype(np.int32)
  tgt = rng.integers(4, cfg.vocab_size, (3, 5)).astype(np.int32)
  src[1, 4:], tgt[2, 3:] = PAD_ID, PAD_ID
  expected = np.asarray(Transformer(cfg).apply({"params": params}, src, tgt))
  with torch.no_grad():
    got = model.logits(torch.from_numpy(src).long(), torch.from_numpy(tgt).long()).numpy()
  valid = tgt != PAD_ID
  assert np.abs(expected[valid]).max() > 1e-2     # logits that say something
  np.testing.assert_allclose(got[valid], expected[valid], atol=1e-4, rtol=1e-4)
  path = str(tmp_path / "model.safetensors")
  from safetensors.numpy import save_file
  save_file(state, path)
  assert convert.read_state_dict(path, allow_pickle=False).keys() == state.keys()
  bad = dict(state)
  bad["embedding.weight"] = bad["embedding.weight"][:, :-1]
  with pytest.raises(convert.ConvertError, match="embedding.weight has shape"):
    convert.params_from_torch_state_dict(bad, cfg)


@pytest.mark.skipif(not os.path.isdir(DATA), reason="needs ../shared/data/multi30k")
def test_cli_export_of_a_classification_run_is_one_line_naming_the_task(tmp_path):
  """A model of another task fails before any conversion, naming the task and what converts."""
  from transformer_jax import checkpoint, tasks
  from transformer_jax.data.tokenizer import tokenizer_item
  with gzip.open(os.path.join(DATA, "train.en.gz"), "rt", encoding="utf-8") as f:
    texts = [line for line, _ in zip(f, range(500))]
  tokenizer = SentencePieceTokenizer.train(texts, 100)
  labels = ["negative", "positive"]
  run_config = {"task": "classification", "model": {
      **TransformerConfig.small(tokenizer.vocab_size, num_decoder_layers=0).to_dict(),
      "pooling": "mean"}}
  task = tasks.from_run_config(run_config, tokenizer=tokenizer, labels=labels)
  params = jax.tree_util.tree_map(np.asarray, nn.meta.unbox(
      task.init_params(jax.random.PRNGKey(0))))
  workdir = tmp_path / "sst"
  checkpoint.write_snapshot(str(workdir / "exports" / "step_0"), params, run_config,
                          tokenizer_item(tokenizer, None, labels), [0])
  for fmt, output in (("hf_marian", tmp_path / "hf"), ("torch", tmp_path / "m.safetensors")):
    result = _cli(f"--to={fmt}", f"--workdir={workdir}", f"--output={output}")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "task='classification'" in lines[0] and "task='seq2seq'" in lines[0], lines[0]
    assert not os.path.exists(output)
