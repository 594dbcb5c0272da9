"""Small Flax Linen models more than one test file routes."""

import flax.linen as nn


class LanguageModel(nn.Module):
  """An embedding, a dense layer and a head: tied (the embedding's
  ``attend``) or its own dense layer."""
  tied: bool

  @nn.compact
  def __call__(self, tokens):
    embed = nn.Embed(11, 4)
    hidden = nn.Dense(4)(embed(tokens))
    return embed.attend(hidden) if self.tied else nn.Dense(11)(hidden)
