"""Ahead-of-time compilation for TPU topologies (transformer_jax.aot), on this CPU machine.

Needs libtpu (requirements-tpu.txt); skipped without it. Models are tiny so that each TPU
compile takes seconds."""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
import types
from typing import Callable

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                reason="libtpu is not installed (pip install -r "
                                "requirements-tpu.txt)")

from configs import default  # noqa: E402
from transformer_jax import sharding  # noqa: E402
from transformer_jax.aot import plan, programs, report, targets  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# One layer each way, d_model 32, 4 heads: the programs of train.py at a size that compiles
# in seconds.
TINY = ["--config.model.num_encoder_layers=1", "--config.model.num_decoder_layers=1",
        "--config.model.d_model=32", "--config.model.d_ff=64"]


def tiny_config(batch_size: int = 64):
  config = default.get_config()
  config.model.update(num_encoder_layers=1, num_decoder_layers=1, d_model=32, d_ff=64)
  config.batch_size = batch_size
  return config


def train_step(batch_size: int, topology: str, **mesh: int) -> report.CompileReport:
  return _train_step(batch_size, topology, tuple(sorted(mesh.items())))


@functools.lru_cache(maxsize=None)   # Compiles are the cost of these tests: one per case.
def _train_step(batch_size: int, topology: str, mesh: tuple) -> report.CompileReport:
  topo = targets.tpu_topology(topology)
  return plan.compile_train_step(tiny_config(batch_size), topo,
                                 sharding.make_mesh(dict(mesh), topo.devices))


