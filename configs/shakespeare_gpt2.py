"""GPT-2 fine-tuned on Shakespeare's plays (nanoGPT's finetune_shakespeare, on this
project's trainer): the character model's run (configs/shakespeare_char.py) with the model
and byte-level BPE of an import from Hugging Face, a fresh optimizer, and the text as one
stream of GPT-2 tokens.

  python -m transformer_jax.convert --from=hf_gpt2 --input=gpt2 --workdir=workdirs/gpt2
  python train.py --config=configs/shakespeare_gpt2.py --workdir=workdirs/shakespeare_gpt2
  printf 'ROMEO:\\n' | python -m transformer_jax.predict --workdir=workdirs/shakespeare_gpt2
  python -m transformer_jax.convert --to=hf_gpt2 --workdir=workdirs/shakespeare_gpt2 \\
      --output=gpt2-shakespeare

init_from names the import: the architecture, the vocabulary and the tokenizer are its
(data.tokenizer="byte_bpe" says so: GPT-2's tokenizer is not trained here). From this file
come the data, the optimizer, the steps and the fine-tuning fields of the model group
(dropout rates, dtype, attention_impl, remat_policy).
"""

import ml_collections

from configs import shakespeare_char


def get_config() -> ml_collections.ConfigDict:
  config = shakespeare_char.get_config()
  config.init_from = "workdirs/gpt2/exports/hf_gpt2"
  config.update(dict(num_train_steps=200, log_every_steps=10, eval_every_steps=100,
                     checkpoint_every_steps=100, keep_checkpoints=1, batch_size=8))
  config.data.update(dict(tokenizer="byte_bpe", max_length=256, eval_max_length=256))
  # max_len: GPT-2's context (the model is the import's), which the batches must fit.
  config.model.update(dict(max_len=1024, dropout_rate=0.0, attention_dropout_rate=0.0))
  # nanoGPT's fine-tuning optimizer: AdamW at a constant rate.
  config.optimizer.update(dict(name="adamw", schedule="constant", learning_rate=3e-5,
                               end_learning_rate=3e-5, warmup_steps=0, weight_decay=0.0))
  config.decode.update(dict(max_new_tokens=100, top_k=200))
  config.eval.update(dict(batch_size=16))
  return config
