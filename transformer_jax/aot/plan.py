"""Planning searches over compiles of the train step: the largest batch that fits, and the
best (data, fsdp, tensor) layout of the chips."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

from transformer_jax import sharding
from transformer_jax.accelerators import GiB
from transformer_jax.aot.programs import build_programs, run_settings, with_batch
from transformer_jax.aot.report import CompileReport, compile_program
from transformer_jax.aot.targets import Topology


def compile_train_step(config: Any, topology: Topology,
                       mesh: jax.sharding.Mesh) -> CompileReport:
  (program,) = build_programs(config, mesh, ("train_step",))
  return compile_program(program, topology, mesh)


def find_max_batch(config: Any, topology: Topology,
                   mesh: jax.sharding.Mesh, tolerance: float = 0.0,
                   log: Callable[[str], None] = lambda s: None
                   ) -> tuple[int, dict[int, CompileReport]]:
  """The largest global batch (rows of data.max_length) whose train step fits, by compiling:
  from the run's batch, guesses interpolated from the reported memory (close to linear in
  the batch) find a bracket [fits, does not fit]; one more interpolated guess (and, if it
  fits, a probe just above it), then bisection, narrow it until the two ends are one step
  apart (or within `tolerance` of the smaller).
  Steps are multiples of data*fsdp*grad_accum_steps. Returns (batch, {batch: report});
  batch 0 when not even one step's worth fits."""
  run = run_settings(config)
  unit = sharding.batch_ways(mesh) * run.grad_accum_steps
  results: dict[int, CompileReport] = {}

  def total(k: int) -> int:
    if k * unit not in results:
      r = compile_train_step(with_batch(config, k * unit), topology, mesh)
      results[k * unit] = r
      log(f"batch {k * unit}: {r.total_bytes / GiB:.2f} GiB/chip, "
          f"{'fits' if r.fits else 'does not fit'} ({r.compile_s:.0f} s compile)")
    return results[k * unit].total_bytes

  hbm = topology.chip.hbm_bytes
  lo, hi = 0, None                  # lo fits (0: nothing known to), hi does not fit
  k = max(1, run.batch_size // unit)
  bracketed = 0                     # compiles since both ends were known
  interpolated = False              # k came from interpolation (not a bisection or probe)
  while True:
    if total(k) <= hbm:
      lo = k
    else:
      hi = k
    bracketed += lo > 0 and hi is not None
    close = max(1, int(tolerance * lo))
    if hi is not None and hi - lo <= close:
      break
    if hi == 1:
      break
    if interpolated and lo == k and (hi is None or lo + close < hi):
      # An interpolated guess fit: where memory is close to linear the limit lies just
      # above it, and one compile `close` higher ends the search if it does not fit.
      k, interpolated = lo + close, False
      continue
    points = sorted(x for x in (lo, hi) if x)
    if len(points) == 2:            # Interpolate between the bracket's ends.
      a, b = points
      slope = (total(b) - total(a)) / (b - a)
    else:                           # One point: what grows with the batch is all but the state.
      a = points[0]
      slope = max(total(a) - results[a * unit].argument_bytes, 1) / a
    guess = a + int((hbm - total(a)) / max(slope, 1.0))
    upper = hi - 1 if hi is not None else max(2 * lo, 1) * 8
    lower = lo + 1 if lo else 1
    if hi is None:                  # No upper end yet: at least double (memory is not quite
      lower = max(lower, 2 * lo)    # linear, so interpolation alone creeps up in small steps).
    guess = min(max(guess, lower), upper)
    interpolated = False
    if guess in (lo, hi) or (hi is not None and guess in (lower, upper) and hi - lo > 2):
      guess = (lo + hi) // 2 if hi is not None else guess    # Interpolation stalls: bisect.
    elif hi is not None and bracketed > 1:
      # One interpolated guess per bracket, then bisection: where XLA rematerializes to
      # fit, memory flattens just above HBM, and interpolating creeps a few rows a compile
      # (big on 8xH100: 3072, 2968, 2896, 2824...).
      guess = (lo + hi) // 2
    else:
      interpolated = hi is not None
    k = guess
  return lo * unit, results


def layouts(num_chips: int) -> list[tuple[int, int, int]]:
  """Every (data, fsdp, tensor) whose product is the chip count."""
  return [(d, f, num_chips // (d * f)) for d in range(1, num_chips + 1) if num_chips % d == 0
          for f in range(1, num_chips // d + 1) if (num_chips // d) % f == 0]


@dataclasses.dataclass
class LayoutRow:
  """The train step under one layout: its report, or why the layout was skipped."""
  data: int
  fsdp: int
  tensor: int
  report: CompileReport | None = None
  skipped: str | None = None
  best: bool = False

  @property
  def step_s(self) -> float | None:
    """XLA's estimate where it gives one, else the roofline bound (same chip throughout)."""
    r = self.report
    return (r.estimated_step_s or r.roofline_step_s) if r else None

  def to_dict(self) -> dict[str, Any]:
    row: dict[str, Any] = {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor,
                           "best": self.best}
    if self.skipped is not None:
      row["skipped"] = self.skipped
    return {**row, **(self.report.to_dict() if self.report else {})}

  def line(self) -> str:
    head = f"{self.data:>4} {self.fsdp:>4} {self.tensor:>6}"
    r = self.report
    if r is None:
      return f"{head}  skipped: {self.skipped}"
    step = "-" if r.estimated_step_s is None else f"{1e3 * r.estimated_step_s:.1f}"
    mfu = "-" if r.estimated_mfu is None else f"{100 * r.estimated_mfu:.1f}%"
    roof = "-" if r.roofline_step_s is None else f"{1e3 * r.roofline_step_s:.1f}"
    tok = ("-" if r.estimated_tokens_per_s_per_chip is None
           else f"{r.estimated_tokens_per_s_per_chip:,.0f}")
    return (f"{head}  {r.total_bytes / GiB:>9.2f} {'yes' if r.fits else 'NO':>4} "
            f"{step:>9} {tok:>11} {mfu:>6} {roof:>11}{'  <- best' if self.best else ''}")


LAYOUT_HEADER = ("data fsdp tensor  GiB/chip fits   step ms  tok/s/chip    MFU  roofline ms"
                 "   (step, tokens/s, MFU: XLA cost-model estimates; roofline: lower bound)")


def sweep_layouts(config: Any, topology: Topology,
                  log: Callable[[str], None] = lambda s: None) -> list[LayoutRow]:
  """The train step compiled under every layout; the best (fits, then shortest estimated
  step, then least memory) is marked `best`."""
  rows = []
  for d, f, t in layouts(len(topology.devices)):
    row = LayoutRow(d, f, t)
    try:
      mesh = sharding.make_mesh(dict(data=d, fsdp=f, tensor=t), topology.devices)
      row.report = compile_train_step(config, topology, mesh)
    except sharding.MeshError as e:
      row.skipped = str(e)
    log(row.line())
    rows.append(row)
  ok = [r for r in rows if r.report and r.report.fits and r.step_s]
  if ok:
    min(ok, key=lambda r: (r.step_s, r.report.total_bytes if r.report else 0)).best = True
  return rows
