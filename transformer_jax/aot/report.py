"""One program compiled for one topology, and what is reported of it per chip: XLA's
memory plan against HBM, FLOPs and bytes, XLA's cost-model estimates, our roofline bound,
and when it does not fit, by how much and what would help."""

from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Any, Callable

import jax

from transformer_jax import sharding
from transformer_jax.accelerators import GiB, compiled_memory
from transformer_jax.aot.hlo_cost import (
  NO_BREAKDOWN,
  collective_bytes,
  kernel_calls,
  op_breakdown,
  unsized_cudnn_workspaces,
)
from transformer_jax.aot.programs import Program, RunSettings
from transformer_jax.aot.roofline import breakdown as families_by_roofline
from transformer_jax.aot.targets import Topology, tracing_for

ESTIMATE_NOTE = ("estimated step time, tokens/s and MFU are XLA's TPU cost-model estimates "
                 "(compiled here, without a TPU), not measurements")
GPU_NOTE = ("XLA's GPU compiler gives no cost analysis: no compiled FLOPs or bytes and no "
            "estimated step time; the roofline is our lower bound from the vendor datasheet's "
            "dense bf16 peak and HBM bandwidth (transformer_jax/accelerators.py), not a "
            "measurement")
TRITON_OFF_NOTE = ("compiled with cuBLAS matmuls (xla_gpu_enable_triton_gemm=false): XLA "
                   "could not tile one for Triton without a GPU to autotune on")
_TRITON_TILING = "Couldn't find output tile sizes"
CUB_SORT_OFF_NOTE = ("compiled with XLA's own sort (xla_gpu_enable_cub_radix_sort=false): a "
                     "large sort (sampling's, over the vocabulary) is CUB's on a GPU, whose "
                     "set-up needs the CUDA runtime this machine lacks; its scratch memory may "
                     "differ")
_NO_CUDA_RUNTIME = "Error loading CUDA libraries"
# What the compile-only GPU compiler cannot do without a GPU, and the option that avoids it:
# {what its error says: (compiler options, the note that says so)}.
_GPU_FALLBACKS = {
    _TRITON_TILING: ({"xla_gpu_enable_triton_gemm": False}, TRITON_OFF_NOTE),
    _NO_CUDA_RUNTIME: ({"xla_gpu_enable_cub_radix_sort": False}, CUB_SORT_OFF_NOTE),
}
CUDNN_WORKSPACE_NOTE = ("cuDNN's attention calls are planned with 0-byte workspaces: cuDNN "
                        "sizes them when XLA builds its graphs on the GPU, so the GPU's own "
                        "compile needs more (benchmarks/train_step.py reports them there)")
ROOFLINE_WITHOUT_COST = ("roofline from the model FLOPs at peak or the arguments and outputs "
                         "at HBM bandwidth (no compiled FLOPs or bytes)")
KERNELS_UNPRICED = ("calls fused kernels ({kernels}) whose work XLA's cost model does not "
                    "price: no estimated step time, and no compiled FLOPs or bytes (they "
                    "would leave the kernels out)")


