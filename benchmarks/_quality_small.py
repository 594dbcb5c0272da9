"""Small Llama-style models of one family, for the learning-rate transfer test.

Each width is pretrained briefly from scratch (AdamW, next-token loss on the
training tweets' text, never the held-out ones), then fine-tuned on the tweet
sentiment task like the real model. The SmolLM2 tokenizer is kept but its
49k-token vocabulary is cut to the most frequent tokens of the training
tweets (the rest share one id): a 49k x d embedding would dominate these
models' size and time on two CPU cores.
"""

import collections
import dataclasses
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from examples.finetune import api


@dataclasses.dataclass(frozen=True)
class CompactVocabulary:
  """A map from tokenizer ids to ``size`` model ids.

  Attributes:
    to_compact: ``int32[tokenizer vocabulary]``; ids outside the kept set map
      to ``size - 1``.
    size: model vocabulary size.
  """
  to_compact: np.ndarray
  size: int

  def ids(self, ids: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(i) for i in self.to_compact[np.asarray(ids, np.int64)])

  def example(self, example: api.TokenizedExample) -> api.TokenizedExample:
    return api.TokenizedExample(self.ids(example.prompt_ids),
                                self.ids(example.completion_ids))


def compact_vocabulary(examples: Sequence[api.TokenizedExample],
                       tokenizer_size: int, size: int,
                       always: Sequence[int] = ()) -> CompactVocabulary:
  """Keeps ``always`` and the most frequent ids of ``examples``."""
  counts = collections.Counter()
  for example in examples:
    counts.update(example.prompt_ids)
    counts.update(example.completion_ids)
  kept = list(dict.fromkeys(always))
  for token, _ in counts.most_common():
    if len(kept) >= size - 1:
      break
    if token not in kept:
      kept.append(token)
  to_compact = np.full((tokenizer_size,), size - 1, np.int32)
  to_compact[np.asarray(kept, np.int64)] = np.arange(len(kept))
  return CompactVocabulary(to_compact, size)


def compact_eval_set(eval_set, vocabulary: CompactVocabulary):
  return dataclasses.replace(
      eval_set, prompts=[vocabulary.ids(p) for p in eval_set.prompts],
      candidates=[[vocabulary.ids(c) for c in cands]
                  for cands in eval_set.candidates])


def language_modelling_examples(texts: Sequence[str], tokenizer,
                                vocabulary: CompactVocabulary
                                ) -> list[api.TokenizedExample]:
  """Whole texts as completions after the BOS prompt: loss on every token."""
  examples = []
  for text in texts:
    tokenized = api.tokenize(tokenizer, '', text)
    examples.append(vocabulary.example(tokenized))
  return examples


def small_config(width: int, vocab_size: int, *, num_layers: int,
                 head_dim: int, max_positions: int,
                 bos_token_id, eos_token_id) -> api.ModelConfig:
  """A Llama-style config of the family: only the width varies.

  Heads grow with the width at a fixed head size, the MLP is 8/3 wide (as in
  Llama, rounded to a multiple of 16), embeddings are tied (as in SmolLM2).
  """
  heads = max(width // head_dim, 1)
  return api.ModelConfig(
      family='llama', vocab_size=vocab_size, hidden_size=width,
      num_layers=num_layers, num_heads=heads, num_kv_heads=heads,
      head_dim=head_dim, intermediate_size=16 * round(width * 8 / 3 / 16),
      max_position_embeddings=max_positions, tie_word_embeddings=True,
      norm_eps=1e-5, bos_token_id=bos_token_id, eos_token_id=eos_token_id)


def new_model(config: api.ModelConfig, seed: int):
  return api.new_decoder(config, dtype=jnp.float32, remat=False, seed=seed)
