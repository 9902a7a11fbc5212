"""Log-probabilities in OpenAI's legacy completions shape (what lm-evaluation-harness reads):

  "logprobs": {"tokens": [str, ...], "token_logprobs": [float | null, ...],
               "top_logprobs": [{str: float} | null, ...], "text_offset": [int, ...]}

per choice, over the tokens reported (an echoed prompt's, the first null, then the drawn
ones'). A token's string is its own text, special tokens written out; `top_logprobs` holds
the `logprobs` likeliest tokens at its place and the token itself, as vLLM reports them;
`text_offset` is where each token's string starts in the choice's text, the strings laid
end to end, as vLLM counts them.
"""

from __future__ import annotations

from typing import Any, Sequence

from transformer_jax.serving.streaming import Logprob


class LogprobsFormat:
  """The JSON of reported log-probabilities for one served tokenizer."""

  def __init__(self, tokenizer: Any):
    self.tokenizer = tokenizer
    self._texts: dict[int, str] = {}

  def text(self, token: int) -> str:
    """A token's own string: the tokenizer's `token_text` (special tokens written out), or
    its decoding."""
    if token not in self._texts:
      own = getattr(self.tokenizer, "token_text", None)
      self._texts[token] = own(token) if own else self.tokenizer.decode([token])
    return self._texts[token]

  def block(self, logprobs: Sequence[Logprob], top: int,
            offset: int = 0) -> tuple[dict[str, Any], int]:
    """The "logprobs" object of `logprobs`, the `top` likeliest at each place, its first
    token's string at `offset` in the text; and the offset after its last."""
    block: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                   "text_offset": []}
    for reported in logprobs:
      text = self.text(reported.token)
      block["tokens"].append(text)
      block["token_logprobs"].append(reported.logprob)
      block["text_offset"].append(offset)
      offset += len(text)
      if reported.logprob is None:
        block["top_logprobs"].append(None)
        continue
      likeliest: dict[str, float] = {}
      for token, value in (*reported.top[:top], (reported.token, reported.logprob)):
        likeliest.setdefault(self.text(token), value)
      block["top_logprobs"].append(likeliest)
    return block, offset
