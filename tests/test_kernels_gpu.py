"""The GPU self-check of the fused attention paths ("pallas", "cudnn", "cudnn_dense"), skipped
without an NVIDIA GPU: bf16 inputs at the shapes training runs (8 heads of 64, rows of 256,
packed with 1-8 segments and padded tails) against the float32 einsum path, values and
gradients, and everything finite; then the whole Transformer and LanguageModel on a packed
batch, loss and gradients against einsum. A path passes where its error is within twice
einsum's own bf16 error (plus 0.5%) everywhere and nothing is NaN or infinite; a kernel
that did not run (a fallback) fails. One jit per path and case keeps the compiles few.

With SELF_CHECK_JSON=path, every result (errors, finiteness, pass) is written there as JSON
when the module ends: benchmarks/gpu_suite.sh reads it, and times only the paths that
passed. SELF_CHECK_ON_CPU=1 runs the same checks on a CPU (the Pallas kernel in interpret
mode, the cuDNN paths recorded as not run, tiny shapes): a check of this harness."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import warnings
from typing import Iterator

import attention_cases as cases
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax import Transformer, TransformerConfig
from transformer_jax.modules import kernels
from transformer_jax.modules.attention import dot_product_attention
from transformer_jax.modules.models import LanguageModel
from transformer_jax.platforms import cudnn_version

ON_CPU = os.environ.get("SELF_CHECK_ON_CPU") == "1"
pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu" and not ON_CPU,
                                reason="the GPU self-check needs an NVIDIA GPU")
PATHS = ("pallas", "cudnn", "cudnn_dense")
SLACK = 5e-3      # beyond twice einsum's own bf16 error
LENGTH = 32 if ON_CPU else 256
CROSS = 32 if ON_CPU else 192            # the key length of cross-attention, T != S
ROWS = 2 if ON_CPU else 16
HEADS = 2 if ON_CPU else 8
MAX_SEGMENTS = 8


def _packed_rows(rows: int, length: int, seed: int) -> list[list[int]]:
  """1-8 segments a row of random lengths, most rows with a padded tail."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(rows):
    count = int(rng.integers(1, MAX_SEGMENTS + 1))
    cuts = np.sort(rng.choice(np.arange(1, length), size=count, replace=False))
    lengths = np.diff(np.concatenate([[0], cuts])).tolist()
    out.append([int(n) for n in lengths])
  return out


def _cases() -> dict[str, dict]:
  packed, keys = _packed_rows(ROWS, LENGTH, 0), _packed_rows(ROWS, CROSS, 1)
  keys = [k[:len(q)] + [1] * (len(q) - len(k)) for q, k in zip(packed, keys)]  # m meets m
  padded = [[int(n)] for n in np.random.default_rng(2).integers(LENGTH // 4, LENGTH + 1, ROWS)]
  return {
      "padded": dict(q_rows=padded, k_rows=None, t=LENGTH, packed=False, causal=False),
      "causal": dict(q_rows=padded, k_rows=None, t=LENGTH, packed=False, causal=True),
      "packed self": dict(q_rows=packed, k_rows=None, t=LENGTH, packed=True, causal=False),
      "packed causal": dict(q_rows=packed, k_rows=None, t=LENGTH, packed=True, causal=True),
      "packed cross, T != S": dict(q_rows=packed, k_rows=keys, t=LENGTH, s=CROSS,
                                   packed=True, causal=False),
  }


CASES = _cases()
RESULTS: dict[str, dict[str, dict]] = {path: {} for path in PATHS}


@pytest.fixture(scope="module", autouse=True)
def _report():
  """Writes RESULTS to $SELF_CHECK_JSON when the module's tests are done."""
  yield
  target = os.environ.get("SELF_CHECK_JSON")
  if target:
    summary = {path: {"passed": _passed(path), "cases": r} for path, r in RESULTS.items()}
    with open(target, "w") as f:
      json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                 "cudnn": cudnn_version(), "paths": summary}, f, indent=1)


def _passed(path: str) -> bool:
  """Every case that applies to the path ran and passed."""
  expected = [c for c in CASES if _runnable(path, c) is None] + ["Transformer", "LanguageModel"]
  return all(RESULTS[path].get(c, {}).get("passed") for c in expected)


@pytest.fixture(autouse=True)
def _kernels_as_on_the_gpu(monkeypatch):
  """On a CPU: the Pallas kernel in interpret mode, traced as for a GPU."""
  if not ON_CPU:
    yield
    return
  monkeypatch.setattr(kernels, "pallas_attention",
                      functools.partial(kernels.pallas_attention, interpret=True))
  with kernels.target_platform("gpu"):
    yield


def _runnable(path: str, case_name: str) -> str | None:
  """Why `path` does not apply to the case (None: it does)."""
  if path == "pallas" and "cross" in case_name:
    return "self-attention only (cross-attention takes einsum)"
  if ON_CPU and path != "pallas":
    return "needs a GPU"
  return None


# What the traced program of each path calls on a GPU (XLA's attention, a fallback, calls
# none of them). Interpret mode (the CPU check) calls no kernel.
KERNEL_MARKERS = {"pallas": "triton", "cudnn": "__cudnn$fmha", "cudnn_dense": "__cudnn$fmha"}


@functools.lru_cache(maxsize=None)
def _path(implementation: str) -> cases.Path:
  def fused(q, k, v, mask):
    return dot_product_attention(q, k, v, mask, implementation)
  return fused


