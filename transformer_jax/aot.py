"""Compile the real training programs for a Cloud TPU topology, here, without a TPU.

  python -m transformer_jax.aot --config=configs/wmt14_ende_big.py --topology=v5p:2x2x2 \
      [--config.mesh.fsdp=-1 --config.mesh.data=1 ...] [--json] [--find_max_batch]
      [--sweep_layouts] [--programs=train_step,eval_step,decode]

libtpu (requirements-tpu.txt) describes a TPU slice by name ("v5p:2x2x2": TPU v5p chips in a
2x2x2 torus) as compile-only devices. The train step, the eval step and the beam-search
decode are built by the same code as in `train.py` (task, optimizer, state and shardings, on
a mesh of those devices), given `jax.ShapeDtypeStruct`s instead of arrays, and compiled by
XLA for the TPU: nothing is allocated, no data is read, no tokenizer is trained (the
vocabulary size comes from the config). Reported per chip: XLA's memory plan against the
chip's HBM; the compiled FLOPs and bytes; and from XLA's TPU cost model an estimated step
time, tokens/s and MFU. Those three are estimates of XLA's cost model, not measurements.

Exit status: 0 when every program fits in HBM, 1 when one does not (one line says by how
much and what would help), 2 for a usage error (unknown topology, bad mesh or config).
"""

from __future__ import annotations

import os

# Compile-only use of libtpu: another process (a test run, a trainer) may hold libtpu's
# single-user lockfile; this process never opens a TPU, so it need not take it. The local
# backend is the CPU one. Both are read when libtpu/JAX start, hence before importing jax.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import contextlib  # noqa: E402
import copy  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_collections  # noqa: E402

from transformer_jax import decoding, errors, sharding  # noqa: E402
from transformer_jax.errors import UserError  # noqa: E402
from transformer_jax.accelerators import GiB, TPU_CHIPS, TpuChip, compiled_memory  # noqa: E402
from transformer_jax.config import TransformerConfig  # noqa: E402
from transformer_jax.flops import model_flops  # noqa: E402
from transformer_jax.data.synthetic import SyntheticData  # noqa: E402
from transformer_jax.training.experiment import Experiment  # noqa: E402

PROGRAMS = ("train_step", "eval_step", "decode")
ESTIMATE_NOTE = ("estimated step time, tokens/s and MFU are XLA's TPU cost-model estimates "
                 "(compiled here, without a TPU), not measurements")


class UsageError(UserError):
  """A topology, mesh or config that cannot be compiled as asked (exit status 2)."""


# ---------------------------------------------------------------------------- topology
@contextlib.contextmanager
def _quiet_stderr():
  """libtpu, loading on a machine without a TPU, logs warnings about the missing TPU VM
  metadata straight to file descriptor 2; they do not concern compile-only use. Errors
  still arrive as Python exceptions."""
  sys.stderr.flush()
  saved = os.dup(2)
  try:
    with open(os.devnull, "w") as devnull:
      os.dup2(devnull.fileno(), 2)
      yield
  finally:
    os.dup2(saved, 2)
    os.close(saved)


@dataclasses.dataclass(frozen=True)
class Topology:
  name: str                     # as given, e.g. "v5p:2x2x2"
  chip: TpuChip
  devices: tuple                # compile-only jax devices, one per chip


def tpu_topology(name: str) -> Topology:
  """The compile-only devices of a TPU slice named "GEN:AxB[xC]" (GEN in v4, v5e, v5p,
  v6e). One device per chip: v4 as megacore (its two TensorCores as one device, as a v4
  runtime runs by default); v5p is megacore already; v5e and v6e have one core."""
  generation = name.split(":")[0]
  if generation not in TPU_CHIPS or ":" not in name:
    raise UsageError(f"--topology={name!r}: expected GEN:SHAPE with GEN one of "
                     f"{sorted(TPU_CHIPS)}, e.g. v5p:2x2x2 (8 chips) or v5e:2x4")
  from jax.experimental import topologies
  kwargs = {"chip_config_name": "megacore"} if generation == "v4" else {}
  try:
    with _quiet_stderr():
      devices = topologies.get_topology_desc(topology_name=name, platform="tpu",
                                             **kwargs).devices
  except Exception as e:  # libtpu's messages are several lines; its first one says why.
    detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise UsageError(f"--topology={name!r}: libtpu cannot describe it ({detail}); is "
                     "jax[tpu] installed (pip install -r requirements-tpu.txt), and is the "
                     "shape one that generation has, e.g. v5e:2x4, v5p:2x2x2?") from None
  chip = TPU_CHIPS[generation]
  found = devices[0].device_kind
  if found != chip.device_kind:
    raise UsageError(f"--topology={name!r} gave {found!r} devices, not {chip.device_kind!r}")
  return Topology(name, chip, tuple(devices))


