"""TransformerConfig: every architecture choice in one frozen dataclass.

Defaults reproduce "Attention Is All You Need" (Vaswani et al., 2017); modern choices are
options. The config is validated on construction, so a bad value fails where it is written,
with the field's name, instead of deep inside a jitted function.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from transformer_jax.errors import UserError

# Token ids fixed across the project (tokenizers, data pipeline, decoding).
PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
UNK_ID = 3
# The output logit of PAD, BOS and UNK under `bos_is_eos`: far below what a model gives its
# real tokens, so their probability is 0 in float32; finite, so label smoothing's sum over
# every logit stays finite (it adds a constant to the smoothed loss, no gradient).
NO_TOKEN_LOGIT = -1e4

# The fused attention kernels (modules/kernels.py runs them).
KERNELS = ("pallas", "cudnn", "cudnn_dense", "splash")
_CHOICES = {
    "norm_position": ("post", "pre"),
    "positional": ("sinusoidal", "learned", "rotary"),
    "norm_type": ("layer", "rms", "rms_plus_one"),
    "rope_scaling": ("none", "linear", "llama3"),
    "activation": ("relu", "gelu", "swish", "silu", "relu2"),
    "sinusoidal_layout": ("interleaved", "halves"),
    "attention_impl": ("einsum", "xla", *KERNELS, "auto"),
    "remat_policy": ("none", "full", "dots", "dots_no_batch"),
    "weight_init": ("xavier", "gpt2"),
}
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Hyper-parameters of the encoder-decoder Transformer and its encoder-only heads.

  Attributes:
    vocab_size: source vocabulary size (and target's when `target_vocab_size` is None).
    target_vocab_size: target vocabulary size; None means the vocabulary is shared.
    d_model: width of the residual stream.
    num_heads: attention heads; d_model must be divisible by it (d_k = d_model / heads).
    d_ff: hidden width of the position-wise feed-forward network.
    num_encoder_layers / num_decoder_layers: depth of each stack (0 decoder layers is
      allowed for encoder-only models).
    dropout_rate: residual, embedding and feed-forward dropout (paper: 0.1 base, 0.3 big).
    attention_dropout_rate: dropout on attention weights (the paper uses none).
    activation_dropout_rate: dropout inside the feed-forward network (paper: none).
    max_len: longest sequence the positional encoding supports.
    share_embeddings: one embedding table for source and target (needs equal vocabularies).
    tie_output: the pre-softmax projection reuses the target embedding (paper §3.4).
    norm_position: "post" (paper: LayerNorm(x + Sublayer(x))) or "pre" (with a final norm).
    positional: "sinusoidal" (paper §3.5), "learned", or "rotary" (RoPE, Su et al. 2021:
      queries and keys of self-attention rotated by their position, so their dot product
      depends on relative position only; nothing is added to the embeddings).
    rope_theta: the base of the rotary frequencies (10,000 as in RoFormer and LLaMA).
    norm_type: "layer" (LayerNorm, the paper's) or "rms" (RMSNorm: no mean, no bias).
    gated_ffn: the feed-forward is act(x W_gate) * (x W_up) W_down (with activation
      "silu": SwiGLU, Shazeer 2020) instead of act(x W1) W2.
    num_kv_heads: key/value heads of self- and cross-attention (grouped-query attention,
      Ainslie et al. 2023); each serves num_heads / num_kv_heads query heads. None: as
      many as query heads (multi-head attention).
    use_bias: biases in the attention and feed-forward projections and the LayerNorms
      (False: none, as in PaLM and LLaMA).
    activation: feed-forward nonlinearity, "relu" (paper), "gelu" (tanh approximation), or
      "swish" / "silu" (two names of x * sigmoid(x), as Marian and Hugging Face spell it).
    sinusoidal_layout: where the sinusoids go: "interleaved" (paper: sin at even, cos at odd
      dimensions) or "halves" (sin in the first half, cos in the second; Marian/OPUS-MT).
    final_logits_bias: add a learned per-token bias to the output logits (Marian's
      `final_logits_bias`).
    zero_decoder_start: the decoder's start token (BOS) embeds to zeros (its position
      encoding is still added), as Marian starts its decoders and CTranslate2 runs them:
      set by imports from MarianMT, and for a model trained here that is to be deployed on
      CTranslate2 (convert --to=hf_marian).
    scale_embeddings: token embeddings are multiplied by sqrt(d_model) before the positions
      are added (paper §3.4); False: used as they are (GPT-2, whose tied output projection
      reads the same table).
    bos_is_eos: one token, EOS, both ends a text and starts the next (GPT-2's
      <|endoftext|>): BOS reads EOS's embedding row, and the output scores only EOS and the
      text's tokens, PAD, BOS and UNK (ids such a vocabulary lacks) getting the logit
      NO_TOKEN_LOGIT, so training never moves their rows. Set by convert --from=hf_gpt2.
    absent_ids: which of PAD, BOS and UNK an imported vocabulary has no token for (Llama's
      has no PAD, Llama 3's no UNK either), and the tokens an import's checkpoint has no
      embedding row for (Gemma 3 1B's tokenizer ends with an image token past its rows):
      the output scores them NO_TOKEN_LOGIT, as bos_is_eos does PAD, BOS and UNK, so the
      softmax over the real tokens is the source's.
    attention_impl: "einsum" (explicit; the only path that can return attention weights
      or apply attention dropout), "xla" (jax.nn.dot_product_attention with a dense mask),
      the fused kernels (modules/kernels.py) "pallas" (NVIDIA GPUs, self-attention),
      "cudnn" and "cudnn_dense" (NVIDIA GPUs) and "splash" (TPUs), which fall back to
      "xla" with a warning on another backend, or "auto": the path the platform compiled
      for has proved exact and fastest (kernels.AUTO: einsum on NVIDIA GPUs and CPUs,
      splash on TPUs).
    max_segments: the most sequences a packed row holds (the packer's bound; the trainer
      sets it from data.max_segments; 0: none given). cuDNN's packed layout is sized by it.
    dtype: compute dtype name ("float32" or "bfloat16"); parameters stay `param_dtype`.
    param_dtype: parameter storage dtype name.
    layer_norm_epsilon: LayerNorm epsilon.
    scan_layers: run each stack as one `nn.scan` over a layer with stacked parameters
      (leading logical axis "layers"), so compile time barely grows with depth. Parameters
      convert to and from the unrolled layout with `transformer_jax.params.stack_layers` /
      `unstack_layers`.
    remat_policy: rematerialise each layer's activations in the backward pass: "none",
      "full" (save nothing), "dots" (save matmul outputs), "dots_no_batch" (save only
      matmuls without batch dimensions, i.e. not attention scores).
    fused_qkv: self-attention projects query, key and value with one (d_model, 3, heads,
      d_k) kernel named "qkv" (convert with `params.fuse_qkv` / `split_qkv`).
    weight_init: "xavier" (the paper's model as Flax's WMT example and fairseq start it) or
      "gpt2" (GPT-2's and nanoGPT's); `modules/init.py` says what each draws.

  The options of today's open language models (convert/: Llama 3, Mistral, Qwen2/3,
  Gemma 3), each usable when training from scratch too:
    head_size: the attention's head dimension (0: d_model / num_heads; Qwen3 and Gemma 3
      give one of their own, so num_heads * head_size may differ from d_model).
    qkv_bias: biases on the query, key and value projections even without use_bias
      (Qwen2).
    qk_norm: each head's query and key normalised over the head dimension (the config's
      norm_type) before the rotary positions (Qwen3, Gemma 3; QK-norm).
    attention_scale: what the scores Q K^T are multiplied by (0: 1/sqrt(head dimension);
      Gemma 3: query_pre_attn_scalar^-0.5).
    sandwich_norm: pre-LN with a second norm on each sublayer's output before the residual
      sum, four norms a layer (Gemma 2 and 3).
    norm_type "rms_plus_one": RMSNorm scaled by 1 + w, w starting at 0 (Gemma).
    rope_scaling: the rotary frequencies "none" (theta^(-2i/H)), "linear" (all divided by
      rope_scaling_factor) or "llama3" (Llama 3.1's: the low frequencies divided, the high
      ones kept, blended between, by rope_low_freq_factor, rope_high_freq_factor and
      rope_original_max_len); `embedding.rotary_frequencies` computes them.
    sliding_window: a sliding layer's query sees only the keys fewer than this many
      positions back, itself included (0: none; Mistral v0.1, Gemma 3).
    layer_types: per layer, "sliding" or "full" (); empty: every layer sliding where
      sliding_window > 0. Scanned layers (scan_layers) must all be alike.
    local_rope_theta: the rotary base of sliding layers, unscaled (0: as the full layers;
      Gemma 3's 10,000 beside its full layers' 1,000,000).
    end_ids: token ids that end a text besides EOS (an import's other eos_token_ids:
      Llama 3's <|eot_id|>, Qwen's <|im_end|>); generation stops at any of them.

  Options of the modded-nanogpt speedrun's records (benchmarks/RESULTS.md measures them):
    activation "relu2": the feed-forward's ReLU squared.
    zero_init_residual: the two projections that write into the residual stream
      (attention's output, the feed-forward's second) start at zero, so each layer starts
      as the identity.
    logit_softcap: logits become c * tanh(logits / c) with c this (0: off; Gemma 2's
      final_logit_softcapping).
  """

  vocab_size: int
  target_vocab_size: int | None = None
  d_model: int = 512
  num_heads: int = 8
  d_ff: int = 2048
  num_encoder_layers: int = 6
  num_decoder_layers: int = 6
  dropout_rate: float = 0.1
  attention_dropout_rate: float = 0.0
  activation_dropout_rate: float = 0.0
  max_len: int = 512
  share_embeddings: bool = True
  tie_output: bool = True
  norm_position: str = "post"
  positional: str = "sinusoidal"
  rope_theta: float = 10000.0
  norm_type: str = "layer"
  gated_ffn: bool = False
  num_kv_heads: int | None = None
  use_bias: bool = True
  activation: str = "relu"
  sinusoidal_layout: str = "interleaved"
  final_logits_bias: bool = False
  zero_decoder_start: bool = False
  scale_embeddings: bool = True
  bos_is_eos: bool = False
  absent_ids: tuple[int, ...] = ()
  attention_impl: str = "xla"
  dtype: str = "float32"
  param_dtype: str = "float32"
  layer_norm_epsilon: float = 1e-6
  scan_layers: bool = False
  remat_policy: str = "none"
  fused_qkv: bool = False
  weight_init: str = "xavier"
  max_segments: int = 0
  head_size: int = 0
  qkv_bias: bool = False
  qk_norm: bool = False
  attention_scale: float = 0.0
  sandwich_norm: bool = False
  rope_scaling: str = "none"
  rope_scaling_factor: float = 1.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_len: int = 0
  sliding_window: int = 0
  layer_types: tuple[str, ...] = ()
  local_rope_theta: float = 0.0
  end_ids: tuple[int, ...] = ()
  zero_init_residual: bool = False
  logit_softcap: float = 0.0

  # ----------------------------------------------------------------------------- presets
  @classmethod
  def base(cls, vocab_size: int, **overrides: Any) -> "TransformerConfig":
    """Transformer (base) of the paper's Table 3: N=6, d_model 512, d_ff 2048, h=8."""
    return cls(vocab_size=vocab_size, **overrides)

  @classmethod
  def big(cls, vocab_size: int, **overrides: Any) -> "TransformerConfig":
    """Transformer (big): d_model 1024, d_ff 4096, h=16, dropout 0.3."""
    params = dict(d_model=1024, d_ff=4096, num_heads=16, dropout_rate=0.3)
    return cls(vocab_size=vocab_size, **{**params, **overrides})

  @classmethod
  def small(cls, vocab_size: int, **overrides: Any) -> "TransformerConfig":
    """A tiny model for tests and the CPU default job."""
    params = dict(d_model=64, d_ff=128, num_heads=4, num_encoder_layers=2,
                  num_decoder_layers=2, max_len=128)
    return cls(vocab_size=vocab_size, **{**params, **overrides})

  @classmethod
  def from_dict(cls, values: dict[str, Any]) -> "TransformerConfig":
    """Builds a config from a mapping, naming any key that is not a field."""
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - fields)
    if unknown:
      raise UserError(f"TransformerConfig: unknown option(s) {unknown}; "
                      f"valid options are {sorted(fields)}")
    return cls(**values)

  def replace(self, **changes: Any) -> "TransformerConfig":
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  # -------------------------------------------------------------------------- derived
  @property
  def tgt_vocab_size(self) -> int:
    return self.vocab_size if self.target_vocab_size is None else self.target_vocab_size

  @property
  def kv_heads(self) -> int:
    return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

  @property
  def head_dim(self) -> int:
    return self.head_size or self.d_model // self.num_heads

  def layer_sliding(self, index: int) -> bool:
    """Whether layer `index` (of either stack) sees a sliding window of keys."""
    if self.layer_types:
      return self.layer_types[index] == "sliding"
    return self.sliding_window > 0

  @property
  def no_token_ids(self) -> tuple[int, ...]:
    """The ids the output never scores (absent_ids; PAD, BOS and UNK under bos_is_eos)."""
    if self.bos_is_eos:
      return tuple(sorted({PAD_ID, BOS_ID, UNK_ID, *self.absent_ids}))
    return self.absent_ids

  @property
  def compute_dtype(self) -> Any:
    return _DTYPES[self.dtype]

  @property
  def params_dtype(self) -> Any:
    return _DTYPES[self.param_dtype]

  # ------------------------------------------------------------------------ validation
  def __post_init__(self) -> None:
    def fail(field: str, message: str) -> None:
      raise UserError(f"TransformerConfig.{field}={getattr(self, field)!r}: {message}")

    for field in ("vocab_size", "d_model", "num_heads", "d_ff", "max_len"):
      value = getattr(self, field)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        fail(field, "must be a positive integer")
    for field in ("num_encoder_layers", "num_decoder_layers", "max_segments", "head_size",
                  "sliding_window", "rope_original_max_len"):
      value = getattr(self, field)
      if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        fail(field, "must be a non-negative integer")
    if self.target_vocab_size is not None and (
        not isinstance(self.target_vocab_size, int) or isinstance(self.target_vocab_size, bool)
        or self.target_vocab_size <= 0):
      fail("target_vocab_size", "must be a positive integer or None (shared vocabulary)")
    if self.d_model % self.num_heads and not self.head_size:
      fail("d_model", f"must be divisible by num_heads={self.num_heads} (or give head_size)")
    for field in ("dropout_rate", "attention_dropout_rate", "activation_dropout_rate"):
      value = getattr(self, field)
      if not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        fail(field, "must be a number in [0, 1)")
    if not isinstance(self.layer_norm_epsilon, (int, float)) or self.layer_norm_epsilon <= 0:
      fail("layer_norm_epsilon", "must be a positive number")
    for field in ("scan_layers", "fused_qkv", "final_logits_bias", "zero_decoder_start",
                  "gated_ffn", "use_bias", "scale_embeddings", "bos_is_eos", "qkv_bias",
                  "qk_norm", "sandwich_norm", "zero_init_residual"):
      if not isinstance(getattr(self, field), bool):
        fail(field, "must be True or False")
    for field in ("absent_ids", "layer_types", "end_ids"):
      if isinstance(getattr(self, field), list):   # as JSON gives it back
        object.__setattr__(self, field, tuple(getattr(self, field)))
    if not isinstance(self.absent_ids, tuple) or any(
        not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.tgt_vocab_size
        or i == EOS_ID for i in self.absent_ids):
      fail("absent_ids", f"must be a tuple of ids of the vocabulary other than EOS {EOS_ID} "
           f"(PAD {PAD_ID}, BOS {BOS_ID}, UNK {UNK_ID}, or an import's tokens its checkpoint "
           "has no row for)")
    for field, choices in _CHOICES.items():
      if getattr(self, field) not in choices:
        fail(field, f"must be one of {choices}")
    if self.num_kv_heads is not None:
      if (not isinstance(self.num_kv_heads, int) or isinstance(self.num_kv_heads, bool)
          or self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads):
        fail("num_kv_heads", f"must be a positive divisor of num_heads={self.num_heads} "
             "(or None: one key/value head per query head)")
      if self.fused_qkv and self.num_kv_heads != self.num_heads:
        fail("fused_qkv", "projects as many key/value heads as query heads; set it to "
             "False for grouped-query attention (num_kv_heads < num_heads)")
    if self.positional == "rotary" and self.head_dim % 2:
      fail("positional", f"rotary positions rotate pairs of dimensions: the head dimension "
           f"{self.head_dim} (head_size, or d_model / num_heads) must be even")
    if not isinstance(self.rope_theta, (int, float)) or not self.rope_theta > 0:
      fail("rope_theta", "must be a positive number")
    self._check_modern_options(fail)
    if self.attention_impl in KERNELS and self.attention_dropout_rate > 0:
      fail("attention_dropout_rate", f"the {self.attention_impl} kernel has no attention "
           "dropout; set it to 0, or attention_impl to 'einsum'")   # "auto": experiment.py
    for field in ("dtype", "param_dtype"):
      if getattr(self, field) not in _DTYPES:
        fail(field, f"must be one of {tuple(_DTYPES)}")
    if self.share_embeddings and self.tgt_vocab_size != self.vocab_size:
      fail("share_embeddings", f"needs equal vocabularies, got vocab_size={self.vocab_size} "
           f"and target_vocab_size={self.target_vocab_size}; set share_embeddings=False")

  def _check_modern_options(self, fail: Any) -> None:
    """The options of today's open language models (see the class doc)."""
    for field in ("attention_scale", "local_rope_theta", "logit_softcap"):
      value = getattr(self, field)
      if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
        fail(field, "must be a number >= 0 (0: the default)")
    if self.rope_scaling != "none":
      if not isinstance(self.rope_scaling_factor, (int, float)) or self.rope_scaling_factor < 1:
        fail("rope_scaling_factor", "must be a number >= 1")
    if self.rope_scaling == "llama3":
      if not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
        fail("rope_low_freq_factor", "must be > 0 and below rope_high_freq_factor="
             f"{self.rope_high_freq_factor}")
      if not self.rope_original_max_len:
        fail("rope_original_max_len", "rope_scaling='llama3' needs the context the model "
             "was trained at (a positive integer)")
    layers = max(self.num_encoder_layers, self.num_decoder_layers)
    if self.layer_types:
      if (any(kind not in ("sliding", "full") for kind in self.layer_types)
          or len(self.layer_types) != layers
          or (self.num_encoder_layers and self.num_decoder_layers)):
        fail("layer_types", f"must name 'sliding' or 'full' for each of the {layers} layers "
             "of a one-stack model (or be empty)")
      if "sliding" in self.layer_types and not self.sliding_window:
        fail("layer_types", "names sliding layers; give their sliding_window too")
      if self.scan_layers and len(set(self.layer_types)) > 1:
        fail("scan_layers", "scanned layers must be alike; layer_types mixes sliding and "
             "full layers: set scan_layers=False")
    if not isinstance(self.end_ids, tuple) or any(
        not isinstance(i, int) or isinstance(i, bool) or not 0 < i < self.tgt_vocab_size
        or i in (BOS_ID, UNK_ID) for i in self.end_ids):
      fail("end_ids", "must be ids of tokens of the vocabulary (not PAD, BOS or UNK)")
