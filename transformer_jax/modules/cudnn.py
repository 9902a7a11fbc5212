"""cuDNN flash attention (NVIDIA GPUs) through JAX's cuDNN bindings, the masks as cuDNN
takes them: unpacked rows as `is_causal` and each row's query and key lengths; packed rows
(several sequences a row) as cuDNN's packed layout, each segment's offset and length in the
query row and in the key row (`packed_layout`), so that one call serves encoder
self-attention, causal decoder self-attention and cross-attention with T != S. And the call
that takes the dense mask as a bias (`dense_attention`). The CPU can describe these calls
(the tests check the layout), never run them: tests/test_kernels_gpu.py checks them on a GPU.

Shapes: B batch, T query length, S key length, N heads, H head dimension, M the packer's
bound on segments per row.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.errors import UserError

Array = jax.Array

MAX_ELEMENTS = 2 ** 31   # cuDNN's attention indexes B*T*N*H with 32-bit integers


def check_size(query: Array, key: Array, implementation: str) -> None:
  """Refuses one device's attention too large for cuDNN's 32-bit indexing (a UserError:
  the batch per device, not the kernel, has to change)."""
  for name, x in (("queries", query), ("keys", key)):
    if x.size >= MAX_ELEMENTS:
      raise UserError(f"model.attention_impl={implementation!r}: the {name} of one device "
                      f"hold B*L*N*H = {' x '.join(map(str, x.shape))} = {x.size:,} elements, "
                      "beyond the 2^31 cuDNN's attention indexes; put fewer rows on each "
                      "device (batch_size, mesh) or use attention_impl='einsum'")


def attention(query: Array, key: Array, value: Array, query_segments: Array,
              key_segments: Array, *, causal: bool, packed: bool, max_segments: int = 0,
              scale: float | None = None,
              implementation: Literal["cudnn", "xla"] = "cudnn") -> Array:
  """cuDNN flash attention with the mask as lengths (unpacked) or cuDNN's packed layout
  (`packed_layout`, sized by `max_segments`, the packer's bound on segments per row).
  `implementation="xla"` runs JAX's reference of the same unpacked call (a CPU check of the
  lengths); packed rows need the GPU. Gradients at padding positions are zero, whatever the
  kernel leaves in them. `scale` multiplies the scores (default 1 / sqrt(H))."""
  check_size(query, key, "cudnn")
  if scale is None:
    scale = float(1 / np.sqrt(query.shape[-1]))
  if not packed:
    # A row with no key at all (an empty padding row) attends to its first key: finite,
    # and its output is never read.
    return jax.nn.dot_product_attention(
        query, key, value, is_causal=causal,
        query_seq_lengths=_lengths(query_segments),
        key_value_seq_lengths=jnp.maximum(_lengths(key_segments), 1), scale=scale,
        implementation=implementation)
  from jax._src.cudnn import fused_attention_stablehlo as binding  # packed: no public API
  if max_segments < 1:
    raise ValueError("packed rows need the packer's bound on segments per row "
                     "(data.max_segments > 0)")
  (q_offsets, q_lengths), (kv_offsets, kv_lengths) = packed_layout(
      query_segments, key_segments, max_segments)
  query_valid, key_valid = query_segments != 0, key_segments != 0
  mask_type = binding.MaskType.PADDING_CAUSAL if causal else binding.MaskType.PADDING
  out = binding.dot_product_attention(
      _zero_gradient_outside(query, query_valid), _zero_gradient_outside(key, key_valid),
      _zero_gradient_outside(value, key_valid), q_seqlen=q_lengths, kv_seqlen=kv_lengths,
      q_offsets=q_offsets, kv_offsets=kv_offsets, scale=scale,
      mask_type=mask_type)
  return jnp.where(query_valid[:, :, None, None], out, 0).astype(out.dtype)


def dense_attention(query: Array, key: Array, value: Array, mask: Array,
                    scale: float | None = None) -> Array:
  """cuDNN flash attention given the dense (B, 1, T, S) boolean mask, which JAX turns into
  a bias (the call measured fastest on an H200, 2026-11-26, before the masks were native).
  `scale` multiplies the scores (default 1 / sqrt(H))."""
  check_size(query, key, "cudnn_dense")
  mask = jnp.broadcast_to(mask, (query.shape[0], 1, query.shape[1], key.shape[1]))
  return jax.nn.dot_product_attention(query, key, value, mask=mask, scale=scale,
                                      implementation="cudnn")


@jax.custom_vjp
def _zero_gradient_outside(x: Array, valid: Array) -> Array:
  """x itself; its gradient is zero where `valid` (B, L) is False, so that what a kernel
  leaves at positions no segment covers never reaches the weights."""
  return x


def _zero_gradient_forward(x: Array, valid: Array) -> tuple[Array, Array]:
  return x, valid


def _zero_gradient_backward(valid: Array, grad: Array) -> tuple[Array, None]:
  return jnp.where(valid[:, :, None, None], grad, 0).astype(grad.dtype), None


_zero_gradient_outside.defvjp(_zero_gradient_forward, _zero_gradient_backward)


def _lengths(segments: Array) -> Array:
  return jnp.sum(segments != 0, axis=1, dtype=jnp.int32)


def packed_layout(query_segments: Array, key_segments: Array, max_segments: int
                  ) -> tuple[tuple[Array, Array], tuple[Array, Array]]:
  """(B, T) and (B, S) segment ids (1 .. max_segments in order, each contiguous, query
  segment m meeting key segment m; 0 at a row's padding tail) -> cuDNN's packed layout:
  (offsets (B, M + 2), lengths (B, M + 1)) of the queries and of the keys, M =
  max_segments, -1 past a row's slots. Every query is in a slot: where both rows have a
  padding tail, the two tails are slot M + 1; padding queries facing a full key row extend
  the row's last segment (an empty query row becomes segment 1). Real queries keep their
  own segment's keys, so none sees a padding key; padding keys facing a full query row are
  in no slot (their gradients are zeroed by `cudnn_attention`)."""
  query_pad = query_segments == 0
  key_pad = key_segments == 0
  both = (query_pad.any(1) & key_pad.any(1))[:, None]
  last = jnp.maximum(query_segments.max(1, keepdims=True), 1)
  pad_slot = max_segments + 1
  queries = jnp.where(query_pad, jnp.where(both, pad_slot, last), query_segments)
  keys = jnp.where(key_pad & both, pad_slot, key_segments)
  return segment_offsets(queries, pad_slot), segment_offsets(keys, pad_slot)


def segment_offsets(segments: Array, max_segments: int) -> tuple[Array, Array]:
  """(B, L) segment ids (1, 2, ... in order, each contiguous; 0 in no segment) -> each
  row's segment starts (B, M + 1) and lengths (B, M), -1 past its last segment (JAX's
  binding turns them into offsets over the whole batch)."""
  ids = jnp.arange(1, max_segments + 1, dtype=segments.dtype)
  member = segments[:, None, :] == ids[None, :, None]                     # (B, M, L)
  lengths = member.sum(-1, dtype=jnp.int32)
  present = lengths > 0
  starts = jnp.where(present, jnp.argmax(member, axis=-1).astype(jnp.int32), -1)
  offsets = jnp.pad(starts, ((0, 0), (0, 1)), constant_values=-1)
  return offsets, jnp.where(present, lengths, -1)
