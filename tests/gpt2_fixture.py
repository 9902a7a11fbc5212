"""A small random GPT2LMHeadModel and its tokenizer files, written with save_pretrained,
offline: a byte-level BPE trained here on Shakespeare and saved in GPT-2's format (vocab.json
and merges.txt, <|endoftext|> last as in GPT-2), which GPT2Tokenizer loads. The source model
of the GPT-2 tests, and the transformers side of their comparisons."""

from __future__ import annotations

import gzip
import json
import os

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAKESPEARE = os.path.join(ROOT, "..", "shared", "data", "shakespeare")
END = "<|endoftext|>"


def lines(split: str = "train", limit: int | None = None) -> list[str]:
  """The split's non-blank lines (without their newline), the first `limit` of them."""
  found = []
  with gzip.open(os.path.join(SHAKESPEARE, f"{split}.txt.gz"), "rt", encoding="utf-8") as f:
    for line in f:
      if line.strip():
        found.append(line.rstrip("\n"))
        if limit and len(found) == limit:
          break
  return found


def write_tokenizer_files(directory: str, size: int = 400) -> None:
  """vocab.json and merges.txt of a byte-level BPE trained on Shakespeare."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=size, show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tokenizer.train_from_iterator(lines("train", 5000), trainer)
  tokenizer.model.save(directory)
  path = os.path.join(directory, "vocab.json")
  with open(path, encoding="utf-8") as f:
    vocab = json.load(f)
  vocab[END] = len(vocab)                       # GPT-2's one special token, its last id
  with open(path, "w", encoding="utf-8") as f:
    json.dump(vocab, f, ensure_ascii=False)


def write_gpt2_dir(directory: str, n_positions: int = 64) -> None:
  """A random GPT2LMHeadModel (GPT-2's architecture at n_embd 32, 2 layers, 4 heads) and
  its tokenizer, saved with save_pretrained."""
  import torch
  import transformers
  write_tokenizer_files(directory)
  tokenizer = transformers.GPT2Tokenizer.from_pretrained(directory)
  tokenizer.save_pretrained(directory)
  end = tokenizer.convert_tokens_to_ids(END)
  config = transformers.GPT2Config(
      vocab_size=len(tokenizer), n_positions=n_positions, n_embd=32, n_layer=2, n_head=4,
      bos_token_id=end, eos_token_id=end)
  torch.manual_seed(0)
  model = transformers.GPT2LMHeadModel(config).eval()
  with torch.no_grad():   # every tensor random, LayerNorms and biases included
    for name, p in model.named_parameters():
      p.copy_(1.0 + 0.2 * torch.randn_like(p) if name.endswith(("ln_1.weight", "ln_2.weight",
                                                                "ln_f.weight"))
              else 0.3 * torch.randn_like(p))
  model.save_pretrained(directory)


def hf_batch(tokenizer, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
  """GPT-2's ids of <|endoftext|> + each text, right-padded (with <|endoftext|>), and the
  attention mask."""
  end = tokenizer.convert_tokens_to_ids(END)
  rows = [[end] + tokenizer(t)["input_ids"] for t in texts]
  width = max(map(len, rows))
  ids = np.array([r + [end] * (width - len(r)) for r in rows])
  mask = np.array([[1] * len(r) + [0] * (width - len(r)) for r in rows])
  return ids, mask


def hf_logits(model, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
  import torch
  with torch.no_grad():
    return model(input_ids=torch.from_numpy(ids),
                 attention_mask=torch.from_numpy(mask)).logits.numpy()


def hf_greedy(model, tokenizer, prompt: str, count: int) -> list[int]:
  """generate(**tokenizer(prompt), do_sample=False), as users call it: the new ids, up to and
  with the end token. (Any Hugging Face causal LM and its tokenizer.)"""
  import torch
  inputs = tokenizer(prompt, return_tensors="pt")
  with torch.no_grad():
    out = model.generate(**inputs, do_sample=False, max_new_tokens=count,
                         pad_token_id=tokenizer.eos_token_id).numpy()[0]
  new = out[inputs["input_ids"].shape[1]:].tolist()
  end = tokenizer.eos_token_id
  return new[:new.index(end) + 1] if end in new else new
