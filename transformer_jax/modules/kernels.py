"""Fused attention kernels that never write the (B, N, T, S) scores, and the masks as each
takes them natively. `attention_impl` names one, or "auto": the path that the platform's own
self-check proved exact (values and gradients, finite everywhere) and that was timed fastest
there (AUTO below; docs/gpu.md cites the measurements).

- "pallas" (NVIDIA GPUs): JAX's Pallas flash attention for GPUs (Triton), self-attention
  only (encoder, causal decoder, language model; packed or not): one row of segment ids
  serves queries and keys, padding being a segment of its own. `interpret=True` runs the
  same kernel on a CPU (the tests).
- "cudnn" (NVIDIA GPUs): cuDNN flash attention through JAX's cuDNN bindings. Unpacked rows:
  `is_causal` and each row's query and key lengths. Packed rows: cuDNN's packed layout,
  each segment's offset and length in the query row and in the key row, sized by the
  packer's bound on segments per row; padding joins a segment so every output is written.
  Hopper (compute capability 9.0) or newer for packed rows. The CPU can only describe it.
- "cudnn_dense": cuDNN flash attention fed the dense (B, 1, T, S) mask as a bias
  (`jax.nn.dot_product_attention`'s own call): the fastest path measured on an H200 before
  the masks were native, its gradients unchecked; a candidate for the GPU self-check.
- "splash" (TPUs): Pallas splash attention per example under `vmap`: query and key segment
  ids with a causal mask or none. `interpret=True` runs it on a CPU (the tests).

Shapes: B batch, T query length, S key length, N heads, H head dimension; the mask is
`masks.AttentionMask`. No kernel has attention dropout (config.py refuses it). Sliding
windows (`AttentionMask.window`): splash takes one natively (a local mask), cudnn_dense in
its dense mask; pallas and cudnn (packed or by lengths) have none and refuse one
(`WINDOWED`). `scale` multiplies the scores in every kernel.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import warnings
from typing import TYPE_CHECKING, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from transformer_jax import sharding
from transformer_jax.errors import UserError
from transformer_jax.modules import cudnn
from transformer_jax.modules.masks import AttentionMask

if TYPE_CHECKING:
  from jax.experimental.pallas.ops.gpu.attention import BlockSizes

Array = jax.Array

# Each kernel and the platforms it runs on.
_GPU = ("gpu", "cuda")
KERNEL_PLATFORMS = {"pallas": _GPU, "cudnn": _GPU, "cudnn_dense": _GPU, "splash": ("tpu",)}
KERNELS = tuple(KERNEL_PLATFORMS)   # config.KERNELS, in the same order (tested)
# What "auto" runs on each platform (any other: einsum). A kernel enters this table only
# after its platform's self-check passed and it was timed fastest there. NVIDIA GPUs: einsum
# (one H100, 2026-11-28: cuDNN's packed layout gave NaN gradients and a 5.8x slower step;
# Pallas is not yet measured). TPUs: splash.
AUTO = {"gpu": "einsum", "cuda": "einsum", "tpu": "splash"}
WINDOWED = ("splash", "cudnn_dense")   # the kernels that take a sliding window

_TARGET_PLATFORM: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "attention_target_platform", default=None)


@contextlib.contextmanager
def target_platform(platform: str, compute_capability: str | None = None) -> Iterator[None]:
  """Programs traced inside run on `platform` ("tpu", "gpu", "cpu"), not on this process's
  backend: aot traces on a CPU what a GPU or TPU will run. There a kernel that cannot be
  traced is an error (`KernelError`), not a fallback: the plan must be of the program the
  target runs. `compute_capability` ("9.0") answers for the target GPU where JAX's cuDNN
  bindings would ask the local one (there is none)."""
  token = _TARGET_PLATFORM.set(platform)
  restore = None
  if compute_capability is not None:
    from jax._src.cudnn import fused_attention_stablehlo as cudnn
    restore = cudnn.check_compute_capability
    cudnn.check_compute_capability = lambda needed: (_version(compute_capability)
                                                     >= _version(needed))
  try:
    yield
  finally:
    _TARGET_PLATFORM.reset(token)
    if restore is not None:
      cudnn.check_compute_capability = restore


def _version(text: str) -> tuple[int, ...]:
  return tuple(int(part) for part in text.split("."))


class KernelError(UserError):
  """A kernel asked for on a target platform that cannot be traced for it here."""


def planning() -> bool:
  """Whether the program being traced is for a target platform other than this backend."""
  return _TARGET_PLATFORM.get() is not None


def platform() -> str:
  """The platform the program being traced will run on ("gpu" for NVIDIA GPUs)."""
  return _TARGET_PLATFORM.get() or jax.default_backend()


def resolve(implementation: str, on: str | None = None) -> str:
  """"auto" as the attention that platform `on` (default: the one being traced for) has
  proved exact and fastest (AUTO); other names as they are."""
  if implementation != "auto":
    return implementation
  return AUTO.get(on or platform(), "einsum")


def check_dropout(implementation: str, attention_dropout_rate: float,
                  on: str | None = None) -> None:
  """Refuses attention dropout where `implementation` resolves to a kernel, which has none."""
  resolved = resolve(implementation, on)
  if resolved in KERNELS and attention_dropout_rate > 0:
    raise KernelError(f"model.attention_dropout_rate={attention_dropout_rate}: the {resolved} "
                      f"kernel (attention_impl={implementation!r}) has no attention dropout; "
                      "set it to 0, or attention_impl to 'einsum'")


def check_window(implementation: str, sliding_window: int, on: str | None = None) -> None:
  """Refuses a sliding window where `implementation` resolves to a kernel without one."""
  resolved = resolve(implementation, on)
  if sliding_window and resolved in KERNELS and resolved not in WINDOWED:
    raise KernelError(f"model.sliding_window={sliding_window}: the {resolved} kernel "
                      f"(attention_impl={implementation!r}) has no sliding window; use "
                      f"attention_impl {' or '.join(repr(k) for k in WINDOWED)} or 'einsum'")


def fused_attention(query: Array, key: Array, value: Array, mask: AttentionMask,
                    implementation: str, scale: float) -> Array | None:
  """The kernel's output, or None (with a warning) where it cannot run. Traced for a
  target platform (aot), a kernel that cannot run is an error: the plan would be of
  another program. The scores are Q K^T * `scale`."""
  check_window(implementation, mask.window)
  target = platform()
  if target not in KERNEL_PLATFORMS[implementation]:
    return _cannot_run(implementation, f"the backend is {target!r}")
  if implementation == "cudnn" and mask.packed:
    _warn_unproven("attention_impl='cudnn' on packed rows: cuDNN's packed layout has not "
                   "yet passed the GPU self-check (tests/test_kernels_gpu.py); 'einsum' is "
                   "the path measured right there")
  kernel = _kernel(implementation, mask, scale)
  try:  # The kernels check dtypes and shapes when the call is traced.
    return per_device(kernel, query, key, value, mask.query_segments, mask.key_segments)
  except UserError:
    raise
  except (NotImplementedError, ValueError, RuntimeError) as e:
    # A genuine input error raises again from the XLA path.
    return _cannot_run(implementation, f"{type(e).__name__}: {str(e).strip().splitlines()[0]}")


def _kernel(implementation: str, mask: AttentionMask, scale: float) -> Callable[..., Array]:
  """`kernel(query, key, value, query_segments, key_segments)` of `implementation`."""
  if implementation == "splash":
    return functools.partial(splash_attention, causal=mask.causal, window=mask.window,
                             scale=scale)
  if implementation == "pallas":
    return functools.partial(pallas_attention, causal=mask.causal, scale=scale)
  if implementation == "cudnn_dense":
    def dense(q: Array, k: Array, v: Array, q_segments: Array, k_segments: Array) -> Array:
      local = dataclasses.replace(mask, query_segments=q_segments, key_segments=k_segments)
      return cudnn.dense_attention(q, k, v, local.dense(), scale)   # one device's rows
    return dense
  return functools.partial(cudnn.attention, causal=mask.causal, packed=mask.packed,
                           max_segments=mask.max_segments, scale=scale)


def _cannot_run(implementation: str, reason: str) -> Array | None:
  """None, after a warning; traced for a target platform, a KernelError instead."""
  if planning():
    hint = (" (cuDNN's library is needed to trace it: pip install -r requirements-gpu.txt)"
            if "cuDNN not found" in reason else "")
    raise KernelError(f"model.attention_impl={implementation!r} cannot be traced for "
                      f"{platform()!r}: {reason}{hint}; plan "
                      "--config.model.attention_impl=einsum instead")
  _warn_fallback(implementation, reason)
  return None


@functools.lru_cache(maxsize=None)
def _warn_fallback(implementation: str, reason: str) -> None:
  """Warns once per distinct reason (tracing can hit the same fallback many times)."""
  warnings.warn(f"attention_impl={implementation!r} falls back to 'xla': {reason}",
                stacklevel=4)


@functools.lru_cache(maxsize=None)
def _warn_unproven(message: str) -> None:
  warnings.warn(message, stacklevel=4)


def per_device(kernel: Callable[..., Array], query: Array, key: Array, value: Array,
               query_segments: Array, key_segments: Array) -> Array:
  """`kernel(query, key, value, query_segments, key_segments)` on each device's rows and
  heads where the step's arrays are split over a mesh (a Pallas or cuDNN custom call
  cannot be partitioned by XLA: shard_map hands it one device's block)."""
  mesh = sharding.step_mesh()
  if mesh is None:
    return kernel(query, key, value, query_segments, key_segments)
  heads = P(sharding.BATCH_AXES, None, "tensor", None)              # (B, L, N, H)
  rows = P(sharding.BATCH_AXES, None)                               # (B, L)

  def local(*arrays: Array) -> Array:
    with sharding.per_device():
      return kernel(*arrays)
  return jax.shard_map(local, mesh=mesh, in_specs=(heads, heads, heads, rows, rows),
                       out_specs=heads, check_vma=False)(query, key, value, query_segments,
                                                          key_segments)


