"""aot/roofline.py: a compiled GPU program's kernels priced (bytes at HBM bandwidth or FLOPs at
peak) and grouped by the source operation they came from."""

from __future__ import annotations

import pytest

from transformer_jax.aot import roofline

# A module of the GPU compiler's shape: a GEMM fusion, an elementwise fusion from the
# attention's softmax, one from the loss scope, and views that move nothing.
HLO = """
%gemm_computation (p0: bf16[64,32], p1: bf16[32,16]) -> bf16[64,16] {
  %p0 = bf16[64,32]{1,0} parameter(0)
  %p1 = bf16[32,16]{1,0} parameter(1)
  ROOT %dot.1 = bf16[64,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/jvp(Transformer)/decoder/layer_0/feed_forward/wi/dot_general"}
}

%softmax_computation (p2: bf16[64,16]) -> f32[64,16] {
  %p2 = bf16[64,16]{1,0} parameter(0)
  ROOT %e = f32[64,16]{1,0} exponential(%p2)
}

ENTRY %main (a: bf16[64,32], b: bf16[32,16]) -> f32[64] {
  %a = bf16[64,32]{1,0} parameter(0)
  %b = bf16[32,16]{1,0} parameter(1)
  %gemm_fusion = bf16[64,16]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm_computation, metadata={op_name="jit(step)/jvp(Transformer)/decoder/layer_0/feed_forward/wi/dot_general"}
  %bitcast.1 = bf16[64,16]{1,0} bitcast(%gemm_fusion)
  %loop_fusion = f32[64,16]{1,0} fusion(%bitcast.1), kind=kLoop, calls=%softmax_computation, metadata={op_name="jit(step)/jvp(Transformer)/decoder/layer_0/self_attention/exp"}
  ROOT %reduce_fusion = f32[64]{0} fusion(%loop_fusion), kind=kInput, calls=%softmax_computation, metadata={op_name="jit(step)/jvp(loss)/reduce_sum"}
}
"""


def test_each_kernel_is_priced_and_grouped_by_where_it_came_from():
  families = {f.name: f for f in roofline.breakdown(HLO, peak_flops=1e12, bandwidth=1e9)}
  gemm = families[roofline.MATMUL_WEIGHTS]
  assert gemm.flops == 2 * 64 * 16 * 32 and gemm.kernels == 1
  assert gemm.bytes == 2 * (64 * 32 + 32 * 16 + 64 * 16)       # bf16 operands and result
  assert gemm.seconds == pytest.approx(gemm.bytes / 1e9)        # memory-bound here
  softmax = families[roofline.SOFTMAX]
  assert softmax.bytes == 2 * 64 * 16 + 4 * 64 * 16 and softmax.flops == 0
  assert families[roofline.LOSS].bytes == 4 * 64 * 16 + 4 * 64
  assert set(families) == {roofline.MATMUL_WEIGHTS, roofline.SOFTMAX, roofline.LOSS}
  assert roofline.calibrated(list(families.values()), 2 * sum(
      f.seconds for f in families.values())) == pytest.approx(2.0)


@pytest.mark.parametrize("op_name, family", [
    ("jit(step)/jvp(Transformer)/decoder/layer_3/Dropout_0/jit(_bernoulli)/xor", roofline.DROPOUT),
    ("jit(step)/transpose(jvp(Transformer))/encoder/layer_0/self_attention_norm/mul",
     roofline.NORMS),
    ("jit(step)/optimizer/jit(_where)/select_n", roofline.OPTIMIZER),
    ("jit(step)/jvp(Transformer)/encoder/layer_0/self_attention/out/add", roofline.OTHER),
    ("jit(step)/jvp(Transformer)/decoder/layer_1/cross_attention/jit(_where)/select_n",
     roofline.SOFTMAX),
])
def test_elementwise_kernels_take_the_family_of_their_source(op_name, family):
  assert roofline.family_of(op_name, "fusion", "loop_fusion", is_gemm=False) == family


def test_matmuls_are_the_weights_or_attentions_products():
  attention = "jit(step)/transpose(jvp(Transformer))/decoder/layer_0/self_attention/"
  assert roofline.family_of(attention + "bnts,bsnh->btnh/dot_general", "fusion", "gemm",
                            is_gemm=True) == roofline.MATMUL_ATTENTION
  assert roofline.family_of(attention + "out/dot_general", "fusion", "gemm",
                            is_gemm=True) == roofline.MATMUL_WEIGHTS
