"""Small random checkpoints of the causal LM families people bring in 2026, each written by
transformers' own model class with save_pretrained, offline, with a byte-level BPE trained
here on Shakespeare and the special tokens of the family:

- "llama3" (Llama 3.2's shape): rope_scaling "llama3" (factor 8 over an original context of
  16 positions), three eos_token_ids (<|end_of_text|>, <|eom_id|>, <|eot_id|>), a tied
  output, generation_config.json sampling at temperature 0.6, top_p 0.9;
- "mistral" (Mistral 7B v0.1's): a sliding window of 8 keys over every layer, untied;
- "qwen2" (Qwen2.5's): biases on q, k, v, no BOS, eos <|im_end|> and <|endoftext|>, tied,
  generation_config.json sampling at 0.7, top_p 0.8, top_k 20, as Qwen2.5-Instruct's; its
  embedding padded past the tokenizer by 8 zero rows, as Qwen pads its vocab_size;
- "qwen3" (Qwen3's): q/k RMSNorms, head_dim 16 with 4 heads over a width of 32;
- "gemma3" (Gemma 3's text model): (1 + w) norms, four a layer, q/k norms, sqrt(d) embeddings,
  GELU-tanh, query_pre_attn_scalar 24, layer_types sliding, sliding, full with windows of 6,
  the full layers' rope linearly scaled by 4, the sliding ones' base 10,000, eos <eos> and
  <end_of_turn>; its tokenizer's last token (<image_soft_token>) past the embedding's rows,
  and no tie_word_embeddings in config.json (tied by Gemma's default), as Gemma 3 1B's
  files are.

Every weight is random, the norms' too, and away from their start (1, or 0 for Gemma's
1 + w), so a misplaced offset shows. Lengths of 40 tokens pass every window and the
llama3 scaling's original context."""

from __future__ import annotations

import json
import os

from gpt2_fixture import lines

FAMILIES = ("llama3", "mistral", "qwen2", "qwen3", "gemma3")
# Each family's special tokens, its bos (None: none added), eos, and further end tokens.
_TOKENS = {
    "llama3": (["<|begin_of_text|>", "<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"],
               "<|begin_of_text|>", "<|end_of_text|>", ["<|eom_id|>", "<|eot_id|>"]),
    "mistral": (["<s>", "</s>"], "<s>", "</s>", []),
    "qwen2": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>",
              ["<|endoftext|>"]),
    "qwen3": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>",
              ["<|endoftext|>"]),
    "gemma3": (["<pad>", "<eos>", "<bos>", "<unk>", "<end_of_turn>", "<image_soft_token>"],
               "<bos>", "<eos>", ["<end_of_turn>"]),
}
_GENERATION = {"llama3": {"do_sample": True, "temperature": 0.6, "top_p": 0.9},
               "qwen2": {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20}}
MAX_LEN = 64
# Embedding rows beyond (Qwen) or short of (Gemma 3 1B) the tokenizer's tokens.
EXTRA_ROWS = {"qwen2": 8, "gemma3": -1}


def _tokenizer(directory: str, family: str, size: int = 400):
  import transformers
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
  specials, bos, eos, _ = _TOKENS[family]
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  tokenizer.train_from_iterator(lines("train", 3000), trainers.BpeTrainer(
      vocab_size=size, show_progress=False, special_tokens=specials if family == "gemma3"
      else [], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tokenizer.add_special_tokens(specials)
  steps = [processors.ByteLevel(trim_offsets=False)]
  if bos:
    steps.append(processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
        special_tokens=[(bos, tokenizer.token_to_id(bos))]))
  tokenizer.post_processor = processors.Sequence(steps)
  named = {"bos_token": bos, "eos_token": eos}
  if family == "gemma3":
    named.update(pad_token="<pad>", unk_token="<unk>")
  transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, **named).save_pretrained(
      directory)
  return transformers.AutoTokenizer.from_pretrained(directory)


def _config(family: str, tokenizer):
  import transformers
  _, _, eos, more = _TOKENS[family]
  ends = [tokenizer.convert_tokens_to_ids(t) for t in [eos, *more]]
  shared = dict(vocab_size=len(tokenizer) + EXTRA_ROWS.get(family, 0), hidden_size=32, intermediate_size=72,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=MAX_LEN, rms_norm_eps=1e-5,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=ends if more else ends[0])
  if family == "llama3":
    return transformers.LlamaConfig(**shared, tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
  if family == "mistral":
    return transformers.MistralConfig(**shared, sliding_window=8, tie_word_embeddings=False)
  if family == "qwen2":
    return transformers.Qwen2Config(**{**shared, "bos_token_id": ends[1]},
                                    tie_word_embeddings=True, rope_theta=1000000.0)
  if family == "qwen3":
    return transformers.Qwen3Config(**{**shared, "bos_token_id": ends[1]}, head_dim=16,
                                    tie_word_embeddings=False)
  return transformers.Gemma3TextConfig(
      **shared, head_dim=16, query_pre_attn_scalar=24, sliding_window=6,
      layer_types=["sliding_attention", "sliding_attention", "full_attention"],
      pad_token_id=tokenizer.pad_token_id, rope_parameters={
          "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
          "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})


def model_class(family: str):
  import transformers
  return {"llama3": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
          "qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM,
          "gemma3": transformers.Gemma3ForCausalLM}[family]


def write_family_dir(directory: str, family: str, dtype=None, **save_options):
  """A random model of `family` (see the module doc) and its tokenizer, saved with
  save_pretrained in `dtype` (a torch dtype; default float32; `save_options`: e.g.
  max_shard_size); returns the model."""
  import torch
  tokenizer = _tokenizer(directory, family)
  config = _config(family, tokenizer)
  torch.manual_seed(FAMILIES.index(family))
  model = model_class(family)(config).eval()
  with torch.no_grad():   # every tensor random, the norms' weights too
    for name, p in model.named_parameters():
      p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    if EXTRA_ROWS.get(family, 0) > 0:   # padding rows, never a token's
      model.get_input_embeddings().weight[len(tokenizer):] = 0
  if dtype is not None:
    model = model.to(dtype)
  model.save_pretrained(directory, **save_options)
  if family == "gemma3":   # as Gemma 3's published config.json: tied by Gemma's default
    path = os.path.join(directory, "config.json")
    with open(path) as f:
      config = json.load(f)
    config.pop("tie_word_embeddings", None)
    with open(path, "w") as f:
      json.dump(config, f)
  if family in _GENERATION:
    path = os.path.join(directory, "generation_config.json")
    with open(path) as f:
      generation = json.load(f)
    with open(path, "w") as f:
      json.dump({**generation, **_GENERATION[family]}, f)
  return model


def end_ids(family: str, tokenizer) -> list[int]:
  """The family's end tokens' ids (theirs): eos first."""
  _, _, eos, more = _TOKENS[family]
  return [tokenizer.convert_tokens_to_ids(t) for t in [eos, *more]]
