"""The words of a flag: how ``examples.finetune``'s CLI parses and checks one.

tyro splits the command line into flags and their words; the words become
values here (:data:`PARSERS`), so that a refusal is the CLI's own sentence
naming the flag rather than a report tyro prints. :class:`Range` is the
accepted range of a numeric field and :func:`refusal` the check of a value
against a field's annotation.
"""

import dataclasses
import math
import typing
from typing import (
  Annotated,
  Any,
  Callable,
  Literal,
  NamedTuple,
  Optional,
  Union,
)

import tyro


@dataclasses.dataclass(frozen=True)
class Range:
  """The finite numbers a numeric field accepts.

  Attributes:
    low: smallest accepted value (``None``: no lower bound).
    high: largest accepted value (``None``: no upper bound).
    low_open: ``low`` itself is refused.
    high_open: ``high`` itself is refused.
  """
  low: Optional[float] = None
  high: Optional[float] = None
  low_open: bool = False
  high_open: bool = False

  def __str__(self) -> str:
    if self.high is None:
      return f'{">" if self.low_open else ">="} {self.low:g}'
    if self.low is None:
      return f'{"<" if self.high_open else "<="} {self.high:g}'
    return (f'in {"(" if self.low_open else "["}{self.low:g}, '
            f'{self.high:g}{")" if self.high_open else "]"}')

  def __contains__(self, value: float) -> bool:
    if not math.isfinite(value):
      return False
    above = self.low is None or (value > self.low if self.low_open
                                 else value >= self.low)
    below = self.high is None or (value < self.high if self.high_open
                                  else value <= self.high)
    return above and below


# Parsing a flag's words. tyro splits the command line into flags and their
# words; the words become values here, so that a refusal is this module's own
# sentence naming the flag rather than a report tyro prints.

class Malformed(NamedTuple):
  """Words a flag was given that its type cannot take.

  A field holds one only from parsing to ``RunConfig.__post_init__``, which
  refuses it with the flag's name.

  Attributes:
    problem: what is wrong, as it follows the flag's name (``" must be an
      integer, got 'abc'"``).
  """
  problem: str


def from_one_word(parse: Callable[[str], Any]
                   ) -> Callable[[list[str]], Any]:
  """A tyro ``instance_from_str`` taking any number of words (``nargs='*'``),
  so that a missing value reaches this module too, and parsing exactly one.
  """
  def instance_from_str(words: list[str]) -> Any:
    if not words:
      return Malformed(' needs a value')
    if len(words) > 1:
      return Malformed(f' takes one value, got {" ".join(words)!r}')
    return parse(words[0])
  return instance_from_str


def on_off(word: str) -> Union[bool, Malformed]:
  if word.lower() in ('on', 'true', 'yes', '1'):
    return True
  if word.lower() in ('off', 'false', 'no', '0'):
    return False
  return Malformed(f': expected on or off, got {word!r}')


# A switch given as a value (``--remat off``), as docs/example.md writes it.
OnOff = Annotated[bool, tyro.conf.FlagConversionOff,
                  tyro.constructors.PrimitiveConstructorSpec(
                      nargs='*', metavar='{on,off}',
                      instance_from_str=from_one_word(on_off),
                      is_instance=lambda value: isinstance(value, bool),
                      str_from_instance=lambda on: ['on' if on else 'off'])]


def optional_of(kind) -> Optional[Any]:
  """``X`` for ``Optional[X]``, else ``None``."""
  if typing.get_origin(kind) is not Union:
    return None
  members = typing.get_args(kind)
  inner = [arg for arg in members if arg is not type(None)]
  return inner[0] if len(inner) == 1 < len(members) else None


def parse_word(kind, word: str) -> Any:
  """The value of type ``kind`` that ``word`` spells, or a Malformed."""
  inner = optional_of(kind)
  if inner is not None:
    return None if word == 'None' else parse_word(inner, word)
  if typing.get_origin(kind) is Literal:
    choices = typing.get_args(kind)
    if word in choices:
      return word
    return Malformed(f' must be one of {", ".join(map(repr, choices))}, '
                      f'got {word!r}')
  if kind is str:
    return word
  try:
    return kind(word)
  except ValueError:
    noun = 'an integer' if kind is int else 'a number'
    return Malformed(f' must be {noun}, got {word!r}')


def metavar(kind) -> str:
  """What ``--help`` shows for a value of ``kind``, as tyro writes it."""
  inner = optional_of(kind)
  if inner is not None:
    return '{None}|' + metavar(inner)
  if typing.get_origin(kind) is Literal:
    return '{' + ','.join(typing.get_args(kind)) + '}'
  return kind.__name__.upper()


def is_parsed_here(kind) -> bool:
  kind = optional_of(kind) or kind
  return kind in (int, float, str) or typing.get_origin(kind) is Literal


PARSERS = tyro.constructors.ConstructorRegistry()


@PARSERS.primitive_rule
def parsed_here(type_info) -> Optional[
    tyro.constructors.PrimitiveConstructorSpec]:
  """Numbers, strings and choices (and their Optional) are parsed here;
  tyro keeps the plain switches (``--resume``, ``--no-progress``)."""
  kind = type_info.type
  if not is_parsed_here(kind):
    return None
  return tyro.constructors.PrimitiveConstructorSpec(
      nargs='*', metavar=metavar(kind),
      instance_from_str=from_one_word(lambda word: parse_word(kind, word)),
      is_instance=lambda value: refusal(value, kind) is None,
      str_from_instance=lambda value: [str(value)])


def refusal(value, annotation) -> Optional[str]:
  """Why ``value`` does not fit ``annotation``; ``None`` when it does."""
  kind, ranges = annotation, ()
  if typing.get_origin(kind) is Annotated:
    kind, *metadata = typing.get_args(kind)
    ranges = [item for item in metadata if isinstance(item, Range)]
  if optional_of(kind) is not None:  # None means a default.
    if value is None:
      return None
    kind = optional_of(kind)
  if typing.get_origin(kind) is Literal:
    choices = typing.get_args(kind)
    if value not in choices:
      return f'must be one of {", ".join(choices)}, got {value!r}'
    return None
  if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
    return f'must be an integer, got {value!r}'
  if kind is float and (isinstance(value, bool)
                        or not isinstance(value, (int, float))):
    return f'must be a number, got {value!r}'
  for accepted in ranges:
    if value not in accepted:
      noun = 'an integer' if kind is int else 'a finite number'
      return f'must be {noun} {accepted}, got {value!r}'
  return None


def is_switch(annotation) -> bool:
  """A flag without a value (``--resume``), unlike an :data:`OnOff`."""
  kind = annotation
  if typing.get_origin(kind) is Annotated:
    kind = typing.get_args(kind)[0]
  return kind is bool and annotation != OnOff