def with_hbm(topology: Topology, hbm_gib: float) -> Topology:
  """The topology judged against `hbm_gib` per chip instead of the chip's whole HBM (to keep
  headroom, e.g. for XLA's own reservations or a profiler)."""
  chip = copy.copy(topology.chip)
  chip.hbm_bytes = int(hbm_gib * GiB)
  return dataclasses.replace(topology, chip=chip)


# ---------------------------------------------------------------------------- programs
@dataclasses.dataclass(frozen=True)
class Program:
  """One jitted function of a training run and abstract arguments to compile it for;
  `model_flops` (the project's formula, all chips) and `tokens` (array tokens, padding
  included) per call, None where the formula does not apply (decoding)."""
  name: str
  fn: Callable
  args: tuple
  model_flops: int | None
  tokens: int | None


def vocab_size_of(config: ml_collections.ConfigDict) -> int:
  """The vocabulary size a run would get, without reading data or training a tokenizer:
  the synthetic task's fixed symbols, or the SentencePiece size in the config."""
  data = config.data
  if data.source == "synthetic":
    from transformer_jax.data.synthetic import make_vocab
    return make_vocab().vocab_size
  if data.get("tokenizer", "sentencepiece") != "sentencepiece":
    raise UsageError(f"data.tokenizer={data.tokenizer!r}: its vocabulary size is known only "
                     "after reading the data; aot needs a SentencePiece or synthetic config")
  return int(data.vocab_size)


def _training_widths(config: ml_collections.ConfigDict) -> tuple[int, int]:
  """(source, target) widths of the training batches the data group gives."""
  data = config.data
  if data.source == "synthetic":
    return SyntheticData.widths(data.synthetic_task, data.max_length)
  return data.max_length, data.max_length        # packed rows (data/pipeline.py)


def _batch(experiment: Experiment, rows: int, src_len: int,
           tgt_len: int) -> dict[str, jax.ShapeDtypeStruct]:
  """The batch the run feeds, `rows` rows (source `src_len`, target `tgt_len` tokens wide),
  batch-sharded on the experiment's mesh: the task's packed-batch keys, or the synthetic
  data's own (unpacked: no positions or segment ids)."""
  spec = sharding.batch_sharding(experiment.mesh)
  keys = experiment.task.batch_spec(rows, max(src_len, tgt_len))
  if experiment.options.data.synthetic:
    keys = {k: v for k, v in keys.items() if k in SyntheticData.BATCH_KEYS}
  width = lambda k: src_len if k.startswith("src") else tgt_len
  return {k: jax.ShapeDtypeStruct((rows, width(k)), v.dtype, sharding=spec)
          for k, v in keys.items()}


def experiment_for(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh,
                   vocab_size: int) -> Experiment:
  """The run's setup as train.py builds it, on `mesh`, without reading any data."""
  separate = None if config.data.get("shared_vocab", True) else vocab_size
  experiment = Experiment.create(config, data=False, vocab_sizes=(vocab_size, separate),
                                 mesh=mesh)
  if not experiment.task.has_target_text:
    raise UsageError(f"task={config.task!r}: aot compiles translation (seq2seq) configs")
  return experiment


