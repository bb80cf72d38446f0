"""The registry `layouts`: how a checkpoint format stores quantized weights.

A layout is a codec at the edge: it turns `Stored` weights (keyed by the
module name, e.g. 'model.layers.0.self_attn.q_proj') into the tensors and
the `quantization_config` of its format, and back. It never sees a model.

  compressed_tensors  `pack-quantized` (vLLM, llm-compressor, transformers;
                      also spelled 'compressed-tensors')
  gptq                AutoGPTQ's qweight / qzeros / scales / g_idx
  awq                 AutoAWQ's GEMM qweight / qzeros / scales

Example:
  >>> import aqtr.checkpoints
  >>> names()
  ('awq', 'compressed_tensors', 'gptq')
  >>> type(layout('compressed-tensors', scale_dtype='float16')).__name__
  'CompressedTensors'
"""

from __future__ import annotations

import abc
import dataclasses
from typing import ClassVar

import numpy as np

from aqtr.checkpoints.stored import CheckpointError, Stored
from aqtr.core.registry import Registry

__all__ = [
  'Layout',
  'detect',
  'get',
  'layout',
  'names',
  'register',
  'registry',
]

SCALE_DTYPES = ('float32', 'float16', 'bfloat16')


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout(abc.ABC):
  """Base of the `layouts` registry (frozen kw-only dataclass).

  Attributes:
    scale_dtype: the dtype scales are written in: 'float32' (exact: the
      file serves aqtr's values bit for bit), 'float16' or 'bfloat16'
      (rounded; what most published checkpoints use).
  """

  scale_dtype: str = 'float32'
  quant_method: ClassVar[str] = ''

  def __post_init__(self):
    if self.scale_dtype not in SCALE_DTYPES:
      raise CheckpointError(
        f'{type(self).__name__}.scale_dtype must be one of {SCALE_DTYPES}, '
        f'got {self.scale_dtype!r}.'
      )

  def scales(self, s: np.ndarray) -> np.ndarray:
    """`s` (float32) in `scale_dtype`."""
    import ml_dtypes  # noqa: PLC0415 (numpy has no bfloat16)

    bf16 = self.scale_dtype == 'bfloat16'
    dt = ml_dtypes.bfloat16 if bf16 else self.scale_dtype
    return np.asarray(s, np.float32).astype(dt)

  @abc.abstractmethod
  def encode(self, weights: dict[str, Stored]) -> tuple[dict, dict]:
    """{module: Stored} -> (tensors {name: array}, quantization_config)."""

  @abc.abstractmethod
  def decode(
    self, tensors: dict, config: dict
  ) -> tuple[dict[str, Stored], dict]:
    """(tensors, quantization_config) -> ({module: Stored}, the tensors
    that are not quantized weights, e.g. biases and norms)."""

  @classmethod
  def from_config(cls, config: dict) -> Layout:
    """The layout reading a checkpoint of this `quantization_config`."""
    del config
    return cls()


registry: Registry = Registry('layouts', Layout)
register = registry.register
get = registry.get
names = registry.names


def detect(config: dict) -> Layout:
  """The layout of a Hugging Face config's `quantization_config`."""
  qc = config.get('quantization_config')
  if not isinstance(qc, dict):
    raise CheckpointError(
      'config.json: no quantization_config (field quantization_config); '
      'not a quantized checkpoint.'
    )
  method = qc.get('quant_method')
  for name in names():
    cls = get(name)
    if cls.quant_method == method:
      return cls.from_config(qc)
  known = sorted(get(n).quant_method for n in names())
  raise CheckpointError(
    f'config.json: unknown format quant_method={method!r} (field '
    f'quantization_config.quant_method); known: {known}.'
  )


def layout(name, **fields) -> Layout:
  """A Layout instance: `name` a registered name ('-' or '_') or one."""
  if isinstance(name, Layout):
    return name
  key = name.replace('-', '_') if isinstance(name, str) else name
  if key not in registry:
    raise CheckpointError(
      f'unknown checkpoint format {name!r} (argument format); known: '
      f'{", ".join(names())}.'
    )
  return get(key)(**fields)


def need(tensors: dict, name: str, field: str) -> np.ndarray:
  """tensors[name], or one line naming the missing tensor."""
  if name not in tensors:
    raise CheckpointError(f'{name}: missing tensor (needed for {field}).')
  return tensors.pop(name)


def modules(tensors: dict, suffix: str) -> list[str]:
  """The sorted module names of the tensors named '<module><suffix>'."""
  return sorted({k[: -len(suffix)] for k in tensors if k.endswith(suffix)})


def shape_is(a: np.ndarray, want: tuple, name: str, field: str) -> None:
  if tuple(a.shape) != tuple(want):
    raise CheckpointError(
      f'{name}: shape {tuple(a.shape)}, but {field} gives {tuple(want)}.'
    )
