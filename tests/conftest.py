"""Shared helpers for the transformer_jax tests: tiny float32 models and token batches."""

from __future__ import annotations

import os
import sys

# Make the package importable with a bare `pytest` too (`python -m pytest` adds the cwd).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The tests compile many tiny programs, and on CPU compiling them costs far more than running
# them. These XLA options cut compile time several-fold (about 4x for a forward+backward pass
# here) without changing float semantics (no fast-math). They are read when the backend starts
# (first computation), so setting them here, after `import jax`, is early enough. Only set for
# JAX versions where the flags are known to exist: XLA aborts on an unknown flag.
# No TPU or CUDA backend where libtpu or the CUDA plugin is installed only to compile for
# them (tests/test_aot.py, tests/test_aot_gpu.py); before importing jax, which loads the
# CUDA plugin's libraries.
from transformer_jax.platforms import skip_missing_tpu  # noqa: E402

skip_missing_tpu()

import jax  # noqa: E402  (importing does not start a backend)

# Eight CPU devices for the sharding tests (tests/test_sharding.py); unsharded code still runs
# on the first one. Must be set before the backend starts.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()

_FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0",
                       "--xla_cpu_use_fusion_emitters=false")
if jax.__version_info__[:2] == (0, 10) and "TRANSFORMER_JAX_TEST_KEEP_XLA_FLAGS" not in os.environ:
  _flags = os.environ.get("XLA_FLAGS", "")
  for _flag in _FAST_COMPILE_FLAGS:
    if _flag.split("=")[0] not in _flags:
      _flags += " " + _flag
  os.environ["XLA_FLAGS"] = _flags.strip()
  jax.config.update("jax_disable_most_optimizations", True)

import functools

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax import PAD_ID, Transformer, TransformerConfig

# Exact float32 matmuls even where the default would be TF32/bf16 passes (GPU/TPU runs).
jax.config.update("jax_default_matmul_precision", "highest")

VOCAB = 40
ATOL = 1e-5
RTOL = 1e-5


def tiny_config(**overrides) -> TransformerConfig:
  """d_model 32, 2 heads, d_ff 64, one encoder and one decoder layer, no dropout, float32."""
  params = dict(vocab_size=VOCAB, d_model=32, num_heads=2, d_ff=64, num_encoder_layers=1,
                num_decoder_layers=1, max_len=32, dropout_rate=0.0)
  params.update(overrides)
  vocab_size = params.pop("vocab_size")
  return TransformerConfig.small(vocab_size=vocab_size, **params)


def featurizing_task(name: str, tokenizer, labels=("a", "b", "c"), target_tokenizer=None,
                     **config):
  """The task `name` over `tokenizer` with a tiny model: what the data pipeline featurizes
  with (the model is built lazily, so this is cheap)."""
  from transformer_jax import tasks
  cls = tasks.task_class(name)
  cfg = tiny_config(vocab_size=tokenizer.vocab_size, **config)
  return cls(cfg, tokenizer=tokenizer, target_tokenizer=target_tokenizer,
             labels=list(labels) if cls.needs_labels else None)


def random_tokens(seed: int, batch: int, length: int, vocab: int = VOCAB) -> np.ndarray:
  """Real (non-padding) token ids in [PAD_ID + 1, vocab), int32, shape (batch, length)."""
  rng = np.random.default_rng(seed)
  return rng.integers(PAD_ID + 1, vocab, size=(batch, length)).astype(np.int32)


def pad_to(tokens: np.ndarray, length: int) -> np.ndarray:
  """Appends padding (PAD_ID) columns up to `length`."""
  out = np.full((tokens.shape[0], length), PAD_ID, np.int32)
  out[:, : tokens.shape[1]] = tokens
  return out


def init(model, *args, seed: int = 0, **kwargs):
  return model.init(jax.random.PRNGKey(seed), *args, **kwargs)


# Compilation dominates the run time on CPU, so parameters and jitted functions are cached
# per (hashable, frozen) config and reused across tests.
def transformer_variables(cfg: TransformerConfig, seed: int = 0):
  """Transformer variables for `cfg` (parameter shapes do not depend on sequence length).

  Options that change neither the parameter tree nor its initial values (attention
  implementation, activation, dropout rates) share one initialization. The compute dtype is
  kept, so that tests can check that a bfloat16 model still initializes float32 parameters."""
  return _init_variables(cfg.replace(attention_impl="xla", activation="relu",
                                     dropout_rate=0.0, attention_dropout_rate=0.0,
                                     activation_dropout_rate=0.0), seed)


@functools.lru_cache(maxsize=None)
def _init_variables(cfg: TransformerConfig, seed: int):
  dummy = jnp.ones((1, 4), jnp.int32)
  variables = jax.jit(Transformer(cfg).init)(jax.random.PRNGKey(seed), dummy, dummy)
  return nn.meta.unbox(variables)  # Plain arrays (no logical-partitioning boxes).


@functools.lru_cache(maxsize=None)
def transformer_apply(cfg: TransformerConfig):
  """jax.jit of Transformer(cfg).apply; `train` and `method` are static."""
  return jax.jit(Transformer(cfg).apply, static_argnames=("train", "method"))


def assert_close(actual, expected, atol: float = ATOL, rtol: float = RTOL) -> None:
  np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), atol=atol, rtol=rtol)


class TrainedRuns:
  """Tiny trained runs of each task kind and their StableHLO exports, each made once per
  session on first use: training and exporting them is the cost of the serving tests
  (tests/test_serving.py, tests/test_serve.py), which only read them."""

  def __init__(self, tmp_path_factory):
    self._tmp = tmp_path_factory
    self._workdirs: dict[str, str] = {}
    self._artifacts: dict[str, str] = {}

  def workdir(self, kind: str) -> str:
    if kind not in self._workdirs:
      from test_serving import train_workdir
      self._workdirs[kind] = train_workdir(kind, str(self._tmp.mktemp(kind)))
    return self._workdirs[kind]

  def artifact(self, kind: str) -> str:
    """The workdir exported with the export command's defaults."""
    if kind not in self._artifacts:
      from transformer_jax.export import export_stablehlo
      out = str(self._tmp.mktemp("artifact") / kind)
      self._artifacts[kind] = export_stablehlo(self.workdir(kind), None, out, None, None)
    return self._artifacts[kind]


@pytest.fixture(scope="session")
def trained_runs(tmp_path_factory) -> TrainedRuns:
  return TrainedRuns(tmp_path_factory)
