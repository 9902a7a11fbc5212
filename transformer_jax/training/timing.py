"""Where a training run's wall time goes, and JAX's persistent compilation cache.

  clock = RunClock()                   # at the start of a run
  with clock.measure("eval"):
    ...
  clock.split()   # {"perf/time/eval_s": ..., "perf/time/compile_s": ..., "perf/time/total_s": ...}

Compile time is not measured around calls but read from JAX's own monitoring events
(tracing, lowering to MLIR, and XLA compiling or loading from the persistent cache), so it
counts every program wherever it is compiled: the train step, the eval step and the beam
search once per batch shape, eager operations. A phase's time leaves out the compiles inside
it and the phases measured inside it, so the parts add up to the total; `other` is what no
phase measured. The keys are under perf/, like every other value that depends on the machine
rather than on the run's seed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from typing import Any, Iterator

import jax

PREFIX = "perf/time/"
# The phases in the order a run goes through them (each one may be measured several times).
PHASES = ("startup", "data_setup", "init", "input_wait", "steps", "eval", "checkpoint",
          "average", "final_eval")
# jax._src.dispatch's event names: a top-level trace, its lowering, and the XLA compile (or
# the load from the persistent cache, which happens inside the same event).
_TRACE = "/jax/core/compile/jaxpr_trace_duration"
_LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_BACKEND = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"


class _Compiles:
  """Totals since the process started: seconds spent compiling, programs built, and of
  those, programs loaded from the persistent cache."""

  def __init__(self) -> None:
    self.seconds, self.programs, self.cached = 0.0, 0, 0
    self._lock = threading.Lock()    # programs may be compiled from other threads too

  def on_duration(self, event: str, seconds: float, **_: Any) -> None:
    if event in (_TRACE, _LOWER, _BACKEND):
      with self._lock:
        self.seconds += seconds
        self.programs += int(event == _BACKEND)

  def on_event(self, event: str, **_: Any) -> None:
    if event == _CACHE_HIT:
      with self._lock:
        self.cached += 1

  def snapshot(self) -> tuple[float, int, int]:
    with self._lock:
      return self.seconds, self.programs, self.cached


_COMPILES: _Compiles | None = None
_COMMAND_START: list[float] = []


def _compiles() -> _Compiles:
  """The process's compile totals, listening to JAX from the first call on (listeners are
  process-wide, so they are registered once and each run takes differences; a compile on
  another thread during a phase is taken out of that phase too)."""
  global _COMPILES
  if _COMPILES is None:
    _COMPILES = _Compiles()
    jax.monitoring.register_event_duration_secs_listener(_COMPILES.on_duration)
    jax.monitoring.register_event_listener(_COMPILES.on_event)
  return _COMPILES


def command_started(started: float) -> None:
  """The command's start (time.perf_counter(), taken before its imports): the first run of
  the process then reports the time before it as `startup` and counts it in its total."""
  _COMMAND_START[:] = [started]
  _compiles()


@dataclasses.dataclass
class _OpenPhase:
  """A phase being measured: when it started, the compile seconds then, and the net time
  of the phases already closed inside it."""
  phase: str
  started: float
  compiled: float
  inner: float = 0.0

  def net(self, now: float, compiled_now: float) -> float:
    """Its wall time so far, less the compiles since it started."""
    return now - self.started - (compiled_now - self.compiled)


class RunClock:
  """A run's time split: phases measured with `measure`, compile time from JAX's events."""

  def __init__(self) -> None:
    now = time.perf_counter()
    command = _COMMAND_START.pop() if _COMMAND_START else None   # the first run takes it
    self.origin = now if command is None else command
    self.own = {phase: 0.0 for phase in PHASES}
    if command is None:
      del self.own["startup"]    # not measured: not reported
    else:
      self.own["startup"] = now - command
    self._compiles = _compiles()
    self._base = self._compiles.snapshot()
    self._open: list[_OpenPhase] = []   # innermost last

  @contextlib.contextmanager
  def measure(self, phase: str) -> Iterator[None]:
    """Adds the block's wall time to `phase`, less the compiles and the phases measured
    inside it."""
    self._open.append(_OpenPhase(phase, time.perf_counter(), self._compiles.snapshot()[0]))
    try:
      yield
    finally:
      opened = self._open.pop()
      net = opened.net(time.perf_counter(), self._compiles.snapshot()[0])
      self.own[phase] += net - opened.inner
      if self._open:
        self._open[-1].inner += net

  def split(self) -> dict[str, float]:
    """Every phase's seconds, then compile, other (what no phase measured) and the total
    since the origin, under PREFIX; and the programs compiled and loaded from the cache."""
    seconds, programs, cached = self._compiles.snapshot()
    compile_s = seconds - self._base[0]
    now = time.perf_counter()
    total = now - self.origin
    own = dict(self.own)
    # Phases still open (a run stopped inside its loop) count their time so far.
    child = 0.0
    for opened in reversed(self._open):
      net = opened.net(now, seconds)
      own[opened.phase] += net - opened.inner - child
      child = net
    parts = {**own, "compile": compile_s}
    parts["other"] = total - sum(parts.values())
    split = {f"{PREFIX}{name}_s": value for name, value in {**parts, "total": total}.items()}
    split[f"{PREFIX}programs"] = programs - self._base[1]
    split[f"{PREFIX}programs_from_cache"] = cached - self._base[2]
    return split


def summary_line(split: dict[str, float]) -> str:
  """One line: the total, then each part with its share of the total."""
  values = {k[len(PREFIX):]: v for k, v in split.items() if k.startswith(PREFIX)}
  total = values.pop("total_s")
  programs, cached = int(values.pop("programs")), int(values.pop("programs_from_cache"))
  parts = []
  for name, seconds in values.items():
    detail = f", {programs} programs, {cached} from the cache" if name == "compile_s" else ""
    parts.append(f"{name[:-2]} {seconds:.1f} s ({100 * seconds / max(total, 1e-9):.0f}%{detail})")
  return f"time: {total:.1f} s = " + " + ".join(parts)


def use_compilation_cache(directory: str) -> None:
  """Keeps compiled programs in `directory` (JAX's persistent compilation cache), so that a
  run of the same config on the same kind of machine and JAX version loads them instead of
  compiling. Every program is kept: JAX's default keeps only those that took over 1 s to
  compile, and a run's many quicker ones (eval and beam-search shapes) add up."""
  jax.config.update("jax_compilation_cache_dir", directory)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
