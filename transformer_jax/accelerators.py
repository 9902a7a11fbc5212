"""What the project knows about accelerators: published peak rates and memory sizes, and
XLA's static memory plan of a compiled program. Shared by `aot` and the benchmarks."""

from __future__ import annotations

from typing import Any

# Dense (no sparsity) peak TFLOP/s: (substring of the device kind, bfloat16, float32 as JAX
# computes it by default). NVIDIA: float32 matmuls run on TF32 tensor cores at JAX's default
# precision, so the TF32 peak is the relevant one. TPU: float32 matmuls use bfloat16 passes
# by default. First match of the substring in the device kind wins (so "TPU v5 lite" before
# "TPU v5").
KNOWN_PEAKS = [
    ("H100 PCIe", 756.0, 378.0), ("H100 NVL", 835.0, 418.0), ("H100", 989.4, 494.7),
    ("H200", 989.4, 494.7), ("A100", 312.0, 156.0), ("L4", 121.0, 60.0),
    ("TPU v4", 275.0, 275.0), ("TPU v5 lite", 197.0, 197.0), ("TPU v5", 459.0, 459.0),
    ("TPU v6 lite", 918.0, 918.0),
]

GiB = 1024 ** 3


class TpuChip:
  """A Cloud TPU generation as `get_topology_desc` names it ("v5p" in "v5p:2x2x2")."""

  def __init__(self, name: str, device_kind: str, peak_tflops: float, hbm_gib: int,
               hbm_gb_per_s: float):
    self.name, self.device_kind = name, device_kind
    self.peak_flops, self.hbm_bytes = peak_tflops * 1e12, hbm_gib * GiB
    self.hbm_bandwidth = hbm_gb_per_s * 1e9

  def to_dict(self) -> dict[str, Any]:
    return {"name": self.name, "device_kind": self.device_kind,
            "peak_bf16_tflops": self.peak_flops / 1e12, "hbm_bytes": self.hbm_bytes,
            "hbm_bandwidth_bytes_per_s": self.hbm_bandwidth}


# Published per-chip figures (Cloud TPU system architecture pages): dense bf16 peak TFLOP/s,
# HBM GiB, HBM bandwidth GB/s.
TPU_CHIPS = {chip.name: chip for chip in (
    TpuChip("v4", "TPU v4", 275.0, 32, 1228.0),
    TpuChip("v5e", "TPU v5 lite", 197.0, 16, 819.0),
    TpuChip("v5p", "TPU v5", 459.0, 95, 2765.0),
    TpuChip("v6e", "TPU v6 lite", 918.0, 32, 1640.0),
)}


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
