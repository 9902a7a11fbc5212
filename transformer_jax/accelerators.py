"""What the project knows about accelerators: one table of published peak rates and memory
sizes, and XLA's static memory plan of a compiled program. Shared by `aot` and the
benchmarks."""

from __future__ import annotations

import dataclasses
from typing import Any

GiB = 1024 ** 3


@dataclasses.dataclass(frozen=True)
class Chip:
  """One accelerator kind. `device_kind` is a substring of what JAX reports for it (the
  first row whose substring matches wins, so "TPU v5 lite" comes before "TPU v5"); `target`
  is its name for `aot` ("v5p" in --topology=v5p:2x2x2), None where aot does not compile
  for it. Peaks are dense (no sparsity): bfloat16, and float32 as JAX computes it by default
  (NVIDIA: TF32 tensor cores; TPU: bfloat16 passes, so the bf16 peak)."""
  device_kind: str
  platform: str                       # JAX's platform name: "tpu", "cuda"
  bf16_tflops: float
  fp32_tflops: float
  hbm_gib: float | None = None
  hbm_gb_per_s: float | None = None
  target: str | None = None

  @property
  def peak_flops(self) -> float:
    return self.bf16_tflops * 1e12

  @property
  def hbm_bytes(self) -> int:
    return int((self.hbm_gib or 0) * GiB)

  @property
  def hbm_bandwidth(self) -> float:
    return (self.hbm_gb_per_s or 0) * 1e9

  def to_dict(self) -> dict[str, Any]:
    return {"name": self.target, "device_kind": self.device_kind,
            "peak_bf16_tflops": self.bf16_tflops, "hbm_bytes": self.hbm_bytes,
            "hbm_bandwidth_bytes_per_s": self.hbm_bandwidth}


# Published per-chip figures. NVIDIA: the datasheets "NVIDIA H100 Tensor Core GPU", "NVIDIA
# H200 Tensor Core GPU", "NVIDIA A100 Tensor Core GPU" and "NVIDIA L4 Tensor Core GPU" (dense,
# i.e. half of the "with sparsity" figures; SXM form factor where not named; HBM bandwidth
# GB/s). A GPU's memory for aot is what the device reports, from its target description
# (aot/gpu_specs/), not the datasheet's round figure. TPU: the Cloud TPU system architecture
# pages (dense bf16 peak, HBM GiB, HBM bandwidth GB/s).
CHIPS = (
    Chip("H100 PCIe", "cuda", 756.0, 378.0),
    Chip("H100 NVL", "cuda", 835.0, 418.0),
    Chip("H100", "cuda", 989.4, 494.7, hbm_gb_per_s=3350.0, target="h100-sxm"),
    Chip("H200", "cuda", 989.4, 494.7, hbm_gb_per_s=4800.0, target="h200"),
    Chip("A100-SXM4-80GB", "cuda", 312.0, 156.0, hbm_gb_per_s=2039.0, target="a100-80gb"),
    Chip("A100", "cuda", 312.0, 156.0),
    Chip("L4", "cuda", 121.0, 60.0),
    Chip("TPU v4", "tpu", 275.0, 275.0, 32, 1228.0, target="v4"),
    Chip("TPU v5 lite", "tpu", 197.0, 197.0, 16, 819.0, target="v5e"),
    Chip("TPU v5", "tpu", 459.0, 459.0, 95, 2765.0, target="v5p"),
    Chip("TPU v6 lite", "tpu", 918.0, 918.0, 32, 1640.0, target="v6e"),
)

# (substring of the device kind, bfloat16 TFLOP/s, float32 TFLOP/s), first match wins: the
# benchmarks' view of CHIPS.
KNOWN_PEAKS = [(c.device_kind, c.bf16_tflops, c.fp32_tflops) for c in CHIPS]

# The chips aot compiles for, by target name.
TARGET_CHIPS = {c.target: c for c in CHIPS if c.target}


def chip_of(device_kind: str) -> Chip | None:
  """The first row of CHIPS whose substring is in the device kind JAX reports."""
  return next((c for c in CHIPS if c.device_kind in device_kind), None)


def compiled_memory(compiled: Any) -> dict[str, int] | None:
  """XLA's static memory plan of an executable, per device: arguments, outputs,
  temporaries, generated code; `total_bytes` counts donated (aliased) buffers once."""
  try:
    m = compiled.memory_analysis()
  except Exception:  # Not every backend implements it.
    return None
  if m is None:
    return None
  return {"argument_bytes": m.argument_size_in_bytes, "output_bytes": m.output_size_in_bytes,
          "temp_bytes": m.temp_size_in_bytes, "alias_bytes": m.alias_size_in_bytes,
          "generated_code_bytes": m.generated_code_size_in_bytes,
          "total_bytes": (m.argument_size_in_bytes + m.output_size_in_bytes
                          + m.temp_size_in_bytes - m.alias_size_in_bytes
                          + m.generated_code_size_in_bytes)}
