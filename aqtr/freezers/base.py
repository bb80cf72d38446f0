"""Freezers and modes: what a model stores of a quantized operand.

Modes: TRAIN quantizes on the fly; CALIBRATE collects static statistics;
CONVERT runs once and writes frozen values; SERVE reads them. A freezer
owns one forward operand's behaviour in each mode, through four methods
that the framework adapters (Flax linen / nnx, Pax) call for it:

  CALIBRATE  stats = start_stats(call); stats = collect(stats, call)
  CONVERT    parts = freeze(call, stats)        (stored by the adapter)
  SERVE      served = serve(call, parts)        (a `Served` operand)

`call` is an `aqtr.freezers.call.OperandCall`: the operand, its layout in
the dot, its TensorConfig and the engine's quantizer for it. The engine
never stores state; a freezer never stores state either (the adapter
does), so a freezer registered anywhere works in every adapter.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from typing import Any, ClassVar

from aqtr.core.registry import Registry


class Mode(enum.Enum):
  """The life cycle of a quantized model."""

  TRAIN = 'train'
  CALIBRATE = 'calibrate'
  CONVERT = 'convert'
  SERVE = 'serve'


@dataclasses.dataclass(frozen=True)
class Served:
  """What SERVE hands the dot in place of one float operand.

  The dot computes `out_scale * dot_general(operand, other, config')`,
  where config' has this operand's TensorConfig replaced by `tensor`.

  Attributes:
    operand: a float array (quantized on the fly by the dot) or a QTensor
      (used as is: bit-identical to TRAIN when it is what TRAIN computed).
    tensor: replaces `config.fwd.<side>` for this call (None: unchanged).
    out_scale: multiplies the output: a scalar or an array over the
      operand's free axes (None: 1). The dot then accumulates in float32.
  """

  operand: Any
  tensor: Any = None
  out_scale: Any = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Freezer(abc.ABC):
  """Base class of the `freezers` registry: one operand's life cycle.

  Subclasses set `frozen_parts` (the names of the arrays CONVERT stores;
  `optional_parts` those it may add),
  `collects` (whether CALIBRATE keeps statistics), `reads_float` (whether
  SERVE reads the float operand; False lets the adapters drop a frozen
  float kernel from the serving tree) and override the methods below. The
  defaults quantize on the fly and store nothing.
  """

  # The names of the arrays stored in CONVERT and read in SERVE.
  frozen_parts: ClassVar[tuple[str, ...]] = ()
  # Arrays CONVERT may also store, depending on the config (e.g. the zero
  # point of affine numerics).
  optional_parts: ClassVar[tuple[str, ...]] = ()
  # Whether the freezer keeps running statistics in CALIBRATE.
  collects: ClassVar[bool] = False
  # Whether SERVE reads the float operand (False: the kernel can go).
  reads_float: ClassVar[bool] = True

  @abc.abstractmethod
  def stores(self, mode: Mode) -> tuple[str, ...]:
    """The parts this freezer writes to variables in `mode`."""

  def start_stats(self, call) -> Any:
    """CALIBRATE: the statistics before any call (None: collects nothing).

    Args:
      call: the OperandCall (shapes only are meaningful here: the adapters
        create variables from it).
    """
    del call
    return None

  def collect(self, stats: Any, call) -> Any:
    """CALIBRATE: the statistics after seeing `call.x` once."""
    del call
    return stats

  def freeze(self, call, stats: Any) -> dict:
    """CONVERT: {part: array} for every name in `frozen_parts`.

    Args:
      call: the OperandCall (`call.quantize()` is TRAIN's quantization).
      stats: this operand's CALIBRATE statistics, or None.
    """
    del stats
    if self.frozen_parts:
      raise NotImplementedError(
        f'{type(self).__name__} declares frozen_parts {self.frozen_parts} '
        f'but does not override Freezer.freeze ({call.slot.path}).'
      )
    return {}

  def serve(self, call, frozen: dict) -> Served:
    """SERVE: what the dot uses instead of `call.x`, from the stored parts."""
    del frozen
    return Served(call.x)


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
