#!/usr/bin/env bash
# The GPU measurements of benchmarks/gpu_measurements.py as one short, prepared call on a lent
# GPU machine whose image already holds JAX with CUDA, flax, optax, orbax and torch (docs/gpu.md).
#
#   bash benchmarks/gpu_lease.sh steps   OUT   # train steps, PyTorch beside them
#   bash benchmarks/gpu_lease.sh multi30k OUT  # Multi30k trained on the GPU, then served
# One 10-minute call can run both, each under `timeout` (it stops the whole process group):
#   timeout 390 bash benchmarks/gpu_lease.sh steps $OUT; timeout 170 bash ... multi30k $OUT
#
# WHEELS (default .gpu_carry/whl): packages the image lacks (ml-collections, grain,
# array-record, portpicker), installed with --no-deps into /tmp/site. MULTI30K (default
# .gpu_carry/multi30k): the Multi30k files. LARGEST: the largest batch per device from
# `aot --target=$TARGET:1 --find_max_batch`, planned beforehand on a CPU machine (the
# einsum attention of the WMT14 configs, so the step measured there is the step planned).
# Each part writes one JSON per invocation under OUT, after every command, so a call cut
# short still returns what it measured.
set -u
part=${1:?steps or multi30k}
out=${2:?output folder}
WHEELS=${WHEELS:-.gpu_carry/whl}
MULTI30K=${MULTI30K:-.gpu_carry/multi30k}
TARGET=${TARGET:-h200}
LARGEST=${LARGEST:-}
export PYTHONUNBUFFERED=1
mkdir -p "$out"
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
if [ ! -f "$out/environment.txt" ]; then
  python3 -c "import jax; jax.print_environment_info()" 2>&1 | tee "$out/environment.txt"
  python3 -m pip list 2>/dev/null | grep -iE "^(jax|jaxlib|flax|optax|orbax|torch|nvidia-cudnn)" \
    >>"$out/environment.txt"
fi

M="python3 -m benchmarks.gpu_measurements --target=$TARGET"
case $part in
  steps)
    # Fail fast (and cheaply) if this image's JAX cannot run the project at all.
    if ! timeout 180 python3 -m benchmarks.train_step --config=configs/default.py \
        --src_length=16 --tgt_length=16 --steps=2 --warmup=1 --dtype=bfloat16 \
        --attention=cudnn --json >"$out/smoke.json" 2>"$out/smoke.err"; then
      tail -n 40 "$out/smoke.err"; exit 3
    fi
    grep -h "falls back" "$out/smoke.err" | sort -u
    $M --only=train_step --models=base,big --attentions=einsum,cudnn --batches=paper \
      --timeout_s=150 --output="$out/steps_paper.json"
    $M --only=torch --models=base --timeout_s=200 --output="$out/torch.json"
    $M --only=train_step --models=base,big --attentions=einsum --batches=largest \
      --largest_batch="$LARGEST" --timeout_s=150 --output="$out/steps_largest.json"
    $M --only=train_step --models=base,big --attentions=xla --batches=paper \
      --timeout_s=150 --output="$out/steps_xla.json" ;;
  multi30k)
    $M --only=multi30k,serve --seeds=0 --multi30k_dir="$MULTI30K" --runs=/tmp/gpu_runs \
      --timeout_s=400 --output="$out/multi30k.json" ;;
  *) echo "unknown part $part: steps or multi30k" >&2; exit 2 ;;
esac