def build_programs(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh,
                   vocab_size: int, names: tuple[str, ...] = PROGRAMS) -> list[Program]:
  """The jitted programs of a training run (train.py) with abstract, sharded arguments:
  the train step on a `batch_size` x `data.max_length` batch with the donated, sharded
  state; the eval step on the longest evaluation bucket; beam search as evaluation runs it
  (parameters in their training layout, the source rows as a host array: replicated). All
  three come from the run's Experiment, as in train.py."""
  experiment = experiment_for(config, mesh, vocab_size)
  model_cfg = experiment.model_config
  state, state_sharding = experiment.abstract_state()
  src_len, tgt_len = _training_widths(config)
  programs = []
  if "train_step" in names:
    rows = config.batch_size
    programs.append(Program("train_step", experiment.train_step(state_sharding),
                            (state, _batch(experiment, rows, src_len, tgt_len)),
                            model_flops(model_cfg, rows, src_len, tgt_len)["total"],
                            rows * (src_len + tgt_len)))
  eval_len = config.data.get("eval_max_length", None)
  eval_src, eval_tgt = (src_len, tgt_len) if eval_len is None else (eval_len, eval_len)
  # Evaluation pads its batches with empty rows to a multiple of data*fsdp (loop.py).
  ways = sharding.batch_ways(mesh)
  eval_rows = -(-experiment.eval.batch_size // ways) * ways
  if "eval_step" in names:
    programs.append(Program("eval_step", experiment.eval_step(state_sharding.params),
                            (state.params, _batch(experiment, eval_rows, eval_src, eval_tgt)),
                            model_flops(model_cfg, eval_rows, eval_src, eval_tgt,
                                        training=False)["total"],
                            eval_rows * (eval_src + eval_tgt)))
  if "decode" in names:
    decode = experiment.decode
    max_length = min(eval_tgt + decode.max_extra_length, model_cfg.max_len)
    fn = decoding.compiled_search(model_cfg, decode.beam_size, decode.alpha, max_length)
    src = jax.ShapeDtypeStruct((experiment.eval.batch_size, eval_src), jnp.int32,
                               sharding=sharding.replicated(mesh))
    programs.append(Program("decode", fn, (state.params, src), None, None))
  return programs


# ----------------------------------------------------------- where the estimated time goes
_COMPUTATION = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%?[\w.\-]+ = .*? ([a-z][\w\-]*)\((.*)$")
_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_WHILE = re.compile(r"condition=%?([\w.\-]+), body=%?([\w.\-]+)")
_LOOP_BOUND = re.compile(r"^\s+%?[\w.\-]+ = s32\[\]\S* constant\((\d+)\)")


@dataclasses.dataclass(frozen=True)
class OpBreakdown:
  """XLA's per-instruction cost-model estimates of one compiled program."""
  total_cycles: int                  # every loop body counted once per iteration
  once_cycles: int                   # every loop body counted once, as cost_analysis() does
  ops: list[tuple[str, int]]         # (source operation, cycles), largest first
  unknown_loops: int                 # loops whose trip count could not be read


def _trip_count(condition: list[str]) -> int | None:
  """Iterations of a counted loop (scan, fori_loop): its condition is `i < N` for a
  constant N, the counter starting at 0. None for any other condition."""
  bounds = [m.group(1) for m in map(_LOOP_BOUND.match, condition) if m]
  root = [line for line in condition if line.lstrip().startswith("ROOT ")]
  if len(bounds) == 1 and root and " compare(" in root[0] and "direction=LT" in root[0]:
    return int(bounds[0])
  return None


def op_breakdown(hlo_text: str) -> OpBreakdown:
  """XLA's TPU cost model per instruction, summed by source operation: every top-level
  instruction of the optimized module carries its estimate (`estimated_cycles` in its
  backend config), and a loop's body counts once per iteration. Instructions are grouped
  by their `op_name` metadata with layer indices merged (layer_3 -> layer_N), so
  "encoder/layer_N/feed_forward/wi/dot_general" is that matmul in every layer."""
  computations: dict[str, list[str]] = {}
  entry = current = None
  for line in hlo_text.splitlines():
    header = _COMPUTATION.match(line)
    if header:
      current = header.group(2)
      computations[current] = []
      entry = current if header.group(1) else entry
    elif current is not None and line.startswith("  "):
      computations[current].append(line)
  groups: dict[str, int] = {}
  once, unknown = 0, 0

  def add(name: str, times: int) -> None:
    nonlocal once, unknown
    for line in computations.get(name, []):
      instruction = _INSTRUCTION.match(line)
      if not instruction:
        continue
      opcode, rest = instruction.groups()
      loop = _WHILE.search(rest) if opcode == "while" else None
      if loop:
        trips = _trip_count(computations.get(loop.group(1), []))
        unknown += trips is None
        add(loop.group(2), times * (trips or 1))
        continue
      cycles = _CYCLES.search(rest)
      if cycles:
        op = _OP_NAME.search(rest)
        key = re.sub(r"layer_\d+", "layer_N", op.group(1) if op else opcode)
        key = re.sub(r"^jit\([^)]*\)/", "", key)
        groups[key] = groups.get(key, 0) + int(cycles.group(1)) * times
        once += int(cycles.group(1))

  if entry is not None:
    add(entry, 1)
  ranked = sorted(groups.items(), key=lambda kv: -kv[1])
  return OpBreakdown(sum(groups.values()), once, ranked, unknown)


# ------------------------------------------------------------------------------ report
def compile_program(program: Program, topology: Topology, mesh: jax.sharding.Mesh,
                    model_cfg: TransformerConfig | None = None,
                    top_ops: int = 0) -> dict[str, Any]:
  """Compiles `program` and reports per chip: memory, fits, FLOPs, bytes and XLA's
  estimates; with `top_ops`, also the operations XLA estimates to take the most time
  (`op_breakdown`)."""
  start = time.perf_counter()
  try:
    compiled = program.fn.lower(*program.args).compile()
  except jax.errors.JaxRuntimeError as e:
    # The TPU compiler refuses a program whose buffers exceed HBM; its message gives the
    # temporaries it needed and the HBM it had.
    oom = _OUT_OF_MEMORY.search(str(e))
    if not oom:
      raise
    args = _argument_bytes(program.args)
    total = args + _parse_bytes(oom.group(1))
    hbm = topology.chip.hbm_bytes
    return {"compile_s": time.perf_counter() - start, "argument_bytes": args,
            "temp_bytes": total - args, "total_bytes": total, "hbm_bytes": hbm, "fits": False,
            "margin_bytes": hbm - total, "xla_error": str(e).strip().splitlines()[0],
            "model_flops": program.model_flops, "compiled_flops_per_chip": None,
            "compiled_bytes_accessed_per_chip": None, "xla_optimal_seconds": None,
            "estimated_step_s": None, "estimated_tokens_per_s_per_chip": None,
            "estimated_mfu": None, "roofline_step_s": None, "roofline_mfu": None}
  compile_s = time.perf_counter() - start
  memory = compiled_memory(compiled) or {}
  cost = compiled.cost_analysis() or {}
  if isinstance(cost, (list, tuple)):      # Older JAX: one dict per executable.
    cost = cost[0] if cost else {}
  chips = mesh.size
  hbm = topology.chip.hbm_bytes
  total = memory.get("total_bytes", 0)
  # libtpu 0.0.42 estimates only some generations (v5p here); elsewhere optimal_seconds
  # comes back negative, which is no estimate: kept raw in the JSON, reported as none.
  raw_seconds = cost.get("optimal_seconds")
  seconds = float(raw_seconds) if raw_seconds and raw_seconds > 0 else None
  # Parsing the optimized module (megabytes of text for the WMT14 models) is needed only to
  # correct an estimate or to rank operations.
  breakdown = (op_breakdown(compiled.as_text()) if seconds is not None or top_ops
               else OpBreakdown(0, 0, [], 0))
  loops_counted = (seconds is not None and breakdown.unknown_loops == 0
                   and 0 < breakdown.once_cycles < breakdown.total_cycles)
  if loops_counted:
    # cost_analysis() counts a loop body once: a step that scans its layers
    # (model.scan_layers) or its micro-batches (grad_accum_steps) would be estimated at a
    # fraction of its time. XLA's per-instruction estimates, each loop body counted per
    # iteration, give the factor.
    seconds *= breakdown.total_cycles / breakdown.once_cycles
  flops, bytes_accessed = float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))
  chip = topology.chip
  # Not XLA's estimate: the compiled program's FLOPs at peak or its bytes at HBM bandwidth,
  # whichever takes longer; a lower bound on the step time that every generation gets.
  roofline = max(flops / chip.peak_flops, bytes_accessed / chip.hbm_bandwidth) or None
  result: dict[str, Any] = {
      "compile_s": compile_s, **memory, "hbm_bytes": hbm, "fits": total <= hbm,
      "margin_bytes": hbm - total,
      "model_flops": program.model_flops,
      "compiled_flops_per_chip": flops, "compiled_bytes_accessed_per_chip": bytes_accessed,
      "xla_optimal_seconds": raw_seconds, "estimated_step_s": seconds,
      "estimated_tokens_per_s_per_chip": None, "estimated_mfu": None,
      "roofline_step_s": roofline, "roofline_mfu": None,
  }
  if roofline and program.model_flops:
    result["roofline_mfu"] = program.model_flops / (roofline * chips * chip.peak_flops)
  if seconds and program.tokens:
    result["estimated_tokens_per_s_per_chip"] = program.tokens / seconds / chips
  if seconds and program.model_flops:
    result["estimated_mfu"] = program.model_flops / (seconds * chips * chip.peak_flops)
  if loops_counted:
    result["note"] = ("XLA's step estimate is scaled by its per-instruction estimates "
                      f"(x{breakdown.total_cycles / breakdown.once_cycles:.2f}) to count each "
                      "iteration of the step's loops (scan_layers, grad_accum_steps); its "
                      "FLOPs and bytes count each loop body once")
  if top_ops and breakdown.total_cycles:
    result["top_ops"] = [{"op": op, "share": cycles / breakdown.total_cycles}
                         for op, cycles in breakdown.ops[:top_ops]]
  if program.name == "decode" and not loops_counted:
    # A while loop: XLA's cost analysis counts its body once (one decoding step, plus the
    # encoder and the cache set-up), so its FLOPs and time are not a whole decode.
    result["note"] = "cost counts the decoding loop body once"
  return result


