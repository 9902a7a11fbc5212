"""Where XLA's cost model expects a compiled program's time to go: its per-instruction
estimates in the optimized HLO text, each loop body counted once per iteration."""

from __future__ import annotations

import dataclasses
import re

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

  @property
  def loop_factor(self) -> float | None:
    """How much counting each loop iteration adds to counting each loop body once; None
    where that is unknown (a loop without a readable trip count) or there are no loops."""
    if self.unknown_loops == 0 and 0 < self.once_cycles < self.total_cycles:
      return self.total_cycles / self.once_cycles
    return None


NO_BREAKDOWN = OpBreakdown(0, 0, [], 0)


def _trip_count(condition: list[str]) -> int | None:
  """Iterations of a counted loop (scan, fori_loop): its condition is `i < N` for a
  constant N, the counter starting at 0. None for any other condition."""
  bounds = [m.group(1) for m in map(_LOOP_BOUND.match, condition) if m]
  root = [line for line in condition if line.lstrip().startswith("ROOT ")]
  if len(bounds) == 1 and root and " compare(" in root[0] and "direction=LT" in root[0]:
    return int(bounds[0])
  return None


def _computations(hlo_text: str) -> tuple[dict[str, list[str]], str | None]:
  """The module's computations (name -> instruction lines) and the entry's name."""
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
  return computations, entry


def op_breakdown(hlo_text: str) -> OpBreakdown:
  """XLA's TPU cost model per instruction, summed by source operation: every top-level
  instruction of the optimized module carries its estimate (`estimated_cycles` in its
  backend config), and a loop's body counts once per iteration. Instructions are grouped
  by their `op_name` metadata with layer indices merged (layer_3 -> layer_N), so
  "encoder/layer_N/feed_forward/wi/dot_general" is that matmul in every layer."""
  computations, entry = _computations(hlo_text)
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
