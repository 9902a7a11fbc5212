"""Fused attention kernels that never write the (B, N, T, S) scores, and the masks as each
takes them natively: `attention_impl` "cudnn" (NVIDIA GPUs), "splash" (TPUs), or "auto"
(the fastest exact one on the backend; the einsum path on a CPU).

- cuDNN flash attention, through JAX's cuDNN bindings. Unpacked rows: `is_causal` and each
  row's query and key lengths (rows are padded at the end). Packed rows: cuDNN's packed
  layout, each segment's offset and length in the query row and in the key row, so one
  call serves encoder self-attention, causal decoder self-attention and cross-attention
  with T != S alike. Hopper (compute capability 9.0) or newer for packed rows.
- Splash attention (Pallas, TPU), per example under `vmap`: query and key segment ids with
  a causal mask or none. `interpret=True` runs the same kernel on a CPU (the tests).

Shapes: B batch, T query length, S key length, N heads, H head dimension; the mask is
`attention.AttentionMask`. Neither kernel has attention dropout (config.py refuses it).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Callable, Iterator, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from transformer_jax import sharding
from transformer_jax.errors import UserError

Array = jax.Array

# Each kernel and the platforms it runs on; "auto" picks the one of the platform traced for.
KERNEL_PLATFORMS = {"cudnn": ("gpu", "cuda"), "splash": ("tpu",)}
KERNELS = tuple(KERNEL_PLATFORMS)
_FASTEST = {platform: kernel for kernel, platforms in KERNEL_PLATFORMS.items()
            for platform in platforms}

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
  """"auto" as the fastest exact attention on platform `on` (default: the one being traced
  for); other names as they are."""
  if implementation != "auto":
    return implementation
  return _FASTEST.get(on or platform(), "einsum")


def check_dropout(implementation: str, attention_dropout_rate: float,
                  on: str | None = None) -> None:
  """Refuses attention dropout where `implementation` resolves to a kernel, which has none."""
  resolved = resolve(implementation, on)
  if resolved in KERNELS and attention_dropout_rate > 0:
    raise KernelError(f"model.attention_dropout_rate={attention_dropout_rate}: the {resolved} "
                      f"kernel (attention_impl={implementation!r}) has no attention dropout; "
                      "set it to 0, or attention_impl to 'einsum'")


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


# --------------------------------------------------------------------------------- cuDNN
def cudnn_attention(query: Array, key: Array, value: Array, query_segments: Array,
                    key_segments: Array, *, causal: bool, packed: bool,
                    implementation: Literal["cudnn", "xla"] = "cudnn") -> Array:
  """cuDNN flash attention with the mask as lengths (unpacked) or segment offsets and
  lengths (packed). `implementation="xla"` runs JAX's reference of the same unpacked call
  (a CPU check of the lengths); packed rows need the GPU."""
  if not packed:
    # A row with no key at all (an empty padding row) attends to its first key: finite,
    # and its output is never read.
    return jax.nn.dot_product_attention(
        query, key, value, is_causal=causal,
        query_seq_lengths=_lengths(query_segments),
        key_value_seq_lengths=jnp.maximum(_lengths(key_segments), 1),
        implementation=implementation)
  from jax._src.cudnn import fused_attention_stablehlo as cudnn  # packed layout: no public API
  segments = min(query.shape[1], key.shape[1])
  q_offsets, q_lengths = segment_offsets(query_segments, segments)
  kv_offsets, kv_lengths = segment_offsets(key_segments, segments)
  mask_type = cudnn.MaskType.PADDING_CAUSAL if causal else cudnn.MaskType.PADDING
  return cudnn.dot_product_attention(
      query, key, value, q_seqlen=q_lengths, kv_seqlen=kv_lengths, q_offsets=q_offsets,
      kv_offsets=kv_offsets, scale=float(1 / np.sqrt(query.shape[-1])), mask_type=mask_type)


def _lengths(segments: Array) -> Array:
  return jnp.sum(segments != 0, axis=1, dtype=jnp.int32)


def segment_offsets(segments: Array, max_segments: int) -> tuple[Array, Array]:
  """(B, L) segment ids (1, 2, ... in order, each contiguous; 0 at padding) -> cuDNN's
  packed layout: each row's segment starts (B, M + 1) and lengths (B, M), -1 past its last
  segment (JAX's binding turns them into offsets over the whole batch)."""
  ids = jnp.arange(1, max_segments + 1, dtype=segments.dtype)
  member = segments[:, None, :] == ids[None, :, None]                     # (B, M, L)
  lengths = member.sum(-1, dtype=jnp.int32)
  present = lengths > 0
  starts = jnp.where(present, jnp.argmax(member, axis=-1).astype(jnp.int32), -1)
  offsets = jnp.pad(starts, ((0, 0), (0, 1)), constant_values=-1)
  return offsets, jnp.where(present, lengths, -1)


# -------------------------------------------------------------------------------- splash
def splash_attention(query: Array, key: Array, value: Array, query_segments: Array,
                     key_segments: Array, *, causal: bool, interpret: bool = False) -> Array:
  """Pallas splash attention (TPU) under `vmap` over the batch, queries pre-scaled by
  1/sqrt(H). A padding query takes the segment of its row's first key, so that no row of
  the mask is empty (splash needs a visible key in every row); its output is never read."""
  from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_kernel as splash,
  )
  batch, t, heads, depth = query.shape
  s = key.shape[1]
  kernel = _splash_kernel(t, s, heads, causal, interpret)
  query_segments = jnp.where(query_segments == 0, key_segments[:, :1], query_segments)
  heads_first = lambda x: jnp.swapaxes(x, 1, 2)                          # (B, N, L, H)
  scaled = query * jnp.asarray(1 / np.sqrt(depth), query.dtype)
  out = jax.vmap(kernel)(heads_first(scaled), heads_first(key), heads_first(value),
                         segment_ids=splash.SegmentIds(q=query_segments, kv=key_segments))
  return heads_first(out)


@functools.lru_cache(maxsize=None)
def _splash_kernel(t: int, s: int, heads: int, causal: bool, interpret: bool):
  from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_kernel as splash,
  )
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
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