_OUT_OF_MEMORY = re.compile(r"RESOURCE_EXHAUSTED: Ran out of memory.*?\(([\d.]+[KMGT]?)\)",
                           re.DOTALL)


def _parse_bytes(text: str) -> int:
  scale = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}.get(text[-1], 1)
  return int(float(text.rstrip("KMGT")) * scale)


def _argument_bytes(args: Any) -> int:
  """Bytes of one device's shards of abstract arguments (the largest shard of each)."""
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
             for x in jax.tree_util.tree_leaves(args))


def _gib(n: float | None) -> str:
  return "-" if n is None else f"{n / GiB:.2f}"


def format_report(header: str, results: dict[str, dict[str, Any]]) -> str:
  names = list(results)
  rows: list[tuple[str, list[str]]] = []

  def row(label: str, fmt: Callable[[dict[str, Any]], str]) -> None:
    rows.append((label, [fmt(results[n]) for n in names]))

  row("compile time (s)", lambda r: f"{r['compile_s']:.1f}")
  row("arguments (GiB/chip)", lambda r: _gib(r.get("argument_bytes")))
  row("outputs (GiB/chip)", lambda r: _gib(r.get("output_bytes")))
  row("donated, counted once (GiB/chip)", lambda r: _gib(r.get("alias_bytes")))
  row("temporaries (GiB/chip)", lambda r: _gib(r.get("temp_bytes")))
  row("generated code (GiB/chip)", lambda r: _gib(r.get("generated_code_bytes")))
  row("total (GiB/chip)", lambda r: _gib(r.get("total_bytes")))
  row("HBM (GiB/chip)", lambda r: _gib(r["hbm_bytes"]))
  row("fits", lambda r: ("yes" if r["fits"] else "NO") + f" ({r['margin_bytes'] / GiB:+.2f} GiB)")
  row("model FLOPs/step (TFLOP, all chips)",
      lambda r: "-" if r["model_flops"] is None else f"{r['model_flops'] / 1e12:.2f}")
  row("compiled FLOPs (TFLOP/chip)", lambda r: "-" if r["compiled_flops_per_chip"] is None
      else f"{r['compiled_flops_per_chip'] / 1e12:.3f}")
  row("compiled bytes accessed (GiB/chip)",
      lambda r: _gib(r["compiled_bytes_accessed_per_chip"]))
  row("est. step time (ms) [XLA cost model]",
      lambda r: "-" if r["estimated_step_s"] is None else f"{1e3 * r['estimated_step_s']:.2f}")
  row("est. tokens/s/chip [XLA cost model]",
      lambda r: ("-" if r["estimated_tokens_per_s_per_chip"] is None
                 else f"{r['estimated_tokens_per_s_per_chip']:,.0f}"))
  row("est. MFU [XLA cost model]",
      lambda r: "-" if r["estimated_mfu"] is None else f"{100 * r['estimated_mfu']:.1f}%")
  row("roofline step time (ms) [lower bound]",
      lambda r: "-" if r["roofline_step_s"] is None else f"{1e3 * r['roofline_step_s']:.2f}")
  row("roofline MFU [upper bound]",
      lambda r: "-" if r["roofline_mfu"] is None else f"{100 * r['roofline_mfu']:.1f}%")
  width = max(len(label) for label, _ in rows)
  cols = [max(len(n), *(len(v[i]) for _, v in rows)) for i, n in enumerate(names)]
  lines = [header, f"{'':<{width}}  " + "  ".join(f"{n:>{c}}" for n, c in zip(names, cols))]
  lines += [f"{label:<{width}}  " + "  ".join(f"{v:>{c}}" for v, c in zip(values, cols))
            for label, values in rows]
  for n in names:
    if results[n].get("top_ops"):
      lines.append(f"{n}: the operations XLA's cost model estimates to take the most time "
                   "(share of its per-instruction estimates, all layers together)")
      lines += [f"  {100 * t['share']:5.1f}%  {t['op']}" for t in results[n]["top_ops"]]
  notes = [f"{n}: {results[n]['note']}" for n in names if "note" in results[n]]
  lines += [f"note: {ESTIMATE_NOTE} ('-': XLA gave no estimate for this chip); roofline: "
            "the compiled FLOPs at peak or bytes at HBM bandwidth, whichever is slower (our "
            "bound, not XLA's); model FLOPs: transformer_jax/flops.py; tokens: source + "
            "target array tokens (padding included)."] + [f"note: {n}" for n in notes]
  return "\n".join(lines)