# -------------------------------------------------------------------------------- Pallas
def pallas_attention(query: Array, key: Array, value: Array, query_segments: Array,
                     key_segments: Array, *, causal: bool, scale: float | None = None,
                     interpret: bool = False) -> Array:
  """JAX's Pallas flash attention for GPUs (`jax.experimental.pallas.ops.gpu.attention`,
  forward and backward kernels) on self-attention rows (T == S). Its one row of segment
  ids serves queries and keys: padding (segment 0) is a segment of its own, so each padding
  query sees padding keys (at least itself), every output is written and finite, and no
  real query sees a padding key."""
  from jax.experimental.pallas.ops.gpu import attention as pallas_gpu
  if query.shape[1] != key.shape[1]:
    raise ValueError(f"the Pallas kernel serves self-attention (T == S), got T="
                     f"{query.shape[1]} and S={key.shape[1]}")
  del key_segments   # self-attention: the queries' row
  return pallas_gpu.mha(query, key, value, query_segments,
                        sm_scale=float(1 / np.sqrt(query.shape[-1]) if scale is None
                                       else scale), causal=causal,
                        block_sizes=pallas_blocks(query.shape[1]), interpret=interpret)


def pallas_blocks(length: int) -> "BlockSizes":
  """The Pallas kernel's tiles for rows of `length` tokens: those of the Triton tutorial's
  flash attention on Hopper for a head dimension of 64 where the row allows (forward: 128
  queries against 64-key steps; backward: 128 keys (dK, dV) over 32-query steps, and 128
  queries (dQ) over 32-key steps); shorter rows take the largest power-of-two tile of at
  least 16 (Triton's smallest matmul) that divides them."""
  from jax.experimental.pallas.ops.gpu import attention as pallas_gpu
  tile = next((t for t in (128, 64, 32, 16) if length % t == 0), None)
  if tile is None:
    raise ValueError(f"the Pallas kernel tiles rows by multiples of 16 tokens; these rows "
                     f"have {length} (pad data.max_length to a multiple of 16)")
  step = min(32, tile)
  return pallas_gpu.BlockSizes(block_q=tile, block_k=min(64, tile), block_q_dkv=step,
                               block_kv_dkv=tile, block_q_dq=tile, block_kv_dq=step)


