"""Read from a compiled program's optimized HLO text, each loop body counted once per
iteration: where XLA's cost model expects the time to go (its per-instruction estimates),
and how many bytes each kind of collective moves, by element type."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Iterator, NamedTuple

_COMPUTATION = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%?[\w.\-]+ = (.*?) ([a-z][\w\-]*)\((.*)$")
_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
OP_NAME = re.compile(r'op_name="([^"]*)"')
_WHILE = re.compile(r"condition=%?([\w.\-]+), body=%?([\w.\-]+)")
_LOOP_BOUND = re.compile(r"^\s+%?[\w.\-]+ = s32\[\]\S* constant\((\d+)\)")
ARRAY = re.compile(r"\b(pred|[su](?:4|8|16|32|64)|bf16|f8\w*|f16|f32|f64)\[([\d,]*)\]")
_ELEMENT_BITS = {"pred": 8, "bf16": 16, "f16": 16, "f32": 32, "f64": 64}
# Collectives by the name they are reported under; an asynchronous "-start" counts as the
# operation (its "-done" moves nothing more).
COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
# The TPU compiler fuses a reduce-scatter into a custom fusion that calls a computation named
# "all-reduce-scatter..." (an all-reduce of which each chip keeps its slice).
_FUSED_COLLECTIVE = re.compile(r"calls=%?(all-reduce-scatter|all-gather|all-reduce|reduce-scatter)\b")
_FUSED_KIND = {"all-reduce-scatter": "reduce-scatter"}


# Custom calls of fused kernels (Pallas/Mosaic on TPU, cuDNN's attention, Pallas on GPU):
# XLA's cost model sees them as opaque calls, and prices none of their work.
_CUSTOM_CALL = re.compile(r'custom_call_target="([^"]+)"')
_KERNEL_TARGETS = ("tpu_custom_call", "__cudnn$fmha", "__gpu$xla.gpu.triton", "mosaic_gpu")


def kernel_calls(hlo_text: str) -> dict[str, int]:
  """How many times the module calls each fused kernel, by custom-call target."""
  counts: dict[str, int] = {}
  for target in _CUSTOM_CALL.findall(hlo_text):
    if target.startswith(_KERNEL_TARGETS):
      counts[target] = counts.get(target, 0) + 1
  return counts


_CUDNN_CALL = re.compile(r"= \(([^=]*)\) custom-call\(.*custom_call_target=\"__cudnn\$")
_WORKSPACE = re.compile(r"u8\[(\d+)\]")


def cudnn_workspaces(hlo_text: str) -> list[int]:
  """The workspace bytes of each cuDNN custom call (its last output, u8[N]): sized by cuDNN
  when XLA builds the call's graph on a GPU, 0 in a compile without one."""
  sizes = []
  for line in hlo_text.splitlines():
    call = _CUDNN_CALL.search(line)
    workspace = _WORKSPACE.findall(call.group(1)) if call else []
    if workspace:
      sizes.append(int(workspace[-1]))
  return sizes


def unsized_cudnn_workspaces(hlo_text: str) -> bool:
  """Whether the module calls cuDNN with workspaces it could not size (a compile-only plan)."""
  return 0 in cudnn_workspaces(hlo_text)


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


def computations_of(hlo_text: str) -> tuple[dict[str, list[str]], str | None]:
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


class Instruction(NamedTuple):
  shape: str          # the result's shape text
  opcode: str
  rest: str           # the rest of the line: operands, attributes, metadata
  times: int          # how often it runs per call (loop bodies: per iteration)
  unknown_trips: bool = False   # a while loop whose trip count could not be read


def instructions(hlo_text: str) -> Iterator[Instruction]:
  """Each instruction the entry computation runs, through loop bodies (a body's
  instructions run once per iteration; a loop without a readable trip count, once, and the
  loop itself says so in `unknown_trips`)."""
  computations, entry = computations_of(hlo_text)

  def walk(name: str, times: int) -> Iterator[Instruction]:
    for line in computations.get(name, []):
      instruction = _INSTRUCTION.match(line)
      if not instruction:
        continue
      shape, opcode, rest = instruction.groups()
      loop = _WHILE.search(rest) if opcode == "while" else None
      if loop:
        trips = _trip_count(computations.get(loop.group(1), []))
        yield Instruction(shape, "while", rest, times, unknown_trips=trips is None)
        yield from walk(loop.group(2), times * (trips or 1))
      else:
        yield Instruction(shape, opcode, rest, times)

  if entry is not None:
    yield from walk(entry, 1)


def op_breakdown(hlo_text: str) -> OpBreakdown:
  """XLA's TPU cost model per instruction, summed by source operation: every top-level
  instruction of the optimized module carries its estimate (`estimated_cycles` in its
  backend config), and a loop's body counts once per iteration. Instructions are grouped
  by their `op_name` metadata with layer indices merged (layer_3 -> layer_N), so
  "encoder/layer_N/feed_forward/wi/dot_general" is that matmul in every layer."""
  groups: dict[str, int] = {}
  once, unknown = 0, 0
  for instruction in instructions(hlo_text):
    _, opcode, rest, times, unknown_trips = instruction
    if opcode == "while":
      unknown += unknown_trips
      continue
    cycles = _CYCLES.search(rest)
    if cycles:
      op = OP_NAME.search(rest)
      key = re.sub(r"layer_\d+", "layer_N", op.group(1) if op else opcode)
      key = re.sub(r"^jit\([^)]*\)/", "", key)
      groups[key] = groups.get(key, 0) + int(cycles.group(1)) * times
      once += int(cycles.group(1))
  ranked = sorted(groups.items(), key=lambda kv: -kv[1])
  return OpBreakdown(sum(groups.values()), once, ranked, unknown)


def array_bytes(element: str, dims: str) -> int:
  bits = _ELEMENT_BITS.get(element) or int(re.sub(r"\D", "", element)[:2] or 8)
  return math.prod(int(d) for d in dims.split(",") if d) * bits // 8


def collective_bytes(hlo_text: str) -> dict[str, int]:
  """Bytes of the results of each kind of collective per chip and call, keyed "kind
  element-type" (e.g. "all-reduce bf16"): what each chip receives, before the ring or tree
  that moves it. An asynchronous start's result holds its operand and its result (and
  context scalars): only the result half is counted. A fusion that calls a collective
  (the TPU's "all-reduce-scatter" fusions) counts as that collective."""
  found: dict[str, int] = {}
  for shape, opcode, rest, times, _ in instructions(hlo_text):
    kind = opcode.removesuffix("-start")
    fused = _FUSED_COLLECTIVE.search(rest) if opcode == "fusion" else None
    if fused:
      kind = _FUSED_KIND.get(fused.group(1), fused.group(1))
    elif kind not in COLLECTIVES:
      continue
    arrays = [a for a in ARRAY.findall(shape) if a[1] or a[0] not in ("u32", "s32")]
    if opcode.endswith("-start") and kind != "all-reduce":
      arrays = arrays[len(arrays) // 2:]
    for element, dims in arrays:
      key = f"{kind} {element}"
      found[key] = found.get(key, 0) + array_bytes(element, dims) * times
  return dict(sorted(found.items()))
