"""Where a compiled step's time goes on a GPU, estimated from its optimized HLO (XLA's GPU
compiler gives no cost analysis): each kernel the step launches (a fusion, a GEMM, a custom
call) priced as a roofline, the larger of the bytes it reads and writes over the card's HBM
bandwidth and its FLOPs over the dense bf16 peak, and grouped by family from the source
operation it came from (its op_name metadata: the model's module path, and the named scopes
"loss" and "optimizer" of tasks/losses.py and training/steps.py).

An estimate, labelled so wherever it is shown: it ignores caches, launch gaps and how close
each kernel comes to its roofline, and prices a custom call (Pallas, cuDNN) by its bytes
only. `calibrated` scales it to a measured step time, which keeps the shares and the
ranking of the families."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from transformer_jax.aot.hlo_cost import (
  ARRAY,
  OP_NAME,
  array_bytes,
  computations_of,
  instructions,
)

_NAME = re.compile(r"^\s+(?:ROOT )?%?([\w.\-]+) = ")
_OPERANDS = re.compile(r"%([\w.\-]+)")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_DOT = re.compile(r"= (\S+) dot\(%?([\w.\-]+), .*?lhs_contracting_dims=\{([\d,]*)\}")
_DIMS = re.compile(r"\[([\d,]*)\]")
# Instructions that move no data: views, tuples and the program's arguments.
_FREE = ("parameter", "get-tuple-element", "bitcast", "tuple", "constant", "while",
         "after-all", "partition-id", "replica-id", "opt-barrier")
_ATTENTION_PRODUCTS = ("btnh,bsnh->bnts", "bnts,bsnh->btnh")
_PROJECTIONS = re.compile(r"_attention/(?:[\w.]*_projection|[\w.]*_keys_values|qkv|query|key|"
                          r"value|out)/")

# The named scopes, as they appear under transformations: "jit(step)/jvp(loss)/reduce_max".
_SCOPE_LOSS = re.compile(r"[/(]loss[/)]")
_SCOPE_OPTIMIZER = re.compile(r"[/(]optimizer[/)]")

MATMUL_WEIGHTS = "matmul: weights"
MATMUL_ATTENTION = "matmul: attention scores (QK^T, PV)"
FUSED_ATTENTION = "fused attention kernel (bytes only)"
DROPOUT = "dropout: random bits and masks"
SOFTMAX = "attention: softmax and masking"
NORMS = "layer norms"
LOSS = "loss over the vocabulary"
OPTIMIZER = "optimizer (Adam, the non-finite guard)"
COPIES = "copies and transposes"
OTHER = "other elementwise (residuals, activations, embeddings)"


@dataclasses.dataclass
class Family:
  """One family's kernels: their count, bytes moved, FLOPs and estimated time."""
  name: str
  kernels: int = 0
  bytes: int = 0
  flops: int = 0
  seconds: float = 0.0

  def to_dict(self) -> dict[str, Any]:
    return {"family": self.name, "kernels": self.kernels, "gigabytes": self.bytes / 1e9,
            "gflops": self.flops / 1e9, "estimated_ms": 1e3 * self.seconds}


def _shape_bytes(shape: str) -> int:
  return sum(array_bytes(element, dims) for element, dims in ARRAY.findall(shape))


def _dims(shape: str) -> list[int]:
  """The dimensions of an array shape's text ("bf16[96,256]{1,0}" -> [96, 256])."""
  found = _DIMS.search(shape)
  return [int(d) for d in found.group(1).split(",") if d] if found else []


def _dots(computation: list[str], shapes: dict[str, str]) -> tuple[int, str]:
  """The FLOPs of a fused computation's dots (2 x output elements x contracted length) and
  the source operation of its first dot."""
  flops, source = 0, ""
  for line in computation:
    dot = _DOT.search(line)
    if not dot:
      continue
    result, lhs, contracting = dot.groups()
    lhs_dims = _dims(shapes[lhs])
    flops += 2 * math.prod(_dims(result)) * math.prod(
        lhs_dims[int(i)] for i in contracting.split(",") if i)
    op = OP_NAME.search(line)
    source = source or (op.group(1) if op else "")
  return flops, source


def family_of(op_name: str, opcode: str, kernel: str, is_gemm: bool) -> str:
  """The family of one kernel, from its source operation, opcode and name."""
  if is_gemm:
    return MATMUL_ATTENTION if any(e in op_name for e in _ATTENTION_PRODUCTS) else MATMUL_WEIGHTS
  if opcode == "custom-call":
    return FUSED_ATTENTION
  if "Dropout" in op_name or "_bernoulli" in op_name or "random_bits" in op_name:
    return DROPOUT
  if _SCOPE_LOSS.search(op_name):
    return LOSS
  if _SCOPE_OPTIMIZER.search(op_name):
    return OPTIMIZER
  if "_norm/" in op_name:
    return NORMS
  if "attention/" in op_name and not _PROJECTIONS.search(op_name):
    return SOFTMAX
  if opcode in ("copy", "transpose") or "transpose" in kernel or "copy" in kernel:
    return COPIES
  return OTHER


def breakdown(hlo_text: str, peak_flops: float, bandwidth: float) -> list[Family]:
  """Every kernel of the optimized module (loop bodies once per iteration) by family,
  largest estimated time first."""
  computations, _ = computations_of(hlo_text)
  shapes: dict[str, str] = {}
  for lines in computations.values():
    for line in lines:
      defined = _NAME.match(line)
      if defined:
        shapes[defined.group(1)] = line[defined.end():].split(" ", 1)[0]
  families: dict[str, Family] = {}
  for shape, opcode, rest, times, _ in instructions(hlo_text):
    if opcode in _FREE:
      continue
    operands = rest.split(")", 1)[0]
    moved = _shape_bytes(shape) + sum(_shape_bytes(shapes.get(o, ""))
                                      for o in _OPERANDS.findall(operands))
    calls = _CALLS.search(rest)
    kernel = calls.group(1) if calls else opcode
    flops, dot_source = _dots(_called(computations, kernel), shapes)
    op = OP_NAME.search(rest)
    source = dot_source or (op.group(1) if op else "")
    family = families.setdefault(name := family_of(source, opcode, kernel, flops > 0),
                                 Family(name))
    family.kernels += times
    family.bytes += moved * times
    family.flops += flops * times
    family.seconds += max(moved / bandwidth, flops / peak_flops) * times
  return sorted(families.values(), key=lambda f: -f.seconds)


def _called(computations: dict[str, list[str]], name: str) -> list[str]:
  """The lines of computation `name` and of every computation it calls (Triton GEMM
  fusions nest theirs)."""
  lines = list(computations.get(name, []))
  for line in computations.get(name, []):
    for callee in _CALLS.findall(line):
      lines += _called(computations, callee)
  return lines


def calibrated(families: list[Family], measured_seconds: float) -> float:
  """The factor that scales the estimate's total to a measured step time."""
  return measured_seconds / sum(f.seconds for f in families)