# -------------------------------------------------------------------------------- splash
def splash_attention(query: Array, key: Array, value: Array, query_segments: Array,
                     key_segments: Array, *, causal: bool, window: int = 0,
                     scale: float | None = None, interpret: bool = False) -> Array:
  """Pallas splash attention (TPU) under `vmap` over the batch, queries pre-scaled by
  `scale` (default 1/sqrt(H)); a sliding `window` (0: none) as its local mask. A padding
  query takes the segment of its row's first key, so that no row of
  the mask is empty (splash needs a visible key in every row); its output is never read."""
  from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_kernel as splash,
  )
  batch, t, heads, depth = query.shape
  s = key.shape[1]
  kernel = _splash_kernel(t, s, heads, causal, window, interpret)
  query_segments = jnp.where(query_segments == 0, key_segments[:, :1], query_segments)
  heads_first = lambda x: jnp.swapaxes(x, 1, 2)                          # (B, N, L, H)
  scaled = query * jnp.asarray(1 / np.sqrt(depth) if scale is None else scale, query.dtype)
  out = jax.vmap(kernel)(heads_first(scaled), heads_first(key), heads_first(value),
                         segment_ids=splash.SegmentIds(q=query_segments, kv=key_segments))
  return heads_first(out)


@functools.lru_cache(maxsize=None)
def _splash_kernel(t: int, s: int, heads: int, causal: bool, window: int, interpret: bool):
  from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_kernel as splash,
  )
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
  one: masks.Mask
  if window:   # keys fewer than `window` positions away, before (and unless causal, after)
    one = masks.LocalMask((t, s), (window - 1, 0 if causal else window - 1), offset=0)
  else:
    one = masks.CausalMask((t, s)) if causal else masks.FullMask((t, s))
  bq, bkv = _block(t), _block(s)
  blocks = splash.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv,
                             block_q_dkv=bq, block_kv_dkv=bkv, block_kv_dkv_compute=bkv,
                             block_q_dq=bq, block_kv_dq=bkv)
  return splash.make_splash_mha(masks.MultiHeadMask([one] * heads), block_sizes=blocks,
                                head_shards=1, q_seq_shards=1, interpret=interpret)


def _block(length: int) -> int:
  """The largest tile of 512, 256 or 128 that divides `length` (the whole row if none)."""
  return next((b for b in (512, 256, 128) if length % b == 0), length)
