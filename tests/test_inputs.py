"""Host-side input checks (check_token_ids / check_inputs) and why the model needs them."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import VOCAB, random_tokens, tiny_config, transformer_apply, transformer_variables

from transformer_jax import InputError, TransformerConfig, check_inputs, check_token_ids

MAX_LEN = 16


def test_input_error_is_a_value_error():
  assert issubclass(InputError, ValueError)


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint8, np.int16])
def test_valid_input_passes_and_returns_int32(dtype):
  tokens = np.array([[1, 2, 3, 0], [VOCAB - 1, 5, 0, 0]], dtype)
  out = check_token_ids(tokens, VOCAB, MAX_LEN, "src")
  assert out.dtype == np.int32 and out.shape == (2, 4)
  np.testing.assert_array_equal(out, tokens.astype(np.int64))


def test_python_lists_are_accepted():
  out = check_token_ids([[1, 2], [3, 0]], VOCAB, MAX_LEN, "src")
  assert out.dtype == np.int32
  np.testing.assert_array_equal(out, [[1, 2], [3, 0]])


def test_boundaries_are_inclusive_where_they_should_be():
  check_token_ids(np.array([[0, VOCAB - 1]]), VOCAB, MAX_LEN, "src")       # ids 0 and V-1
  check_token_ids(np.ones((1, MAX_LEN), np.int32), VOCAB, MAX_LEN, "src")  # length == max_len


def test_id_at_or_above_vocab_names_the_id_and_its_position():
  tokens = np.array([[1, 2, 3], [4, VOCAB, VOCAB + 5]], np.int32)
  with pytest.raises(InputError) as info:
    check_token_ids(tokens, VOCAB, MAX_LEN, "source tokens")
  message = str(info.value)
  assert "source tokens" in message
  assert f"token id {VOCAB} " in message and "[1, 1]" in message   # the first bad one
  assert str(VOCAB) in message and "2 id(s)" in message            # vocabulary and count


def test_negative_id_names_the_id_and_its_position():
  tokens = np.array([[1, -1, 3]], np.int32)
  with pytest.raises(InputError) as info:
    check_token_ids(tokens, VOCAB, MAX_LEN, "target tokens")
  message = str(info.value)
  assert "target tokens" in message and "-1" in message and "[0, 1]" in message


def test_too_long_names_length_and_max_len():
  with pytest.raises(InputError) as info:
    check_token_ids(np.ones((2, MAX_LEN + 3), np.int32), VOCAB, MAX_LEN, "src")
  message = str(info.value)
  assert str(MAX_LEN + 3) in message and f"max_len={MAX_LEN}" in message


@pytest.mark.parametrize("shape", [(5,), (2, 3, 4), ()])
def test_non_2d_input_is_rejected(shape):
  with pytest.raises(InputError) as info:
    check_token_ids(np.ones(shape, np.int32), VOCAB, MAX_LEN, "src")
  assert "2-D" in str(info.value) and str(shape) in str(info.value)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.bool_])
def test_non_integer_dtype_is_rejected(dtype):
  with pytest.raises(InputError) as info:
    check_token_ids(np.ones((2, 3), dtype), VOCAB, MAX_LEN, "src")
  message = str(info.value)
  assert "integer" in message and np.dtype(dtype).name in message


def test_check_inputs_uses_each_sides_vocabulary_and_max_len():
  cfg = TransformerConfig.small(VOCAB, target_vocab_size=VOCAB + 10, share_embeddings=False,
                                max_len=MAX_LEN)
  src = np.array([[1, 2, 3]])
  tgt = np.array([[1, VOCAB + 5]])                       # valid only for the target side
  out_src, out_tgt = check_inputs(cfg, src, tgt)
  assert out_src.dtype == np.int32 and out_tgt.dtype == np.int32
  with pytest.raises(InputError, match="source tokens"):
    check_inputs(cfg, tgt, src)                          # VOCAB + 5 is no source id
  with pytest.raises(InputError, match="target tokens"):
    check_inputs(cfg, src, np.array([[1, VOCAB + 10]]))
  with pytest.raises(InputError, match=f"max_len={MAX_LEN}"):
    check_inputs(cfg, np.ones((1, MAX_LEN + 1), np.int32))
  src_only, none = check_inputs(cfg, src)
  assert none is None and src_only.dtype == np.int32


def test_check_inputs_rejects_mismatched_batch_sizes():
  with pytest.raises(InputError) as info:
    check_inputs(tiny_config(), np.ones((2, 3), np.int32), np.ones((3, 3), np.int32))
  assert "2" in str(info.value) and "3" in str(info.value)


# ------------------------------------------------------- why the checks are needed at all
def test_model_silently_accepts_out_of_range_ids_that_check_inputs_rejects():
  """JAX gathers are not bounds-checked and raise nothing: an id >= vocab_size reads a NaN
  row (jnp.take's default 'fill' mode; older JAX clamped to the last row instead) and a
  negative id wraps around to the end of the table. check_inputs catches both on the host."""
  cfg = tiny_config()
  apply, variables = transformer_apply(cfg), transformer_variables(cfg)
  src, tgt = random_tokens(50, 2, 8), random_tokens(51, 2, 7)

  def logits_with(bad_id):
    bad = src.copy()
    bad[0, 3] = bad_id
    return bad, np.asarray(apply(variables, bad, tgt))

  last_row = logits_with(VOCAB - 1)[1]

  too_big, out = logits_with(VOCAB)                    # no exception from the model
  assert not np.all(np.isfinite(out)) or np.allclose(out, last_row, atol=1e-5)
  with pytest.raises(InputError, match=f"token id {VOCAB} at \\[0, 3\\]"):
    check_inputs(cfg, too_big, tgt)

  negative, out = logits_with(-1)                      # no exception, finite, but wrong
  assert np.all(np.isfinite(out))
  np.testing.assert_allclose(out, last_row, atol=1e-5)
  with pytest.raises(InputError, match=r"token id -1 at \[0, 3\]"):
    check_inputs(cfg, negative, tgt)
