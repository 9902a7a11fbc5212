#!/usr/bin/env bash
# The GPU measurements (benchmarks/gpu_measurements.py) in two calls, on a host whose Python
# already has JAX with CUDA, flax, optax, orbax and torch (docs/gpu.md). Each command writes
# its JSON under OUT when it ends, so a call cut short still returns what it measured.
#
#   bash benchmarks/gpu_suite.sh kernels   OUT  # first call, <= 8 minutes: the environment,
#       # the self-check of every fused attention path (tests/test_kernels_gpu.py), the
#       # base and big steps with einsum and each path that passed, the fastest base step's
#       # profile; then, while the budget lasts, base beside torch.compile and the levers
#   bash benchmarks/gpu_suite.sh workloads OUT  # second call, <= 6 minutes: GPT-2 small
#       # beside nanoGPT's model under torch.compile, then Multi30k trained and served
#   bash benchmarks/gpu_suite.sh kernels OUT --tiny   # the same commands, tiny, on a CPU
#
# BUDGET (default 400 for kernels, 330 for workloads): seconds after which no command
# starts (the most important go first). WHEELS (default .gpu_carry/whl): packages the host
# lacks, installed with --no-deps into /tmp/site; the host's own JAX is used as it is,
# whatever this repository pins. Fetch them beforehand on any x86-64 machine with pip, for
# the host's Python (e.g. 3.12):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_24_x86_64 --platform manylinux_2_27_x86_64 \
#     --platform manylinux2014_x86_64 -d .gpu_carry/whl \
#     ml-collections==1.1.0 grain==0.2.18 array-record portpicker pytest iniconfig pluggy \
#     packaging pygments
# MULTI30K (default .gpu_carry/multi30k): the Multi30k files. TARGET: the aot name of this
# GPU (h100-sxm, h200) for the plans beside the measurements.
set -u
part=${1:?kernels or workloads}
out=${2:?output folder}
tiny=${3:-}
WHEELS=${WHEELS:-.gpu_carry/whl}
MULTI30K=${MULTI30K:-.gpu_carry/multi30k}
TARGET=${TARGET:-h100-sxm}
export PYTHONUNBUFFERED=1
mkdir -p "$out"
if [ -n "$tiny" ] && [ "$tiny" != "--tiny" ]; then
  echo "unknown option $tiny: --tiny or nothing" >&2; exit 2
fi
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
if [ ! -f "$out/environment.txt" ]; then
  python3 -c "import jax; jax.print_environment_info()
from transformer_jax.platforms import cudnn_version; print('cuDNN', cudnn_version())" 2>&1 \
    | tee "$out/environment.txt"
  python3 -m pip list 2>/dev/null | grep -iE "^(jax|jaxlib|flax|optax|orbax|torch|nvidia-cudnn)" \
    >>"$out/environment.txt"
fi

M="python3 -m benchmarks.gpu_measurements --target=$TARGET $tiny"
case $part in
  kernels)
    # Fail fast (and cheaply) if this host's JAX cannot run the project at all.
    if ! timeout 180 python3 -m benchmarks.train_step --config=configs/default.py \
        --src_length=16 --tgt_length=16 --steps=2 --warmup=1 --dtype=bfloat16 \
        --attention=einsum --json >"$out/smoke.json" 2>"$out/smoke.err"; then
      tail -n 40 "$out/smoke.err"; exit 3
    fi
    $M --only=self_check,paths,profile,torch,variants --models=base,big --timeout_s=200 \
      --budget_s="${BUDGET:-400}" --runs=/tmp/gpu_runs --output="$out/kernels.json"
    cp /tmp/gpu_runs/self_check.json "$out/" 2>/dev/null ;;
  workloads)
    $M --only=gpt2,multi30k,serve --seeds=0 --multi30k_dir="$MULTI30K" --runs=/tmp/gpu_runs \
      --timeout_s=240 --budget_s="${BUDGET:-330}" --output="$out/workloads.json" ;;
  *) echo "unknown part $part: kernels or workloads" >&2; exit 2 ;;
esac