@dataclasses.dataclass(frozen=True)
class CompileReport:
  """Per chip. Memory is XLA's static plan (donated buffers counted once); `estimated_*`
  are XLA's cost-model estimates (None where it gives none); `roofline_*` our bound: the
  compiled FLOPs at peak, its bytes at HBM bandwidth or the model's FLOPs at peak, whichever
  is slowest."""
  compile_s: float
  argument_bytes: int
  temp_bytes: int
  total_bytes: int
  hbm_bytes: int
  fits: bool
  margin_bytes: int                            # HBM - total: negative when it does not fit
  model_flops: int | None                      # transformer_jax/flops.py, all chips
  compiled_flops_per_chip: float | None
  compiled_bytes_accessed_per_chip: float | None
  xla_optimal_seconds: float | None            # as XLA gave it (negative: no estimate)
  estimated_step_s: float | None = None
  estimated_tokens_per_s_per_chip: float | None = None
  estimated_mfu: float | None = None
  roofline_step_s: float | None = None
  roofline_mfu: float | None = None
  # Absent (None) when the compiler refused the program for its size:
  output_bytes: int | None = None
  alias_bytes: int | None = None
  generated_code_bytes: int | None = None
  xla_error: str | None = None                 # the compiler's refusal
  note: str | None = None                      # how to read this program's figures
  top_ops: list[dict[str, Any]] | None = None  # {"op", "share"} of XLA's estimates
  # Bytes of each collective's results per chip and call, "kind element-type" -> bytes
  # (hlo_cost.collective_bytes); {} for a program without collectives.
  collectives: dict[str, int] | None = None
  # GPU targets: the kernels' time by family, our roofline estimate (aot/roofline.py).
  kernel_families: list[dict[str, Any]] | None = None

  _OPTIONAL = ("output_bytes", "alias_bytes", "generated_code_bytes", "xla_error", "note",
               "top_ops", "collectives", "kernel_families")

  def to_dict(self) -> dict[str, Any]:
    """The JSON form: the optional fields only where present."""
    return {k: v for k, v in dataclasses.asdict(self).items()
            if v is not None or k not in self._OPTIONAL}


# The TPU compiler refuses a program whose buffers exceed HBM; its message gives the
# temporaries it needed.
_OUT_OF_MEMORY = re.compile(r"RESOURCE_EXHAUSTED: Ran out of memory.*?\(([\d.]+[KMGT]?)\)",
                           re.DOTALL)


def _parse_bytes(text: str) -> int:
  scale = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}.get(text[-1], 1)
  return int(float(text.rstrip("KMGT")) * scale)


def argument_bytes(args: Any) -> int:
  """Bytes of one device's shards of abstract arguments (the largest shard of each)."""
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
             for x in jax.tree_util.tree_leaves(args))


def _compile(lowered: Any, notes: list[str]) -> Any:
  """`lowered` compiled, retried with an option of _GPU_FALLBACKS (its note added) where
  the GPU compiler fails for want of a GPU: with no GPU to autotune on it can fail to tile
  a small matmul for Triton (cuBLAS then does the matmuls, as XLA falls back to on a GPU),
  and without the CUDA runtime it cannot set up CUB's sort."""
  options: dict[str, Any] = {}
  while True:
    try:
      return lowered.compile(compiler_options=options) if options else lowered.compile()
    except jax.errors.JaxRuntimeError as e:
      fallback = next((f for marker, f in _GPU_FALLBACKS.items()
                       if marker in str(e) and not f[0].items() <= options.items()), None)
      if fallback is None:
        raise
      options.update(fallback[0])
      notes.append(fallback[1])


