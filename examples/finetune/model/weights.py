"""A model from named checkpoint tensors: the part every file format shares.

The model is first built abstractly (``nnx.eval_shape``: shapes only, no
memory); each parameter is then read by name from a :class:`TensorSource`
through a small per-family :class:`NameTable`, converted from PyTorch's
``(out, in)`` layout to Flax's ``(in, out)``, checked, placed (on the mesh,
if any) and merged into the model. ``loading`` (Hugging Face directories) and
``gguf`` (GGUF files) supply the sources and tables.
"""

import dataclasses
import json
from typing import Any, Iterator, Optional, Protocol

from flax import nnx
import jax
import numpy as np

from examples.finetune.model import config as config_lib
from examples.finetune.model import decoder as decoder_lib
from examples.finetune.model import sharding as sharding_lib

# Checkpoint entries that hold no parameter (buffers of older exports).
_IGNORED_SUFFIXES = ('rotary_emb.inv_freq', 'attention.bias',
                     'attention.masked_bias')


class ModelLoadError(ValueError):
  """A checkpoint that cannot be loaded; the message is one readable line."""


@dataclasses.dataclass(frozen=True)
class NameTable:
  """Where each of our modules lives in a checkpoint.

  Attributes:
    top: our module path (dot-joined) -> checkpoint module name.
    block: our module path inside a block -> name inside a layer.
    layer: checkpoint prefix of layer ``i`` (``str.format`` with ``i``).
    leaf: our leaf name -> checkpoint leaf name.
  """
  top: dict[str, str]
  block: dict[str, str]
  layer: str
  leaf: dict[str, str]


# Our leaf names -> PyTorch's (``nn.Linear``, ``nn.Embedding``, norms).
TORCH_LEAVES = {'kernel': 'weight', 'scale': 'weight', 'embedding': 'weight',
                'bias': 'bias'}


class TensorSource(Protocol):
  """Named tensors of a checkpoint in PyTorch layout, read one at a time."""

  def names(self) -> set[str]:
    ...

  def read(self, name: str) -> np.ndarray:
    ...


def read_json(path: str) -> Any:
  """A JSON file's contents; an unreadable file is a ModelLoadError."""
  try:
    with open(path, encoding='utf-8') as f:
      return json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ModelLoadError(f'cannot parse {path}: {e}') from None


def _to_flax(name: str, leaf: str, tensor: np.ndarray,
             config: config_lib.ModelConfig) -> np.ndarray:
  """PyTorch layout -> our layout for one tensor."""
  if name.endswith('query_key_value.weight'):
    # (heads * 3 * hd, d), rows grouped per head -> (d, 3, heads * hd).
    d = tensor.shape[-1]
    per_head = tensor.reshape(config.num_heads, 3, config.head_dim, d)
    return per_head.transpose(3, 1, 0, 2).reshape(d, 3, -1)
  if name.endswith('query_key_value.bias'):
    per_head = tensor.reshape(config.num_heads, 3, config.head_dim)
    return per_head.transpose(1, 0, 2).reshape(3, -1)
  if leaf == 'kernel':
    return tensor.T
  return tensor


def _to_torch(name: str, leaf: str, tensor: np.ndarray,
              config: config_lib.ModelConfig) -> np.ndarray:
  """Our layout -> PyTorch layout for one tensor: :func:`_to_flax` undone."""
  if name.endswith('query_key_value.weight'):
    d = tensor.shape[0]
    per_head = tensor.reshape(d, 3, config.num_heads, config.head_dim)
    return per_head.transpose(2, 1, 3, 0).reshape(-1, d)
  if name.endswith('query_key_value.bias'):
    per_head = tensor.reshape(3, config.num_heads, config.head_dim)
    return per_head.transpose(1, 0, 2).reshape(-1)
  if leaf == 'kernel':
    return tensor.T
  return tensor


def _checkpoint_name(table: NameTable, names: tuple[str, ...],
                     layer: Optional[int]) -> str:
  module, leaf = '.'.join(names[:-1]), names[-1]
  if layer is None:
    return f'{table.top[module]}.{table.leaf[leaf]}'
  return f'{table.layer.format(layer)}{table.block[module]}.{table.leaf[leaf]}'


def _alternatives(name: str) -> Iterator[str]:
  yield name
  # Some exports (older OPT) drop the wrapper's 'model.' prefix.
  if name.startswith('model.'):
    yield name[len('model.'):]


