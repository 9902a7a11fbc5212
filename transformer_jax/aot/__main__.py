"""The aot command line (see the package's doc): one program report, the largest batch
(--find_max_batch), or every layout (--sweep_layouts)."""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable

from absl import flags

from transformer_jax import errors, sharding
from transformer_jax.accelerators import GiB
from transformer_jax.aot import plan, programs, report, targets

FLAGS = flags.FLAGS


def _define_flags() -> None:
  from ml_collections import config_flags
  config_flags.DEFINE_config_file(
      "config", None, "Config file, as for train.py; fields overridable as --config.a.b=V.",
      lock_config=True)
  flags.DEFINE_string("topology", None, "What to compile for: a TPU slice GEN:SHAPE (v4:2x2x1, "
                      "v5e:2x4, v5p:2x2x1, v5p:4x4x2, v6e:2x4, ...) or N GPUs KIND:N "
                      "(h100-sxm:8, h200:8, a100-80gb:8; pip install -r requirements-gpu.txt).",
                      required=True)
  flags.DEFINE_alias("target", "topology")
  flags.DEFINE_bool("json", False, "Print one JSON object (progress lines go to stderr).")
  flags.DEFINE_string("programs", ",".join(programs.PROGRAMS),
                      "Comma-separated programs to compile.")
  flags.DEFINE_bool("find_max_batch", False, "Find the largest global batch whose train step "
                    "fits, by compiling (bisection).")
  flags.DEFINE_float("batch_tolerance", 0.0, "--find_max_batch stops when the bracket is "
                     "within this fraction of the batch (0: exact, to one step).")
  flags.DEFINE_float("hbm_gib", None, "Judge fitting against this many GiB per chip instead "
                     "of the chip's HBM (headroom).", lower_bound=0.001)
  flags.DEFINE_integer("top_ops", 0, "Also list the N operations that XLA's cost model "
                       "estimates to take the most time in each program.", lower_bound=0)
  flags.DEFINE_bool("sweep_layouts", False, "Compile the train step under every (data, fsdp, "
                    "tensor) layout of the chips and mark the best.")


def _sweep(config: Any, topology: targets.Topology, header: str, summary: dict[str, Any],
           log: Callable[[str], None]) -> int:
  run = programs.run_settings(config)
  log(f"{header}; batch {run.batch_size}; train_step under every layout\n{plan.LAYOUT_HEADER}")
  rows = plan.sweep_layouts(config, topology, log)
  summary["layouts"] = [r.to_dict() for r in rows]
  if FLAGS.json:
    print(json.dumps(summary, default=str))
  best = [r for r in rows if r.best]
  if not best:
    print(f"does not fit: no layout of {len(topology.devices)} chips fits batch "
          f"{run.batch_size} in {topology.chip.hbm_bytes / GiB:.0f} GiB per chip; would help: "
          "remat (--config.model.remat_policy=full), a smaller batch per step "
          "(--config.grad_accum_steps), more chips", file=sys.stderr)
    return 1
  b = best[0]
  log(f"best: --config.mesh.data={b.data} --config.mesh.fsdp={b.fsdp} "
      f"--config.mesh.tensor={b.tensor}")
  return 0


def _max_batch(config: Any, topology: targets.Topology, mesh: Any, header: str,
               summary: dict[str, Any], log: Callable[[str], None]) -> int:
  log(f"{header}; searching the largest global batch of train_step that fits")
  batch, results = plan.find_max_batch(config, topology, mesh, FLAGS.batch_tolerance, log)
  chips = len(topology.devices)
  summary.update(max_batch=batch, max_batch_per_chip=batch / chips,
                 compiles={str(k): v.to_dict() for k, v in sorted(results.items())})
  if FLAGS.json:
    print(json.dumps(summary, default=str))
  if batch == 0:
    smallest = min(results)
    run = programs.run_settings(programs.with_batch(config, smallest))
    print(report.advice("train_step", results[smallest], run, mesh, topology), file=sys.stderr)
    return 1
  fitted = results[batch]
  log(f"largest batch that fits: {batch} rows of {programs.run_settings(config).max_length} "
      f"tokens ({batch / chips:g} per chip), {fitted.total_bytes / GiB:.2f} GiB/chip"
      + (f"; est. step {1e3 * fitted.estimated_step_s:.1f} ms, MFU "
         f"{100 * fitted.estimated_mfu:.1f}% [XLA cost model]" if fitted.estimated_mfu and fitted.estimated_step_s else ""))
  return 0