def compile_program(program: Program, topology: Topology, mesh: jax.sharding.Mesh,
                    top_ops: int = 0) -> CompileReport:
  """Compiles `program` and reports per chip: memory, fits, FLOPs, bytes and XLA's
  estimates; with `top_ops`, also the operations XLA estimates to take the most time
  (`hlo_cost.op_breakdown`)."""
  start = time.perf_counter()
  hbm = topology.chip.hbm_bytes
  with tracing_for(topology):
    lowered = program.fn.lower(*program.args)
  notes: list[str] = []
  try:
    compiled = _compile(lowered, notes)
  except jax.errors.JaxRuntimeError as e:
    oom = _OUT_OF_MEMORY.search(str(e))
    if not oom:
      raise
    args = argument_bytes(program.args)
    total = args + _parse_bytes(oom.group(1))
    return CompileReport(
        compile_s=time.perf_counter() - start, argument_bytes=args, temp_bytes=total - args,
        total_bytes=total, hbm_bytes=hbm, fits=False, margin_bytes=hbm - total,
        model_flops=program.model_flops, compiled_flops_per_chip=None,
        compiled_bytes_accessed_per_chip=None, xla_optimal_seconds=None,
        xla_error=str(e).strip().splitlines()[0])
  compile_s = time.perf_counter() - start
  memory: dict[str, Any] = compiled_memory(compiled) or {"argument_bytes": 0, "temp_bytes": 0,
                                         "total_bytes": 0}
  cost = compiled.cost_analysis() or {}
  if isinstance(cost, (list, tuple)):      # Older JAX: one dict per executable.
    cost = cost[0] if cost else {}
  # libtpu 0.0.42 estimates only some generations (v5p here); elsewhere optimal_seconds
  # comes back negative, which is no estimate: kept raw in the JSON, reported as none.
  raw_seconds = cost.get("optimal_seconds")
  seconds = float(raw_seconds) if raw_seconds and raw_seconds > 0 else None
  # The optimized module: megabytes of text for the WMT14 models, parsed in about a second.
  hlo_text = compiled.as_text()
  kernels = kernel_calls(hlo_text)
  gpu = topology.chip.platform == "cuda"
  if gpu and unsized_cudnn_workspaces(hlo_text):
    notes.append(CUDNN_WORKSPACE_NOTE)
  if kernels:     # A step time without the kernels' work would be too fast, not an estimate.
    seconds = None
    notes.append(KERNELS_UNPRICED.format(kernels=", ".join(
        f"{n}x {target}" for target, n in sorted(kernels.items()))))
  breakdown = op_breakdown(hlo_text) if seconds is not None or top_ops else NO_BREAKDOWN
  loop_factor = breakdown.loop_factor if seconds is not None else None
  if loop_factor and seconds is not None:
    # cost_analysis() counts a loop body once: a step that scans its layers
    # (model.scan_layers) or its micro-batches (grad_accum_steps) would be estimated at a
    # fraction of its time. XLA's per-instruction estimates, each loop body counted per
    # iteration, give the factor.
    seconds *= loop_factor
    notes.append(f"XLA's step estimate is scaled by its per-instruction estimates "
                 f"(x{loop_factor:.2f}) to count each iteration of the step's loops "
                 "(scan_layers, grad_accum_steps); its FLOPs and bytes count each loop body "
                 "once")
  elif program.name == "decode":
    # A while loop: XLA's cost analysis counts its body once (one decoding step, plus the
    # encoder and the cache set-up), so its FLOPs and time are not a whole decode.
    notes.append("cost counts the decoding loop body once")
  chip, chips = topology.chip, mesh.size
  if cost and not kernels:
    flops, bytes_accessed = float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))
    # Not XLA's estimate: the compiled program's FLOPs at peak or its bytes at HBM bandwidth,
    # whichever takes longer; a lower bound on the step time that every generation gets.
    # Its cost counts a loop body (scanned layers, micro-batches) once, so the model's own
    # FLOPs at peak bound it too: the roofline MFU never passes 100%.
    roofline = max(flops / chip.peak_flops, bytes_accessed / chip.hbm_bandwidth,
                   (program.model_flops or 0) / chips / chip.peak_flops) or None
  else:
    # No cost analysis (XLA's GPU compiler gives none), or one blind to the kernels: the
    # bound from what must happen at least once per call, the model's FLOPs at peak, or
    # reading the arguments and writing the outputs at HBM bandwidth.
    flops, bytes_accessed = None, None
    least_bytes = memory["argument_bytes"] + memory.get("output_bytes", 0)
    roofline = max((program.model_flops or 0) / chips / chip.peak_flops,
                   least_bytes / chip.hbm_bandwidth) or None
    notes.append(ROOFLINE_WITHOUT_COST)
  mfu = lambda s: program.model_flops / (s * chips * chip.peak_flops)
  return CompileReport(
      compile_s=compile_s, **memory, hbm_bytes=hbm, fits=memory["total_bytes"] <= hbm,
      margin_bytes=hbm - memory["total_bytes"], model_flops=program.model_flops,
      compiled_flops_per_chip=flops, compiled_bytes_accessed_per_chip=bytes_accessed,
      xla_optimal_seconds=raw_seconds, estimated_step_s=seconds,
      estimated_tokens_per_s_per_chip=(program.tokens / seconds / chips
                                       if seconds and program.tokens else None),
      estimated_mfu=mfu(seconds) if seconds and program.model_flops else None,
      roofline_step_s=roofline,
      roofline_mfu=mfu(roofline) if roofline and program.model_flops else None,
      note="; ".join(notes) or None,
      top_ops=([{"op": op, "share": cycles / breakdown.total_cycles}
                for op, cycles in breakdown.ops[:top_ops]]
               if top_ops and breakdown.total_cycles else None),
      collectives=collective_bytes(hlo_text),
      kernel_families=([f.to_dict() for f in families_by_roofline(
          hlo_text, chip.peak_flops, chip.hbm_bandwidth)] if gpu else None))