@contextlib.contextmanager
def _recorded(path: str, case: str) -> Iterator[dict]:
  """The result the body fills in, recorded under RESULTS as passed or not; an exception
  (a fallback, which is an error here, or a kernel's failure) records a failure."""
  result: dict = {}
  try:
    with warnings.catch_warnings():
      warnings.filterwarnings("error", message=".*falls back.*")
      yield result
  except Exception as e:
    RESULTS[path][case] = {"passed": False, "error": f"{type(e).__name__}: {e}"[:500]}
    raise
  RESULTS[path][case] = result
  assert result["passed"], result


@pytest.mark.parametrize("case_name", list(CASES))
@pytest.mark.parametrize("path", PATHS)
def test_each_path_in_bf16_is_as_close_to_float32_einsum_as_einsum_is(path, case_name):
  reason = _runnable(path, case_name)
  if reason:
    pytest.skip(reason)
  case = cases.make_case(**CASES[case_name], heads=HEADS, dtype=jnp.bfloat16,
                         max_segments=MAX_SEGMENTS if path == "cudnn" else 0)
  with _recorded(path, case_name) as result:
    called = None if ON_CPU else KERNEL_MARKERS[path] in jax.jit(_path(path)).lower(
        case.q, case.k, case.v, case.mask).as_text()
    ours, einsum = cases.evaluate(_path(path), case), cases.evaluate(cases.einsum, case)
    parts = ("output", "dq", "dk", "dv")
    result.update(errors=dict(zip(parts, ours.errors)), finite=ours.finite,
                  einsum_bf16_errors=dict(zip(parts, einsum.errors)), kernel_called=called,
                  passed=called is not False and ours.finite and all(
                      o <= 2 * e + SLACK for o, e in zip(ours.errors, einsum.errors)))


def _model_config(path: str, dtype: str = "bfloat16") -> TransformerConfig:
  return TransformerConfig.small(
      vocab_size=64, d_model=64 * HEADS, num_heads=HEADS, d_ff=128, max_len=LENGTH,
      num_encoder_layers=1, num_decoder_layers=1, dropout_rate=0.0, dtype=dtype,
      attention_impl=path, max_segments=MAX_SEGMENTS if path == "cudnn" else 0)


def _loss_and_grads(model, params, batch: dict, targets, real) -> tuple[float, jax.Array]:
  """The mean loss over real tokens and every parameter's gradient, as one vector."""
  def loss(params):
    logits = model.apply({"params": params}, **batch).astype(jnp.float32)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
    return jnp.sum(jnp.where(real, nll, 0.0)) / jnp.sum(real)
  value, grads = jax.jit(jax.value_and_grad(loss))(params)
  return float(value), jnp.concatenate([g.ravel() for g in jax.tree.leaves(grads)])


def _model_inputs(kind: str) -> tuple[type, dict, jax.Array, jax.Array]:
  seg = cases.segment_rows(CASES["packed self"]["q_rows"], LENGTH)
  tokens = cases.tokens(seg, 64, seed=5)
  if kind == "LanguageModel":
    return LanguageModel, dict(tokens=tokens, positions=cases.positions(seg),
                               segment_ids=seg), tokens, seg != 0
  return Transformer, dict(src=tokens, tgt=tokens,
                           src_positions=cases.positions(seg),
                           tgt_positions=cases.positions(seg), src_segment_ids=seg,
                           tgt_segment_ids=seg), tokens, seg != 0


def _relative_l2(got: jax.Array, want: jax.Array) -> float:
  return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))


@functools.lru_cache(maxsize=None)
def _model_run(kind: str, path: str, dtype: str = "bfloat16") -> tuple[float, jax.Array]:
  """The loss and gradient vector of `kind` with `path` attention, from the float32 einsum
  model's initial parameters (each computed once: the references serve every path)."""
  model_class, batch, targets, real = _model_inputs(kind)
  reference = model_class(_model_config("einsum", "float32"))
  params = nn.meta.unbox(jax.jit(reference.init)(jax.random.PRNGKey(0), **batch))["params"]
  return _loss_and_grads(model_class(_model_config(path, dtype)), params, batch, targets, real)


@pytest.mark.parametrize("kind", ["Transformer", "LanguageModel"])
@pytest.mark.parametrize("path", PATHS)
def test_the_models_loss_and_gradients_on_packed_rows_match_einsum(path, kind):
  """The bf16 model's loss and gradient vector, against the float32 einsum model's: as close
  as the bf16 einsum model's."""
  if ON_CPU and path != "pallas":
    pytest.skip("needs a GPU")
  want_loss, want = _model_run(kind, "einsum", "float32")
  einsum_loss, einsum = _model_run(kind, "einsum")
  with _recorded(path, kind) as result:
    got_loss, got = _model_run(kind, path)
    errors = {"loss": abs(got_loss - want_loss) / abs(want_loss),
              "gradients": _relative_l2(got, want)}
    einsum_errors = {"loss": abs(einsum_loss - want_loss) / abs(want_loss),
                     "gradients": _relative_l2(einsum, want)}
    finite = bool(np.isfinite(got_loss)) and bool(jnp.isfinite(got).all())
    result.update(errors=errors, einsum_bf16_errors=einsum_errors, finite=finite,
                  passed=finite and all(errors[k] <= 2 * einsum_errors[k] + SLACK
                                        for k in errors))
