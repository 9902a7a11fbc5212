"""Benchmark of the jitted training step: compile time, step time, tokens/s, model FLOPs and
MFU, memory; optionally side by side with PyTorch.

  python -m benchmarks.train_step --config=configs/wmt14_ende_base.py --batch_size=64 \
      --src_length=32 --tgt_length=32 [--dtype=bfloat16 --scan --remat=dots --fused_qkv] \
      [--compare=torch] [--json]
  python -m benchmarks.train_step --config=configs/gpt2_small.py --batch_size=16 \
      --length=1024 [--compare=torch]

The step is the trainer's own (`make_train_step`: loss, gradients, Adam, the non-finite
guard, state donated), run on one random batch kept on the device, so the figure is the
step's compute, not the input pipeline. A language model's (task lm) rows are --length tokens,
each document's inputs BOS + its targets. Model FLOPs: `transformer_jax.flops.model_flops`,
or `lm_flops` (6 N per token for the weights plus the attention terms, no causal halving);
`hardware_flops_per_step` counts the traced program's matmuls, remat recomputation
included. MFU = model FLOPs per second / the peak (see --peak_tflops). With --compare=torch
the JAX, PyTorch-eager and torch.compile steps are timed in turns, `--block` steps at a
time, so that on a shared machine all three see the same load.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
from absl import flags, logging

from benchmarks import common
from transformer_jax import errors
from transformer_jax.aot.hlo_cost import cudnn_workspaces
from transformer_jax.flops import lm_flops, matmul_flops, model_flops
from transformer_jax.params import count_params
from transformer_jax.tasks import task_class
from transformer_jax.training.optimizers import make_optimizer, make_schedule
from transformer_jax.training.state import create_train_state
from transformer_jax.training.steps import make_train_step

flags.DEFINE_float("peak_tflops", None, "Peak TFLOP/s for MFU (default: the known dense "
                   "peak of the accelerator for the dtype, or a measured matmul rate).")
flags.DEFINE_bool("packed", False, "Packed rows: several examples per row with segment ids.")
flags.DEFINE_enum("compare", None, ["torch"], "Also run the same model in PyTorch (eager "
                  "and torch.compile) in this process and print the ratios.")
FLAGS = flags.FLAGS


def prepare_jax(s: common.Setup, batch: dict) -> tuple[dict[str, Any], Callable[[], None]]:
  """Compiles the trainer's step: (facts about it, a call that runs one step)."""
  cfg = s.config
  task = task_class(s.task)(s.model, label_smoothing=cfg.label_smoothing, head=s.head)
  schedule = make_schedule(cfg.optimizer, s.model.d_model, cfg.num_train_steps)
  optimizer = make_optimizer(cfg.optimizer, schedule)
  params = jax.jit(lambda key: nn.meta.unbox(task.init_params(key)))(
      jax.random.PRNGKey(FLAGS.seed))
  state = create_train_state(params, optimizer, FLAGS.seed)
  batch = jax.device_put(batch)
  step = make_train_step(task, optimizer, schedule, cfg.get("grad_accum_steps", 1))
  compiled, compile_times = common.compile_jitted(step, state, batch)
  info = {"parameters": count_params(state.params), **compile_times,
          "hardware_flops_per_step": matmul_flops(step, state, batch),
          "compiled_memory": common.compiled_memory(compiled)}
  workspaces = cudnn_workspaces(compiled.as_text())
  if workspaces:   # what a compile-only plan counts as 0 bytes (aot/report.py)
    info["cudnn_workspace_bytes"] = {"calls": len(workspaces), "largest": max(workspaces),
                                     "total": sum(workspaces)}

  def call() -> None:
    nonlocal state
    state, metrics = compiled(state, batch)
    jax.block_until_ready((state, metrics))
  return info, call


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise errors.UserError(f"unexpected arguments: {' '.join(argv[1:])}")
  logging.set_verbosity(logging.WARNING)
  s = common.setup()
  if FLAGS.packed and FLAGS.compare:
    raise errors.UserError("--packed has no PyTorch counterpart (the PyTorch models take no "
                           "segment ids); drop --compare or --packed")
  lm = s.task == "lm"
  batch = common.random_batch(s, FLAGS.seed, packed=FLAGS.packed)
  tokens = common.count_tokens(batch)
  flops = (lm_flops(s.model, s.batch_size, s.tgt_length) if lm
           else model_flops(s.model, s.batch_size, s.src_length, s.tgt_length))
  peak, peak_source = common.peak_tflops(s.model.dtype, FLAGS.peak_tflops)

  if FLAGS.compare == "torch":   # refused before any work if PyTorch cannot mirror it
    from benchmarks import torch_reference
    torch_reference.check_mirrored(s)
  jax_info, jax_call = prepare_jax(s, batch)
  calls = {"jax": jax_call}
  if FLAGS.compare == "torch":
    torch_info, torch_calls = torch_reference.prepare(s, batch, FLAGS.seed)
    calls.update(torch_calls)
  # In turns, so that JAX and PyTorch see the same load on a shared machine.
  times = common.time_interleaved(calls, FLAGS.warmup, FLAGS.steps, FLAGS.block)
  jax_result = {**jax_info, "step_time_ms": common.stats_ms(times["jax"]),
                "peak_memory_bytes": common.peak_memory_bytes()}
  seconds = jax_result["step_time_ms"]["median"] / 1000.0
  achieved = flops["total"] / seconds / 1e12
  result = {
      "benchmark": "train_step", **common.stamp(), "model": s.model.to_dict(),
      "task": s.task,
      "batch": {"batch_size": s.batch_size,
                **({"length": s.tgt_length} if lm else {"src_length": s.src_length,
                                                         "tgt_length": s.tgt_length}),
                "packed": FLAGS.packed, "tokens_per_step": tokens},
      **jax_result,
      "tokens_per_sec": tokens / seconds,
      "model_flops_per_step": flops["total"],
      "model_flops_breakdown": {"weights": flops["weights"], "attention": flops["attention"]},
      "flops_formula": ("6*N per token for the weights (each token through the decoder-only "
                        "model's matmul weights) + 12*d*L*T^2 per sequence for the causal "
                        "self-attention" if lm else
                        "6*N per token for the weights (source and target tokens through the "
                        "matmul weights each meets) + 12*d*L*(lengths product) per sequence "
                        "for encoder self-, decoder self- and cross-attention"),
      "causal_halving": False,
      "achieved_tflops": achieved, "peak_tflops": peak, "peak_source": peak_source,
      "mfu": achieved / peak,
  }
  rows = [
      ("device", f"{result['device']['kind']} ({result['device']['platform']}), "
                 f"load average {result['load_average']}"),
      ("model", f"{result['parameters']:,} parameters, d_model {s.model.d_model}, "
                + (f"{s.model.num_decoder_layers} layers (decoder-only), " if lm else
                   f"{s.model.num_encoder_layers}+{s.model.num_decoder_layers} layers, ")
                + f"vocab {s.model.vocab_size:,}, "
                f"{s.model.dtype}, attention {s.model.attention_impl}, scan "
                f"{s.model.scan_layers}, remat {s.model.remat_policy}, fused_qkv "
                f"{s.model.fused_qkv}"),
      ("batch", (f"{s.batch_size} x {s.tgt_length}" if lm else
                 f"{s.batch_size} x ({s.src_length} + {s.tgt_length})")
                + f", {tokens:,} tokens{' (packed)' if FLAGS.packed else ''}"),
      ("compile_s", f"{result['compile_s']:.2f} (lowering {result['lower_s']:.2f}; CPU time "
                    f"{result['compile_cpu_s']:.2f})"),
      ("step_time", common.fmt_ms(result["step_time_ms"])),
      ("tokens_per_sec", f"{result['tokens_per_sec']:,.0f}"),
      ("model_flops_per_step", f"{flops['total']:.4g} (hardware {result['hardware_flops_per_step']:.4g})"),
      ("achieved_tflops", f"{achieved:.4g}"),
      ("mfu", f"{100 * result['mfu']:.1f}% of {peak:.4g} TFLOP/s ({peak_source})"),
      ("peak_memory", "not reported by this backend" if result["peak_memory_bytes"] is None
                      else f"{result['peak_memory_bytes'] / 2**20:,.0f} MiB"),
  ]
  if result["compiled_memory"]:
    rows.append(("compiled_memory", f"{result['compiled_memory']['total_bytes'] / 2**20:,.0f} "
                                    "MiB (XLA plan: arguments + outputs + temporaries)"))
  if FLAGS.compare == "torch":
    result["compare"] = torch_reference.summarize(torch_info, times, result, tokens)
    rows += torch_reference.table_rows(result["compare"])
  common.emit(result, rows)


if __name__ == "__main__":
  errors.run(main)
