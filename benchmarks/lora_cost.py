"""What LoRA saves against full fine-tuning, both through the trainer's own step
(training/steps.py, with `lora.freeze_base` on the optimizer as train.py builds it), random
weights of a published shape (benchmarks/llama_shapes.py):

  # memory: XLA's plan of the step, compiled here for the targets (nothing runs)
  python -m benchmarks.lora_cost --mode=plan --models=llama3.2-1b,llama3.1-8b \
      --targets=h100-sxm:1,v5e:2x4 --rows=4 --length=2048 [--json]
  # speed: both steps on this machine's CPU, timed in turns
  python -m benchmarks.lora_cost --mode=time --models=tinyllama --layers=4 --rows=1 \
      --length=256 [--steps=10] [--json]

Both steps are AdamW (weight decay 0) on one batch of --rows x --length tokens. "full"
trains every parameter, stored in --full_params (float32: mixed precision's master weights,
so that Adam's moments are float32 too; or bfloat16); "lora" trains adapters of rank
--rank on q/k/v/o and gate/up/down (float32), the base frozen in bfloat16. The plan
compiles with the layers scanned and each layer rematerialised (common's --remat, here "full": gradient
checkpointing, as fine-tuning at these sizes runs) in bfloat16; a multi-chip target shards
the parameters and the optimizer state over all its chips (mesh fsdp), a chip a row.

The plan's memory per chip: the parameters and the optimizer state (the step's arguments,
from their shapes), the gradients (the trained parameters' size: what the backward pass
must hold), and the rest of XLA's temporaries (activations and the update's buffers; the
plan's temporaries less the gradients, so an estimate of that split, not a measure), and
XLA's total with whether it fits the chip.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from absl import flags

from benchmarks import common
from benchmarks.llama_shapes import SHAPES
from transformer_jax import errors, lora, sharding
from transformer_jax.accelerators import GiB
from transformer_jax.options import LoraOptions, OptimizerOptions
from transformer_jax.tasks.lm import LanguageModelTask
from transformer_jax.training.optimizers import make_optimizer, make_schedule
from transformer_jax.training.state import new_train_state
from transformer_jax.training.steps import make_train_step

FLAGS = flags.FLAGS
VARIANTS = ("full", "lora")


def define_flags() -> None:
  """The command-line flags (besides benchmarks.common's --length, --remat, --warmup, --steps,
  --block, --json), defined only when this module is the program."""
  flags.DEFINE_enum("mode", "plan", ["plan", "time"], "plan: memory of the compiled step for "
                    "--targets; time: both steps on this CPU.")
  flags.DEFINE_list("models", ["llama3.2-1b", "llama3.1-8b"], f"Shapes: {', '.join(SHAPES)}.")
  flags.DEFINE_list("targets", ["h100-sxm:1", "v5e:2x4"], "plan: aot targets.")
  flags.DEFINE_integer("rows", 4, "Rows per step (all chips).", lower_bound=1)
  flags.DEFINE_integer("rank", 16, "LoRA rank.", lower_bound=1)
  flags.DEFINE_integer("layers", 0, "Layers (0: the shape's).", lower_bound=0)
  flags.DEFINE_enum("full_params", "float32", ["float32", "bfloat16"],
                    "Full fine-tuning's parameter dtype.")
  FLAGS.set_default("length", 2048)
  FLAGS.set_default("remat", "full")


def _setup(name: str, variant: str, mesh: Any, planned: bool) -> tuple[Any, Any, dict]:
  """(the jitted step, its abstract sharded state, its batch) of `variant` on `mesh`."""
  cfg = SHAPES[name].our_config().replace(max_len=FLAGS.length, dropout_rate=0.0)
  if FLAGS.layers:
    cfg = cfg.replace(num_decoder_layers=FLAGS.layers)
  if planned:
    cfg = cfg.replace(dtype="bfloat16", scan_layers=True, remat_policy=FLAGS.remat)
  adapted = variant == "lora"
  cfg = cfg.replace(param_dtype="bfloat16" if adapted else FLAGS.full_params)
  task = LanguageModelTask(cfg, label_smoothing=0.0)
  options = OptimizerOptions(name="adamw", schedule="constant", learning_rate=1e-4,
                             warmup_steps=0)
  schedule = make_schedule(options, cfg.d_model, 100)
  optimizer = make_optimizer(options, schedule)
  lora_options = LoraOptions(rank=FLAGS.rank, alpha=2.0 * FLAGS.rank) if adapted else None
  if lora_options:
    optimizer = lora.freeze_base(optimizer)

  def new_state() -> Any:
    params = task.init_params(jax.random.key(0))
    if lora_options:
      params = lora.adapted(params, lora.init_adapters(nn.meta.unbox(params), lora_options,
                                                       jax.random.key(1)))
    return new_train_state(params, optimizer, 0)

  state, state_sharding = sharding.abstract_sharded(new_state, mesh)
  rows = sharding.batch_sharding(mesh)
  step = make_train_step(task, optimizer, schedule, 1, state_sharding, rows,
                         lora_options=lora_options)
  batch = {k: jax.ShapeDtypeStruct((FLAGS.rows, FLAGS.length), v.dtype, sharding=rows)
           for k, v in task.batch_spec(FLAGS.rows, FLAGS.length).items()}
  return step, state, batch


def plan(name: str, target: str) -> dict[str, dict[str, Any]]:
  """Each variant's memory per chip on `target` (aot's compile-only devices)."""
  from transformer_jax.aot import targets
  from transformer_jax.aot.programs import Program
  from transformer_jax.aot.report import argument_bytes, compile_program
  topology = targets.describe(target, "--targets")
  chips = len(topology.devices)
  mesh = sharding.make_mesh({"data": 1, "fsdp": chips, "tensor": 1}, topology.devices)
  out = {}
  with targets.tracing_for(topology):
    for variant in VARIANTS:
      step, state, batch = _setup(name, variant, mesh, planned=True)
      report = compile_program(Program("train_step", step, (state, batch),
                                       None, None), topology, mesh)
      trained = lora.trainable(state.params)
      gradients = argument_bytes(trained)
      out[variant] = {
          "parameters": argument_bytes(lora.base(state.params)),
          "adapters": argument_bytes(trained) if variant == "lora" else 0,
          "optimizer_state": argument_bytes(state.opt_state), "gradients": gradients,
          "activations_and_other": max(report.temp_bytes - gradients, 0),
          "total": report.total_bytes, "hbm": report.hbm_bytes, "fits": report.fits,
          "trained_parameters": sum(x.size for x in jax.tree_util.tree_leaves(trained)),
          "compile_s": round(report.compile_s, 1), "xla_error": report.xla_error}
  return out


def time_steps(name: str) -> dict[str, dict[str, float]]:
  """Both steps' median milliseconds on this machine, timed in turns."""
  mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  calls, states = {}, {}
  rng = jax.random.key(FLAGS.seed)
  for variant in VARIANTS:
    step, abstract, batch_spec = _setup(name, variant, mesh, planned=False)
    states[variant] = jax.tree_util.tree_map(
        lambda s: jax.device_put(jnp.zeros(s.shape, s.dtype), s.sharding), abstract)
    batch = {k: jax.random.randint(jax.random.fold_in(rng, i), s.shape, 4, 1000, s.dtype)
             for i, (k, s) in enumerate(batch_spec.items())}
    batch["positions"] = jnp.tile(jnp.arange(FLAGS.length, dtype=jnp.int32), (FLAGS.rows, 1))
    batch["segment_ids"] = jnp.ones_like(batch["segment_ids"])

    def call(variant: str = variant, step: Any = step, batch: dict = batch) -> None:
      states[variant], metrics = step(states[variant], batch)
      jax.block_until_ready(metrics)
    calls[variant] = call
  times = common.time_interleaved(calls, FLAGS.warmup, FLAGS.steps, FLAGS.block)
  return {v: common.stats_ms(t) for v, t in times.items()}