def run_cli(*args: str) -> subprocess.CompletedProcess:
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the CPU test flags
  env["PYTHONPATH"] = ROOT
  return subprocess.run([sys.executable, "-m", "transformer_jax.aot",
                         f"--config={ROOT}/configs/default.py", *TINY, *args],
                        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


# The 3-D v5p slice skips the fsdp layout, which the 2-D slice covers (a compile saved).
@pytest.mark.parametrize("topology, layouts", [("v5e:2x2", ("data", "fsdp", "tensor")),
                                               ("v5p:2x2x2", ("data", "tensor"))])
def test_compiles_under_data_fsdp_and_tensor_meshes(topology, layouts):
  chips = len(targets.tpu_topology(topology).devices)
  meshes = {"data": dict(data=chips), "fsdp": dict(fsdp=chips),
            "tensor": dict(data=chips // 4, tensor=4)}
  results = {name: train_step(64, topology, **meshes[name]) for name in layouts}
  for r in results.values():
    assert r.fits and 0 < r.total_bytes < r.hbm_bytes
    assert r.compiled_flops_per_chip > 0 and r.estimated_step_s > 0
    assert 0 < r.estimated_mfu < 1
  # Sharding the state over fsdp or tensor leaves each chip less of it than replication.
  for name in set(layouts) - {"data"}:
    assert results[name].argument_bytes < results["data"].argument_bytes
  # Data parallelism sums the float32 gradients; fsdp gathers the parameters it splits.
  assert results["data"].collectives.get("all-reduce f32", 0) > 0
  if "fsdp" in results:
    assert results["fsdp"].collectives.get("all-gather f32", 0) > 0


def test_every_program_compiles_and_reports():
  topo = targets.tpu_topology("v5e:2x2")
  config = tiny_config()
  mesh = sharding.make_mesh(dict(fsdp=4), topo.devices)
  built = programs.build_programs(config, mesh)
  assert [p.name for p in built] == list(programs.PROGRAMS)
  results = {p.name: report.compile_program(p, topo, mesh) for p in built[1:]}
  results["train_step"] = train_step(64, "v5e:2x2", fsdp=4)   # compiled above
  assert all(r.fits and r.total_bytes > 0 for r in results.values())
  text = report.format_report("header", results)
  assert "XLA cost model" in text and "not measurements" in text


def test_too_large_for_v5e_does_not_fit_and_says_why():
  proc = run_cli("--topology=v5e:2x2", "--programs=train_step",
                 "--config.batch_size=4194304")
  assert proc.returncode == 1, proc.stderr
  lines = proc.stderr.strip().splitlines()
  assert "Traceback" not in proc.stderr
  assert lines[-1].startswith("does not fit: train_step needs")
  assert "GiB more than the 16 GiB" in lines[-1]
  assert "fsdp" in lines[-1] and "remat" in lines[-1] and "more chips" in lines[-1]


def test_eval_and_decode_that_do_not_fit_say_why():
  # Judged against 1 MiB per chip: the evaluation batch's logits and the beam search's
  # cache of 4096 rows do not fit; each program gets its own line of advice.
  proc = run_cli("--topology=v5e:2x2", "--programs=eval_step,decode", "--hbm_gib=0.001",
                 "--config.eval.batch_size=4096")
  assert proc.returncode == 1, proc.stderr
  assert "Traceback" not in proc.stderr
  lines = proc.stderr.strip().splitlines()[-2:]
  for name, line in zip(("eval_step", "decode"), lines):
    assert line.startswith(f"does not fit: {name} needs"), line
    assert "--config.eval.batch_size, now 4096" in line and "more chips" in line


def test_user_errors_exit_2_without_traceback():
  proc = run_cli("--topology=v9z:2x2")
  assert proc.returncode == 2 and "Traceback" not in proc.stderr
  assert proc.stderr.strip().splitlines()[-1].startswith("error: --topology='v9z:2x2'")
  proc = run_cli("--topology=v5e:2x2", "--config.mesh.data=3")
  assert proc.returncode == 2 and "Traceback" not in proc.stderr
  assert "mesh" in proc.stderr.strip().splitlines()[-1]
  proc = run_cli("--topology=v5p:2x2x1", "--top_ops=-1")    # absl rejects the value
  assert proc.returncode == 2 and "Traceback" not in proc.stderr
  assert proc.stderr.strip().splitlines()[-1].startswith("error: flag --top_ops=-1")


def test_find_max_batch_fits_and_twice_does_not():
  # Judged against 16 MiB per chip instead of 16 GiB, from a batch of 16: the same search,
  # at batches that compile in seconds; stopped when the bracket is within the batch found
  # (fits, and twice it does not: what the test asserts, in few compiles).
  topo = targets.with_hbm(targets.tpu_topology("v5e:2x2"), 16 / 1024)
  config = tiny_config(16)
  mesh = sharding.make_mesh(dict(data=4), topo.devices)
  batch, results = plan.find_max_batch(config, topo, mesh, tolerance=1.0)
  assert batch > 0 and batch % 4 == 0 and results[batch].fits
  assert results[batch].total_bytes > 0.5 * topo.chip.hbm_bytes
  twice = results.get(2 * batch) or plan.compile_train_step(tiny_config(2 * batch), topo, mesh)
  assert not twice.fits
  # The reported memory grows with the batch (the batch is an argument too).
  compiled = [results[b] for b in sorted(results)]
  assert len(compiled) >= 2
  for smaller, larger in zip(compiled, compiled[1:]):
    assert larger.total_bytes > smaller.total_bytes
    assert larger.argument_bytes > smaller.argument_bytes


_HLO = """HloModule m

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %sum = f32[8]{0} all-reduce(%x), channel_id=1, to_apply=%add
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %sum)
}

%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: bf16[4,2], b: (s32[], f32[8])) -> f32[8] {
  %a = bf16[4,2]{1,0} parameter(0)
  %start = (bf16[4,2]{1,0}, bf16[16,2]{1,0}, u32[], u32[]) all-gather-start(%a), dimensions={0}
  %done = bf16[16,2]{1,0} all-gather-done(%start)
  %fusion.6 = bf16[4,2]{1,0} fusion(%done), kind=kCustom, calls=%all-reduce-scatter.6
  %b = (s32[], f32[8]{0}) parameter(1)
  %w = (s32[], f32[8]{0}) while(%b), condition=%cond, body=%body
  ROOT %r = f32[8]{0} get-tuple-element(%w), index=1
}
"""


def test_collectives_are_counted_per_call_by_kind_and_element_type():
  from transformer_jax.aot import hlo_cost
  # The gather's result half of its start (16 x 2 bf16), the TPU's reduce-scatter fusion
  # (its 4 x 2 bf16 slice), the loop's all-reduce three times.
  assert hlo_cost.collective_bytes(_HLO) == {"all-gather bf16": 64, "all-reduce f32": 96,
                                             "reduce-scatter bf16": 16}

  # A loop whose condition is not `i < constant` runs an unknown number of times: its body
  # counts once, and the breakdown says a loop was unknown instead of scaling by a guess.
  unknown = _HLO.replace("direction=LT", "direction=NE")
  assert hlo_cost.collective_bytes(unknown)["all-reduce f32"] == 32
  assert hlo_cost.op_breakdown(unknown).unknown_loops == 1
  assert hlo_cost.op_breakdown(_HLO).unknown_loops == 0

def _search_without_compiling(monkeypatch, gib_at: Callable[[int], float], state_gib: float,
                              limit_gib: float, topology: str, data: int,
                              tolerance: float) -> tuple[int, list[int]]:
  """find_max_batch over a memory curve `gib_at(rows)` instead of compiles: (batch, the
  batches it compiled)."""
  compiled: list[int] = []

  def fake_compile(options, topo, mesh):
    rows = options.train.batch_size
    compiled.append(rows)
    gib = gib_at(rows)
    return types.SimpleNamespace(total_bytes=int(gib * 2**30),
                                 argument_bytes=int(state_gib * 2**30),
                                 fits=gib <= limit_gib, compile_s=0.0)

  monkeypatch.setattr(plan, "compile_train_step", fake_compile)
  topo = targets.with_hbm(targets.tpu_topology(topology), limit_gib)
  mesh = sharding.make_mesh(dict(data=data), topo.devices[:data])
  batch, _ = plan.find_max_batch(tiny_config(96), topo, mesh, tolerance=tolerance)
  return batch, compiled


def test_find_max_batch_bisects_where_memory_flattens_above_hbm(monkeypatch):
  """Without compiling, memory shaped as big's on 8xH100 (benchmarks/RESULTS.md): linear in
  the batch up to HBM (59.33 GiB at about 2,355 rows), then flat just above it, where XLA
  rematerializes to fit (60.06 GiB at 2,760 rows, 60.76 at 3,072). Interpolating from the
  bracket's far end crept down 40-80 rows a compile (25 compiles); the search bisects."""
  batch, compiled = _search_without_compiling(
      monkeypatch, lambda rows: (5.1 + (rows - 96) * 0.024 if rows <= 2355
                                 else max(59.4, 60.0 + (rows - 2760) * 0.0012)),
      state_gib=2.39, limit_gib=59.33, topology="v5p:2x2x2", data=8, tolerance=0.1)
  assert 0.9 * 2352 <= batch <= 2352      # within the tolerance of the largest that fits
  assert len(compiled) <= 8, compiled


def test_find_max_batch_probes_just_above_a_guess_that_fits(monkeypatch):
  """Without compiling, memory linear in the batch (the base step on one H200 as planned:
  11.51 GiB at 96 rows, 104.04 at 933): the interpolated guess lands just under the limit,
  and one compile a tolerance step above it ends the search (it bisected 4 more times)."""
  batch, compiled = _search_without_compiling(
      monkeypatch, lambda rows: 11.51 + (rows - 96) * (104.04 - 11.51) / (933 - 96),
      state_gib=0.71, limit_gib=105.8, topology="v5p:2x2x1", data=1, tolerance=0.05)
  assert 0.95 * 948 <= batch <= 948 and len(compiled) <= 5, compiled


def test_layouts_are_every_factorisation():
  assert sorted(plan.layouts(4)) == [(1, 1, 4), (1, 2, 2), (1, 4, 1), (2, 1, 2), (2, 2, 1),
                                    (4, 1, 1)]
  assert all(d * f * t == 32 for d, f, t in plan.layouts(32)) and len(plan.layouts(32)) == 21


@functools.lru_cache(maxsize=None)
def _v5p_train_step(**fields) -> report.CompileReport:
  """The tiny model's train step on v5p (the generation XLA's cost model estimates), with
  three layers a side so that a scan has something to loop over."""
  topo = targets.tpu_topology("v5p:2x2x1")
  config = tiny_config(64)
  config.model.update(num_encoder_layers=3, num_decoder_layers=3,
                      scan_layers=fields.pop("scan_layers", False))
  config.update(fields)
  mesh = sharding.make_mesh(dict(data=4), topo.devices)
  (program,) = programs.build_programs(config, mesh, ("train_step",))
  return report.compile_program(program, topo, mesh, top_ops=8)


def test_loops_in_the_step_are_counted_per_iteration():
  """XLA's cost_analysis() counts a loop body once, so a step that scans its layers or its
  micro-batches would be estimated at a fraction of the same work unrolled. The report
  scales it by XLA's per-instruction estimates, which lands near the unrolled step."""
  plain = _v5p_train_step()
  assert plain.note is None
  assert plain.estimated_step_s == plain.xla_optimal_seconds
  for variant in (_v5p_train_step(grad_accum_steps=4), _v5p_train_step(scan_layers=True)):
    assert variant.xla_optimal_seconds < 0.8 * plain.estimated_step_s   # undercounted
    assert 0.5 < variant.estimated_step_s / plain.estimated_step_s < 2.0
    assert "count each iteration" in variant.note


def test_top_ops_rank_the_step_by_xlas_own_estimates():
  top = _v5p_train_step().top_ops
  shares = [t["share"] for t in top]
  assert len(top) == 8 and shares == sorted(shares, reverse=True)
  assert 0 < sum(shares) <= 1.0 + 1e-9
  # Layers are merged into one name per operation; the model's matmuls are among them.
  assert not any("layer_0" in t["op"] for t in top)
  assert any("layer_N" in t["op"] and "dot_general" in t["op"] for t in top)
  text = report.format_report("header", {"train_step": _v5p_train_step()})
  assert "estimates to take the most time" in text and "layer_N" in text


def test_auto_attention_is_planned_as_splash_attention_for_tpu():
  """attention_impl=auto traced for v5p is the splash kernel (a Mosaic custom call), with
  no fallback to this CPU's path, and the step compiles and reports its memory."""
  import warnings

  from configs import wmt14_ende_base
  topo = targets.tpu_topology("v5p:2x2x1")
  mesh = sharding.make_mesh(dict(data=4), topo.devices)
  config = wmt14_ende_base.get_config()   # packed rows: segment ids reach the kernel
  config.batch_size, config.data.max_length, config.data.vocab_size = 8, 128, 512
  config.mesh.update(data=4, fsdp=1)
  config.model.update(num_encoder_layers=1, num_decoder_layers=1, d_model=128, d_ff=128,
                      num_heads=2, attention_impl="auto")
  (program,) = programs.build_programs(config, mesh, ("train_step",))
  with warnings.catch_warnings():
    warnings.simplefilter("error")      # a fallback warning fails the test
    with targets.tracing_for(topo):
      text = program.fn.lower(*program.args).as_text()
    compiled = report.compile_program(program, topo, mesh)
  assert text.count("tpu_custom_call") >= 3 * 2      # three attentions, forward and back
  assert compiled.fits and compiled.total_bytes > 0
  # XLA's cost model prices none of the kernel's work: no estimate that leaves it out.
  assert compiled.estimated_step_s is None and compiled.estimated_mfu is None
  assert compiled.compiled_flops_per_chip is None and "tpu_custom_call" in compiled.note
  config.model.attention_impl = "einsum"      # the same step without the kernel
  (program,) = programs.build_programs(config, mesh, ("train_step",))
  with targets.tracing_for(topo):
    assert "tpu_custom_call" not in program.fn.lower(*program.args).as_text()


def tiny_lm_config(batch_size: int = 16, **model):
  """configs/gpt2_small.py at a size that compiles in seconds: 2 layers, d_model 64, rows of
  128 tokens, a vocabulary of 512."""
  from configs import gpt2_small
  config = gpt2_small.get_config()
  config.model.update(num_decoder_layers=2, d_model=64, d_ff=128, num_heads=2, max_len=128,
                      **model)
  config.data.update(vocab_size=512, max_length=128, eval_max_length=128)
  config.update(batch_size=batch_size, grad_accum_steps=1)
  config.eval.batch_size, config.decode.max_new_tokens = 8, 8
  return config


def test_lm_config_plans_the_language_models_programs_and_flops():
  """An lm config: the train step on the task's batch (inputs, targets, positions, segment
  ids of data.max_length), counted by the decoder-only formula; it fits with XLA's estimate;
  the continuations compile as the decode program; auto attention is splash's kernel."""
  from transformer_jax.flops import lm_flops
  topo = targets.tpu_topology("v5p:2x2x1")
  mesh = sharding.make_mesh(dict(data=4), topo.devices)
  config = tiny_lm_config(attention_impl="einsum")
  built = {p.name: p for p in programs.build_programs(config, mesh)}
  assert list(built) == list(programs.PROGRAMS)
  train = built["train_step"]
  batch = train.args[1]
  assert sorted(batch) == ["inputs", "positions", "segment_ids", "targets"]
  assert all(x.shape == (16, 128) for x in batch.values())
  cfg = programs.experiment_for(config, mesh).model_config
  assert cfg.num_encoder_layers == 0 and cfg.vocab_size == 512
  assert train.model_flops == lm_flops(cfg, 16, 128)["total"] and train.tokens == 16 * 128
  assert built["eval_step"].model_flops == lm_flops(cfg, 8, 128, training=False)["total"]
  compiled = {name: report.compile_program(built[name], topo, mesh)
              for name in ("train_step", "decode")}
  assert all(r.fits and r.total_bytes > 0 for r in compiled.values())
  assert 0 < compiled["train_step"].estimated_mfu < 1
  (auto,) = programs.build_programs(tiny_lm_config(attention_impl="auto"), mesh,
                                    ("train_step",))
  with targets.tracing_for(topo):
    assert "tpu_custom_call" in auto.fn.lower(*auto.args).as_text()
