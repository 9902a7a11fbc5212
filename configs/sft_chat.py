"""Chat supervised fine-tuning (SFT) of an imported chat model, its loss on the assistant's
tokens only (TRL's SFTTrainer with assistant-only loss), through LoRA adapters of rank 16:

  python -m transformer_jax.convert --from=hf --input=Qwen/Qwen2.5-0.5B-Instruct \\
      --workdir=workdirs/qwen2.5-0.5b-instruct
  python -m benchmarks.sst2_chat --data=../shared/data/sst2 --out=workdirs/sst2_chat
  python train.py --config=configs/sft_chat.py --workdir=workdirs/sft_chat

data.dir holds train.jsonl and validation.jsonl (gzipped or not), one conversation a line,
{"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}, rendered
with the import's chat template and tokenizer (data.layout="chat", tasks/lm.py; docs/
pretrained_models.md). Conversations are packed into rows of 512 tokens, each keeping its
own weights. init_from names the import's parameter snapshot (W/exports/hf_<family>, e.g.
hf_llama for Llama 3.2 Instruct); from it come the architecture, the tokenizer and its
template. AdamW at 2e-4 (a rate for adapters; about 2e-5 with lora.rank=0, the whole model
trained), 30 warm-up steps, cosine to 2e-5 over 300 steps of 16 rows, no dropout or label
smoothing; greedy samples of the first replies at each evaluation.
"""

import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
  config = default.get_config()
  config.task = "lm"
  config.init_from = "workdirs/qwen2.5-0.5b-instruct/exports/hf_qwen2"
  config.update(dict(num_train_steps=300, log_every_steps=10, eval_every_steps=100,
                     checkpoint_every_steps=100, keep_checkpoints=1, batch_size=16,
                     label_smoothing=0.0))
  config.data = default.text_data(
      dir="workdirs/sst2_chat", tokenizer="hf_tokenizer", layout="chat", max_length=512,
      eval_max_length=512)
  # max_len: at least the rows' length (the model, its context included, is the import's).
  config.model.update(dict(max_len=32768, dropout_rate=0.0, attention_dropout_rate=0.0))
  config.optimizer.update(dict(
      name="adamw", b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0, schedule="warmup_cosine",
      learning_rate=2e-4, end_learning_rate=2e-5, warmup_steps=30, clip_grad_norm=1.0))
  config.lora.update(dict(rank=16, alpha=16.0))
  config.decode.update(dict(max_new_tokens=32, temperature=0.0))
  config.eval.update(dict(batch_size=16, examples=0, num_samples=3))
  return config
