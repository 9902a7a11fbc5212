"""The benchmark tools: their JSON carries the promised fields with consistent values, packed
benchmark batches are well formed, and the PyTorch reference is the same model as ours."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import flax.linen as nn
import jax
import numpy as np
import pytest
from conftest import tiny_config

from transformer_jax import Transformer, errors
from transformer_jax.config import BOS_ID, EOS_ID, PAD_ID
from transformer_jax.flops import lm_flops, model_flops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--config=configs/default.py", "--config.model.d_model=32", "--config.model.d_ff=64",
        "--config.model.num_heads=2", "--config.model.num_encoder_layers=1",
        "--config.model.num_decoder_layers=2", "--batch_size=3", "--warmup=1", "--steps=2"]
# The character-level language model (nanoGPT's recipe: GPT-2's architecture) at the same
# size (its vocabulary given: a character vocabulary is known only after reading the text).
TINY_LM = ["--config=benchmarks/configs/shakespeare_char_nanogpt.py", "--config.model.d_model=32",
           "--config.model.d_ff=64", "--config.model.num_heads=2",
           "--config.model.num_decoder_layers=2", "--vocab_size=40", "--length=16",
           "--batch_size=3", "--warmup=1", "--steps=2"]


def _run(module: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
  env = {**os.environ, "PYTHONPATH": ROOT}
  result = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
  if check:
    assert result.returncode == 0, result.stderr[-3000:]
  return result


def _run_code(code: str, *args: str) -> subprocess.CompletedProcess:
  """`python -c code *args` as _run runs a module."""
  result = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
  assert result.returncode == 0, result.stderr[-3000:]
  return result


def test_train_step_json_has_consistent_fields():
  out = _run("benchmarks.train_step", *TINY, "--scan", "--remat=full", "--fused_qkv",
             "--peak_tflops=2.5", "--json")
  r = json.loads(out.stdout.strip().splitlines()[-1])
  model = r["model"]
  assert (model["scan_layers"], model["remat_policy"], model["fused_qkv"]) == (True, "full",
                                                                               True)
  assert r["device"]["platform"] == jax.default_backend()
  assert r["compile_s"] >= r["lower_s"] > 0
  t = r["step_time_ms"]
  assert t["n"] == 2 and 0 < t["min"] <= t["median"] <= t["max"]
  b = r["batch"]
  assert b["tokens_per_step"] == 3 * (b["src_length"] + b["tgt_length"])   # full rows
  seconds = t["median"] / 1000
  assert r["tokens_per_sec"] == pytest.approx(b["tokens_per_step"] / seconds)
  cfg = tiny_config().replace(**{k: v for k, v in model.items() if k != "vocab_size"},
                              vocab_size=model["vocab_size"])
  assert r["model_flops_per_step"] == model_flops(cfg, 3, b["src_length"],
                                                  b["tgt_length"])["total"]
  assert r["causal_halving"] is False
  assert r["hardware_flops_per_step"] > r["model_flops_per_step"]   # remat recomputes
  assert r["achieved_tflops"] == pytest.approx(r["model_flops_per_step"] / seconds / 1e12)
  assert r["peak_tflops"] == 2.5 and r["peak_source"] == "--peak_tflops"
  assert r["mfu"] == pytest.approx(r["achieved_tflops"] / 2.5)
  assert "peak_memory_bytes" in r and r["compiled_memory"]["total_bytes"] > 0


def test_lm_train_step_times_the_language_model_with_its_flops():
  """An lm config: the decoder-only model's step on (B, --length) rows, counted by lm_flops;
  the seq2seq length flags and a character vocabulary without --vocab_size are refused."""
  out = _run("benchmarks.train_step", *TINY_LM, "--packed", "--peak_tflops=2.5", "--json")
  r = json.loads(out.stdout.strip().splitlines()[-1])
  model, b = r["model"], r["batch"]
  assert r["task"] == "lm" and model["num_decoder_layers"] == 2 and b["length"] == 16
  assert 0 < b["tokens_per_step"] < 3 * 16                    # packed: padding after the last
  cfg = tiny_config().replace(**{k: v for k, v in model.items() if k != "vocab_size"},
                              vocab_size=40)
  assert r["model_flops_per_step"] == lm_flops(cfg, 3, 16)["total"]
  assert r["hardware_flops_per_step"] == r["model_flops_per_step"]     # no remat
  # Tokens, positions (max_len 64), two layers (attention, FFN, norm scales: no biases).
  assert r["parameters"] == 40 * 32 + 64 * 32 + 2 * (4 * 32 * 32 + 2 * 32 * 64 + 2 * 32) + 32
  assert r["mfu"] == pytest.approx(r["achieved_tflops"] / 2.5)
  for flag, culprit in (("--src_length=8", "--src_length"), ("--vocab_size=0", "--vocab_size")):
    out = _run("benchmarks.train_step", *TINY_LM, flag, check=False)
    assert out.returncode == 2 and culprit in out.stderr.strip().splitlines()[-1], out.stderr


PEER_HARNESS = os.path.join(ROOT, "..", "shared", "bench", "peer_flax_wmt.py")


@pytest.mark.skipif(not os.path.exists(PEER_HARNESS), reason="../shared/bench is not beside "
                    "the checkout (the side-by-side harness with Flax's WMT model)")
def test_the_shared_flax_wmt_harness_runs_our_step_beside_the_peer():
  """../shared/bench/peer_flax_wmt.py imports the project's task, optimizer and step by name:
  it still runs them, the models differ by exactly the known parameters, and both fresh
  models predict no better than uniform (each last step's NLL between log V and 2 log V)."""
  tiny = ["--d_model=32", "--num_heads=2", "--d_ff=64", "--layers=1", "--vocab=64",
          "--batch=2", "--src_len=8", "--tgt_len=8", "--max_len=16", "--steps=1",
          "--rounds=2", "--warmup=0", "--json"]
  result = subprocess.run([sys.executable, PEER_HARNESS, *tiny], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
  assert result.returncode == 0, result.stderr[-3000:]
  r = json.loads(result.stdout.strip().splitlines()[-1])
  assert r["params_difference_explained"]
  assert r["timed_steps"] == {"peer": 2, "project": 2}
  for nll in r["last_nll"].values():
    assert np.log(64) - 0.05 < nll < 2 * np.log(64)


# Runs benchmarks.decode as its command does, recording every search's output array (each
# passes through output_tokens once, in the order (1, cache), (1, recompute), (beam, cache),
# (beam, recompute)) into the file named by argv[1].
_RECORD_DECODE_OUTPUTS = """
import atexit, json, sys
import numpy as np
from benchmarks import decode
from transformer_jax import errors
path, outputs, count = sys.argv[1], [], decode.output_tokens
def record(out):
  outputs.append(np.asarray(out).tolist())
  return count(out)
decode.output_tokens = record
atexit.register(lambda: json.dump(outputs, open(path, "w")))
sys.argv = ["benchmarks.decode", *sys.argv[2:]]
errors.run(decode.main)
"""


def test_decode_json_reports_greedy_and_beam_with_and_without_cache(tmp_path):
  record = str(tmp_path / "outputs.json")
  out = _run_code(_RECORD_DECODE_OUTPUTS, record, *TINY, "--max_length=6", "--beam_size=3",
                  "--json")
  r = json.loads(out.stdout.strip().splitlines()[-1])
  assert [(x["beam_size"], x["kv_cache"]) for x in r["runs"]] == [
      (1, True), (1, False), (3, True), (3, False)]
  for x in r["runs"]:
    assert x["sentences_per_sec"] > 0 and 0 < x["mean_output_length"] <= 6
    assert x["tokens_per_sec"] == pytest.approx(x["sentences_per_sec"]
                                                * x["mean_output_length"])
  # Same searches, so the same outputs, token for token, with and without the cache.
  greedy, greedy_recomputed, beam, beam_recomputed = (np.array(o) for o in
                                                      json.load(open(record)))
  assert greedy.shape == beam.shape == (3, 6)
  np.testing.assert_array_equal(greedy, greedy_recomputed)
  np.testing.assert_array_equal(beam, beam_recomputed)
  for outputs in (greedy, beam):   # real searches: rows differ, tokens beyond the specials
    assert len({tuple(row) for row in outputs}) > 1 and (outputs > EOS_ID).any()
  assert set(r["kv_cache_speedup"]) == {"beam_1", "beam_3"}


def test_interleaved_timing_runs_blocks_in_turns():
  from benchmarks.common import time_interleaved
  order = []
  times = time_interleaved({"a": lambda: order.append("a"), "b": lambda: order.append("b")},
                           warmup=1, steps=3, block=2)
  assert order == ["a", "b"] + ["a", "a", "b", "b", "a", "b"]   # warm-up round, then blocks
  assert {name: len(t) for name, t in times.items()} == {"a": 3, "b": 3}
  with pytest.raises(ValueError, match="block=0"):
    time_interleaved({"a": lambda: None}, warmup=0, steps=3, block=0)
  out = _run("benchmarks.train_step", *TINY, "--block=0", check=False)
  assert out.returncode != 0 and "--block" in out.stderr


def test_profile_groups_op_time_and_finds_the_matmuls():
  from benchmarks.profile_step import MATMUL, op_times
  events = [{"ph": "X", "name": "ynn_fusion.3", "dur": 5}, {"ph": "X", "name": "dot.1", "dur": 2},
            {"ph": "X", "name": "copy_fusion.7", "dur": 4}, {"ph": "X", "name": "copy_fusion",
                                                            "dur": 1},
            {"ph": "X", "name": "$train_step.py:59 call", "dur": 100},
            {"ph": "X", "name": "ThunkExecutor::Execute", "dur": 50},
            {"ph": "X", "name": "ParseArguments", "dur": 3}, {"ph": "X", "name": "end: copy",
                                                              "dur": 3},
            {"ph": "i", "name": "dot.2", "dur": 9}]
  assert op_times(events) == {MATMUL: 7, "copy_fusion": 5}
  out = _run("benchmarks.profile_step", *TINY, "--profile_steps=2")
  lines = out.stdout.strip().splitlines()
  assert "op time" in lines[0]
  shares = {line.split("%")[1].strip(): float(line.split("ms")[1].split("%")[0])
            for line in lines[1:]}
  assert shares[MATMUL] > 5.0          # a training step is mostly its matmuls
  assert sum(shares.values()) <= 100.01


def test_profile_of_a_gpu_counts_its_kernels_alone():
  """A GPU trace: the device's kernels, grouped (GEMMs, cuDNN's attention, XLA's fusions
  without their numbers); the host's events of the same ops are not counted twice."""
  from benchmarks.profile_step import ATTENTION, MATMUL, op_times
  gpu, host = 7, 1
  events = [{"ph": "M", "name": "process_name", "pid": gpu, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": host, "args": {"name": "/host:CPU"}}]
  kernels = {"sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_cublas": 10,
             "nvjet_hsh_128x256_64x4_1x2_h_bz_coopA_NTN": 5, "gemm_fusion_dot_12": 3,
             "cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x128_4x1x1_kernel0_0": 8,
             "loop_multiply_fusion_3": 2, "loop_multiply_fusion": 1,
             "input_reduce_fusion_12_1": 4,
             "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm>(Params)": 6}
  events += [{"ph": "X", "pid": gpu, "name": k, "dur": d} for k, d in kernels.items()]
  events += [{"ph": "X", "pid": host, "name": "loop_multiply_fusion.3", "dur": 50},
             {"ph": "X", "pid": host, "name": "dot.1", "dur": 50}]
  assert op_times(events) == {MATMUL: 24, ATTENTION: 8, "loop_multiply_fusion": 3,
                              "input_reduce_fusion": 4}


def test_bad_lengths_are_named():
  out = _run("benchmarks.train_step", *TINY, "--src_length=600", check=False)
  assert out.returncode != 0 and "max_len" in out.stderr


def test_packed_batches_are_well_formed():
  from benchmarks.common import Setup, count_tokens, random_batch
  s = Setup(config=None, model=tiny_config(), head={}, batch_size=4, src_length=24,
            tgt_length=20)
  b = random_batch(s, seed=1, packed=True)
  for side, tokens in (("src", b["src"]), ("tgt", b["tgt_out"])):
    segments, positions = b[f"{side}_segment_ids"], b[f"{side}_positions"]
    assert ((segments == 0) == (tokens == PAD_ID)).all()
    for row in range(4):
      ids = segments[row][segments[row] > 0]
      assert (np.diff(ids) >= 0).all() and ids.max() >= 2          # several examples
      for k in np.unique(ids):
        assert (positions[row][segments[row] == k] == np.arange((segments[row] == k).sum())).all()
  # Both sides hold the same examples; the decoder input is each target shifted behind BOS.
  assert (b["src_segment_ids"].max(1) == b["tgt_segment_ids"].max(1)).all()
  starts = (b["tgt_positions"] == 0) & (b["tgt_segment_ids"] > 0)
  assert (b["tgt_in"][starts] == BOS_ID).all()
  inner = (b["tgt_positions"] > 0)
  shifted = np.roll(b["tgt_out"], 1, axis=1)
  assert (b["tgt_in"][inner] == shifted[inner]).all()
  assert count_tokens(b) == int((b["src"] != 0).sum() + (b["tgt_out"] != 0).sum())
  assert count_tokens(b) < 4 * (24 + 20)


def test_packed_lm_batches_are_documents_behind_bos():
  from benchmarks.common import Setup, count_tokens, random_batch
  s = Setup(config=None, model=tiny_config(), head={}, batch_size=4, src_length=0,
            tgt_length=24, task="lm")
  b = random_batch(s, seed=1, packed=True)
  segments, positions = b["segment_ids"], b["positions"]
  assert ((segments == 0) == (b["targets"] == PAD_ID)).all() and segments.max(1).min() >= 2
  assert (b["inputs"][(positions == 0) & (segments > 0)] == BOS_ID).all()
  inner = positions > 0       # within a document: the input is the previous target
  assert (b["inputs"][inner] == np.roll(b["targets"], 1, axis=1)[inner]).all()
  assert count_tokens(b) == int((segments > 0).sum()) < 4 * 24


@pytest.mark.parametrize("overrides", [dict(), dict(norm_position="pre", positional="learned",
                                                    activation="gelu")],
                         ids=["paper", "pre-ln-learned-gelu"])
def test_torch_reference_is_the_same_model(overrides):
  """With our parameters copied in, torch.nn.Transformer computes our logits: the side by
  side compares one architecture."""
  torch = pytest.importorskip("torch", reason="PyTorch is an optional benchmark dependency")
  from benchmarks.torch_reference import TorchTransformer
  cfg = tiny_config(num_decoder_layers=2, **overrides)
  rng = np.random.default_rng(0)
  src = rng.integers(4, cfg.vocab_size, (3, 7)).astype(np.int32)
  tgt = rng.integers(4, cfg.vocab_size, (3, 6)).astype(np.int32)
  src[1, 5:], tgt[2, 4:] = PAD_ID, PAD_ID
  params = nn.meta.unbox(Transformer(cfg).init(jax.random.PRNGKey(0), src, tgt))["params"]
  expected = np.asarray(Transformer(cfg).apply({"params": params}, src, tgt))
  model = TorchTransformer(cfg, label_smoothing=0.0).eval()
  assert sum(p.numel() for p in model.parameters()) == sum(
      x.size for x in jax.tree_util.tree_leaves(params))
  model.load_jax_params(params)
  with torch.no_grad():
    got = model.logits(torch.from_numpy(src).long(), torch.from_numpy(tgt).long()).numpy()
  valid = tgt != PAD_ID
  np.testing.assert_allclose(got[valid], expected[valid], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("overrides", [
    dict(norm_position="pre", positional="learned", activation="gelu", use_bias=True,
         scale_embeddings=False),
    dict(positional="sinusoidal", use_bias=False, tie_output=False, fused_qkv=True,
         num_heads=4, layer_norm_epsilon=1e-5)],
    ids=["gpt2", "post-ln-sinusoidal-untied-fused"])
def test_torch_gpt_is_the_same_language_model(overrides):
  """With our parameters copied in, the PyTorch GPT computes our language model's logits at
  every real position of right-padded rows, with as many parameters."""
  torch = pytest.importorskip("torch", reason="PyTorch is an optional benchmark dependency")
  from benchmarks.torch_gpt import TorchGPT
  from transformer_jax.modules.models import LanguageModel
  cfg = tiny_config(num_encoder_layers=0, num_decoder_layers=2, **overrides)
  tokens = np.random.default_rng(0).integers(4, cfg.vocab_size, (3, 9)).astype(np.int32)
  tokens[1, 6:] = PAD_ID
  lm = LanguageModel(cfg)
  params = nn.meta.unbox(lm.init(jax.random.PRNGKey(0), tokens))["params"]
  expected = np.asarray(lm.apply({"params": params}, tokens))
  model = TorchGPT(cfg).eval()
  assert sum(p.numel() for p in model.parameters()) == sum(
      x.size for x in jax.tree_util.tree_leaves(params))
  model.load_jax_params(params)
  with torch.no_grad():
    got = model.logits(torch.from_numpy(tokens).long()).numpy()
  valid = tokens != PAD_ID
  np.testing.assert_allclose(got[valid], expected[valid], atol=1e-4, rtol=1e-4)


def test_compare_torch_refuses_what_the_torch_gpt_does_not_mirror():
  """Rotary positions and RMSNorm (as gated FFNs and grouped-query attention), and Muon:
  one line, before any work."""
  pytest.importorskip("torch", reason="PyTorch is an optional benchmark dependency")
  for flag, field in (("--config.model.positional=rotary", "model.positional"),
                      ("--config.model.norm_type=rms", "model.norm_type"),
                      ("--config.optimizer.name=muon", "optimizer.name")):
    out = _run("benchmarks.train_step", *TINY_LM, flag, "--compare=torch", check=False)
    lines = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert len(lines) == 1 and f"{field}=" in lines[0], out.stderr[-3000:]


def test_seeds_reads_each_runs_final_metrics_and_summarises_them(tmp_path):
  """benchmarks/seeds.py: the newest value of each metric (the averaged model's line comes
  after the last checkpoint's), and mean ± sample standard deviation."""
  from benchmarks import seeds
  lines = [{"step": 10, "eval/f1": 80.0, "train/loss": 1.0},
           {"step": 20, "eval/f1": 85.0}, {"step": 20, "eval/f1": 86.0, "test/f1": 83.0}]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(l) + "\n" for l in lines))
  assert seeds.final_metrics(str(tmp_path), ["eval/f1", "test/f1"]) == {
      "eval/f1": 86.0, "test/f1": 83.0}
  with pytest.raises(errors.UserError, match="eval/bleu"):
    seeds.final_metrics(str(tmp_path), ["eval/bleu"])
  mean, std = seeds.summary([85.0, 86.0, 90.0])
  assert mean == pytest.approx(87.0) and std == pytest.approx(np.std([85, 86, 90], ddof=1))
  assert seeds.summary([84.0]) == (84.0, 0.0)


def test_command_lines_report_user_errors_in_one_line(tmp_path):
  """A bad flag value, a missing required flag and a missing input file each end the
  command before any work with one `error:` line naming the flag, and status 2
  (transformer_jax/errors.py)."""
  missing = tmp_path / "missing.txt"
  cases = {("benchmarks.seeds", "--config=configs/default.py", f"--workdir={tmp_path}",
            "--seeds=0,x"): "--seeds=0,x",
           ("benchmarks.serve_load", f"--model={tmp_path}"): "--inputs",
           ("benchmarks.serve_stream", f"--model={tmp_path}",
            f"--prompts={missing}"): f"--prompts={missing}",
           ("benchmarks.gpu_measurements", f"--output={tmp_path}/m.json",
            f"--runs={tmp_path}/runs", "--seeds=0,x"): "--seeds=0,x",
           ("benchmarks.gpu_measurements", f"--output={tmp_path}/m.json",
            f"--runs={tmp_path}/runs", "--largest_batch=base=x"): "base=x",
           ("benchmarks.gpu_measurements", f"--output={tmp_path}/m.json",
            f"--runs={tmp_path}/runs", "--attentions=flash"): "--attentions=flash",
           ("benchmarks.ctranslate2_speed", f"--checkpoint={tmp_path}",
            f"--inputs={missing}"): f"--inputs={missing}",
           ("benchmarks.generate_speed", "--models=gpt3"): "--models"}
  for (module, *args), culprit in cases.items():
    out = _run(module, *args, check=False)
    lines = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert len(lines) == 1 and culprit in lines[0], out.stderr[-3000:]
  assert not os.listdir(tmp_path)        # nothing trained or written


def test_generate_speed_reports_both_sides_on_the_same_ids():
  """benchmarks.generate_speed at toy size: a row per batch with both sides' tokens/s and
  first-token times, and the two generating the same greedy ids from the same weights."""
  pytest.importorskip("transformers")
  out = _run("benchmarks.generate_speed", "--models=tiny", "--batches=1,3", "--prompt=5",
             "--new=6", "--steps=1", "--warmup=0", "--json")
  report = json.loads(out.stdout)
  assert [row["batch"] for row in report["rows"]] == [1, 3]
  for row in report["rows"]:
    assert row["same_ids_rows"] == row["batch"]
    for side in ("transformers", "ours"):
      assert row[side]["tokens_per_s"] > 0 and row[side]["first_token_ms"] > 0