def _gib(n: float | None) -> str:
  return "-" if n is None else f"{n / GiB:.2f}"


def _or_dash(value: float | None, fmt: Callable[[float], str]) -> str:
  return "-" if value is None else fmt(value)


# (row label, how a report's value is shown) in the order of the table.
_ROWS: list[tuple[str, Callable[[CompileReport], str]]] = [
    ("compile time (s)", lambda r: f"{r.compile_s:.1f}"),
    ("arguments (GiB/chip)", lambda r: _gib(r.argument_bytes)),
    ("outputs (GiB/chip)", lambda r: _gib(r.output_bytes)),
    ("donated, counted once (GiB/chip)", lambda r: _gib(r.alias_bytes)),
    ("temporaries (GiB/chip)", lambda r: _gib(r.temp_bytes)),
    ("generated code (GiB/chip)", lambda r: _gib(r.generated_code_bytes)),
    ("total (GiB/chip)", lambda r: _gib(r.total_bytes)),
    ("HBM (GiB/chip)", lambda r: _gib(r.hbm_bytes)),
    ("fits", lambda r: ("yes" if r.fits else "NO") + f" ({r.margin_bytes / GiB:+.2f} GiB)"),
    ("model FLOPs/step (TFLOP, all chips)",
     lambda r: _or_dash(r.model_flops, lambda v: f"{v / 1e12:.2f}")),
    ("compiled FLOPs (TFLOP/chip)",
     lambda r: _or_dash(r.compiled_flops_per_chip, lambda v: f"{v / 1e12:.3f}")),
    ("compiled bytes accessed (GiB/chip)", lambda r: _gib(r.compiled_bytes_accessed_per_chip)),
    ("est. step time (ms) [XLA cost model]",
     lambda r: _or_dash(r.estimated_step_s, lambda v: f"{1e3 * v:.2f}")),
    ("est. tokens/s/chip [XLA cost model]",
     lambda r: _or_dash(r.estimated_tokens_per_s_per_chip, lambda v: f"{v:,.0f}")),
    ("est. MFU [XLA cost model]", lambda r: _or_dash(r.estimated_mfu, lambda v: f"{100 * v:.1f}%")),
    ("roofline step time (ms) [lower bound]",
     lambda r: _or_dash(r.roofline_step_s, lambda v: f"{1e3 * v:.2f}")),
    ("roofline MFU [upper bound]", lambda r: _or_dash(r.roofline_mfu, lambda v: f"{100 * v:.1f}%")),
]