def _load_parameters(abstract_state: Any, source: TensorSource,
                     table: NameTable, config: config_lib.ModelConfig,
                     scan_layers: bool, param_dtype: Any) -> Any:
  """Fills an abstract parameter state from ``source``; checks everything."""
  available = source.names()
  used = set()
  mesh = sharding_lib.current_mesh()  # set by --mesh

  def read(names: tuple[str, ...], layer: Optional[int],
           expected: tuple[int, ...]) -> np.ndarray:
    wanted = _checkpoint_name(table, names, layer)
    found = next((n for n in _alternatives(wanted) if n in available), None)
    if found is None:
      raise ModelLoadError(f'checkpoint tensor {wanted!r} is missing.')
    used.add(found)
    values = _to_flax(found, names[-1], source.read(found), config)
    if values.shape != expected:
      raise ModelLoadError(
          f'checkpoint tensor {found!r} has shape {values.shape} after '
          f'conversion, expected {expected} for {config.family} config.')
    return values

  def fill(path, abstract):
    names = decoder_lib.path_names(path)
    shape = tuple(abstract.shape)
    if names[0] != 'layers':
      values = read(names, None, shape)
    elif scan_layers:
      values = np.stack([read(names[1:], i, shape[1:])
                         for i in range(config.num_layers)])
    else:
      values = read(names[2:], int(names[1]), shape)
    return sharding_lib.place_param(values, names, mesh,
                                    config.tie_word_embeddings, param_dtype)

  state = jax.tree_util.tree_map_with_path(fill, abstract_state)
  if config.tie_word_embeddings:
    head = _checkpoint_name(table, ('lm_head', 'kernel'), None)
    used.update(_alternatives(head))
  unused = sorted(n for n in available - used
                  if not n.endswith(_IGNORED_SUFFIXES))
  if unused:
    raise ModelLoadError(
        f'checkpoint holds {len(unused)} tensors this {config.family} model '
        f'does not use (unsupported variant?), e.g. {unused[:3]}.')
  return state


def _host_copy(value: jax.Array) -> np.ndarray:
  """The whole array on this host; a collective when it spans processes."""
  if isinstance(value, jax.Array) and not value.is_fully_addressable:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    return np.asarray(multihost_utils.process_allgather(value, tiled=True))
  return np.asarray(jax.device_get(value))


def named_tensors(model: decoder_lib.DecoderLM, table: NameTable
                  ) -> Iterator[tuple[str, np.ndarray]]:
  """``(checkpoint name, PyTorch-layout tensor)`` of every parameter.

  The inverse of loading: the same ``table`` names each parameter, and
  :func:`_to_torch` undoes :func:`_to_flax`. A scanned model yields one
  tensor per layer; a tied head yields nothing (the embedding is the head).
  Every process must iterate (arrays split over processes are gathered).
  """
  config = model.config
  state = nnx.state(model, nnx.Param)
  leaves, _ = jax.tree_util.tree_flatten_with_path(state)
  for path, value in leaves:
    names = decoder_lib.path_names(path)
    values = _host_copy(value)
    if names[0] != 'layers':
      parts = [(_checkpoint_name(table, names, None), values)]
    elif model.scan_layers:
      parts = [(_checkpoint_name(table, names[1:], i), values[i])
               for i in range(config.num_layers)]
    else:
      parts = [(_checkpoint_name(table, names[2:], int(names[1])), values)]
    for name, tensor in parts:
      yield name, np.ascontiguousarray(
          _to_torch(name, names[-1], tensor, config))


def build(config: config_lib.ModelConfig, source: TensorSource,
          table: NameTable, *, dtype: Any, param_dtype: Any = None,
          remat: Optional[str], remat_policy: str,
          scan_layers: bool) -> decoder_lib.DecoderLM:
  """The ``DecoderLM`` of ``config`` with every parameter from ``source``.

  Args:
    config: the architecture.
    source: the checkpoint's tensors.
    table: where each parameter lives in the checkpoint.
    dtype: computation dtype.
    param_dtype: stored parameters' dtype (``None``: ``dtype``); float32
      with a 16-bit ``dtype`` keeps master weights.
    remat: see :class:`decoder.DecoderLM`.
    remat_policy: see :class:`decoder.DecoderLM`.
    scan_layers: see :class:`decoder.DecoderLM`.
  """
  param_dtype = dtype if param_dtype is None else param_dtype
  abstract_model = nnx.eval_shape(lambda: decoder_lib.DecoderLM(
      config, dtype=dtype, param_dtype=param_dtype, remat=remat,
      remat_policy=remat_policy, scan_layers=scan_layers,
      rngs=nnx.Rngs(0)))
  graphdef, abstract_state = nnx.split(abstract_model)
  state = _load_parameters(abstract_state, source, table, config,
                           scan_layers, param_dtype)
  return nnx.merge(graphdef, state)


