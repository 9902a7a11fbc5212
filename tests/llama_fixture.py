"""Small random LlamaForCausalLM models and their tokenizers, written with save_pretrained,
offline, in the two kinds of Llama tokenizer, both trained here on Shakespeare:

- "untied" (TinyLlama's and Llama 2's shape): a SentencePiece BPE with byte fallback
  (<unk> 0, <s> 1, </s> 2) converted by transformers' LlamaTokenizer, tokenizer_config.json
  saying add_bos_token as TinyLlama's does; an untied lm_head.
- "tied" (Llama 3.2's shape): a byte-level BPE with <|begin_of_text|> and <|end_of_text|>
  last, whose tokenizer.json post-processor adds the BOS (Llama 3's way; no add_bos_token);
  lm_head tied to the embeddings, rope_theta 500,000.

Both have grouped-query attention (4 heads, 2 key/value heads), 2 layers, 32 wide."""

from __future__ import annotations

import io
import json
import os

from gpt2_fixture import lines

VARIANTS = ("untied", "tied")
BEGIN, END = "<|begin_of_text|>", "<|end_of_text|>"


def _sentencepiece_tokenizer(directory: str, size: int = 400):
  import sentencepiece as spm
  import transformers
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(lines("train", 3000)), model_writer=model, vocab_size=size,
      model_type="bpe", byte_fallback=True, character_coverage=1.0, unk_id=0, bos_id=1,
      eos_id=2, pad_id=-1, num_threads=1, minloglevel=2)
  path = os.path.join(directory, "tokenizer.model")
  with open(path, "wb") as f:
    f.write(model.getvalue())
  tokenizer = transformers.LlamaTokenizer.from_pretrained(directory, legacy=False,
                                                          add_bos_token=True)
  os.remove(path)
  tokenizer.save_pretrained(directory)   # tokenizer.json's post-processor adds <s>
  config_path = os.path.join(directory, "tokenizer_config.json")
  with open(config_path) as f:
    config = json.load(f)
  with open(config_path, "w") as f:   # as TinyLlama's says it (transformers 5 reads the above)
    json.dump({**config, "add_bos_token": True, "add_eos_token": False, "legacy": False}, f)
  return transformers.AutoTokenizer.from_pretrained(directory)


def _byte_level_tokenizer(directory: str, size: int = 400):
  import transformers
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  tokenizer.train_from_iterator(lines("train", 3000), trainers.BpeTrainer(
      vocab_size=size, show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tokenizer.add_special_tokens([BEGIN, END])
  tokenizer.post_processor = processors.Sequence([
      processors.ByteLevel(trim_offsets=False),
      processors.TemplateProcessing(single=f"{BEGIN} $A", pair=f"{BEGIN} $A {BEGIN} $B",
                                    special_tokens=[(BEGIN, tokenizer.token_to_id(BEGIN))])])
  transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BEGIN,
                                       eos_token=END).save_pretrained(directory)
  return transformers.AutoTokenizer.from_pretrained(directory)


def write_llama_dir(directory: str, variant: str, max_len: int = 64) -> None:
  """A random LlamaForCausalLM of `variant` (see the module doc) and its tokenizer, saved
  with save_pretrained."""
  import torch
  import transformers
  tied = variant == "tied"
  tokenizer = (_byte_level_tokenizer if tied else _sentencepiece_tokenizer)(directory)
  config = transformers.LlamaConfig(
      vocab_size=len(tokenizer), hidden_size=32, intermediate_size=72, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_len,
      rms_norm_eps=1e-5, rope_theta=500000.0 if tied else 10000.0, tie_word_embeddings=tied,
      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
  torch.manual_seed(1 if tied else 0)
  model = transformers.LlamaForCausalLM(config).eval()
  with torch.no_grad():   # every tensor random, the norms' weights too
    for name, p in model.named_parameters():
      p.copy_(1.0 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight")
              else 0.3 * torch.randn_like(p))
  model.save_pretrained(directory)