def main(argv: list[str]) -> None:
  del argv
  if FLAGS.mode == "plan":
    jax.config.update("jax_platforms", "cpu")
  result: dict[str, Any] = {**common.stamp(), "mode": FLAGS.mode, "rows": FLAGS.rows,
                            "length": FLAGS.length, "rank": FLAGS.rank,
                            "layers": FLAGS.layers, "full_params": FLAGS.full_params}
  lines = []
  for name in FLAGS.models:
    if FLAGS.mode == "time":
      stats = time_steps(name)
      result[name] = {**stats, "ratio": stats["lora"]["median"] / stats["full"]["median"]}
      lines += [(f"{name} {v}", common.fmt_ms(stats[v])) for v in VARIANTS]
      lines.append((f"{name} lora / full", f"{result[name]['ratio']:.2f}"))
      continue
    for target in FLAGS.targets:
      rows = plan(name, target)
      result[f"{name} {target}"] = rows
      for variant, r in rows.items():
        lines.append((f"{name} {target} {variant}", ", ".join(
            f"{k} {r[k] / GiB:.2f}" for k in ("parameters", "optimizer_state", "gradients",
                                               "activations_and_other", "total"))
            + f" GiB of {r['hbm'] / GiB:.1f}: {'fits' if r['fits'] else 'does not fit'}"))
  common.emit(result, lines)


if __name__ == "__main__":
  define_flags()
  errors.run(main)
