"""Freezers and modes: what a model stores of a quantized operand.

Modes (ALGORITHMS.md): TRAIN quantizes on the fly; CALIBRATE collects static
statistics; CONVERT runs once and writes frozen values; SERVE reads them.
A freezer says which parts of an operand's quantization are frozen into the
model's variables (nothing, the scales, or the integer values and scales).
The framework adapters (Flax) apply them; the engine never stores state.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from typing import ClassVar

from aqtr.core.registry import Registry


class Mode(enum.Enum):
  """The life cycle of a quantized model."""

  TRAIN = 'train'
  CALIBRATE = 'calibrate'
  CONVERT = 'convert'
  SERVE = 'serve'


@dataclasses.dataclass(frozen=True, kw_only=True)
class Freezer(abc.ABC):
  """Base class of the `freezers` registry."""

  # Which QTensor parts are stored in CONVERT and read in SERVE.
  frozen_parts: ClassVar[tuple[str, ...]] = ()

  @abc.abstractmethod
  def stores(self, mode: Mode) -> tuple[str, ...]:
    """The QTensor parts this freezer writes to variables in `mode`."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class NoFreezer(Freezer):
  """Quantize on the fly in every mode; nothing is stored.

  Example:
    >>> NoFreezer().stores(Mode.CONVERT)
    ()
  """

  def stores(self, mode: Mode) -> tuple[str, ...]:
    if not isinstance(mode, Mode):
      raise TypeError(f'mode must be an aqtr.freezers.Mode, got {mode!r}.')
    return ()


registry: Registry = Registry('freezers', Freezer)
register = registry.register
get = registry.get
names = registry.names
register('none')(NoFreezer)
