"""Compile the real training programs for accelerators this machine does not have.

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

Modules: `targets` (what to compile for), `programs` (the run's programs; the only reader
of the run config), `report` (one compile, reported), `hlo_cost` (XLA's per-instruction
estimates), `plan` (batch and layout searches), `__main__` (the command line).
"""