def format_report(header: str, results: dict[str, CompileReport],
                  note: str = ESTIMATE_NOTE) -> str:
  """A table, one column per program, then its notes (`note`: how to read the estimates)."""
  names = list(results)
  rows = [(label, [show(results[n]) for n in names]) for label, show in _ROWS]
  width = max(len(label) for label, _ in rows)
  cols = [max(len(n), *(len(v[i]) for _, v in rows)) for i, n in enumerate(names)]
  lines = [header, f"{'':<{width}}  " + "  ".join(f"{n:>{c}}" for n, c in zip(names, cols))]
  lines += [f"{label:<{width}}  " + "  ".join(f"{v:>{c}}" for v, c in zip(values, cols))
            for label, values in rows]
  for n in names:
    if results[n].top_ops:
      lines.append(f"{n}: the operations XLA's cost model estimates to take the most time "
                   "(share of its per-instruction estimates, all layers together)")
      lines += [f"  {100 * t['share']:5.1f}%  {t['op']}" for t in results[n].top_ops or []]
  for n in names:
    families = results[n].kernel_families
    if families:
      total = sum(f["estimated_ms"] for f in families)
      lines.append(f"{n}: kernel time by family [our roofline estimate, not a measurement: "
                   f"each kernel's bytes at HBM bandwidth or FLOPs at peak; {total:.1f} ms]")
      lines += [f"  {f['estimated_ms']:7.2f} ms {100 * f['estimated_ms'] / total:5.1f}%  "
                f"{f['kernels']:5d} kernels  {f['family']}" for f in families]
  for n in names:
    collectives = results[n].collectives
    if collectives:
      moved = ", ".join(f"{kind} {size / 2**20:.1f}" for kind, size in collectives.items())
      lines.append(f"{n}: collectives per chip and call (MiB of results, by element type): {moved}")
  lines.append(f"note: {note} ('-': XLA gave no estimate for this chip); roofline: "
               "the compiled FLOPs at peak, bytes at HBM bandwidth or model FLOPs at peak, "
               "whichever is slowest "
               "(our bound, not XLA's; another basis is named below); model FLOPs: "
               "transformer_jax/flops.py; tokens: source + target array tokens (a language "
               "model's: its sequence's; padding included).")
  lines += [f"note: {n}: {results[n].note}" for n in names if results[n].note]
  return "\n".join(lines)


def advice(name: str, report: CompileReport, run: RunSettings, mesh: jax.sharding.Mesh,
           topology: Topology) -> str:
  """One line: by how much `name` does not fit, and what would make it fit."""
  over = -report.margin_bytes
  state, temp = report.argument_bytes, report.temp_bytes
  tips = []
  if name == "train_step":
    replicas = mesh.shape["data"]
    if replicas > 1:   # State is replicated over `data`; fsdp splits it over those chips too.
      saved = state * (1 - 1 / replicas)
      enough = " (enough)" if saved >= over else ""
      tips.append(f"fsdp (--config.mesh.data=1 --config.mesh.fsdp={replicas * mesh.shape['fsdp']}"
                  f" splits the {state / GiB:.1f} GiB/chip of state and batch {replicas} more "
                  f"ways, saving up to {saved / GiB:.1f} GiB{enough})")
    if run.remat_policy == "none" and temp > 0:
      tips.append("remat (--config.model.remat_policy=full recomputes activations instead of "
                  f"keeping them: most of the {temp / GiB:.1f} GiB of temporaries)")
    accum = run.grad_accum_steps * 2
    if run.batch_size % accum == 0 and (run.batch_size // accum) % sharding.batch_ways(mesh) == 0:
      tips.append(f"a smaller batch per step (--config.grad_accum_steps={accum} keeps the batch "
                  "in half-size micro-batches, or lower --config.batch_size)")
    else:
      tips.append("a smaller --config.batch_size")
  else:
    tips.append(f"a smaller evaluation batch (--config.eval.batch_size, now "
                f"{run.eval_batch_size})")
  tips.append(f"more chips (a topology larger than {topology.name})")
  memory = "usable memory" if topology.memory_note else "HBM"
  return (f"does not fit: {name} needs {report.total_bytes / GiB:.2f} GiB per chip, "
          f"{over / GiB:.2f} GiB more than the {topology.chip.hbm_bytes / GiB:.0f} GiB {memory} "
          f"of a {topology.devices[0].device_kind} chip; would help: " + "; ".join(tips))
