"""The benchmarks, each `python -m benchmarks.NAME`; their figures are in RESULTS.md.

transformer_jax is imported first, before any benchmark imports jax: on a machine without an
accelerator its import picks the CPU and silences the CUDA plugin's "no driver" lines
(transformer_jax/platforms.py), which would otherwise precede a benchmark's one-line error.
"""

import transformer_jax  # noqa: F401