def _compile_programs(config: Any, topology: targets.Topology, mesh: Any,
                      names: tuple[str, ...], header: str, summary: dict[str, Any]) -> int:
  run = programs.run_settings(config)
  results = {p.name: report.compile_program(p, topology, mesh, top_ops=FLAGS.top_ops)
             for p in programs.build_programs(config, mesh, names)}
  summary["programs"] = {name: r.to_dict() for name, r in results.items()}
  summary["batch_size"] = run.batch_size
  if FLAGS.json:
    print(json.dumps(summary, default=str))
  else:
    print(report.format_report(f"{header}; batch {run.batch_size}", results, summary["note"]))
  unfit = [report.advice(name, r, run, mesh, topology) for name, r in results.items()
           if not r.fits]
  for line in unfit:
    print(line, file=sys.stderr)
  return 1 if unfit else 0


def main(argv: list[str]) -> int:
  # Compile-only: the local backend is the CPU one, whatever accelerator plugins are
  # installed (set before anything starts a backend).
  import jax
  from absl import logging
  from ml_collections import config_flags
  jax.config.update("jax_platforms", os.environ.get("JAX_PLATFORMS") or "cpu")
  logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    raise targets.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  config = FLAGS.config
  config_path = config_flags.get_config_filename(FLAGS["config"])
  names = tuple(n for n in FLAGS.programs.split(",") if n)
  unknown = [n for n in names if n not in programs.PROGRAMS]
  if unknown:
    raise targets.UsageError(f"--programs: unknown {unknown}; choose from {programs.PROGRAMS}")
  log = ((lambda s: print(s, file=sys.stderr, flush=True)) if FLAGS.json
         else (lambda s: print(s, flush=True)))
  topology = targets.describe(FLAGS.topology,
                              "--target" if FLAGS["target"].present else "--topology")
  if FLAGS.hbm_gib:
    topology = targets.with_hbm(topology, FLAGS.hbm_gib)
  with targets.tracing_for(topology):
    return _plan(config, config_path, names, topology, log)


def _plan(config: Any, config_path: str, names: tuple[str, ...], topology: targets.Topology,
          log: Callable[[str], None]) -> int:
  run = programs.run_settings(config)
  chips, chip = len(topology.devices), topology.chip
  mesh = sharding.make_mesh(run.mesh, topology.devices)
  model_cfg = programs.experiment_for(config, mesh).model_config
  memory = (f"{chip.hbm_bytes / GiB:.1f} GiB usable: {topology.memory_note}"
            if topology.memory_note and not FLAGS.hbm_gib else f"{chip.hbm_bytes / GiB:.0f} GiB HBM")
  header = (f"{config_path} on {topology.name}: {chips} x {topology.devices[0].device_kind} "
            f"({memory}, {chip.peak_flops / 1e12:.0f} TFLOP/s dense bf16 peak per chip); "
            f"vocab {model_cfg.tgt_vocab_size}; dtype {model_cfg.dtype}")
  summary: dict[str, Any] = {"config": config_path, "topology": topology.name,
                             "chips": chips, "chip": chip.to_dict(),
                             "vocab_size": model_cfg.tgt_vocab_size, "dtype": model_cfg.dtype,
                             "note": (report.ESTIMATE_NOTE if chip.platform == "tpu"
                                      else report.GPU_NOTE)}
  if topology.memory_note:
    summary["memory_note"] = topology.memory_note
  if FLAGS.sweep_layouts:
    return _sweep(config, topology, header, summary, log)
  header += f"; mesh {dict(mesh.shape)}"
  summary["mesh"] = dict(mesh.shape)
  if FLAGS.find_max_batch:
    return _max_batch(config, topology, mesh, header, summary, log)
  return _compile_programs(config, topology, mesh, names, header, summary)


if __name__ == "__main__":
  _define_flags()
  errors.run(main)
