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
  # Whether the freezer keeps running statistics in CALIBRATE.
  collects: ClassVar[bool] = False

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


def _as_freezer(value, side: str) -> Freezer | None:
  if value is None or isinstance(value, Freezer):
    return value
  if isinstance(value, str):
    return get(value)()
  raise TypeError(
    f'{side} must be a Freezer, a registered freezer name '
    f'({", ".join(names())}) or None, got {value!r}.'
  )


def configure(config, *, lhs=None, rhs=None):
  """Returns `config` with the freezers of its forward operands set.

  Only the forward operands (`config.fwd.lhs`, `config.fwd.rhs`) are frozen:
  serving runs the forward pass only.

  Args:
    config: an aqtr.DotGeneralConfig.
    lhs, rhs: a Freezer, a registry name ('none', 'calibration',
      'weights') or None to keep the operand's freezer.

  Returns:
    The new config (configs are frozen; `config` is unchanged).

  Example:
    >>> import aqtr
    >>> cfg = configure(aqtr.presets.int8(), rhs='weights')
    >>> cfg.fwd.rhs.freezer.registered_name
    'weights'
  """
  fwd = config.fwd
  for side, value in (('lhs', lhs), ('rhs', rhs)):
    f = _as_freezer(value, side)
    if f is not None:
      t = dataclasses.replace(getattr(fwd, side), freezer=f)
      fwd = dataclasses.replace(fwd, **{side: t})
  return dataclasses.replace(config, fwd=fwd)