def advice(name: str, result: dict[str, Any], config: ml_collections.ConfigDict,
           mesh: jax.sharding.Mesh, topology: Topology) -> str:
  """One line: by how much `name` does not fit, and what would make it fit."""
  over = -result["margin_bytes"]
  state, temp = result.get("argument_bytes", 0), result.get("temp_bytes", 0)
  tips = []
  if name == "train_step":
    replicas = mesh.shape["data"]
    if replicas > 1:   # State is replicated over `data`; fsdp splits it over those chips too.
      saved = state * (1 - 1 / replicas)
      enough = " (enough)" if saved >= over else ""
      tips.append(f"fsdp (--config.mesh.data=1 --config.mesh.fsdp={replicas * mesh.shape['fsdp']}"
                  f" splits the {state / GiB:.1f} GiB/chip of state and batch {replicas} more "
                  f"ways, saving up to {saved / GiB:.1f} GiB{enough})")
    if config.model.remat_policy == "none" and temp > 0:
      tips.append("remat (--config.model.remat_policy=full recomputes activations instead of "
                  f"keeping them: most of the {temp / GiB:.1f} GiB of temporaries)")
    accum = config.grad_accum_steps * 2
    if (config.batch_size // accum) % sharding.batch_ways(mesh) == 0 and config.batch_size % accum == 0:
      tips.append(f"a smaller batch per step (--config.grad_accum_steps={accum} keeps the batch "
                  "in half-size micro-batches, or lower --config.batch_size)")
    else:
      tips.append("a smaller --config.batch_size")
  else:
    tips.append(f"a smaller evaluation batch (--config.decode.batch_size, now "
                f"{config.decode.batch_size})")
  tips.append(f"more chips (a topology larger than {topology.name})")
  return (f"does not fit: {name} needs {result['total_bytes'] / GiB:.2f} GiB per chip, "
          f"{over / GiB:.2f} GiB more than the {topology.chip.hbm_bytes / GiB:.0f} GiB HBM of a "
          f"{topology.chip.device_kind} chip; would help: " + "; ".join(tips))


# ---------------------------------------------------------------------- planning helpers
def _with_batch(config: ml_collections.ConfigDict, batch_size: int) -> ml_collections.ConfigDict:
  config = copy.deepcopy(config)
  config.batch_size = batch_size
  return config


def compile_train_step(config: ml_collections.ConfigDict, topology: Topology,
                       mesh: jax.sharding.Mesh, vocab_size: int) -> dict[str, Any]:
  (program,) = build_programs(config, mesh, vocab_size, ("train_step",))
  return compile_program(program, topology, mesh)


def find_max_batch(config: ml_collections.ConfigDict, topology: Topology,
                   mesh: jax.sharding.Mesh, vocab_size: int, tolerance: float = 0.0,
                   log: Callable[[str], None] = lambda s: None
                   ) -> tuple[int, dict[int, dict[str, Any]]]:
  """The largest global batch (rows of data.max_length) whose train step fits, by compiling:
  a bracket [fits, does not fit] is narrowed with guesses interpolated from the reported
  memory (which is close to linear in the batch), bisecting when a guess would not narrow
  it, until the two ends are one step apart (or within `tolerance` of the smaller).
  Steps are multiples of data*fsdp*grad_accum_steps. Returns (batch, {batch: result});
  batch 0 when not even one step's worth fits."""
  unit = sharding.batch_ways(mesh) * config.grad_accum_steps
  results: dict[int, dict[str, Any]] = {}

  def total(k: int) -> int:
    if k * unit not in results:
      r = compile_train_step(_with_batch(config, k * unit), topology, mesh, vocab_size)
      results[k * unit] = r
      log(f"batch {k * unit}: {r['total_bytes'] / GiB:.2f} GiB/chip, "
          f"{'fits' if r['fits'] else 'does not fit'} ({r['compile_s']:.0f} s compile)")
    return results[k * unit]["total_bytes"]

  hbm = topology.chip.hbm_bytes
  lo, hi = 0, None                  # lo fits (0: nothing known to), hi does not fit
  k = max(1, config.batch_size // unit)
  while True:
    if total(k) <= hbm:
      lo = k
    else:
      hi = k
    if hi is not None and hi - lo <= max(1, int(tolerance * lo)):
      break
    if hi == 1:
      break
    points = sorted(x for x in (lo, hi) if x)
    if len(points) == 2:            # Interpolate between the bracket's ends.
      a, b = points
      slope = (total(b) - total(a)) / (b - a)
    else:                           # One point: what grows with the batch is all but the state.
      a = points[0]
      slope = max(total(a) - results[a * unit].get("argument_bytes", 0), 1) / a
    guess = a + int((hbm - total(a)) / max(slope, 1.0))
    upper = hi - 1 if hi is not None else max(2 * lo, 1) * 8
    lower = lo + 1 if lo else 1
    if hi is None:                  # No upper end yet: at least double (memory is not quite
      lower = max(lower, 2 * lo)    # linear, so interpolation alone creeps up in small steps).
    guess = min(max(guess, lower), upper)
    if guess in (lo, hi) or (hi is not None and guess in (lower, upper) and hi - lo > 2):
      guess = (lo + hi) // 2 if hi is not None else guess    # Interpolation stalls: bisect.
    k = guess
  return lo * unit, results


def layouts(num_chips: int) -> list[tuple[int, int, int]]:
  """Every (data, fsdp, tensor) whose product is the chip count."""
  return [(d, f, num_chips // (d * f)) for d in range(1, num_chips + 1) if num_chips % d == 0
          for f in range(1, num_chips // d + 1) if (num_chips // d) % f == 0]


def sweep_layouts(config: ml_collections.ConfigDict, topology: Topology, vocab_size: int,
                  log: Callable[[str], None] = lambda s: None) -> list[dict[str, Any]]:
  """The train step compiled under every layout; the best (fits, then shortest estimated
  step, then least memory) is marked "best"."""
  rows = []
  for d, f, t in layouts(len(topology.devices)):
    mesh = sharding.make_mesh(dict(data=d, fsdp=f, tensor=t), topology.devices)
    row: dict[str, Any] = {"data": d, "fsdp": f, "tensor": t, "best": False}
    try:
      row.update(compile_train_step(config, topology, mesh, vocab_size))
    except sharding.MeshError as e:
      row["skipped"] = str(e)
    log(_layout_line(row))
    rows.append(row)
  ok = [r for r in rows if r.get("fits") and _step_s(r)]
  if ok:
    min(ok, key=lambda r: (_step_s(r), r["total_bytes"]))["best"] = True
  return rows


def _step_s(r: dict[str, Any]) -> float | None:
  """XLA's estimate where it gives one, else the roofline bound (same chip throughout)."""
  return r.get("estimated_step_s") or r.get("roofline_step_s")


def _layout_line(r: dict[str, Any]) -> str:
  head = f"{r['data']:>4} {r['fsdp']:>4} {r['tensor']:>6}"
  if "skipped" in r:
    return f"{head}  skipped: {r['skipped']}"
  step = "-" if r["estimated_step_s"] is None else f"{1e3 * r['estimated_step_s']:.1f}"
  mfu = "-" if r["estimated_mfu"] is None else f"{100 * r['estimated_mfu']:.1f}%"
  roof = "-" if r.get("roofline_step_s") is None else f"{1e3 * r['roofline_step_s']:.1f}"
  tok = ("-" if r["estimated_tokens_per_s_per_chip"] is None
         else f"{r['estimated_tokens_per_s_per_chip']:,.0f}")
  return (f"{head}  {r['total_bytes'] / GiB:>9.2f} {'yes' if r['fits'] else 'NO':>4} "
          f"{step:>9} {tok:>11} {mfu:>6} {roof:>11}{'  <- best' if r['best'] else ''}")


LAYOUT_HEADER = ("data fsdp tensor  GiB/chip fits   step ms  tok/s/chip    MFU  roofline ms"
                 "   (step, tokens/s, MFU: XLA cost-model estimates; roofline: lower bound)")


# ---------------------------------------------------------------------------------- CLI
def _fail(message: str, status: int) -> None:
  print(f"error: {message}" if status == 2 else message, file=sys.stderr)
  sys.exit(status)


def main(argv: list[str]) -> None:
  from absl import flags, logging
  logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    _fail(f"unexpected arguments: {' '.join(argv[1:])}", 2)
  FLAGS = flags.FLAGS
  config = FLAGS.config
  from ml_collections import config_flags
  config_path = config_flags.get_config_filename(FLAGS["config"])
  names = tuple(n for n in FLAGS.programs.split(",") if n)
  unknown = [n for n in names if n not in PROGRAMS]
  if unknown:
    _fail(f"--programs: unknown {unknown}; choose from {PROGRAMS}", 2)
  log = (lambda s: print(s, file=sys.stderr, flush=True)) if FLAGS.json else \
      (lambda s: print(s, flush=True))
  try:
    topology = tpu_topology(FLAGS.topology)
    if FLAGS.hbm_gib:
      topology = with_hbm(topology, FLAGS.hbm_gib)
    vocab_size = vocab_size_of(config)
    chips = len(topology.devices)
    model_cfg = experiment_for(config, sharding.make_mesh(config.mesh.to_dict(),
                                                          topology.devices),
                               vocab_size).model_config
    chip = topology.chip
    header = (f"{config_path} on {topology.name}: {chips} x {chip.device_kind} "
              f"({chip.hbm_bytes / GiB:.0f} GiB HBM, {chip.peak_flops / 1e12:.0f} TFLOP/s dense "
              f"bf16 peak per chip); vocab {model_cfg.tgt_vocab_size}; dtype {model_cfg.dtype}")
    summary: dict[str, Any] = {"config": config_path, "topology": topology.name,
                               "chips": chips, "chip": chip.to_dict(),
                               "vocab_size": model_cfg.tgt_vocab_size,
                               "dtype": model_cfg.dtype, "note": ESTIMATE_NOTE}
    if FLAGS.sweep_layouts:
      log(f"{header}; batch {config.batch_size}; train_step under every layout\n{LAYOUT_HEADER}")
      rows = sweep_layouts(config, topology, vocab_size, log)
      summary["layouts"] = rows
      best = [r for r in rows if r["best"]]
      if FLAGS.json:
        print(json.dumps(summary, default=str))
      if not best:
        _fail(f"does not fit: no layout of {chips} chips fits batch {config.batch_size} in "
              f"{chip.hbm_bytes / GiB:.0f} GiB per chip; would help: remat "
              "(--config.model.remat_policy=full), a smaller batch per step "
              "(--config.grad_accum_steps), more chips", 1)
      b = best[0]
      log(f"best: --config.mesh.data={b['data']} --config.mesh.fsdp={b['fsdp']} "
          f"--config.mesh.tensor={b['tensor']}")
      return
    mesh = sharding.make_mesh(config.mesh.to_dict(), topology.devices)
    header += f"; mesh {dict(mesh.shape)}"
    summary["mesh"] = dict(mesh.shape)
    if FLAGS.find_max_batch:
      log(f"{header}; searching the largest global batch of train_step that fits")
      batch, results = find_max_batch(config, topology, mesh, vocab_size,
                                      FLAGS.batch_tolerance, log)
      summary.update(max_batch=batch, max_batch_per_chip=batch / chips,
                     compiles={str(k): v for k, v in sorted(results.items())})
      if FLAGS.json:
        print(json.dumps(summary, default=str))
      if batch == 0:
        smallest = min(results)
        _fail(advice("train_step", results[smallest], _with_batch(config, smallest), mesh,
                     topology), 1)
      fitted = results[batch]
      log(f"largest batch that fits: {batch} rows of {config.data.max_length} tokens "
          f"({batch / chips:g} per chip), {fitted['total_bytes'] / GiB:.2f} GiB/chip"
          + (f"; est. step {1e3 * fitted['estimated_step_s']:.1f} ms, MFU "
             f"{100 * fitted['estimated_mfu']:.1f}% [XLA cost model]"
             if fitted["estimated_mfu"] else ""))
      return
    results = {}
    for program in build_programs(config, mesh, vocab_size, names):
      results[program.name] = compile_program(program, topology, mesh,
                                              top_ops=FLAGS.top_ops)
    summary["programs"] = results
    summary["batch_size"] = config.batch_size
    if FLAGS.json:
      print(json.dumps(summary, default=str))
    else:
      print(format_report(f"{header}; batch {config.batch_size}", results))
    for name, result in results.items():
      if not result["fits"]:
        _fail(advice(name, result, config, mesh, topology), 1)
  except (UsageError, sharding.MeshError, ValueError) as e:
    _fail(str(e), 2)


def _define_flags() -> None:
  from absl import flags
  from ml_collections import config_flags
  config_flags.DEFINE_config_file(
      "config", None, "Config file, as for train.py; fields overridable as --config.a.b=V.",
      lock_config=True)
  flags.DEFINE_string("topology", None, "TPU slice, GEN:SHAPE: v4:2x2x1, v5e:2x4, v5p:2x2x1, "
                      "v5p:4x4x2, v6e:2x4, ...", required=True)
  flags.DEFINE_bool("json", False, "Print one JSON object (progress lines go to stderr).")
  flags.DEFINE_string("programs", ",".join(PROGRAMS), "Comma-separated programs to compile.")
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


if __name__ == "__main__":
  from absl import app
  try:
    _define_flags()
  except (AttributeError, KeyError) as e:   # An override of a field the config lacks.
    _fail(f"unknown config field {e}", 2)
  errors.run(main)
