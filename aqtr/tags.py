"""Fiddle tags on the config tree, for `fdl.set_tagged` / `fdl.select(tag=)`.

Two kinds of tags:

* Field tags sit on a class's fields: the class marks the field with a
  fiddle-free marker of `aqtr.core.markers` (`Annotated[int, markers.Bits]`)
  and every `fdl.Config` of that class carries the tag of the same name
  here: `Bits` (IntSymmetric.bits), `ClipGradient`, `Po2Scale`, the
  TensorConfig slots `Numerics`, `Calibration`, `Tiling`, `Sparsity`,
  `Rounding` and
  the DotGeneralRaw fields `UseFwdQuant`, `Accumulator`. (Fiddle reads
  only its own tags from annotations; importing this module extends that
  lookup to the markers, see `field_tags`.)
* Role tags depend on where an operand sits in a DotGeneralConfig (one
  TensorConfig class serves all six operands), so `tag_roles` adds them by
  position; `aqtr.fiddle.as_config` / `config`, the fiddlers and
  `aqtr.selectors` call it for you. Roles assume `x @ w` (lhs activations,
  rhs weights), as in Flax Dense:

    FwdBits             bits of fwd.lhs and fwd.rhs
    BwdBits             bits of every dlhs / drhs operand
    ActivationNumerics  fwd.lhs.numerics, drhs.rhs.numerics (residual x)
    WeightNumerics      fwd.rhs.numerics, dlhs.rhs.numerics (residual w)
    GradientNumerics    dlhs.lhs.numerics, drhs.lhs.numerics (gradient g)
    GradientRounding    dlhs.lhs.rounding, drhs.lhs.rounding: where the
                        stochastic rounding of the gradient goes
    ActivationSparsity  fwd.lhs.sparsity, drhs.rhs.sparsity (residual x)
    WeightSparsity      fwd.rhs.sparsity, dlhs.rhs.sparsity (residual w)

After replacing a whole sub-config with plain Fiddle (e.g. `fdl.set_tagged`
with a new `fdl.Config(IntSymmetric)`), call `tag_roles(cfg)` again so its
fields get their role tags; it is idempotent and also removes stale role
tags from copied sub-configs.

Example:
  >>> import fiddle as fdl, aqtr
  >>> cfg = aqtr.fiddle.config('int8')
  >>> fdl.set_tagged(cfg, tag=aqtr.tags.BwdBits, value=4)
  >>> cfg.dlhs.lhs.numerics.bits, cfg.fwd.lhs.numerics.bits
  (4, 8)
"""

from __future__ import annotations

import inspect
import typing
from typing import Any

import fiddle as fdl
from fiddle import daglish
from fiddle._src import tag_type as fiddle_tag_type

from aqtr.core import markers

# Field tags (the classes mark their fields with aqtr.core.markers).


class Bits(fdl.Tag):
  """Bit width of an integer numerics (every operand)."""


class ClipGradient(fdl.Tag):
  """Whether a numerics masks the gradient of clipped values."""


class Po2Scale(fdl.Tag):
  """Whether a calibration rounds the scale up to a power of two."""


class Numerics(fdl.Tag):
  """The numerics slot of every operand (TensorConfig.numerics)."""


class Calibration(fdl.Tag):
  """The calibration slot of every operand (TensorConfig.calibration)."""


class Tiling(fdl.Tag):
  """The tiling slot of every operand (TensorConfig.tiling)."""


class Sparsity(fdl.Tag):
  """The sparsity slot of every operand (TensorConfig.sparsity)."""


class Rounding(fdl.Tag):
  """The rounding slot of every operand (TensorConfig.rounding)."""


class UseFwdQuant(fdl.Tag):
  """Whether a dot reuses the forward quantization (backward passes)."""


class Accumulator(fdl.Tag):
  """The accumulator of a dot ('auto', 'int32', 'float32')."""


# marker -> the Fiddle tag it stands for.
FIELD_TAGS = {
  markers.Bits: Bits,
  markers.ClipGradient: ClipGradient,
  markers.Po2Scale: Po2Scale,
  markers.Numerics: Numerics,
  markers.Calibration: Calibration,
  markers.Tiling: Tiling,
  markers.Sparsity: Sparsity,
  markers.Rounding: Rounding,
  markers.UseFwdQuant: UseFwdQuant,
  markers.Accumulator: Accumulator,
}


def field_tags(fn_or_cls: Any) -> dict[str, set[fdl.Tag]]:
  """The tags of the fields `fn_or_cls` marks in its annotations.

  Example:
    >>> import aqtr
    >>> field_tags(aqtr.numerics.IntSymmetric)['bits'] == {Bits}
    True
  """
  try:
    hints = typing.get_type_hints(fn_or_cls, include_extras=True)
  except (TypeError, NameError):  # As Fiddle: unresolvable hints, no tags.
    return {}
  found = {}
  for name, hint in hints.items():
    if typing.get_origin(hint) is typing.Annotated:
      tags = {FIELD_TAGS[m] for m in hint.__metadata__ if m in FIELD_TAGS}
      if tags:
        found[name] = tags
  return found


def _find_tags(fn_or_cls: Any) -> dict[str, set]:
  """Fiddle's tags from annotations, plus those of the aqtr markers."""
  found = {
    name: set(tags) for name, tags in _fiddle_find_tags(fn_or_cls).items()
  }
  for name, tags in field_tags(fn_or_cls).items():
    found.setdefault(name, set()).update(tags)
  return found


# Fiddle calls `find_tags_from_annotations` when it builds any fdl.Config;
# wrap it once (idempotent under reloads).
_fiddle_find_tags = getattr(
  fiddle_tag_type.find_tags_from_annotations,
  'wrapped_by_aqtr',
  fiddle_tag_type.find_tags_from_annotations,
)
_find_tags.wrapped_by_aqtr = _fiddle_find_tags
fiddle_tag_type.find_tags_from_annotations = _find_tags

# Role tags (added by position by `tag_roles`).


class FwdBits(fdl.Tag):
  """Bits of the forward dot's operands (fwd.lhs, fwd.rhs)."""


class BwdBits(fdl.Tag):
  """Bits of the backward dots' operands (dlhs.*, drhs.*)."""


class ActivationNumerics(fdl.Tag):
  """Numerics of the activation operand: fwd.lhs, drhs.rhs (residual)."""


class WeightNumerics(fdl.Tag):
  """Numerics of the weight operand: fwd.rhs, dlhs.rhs (residual)."""


class GradientNumerics(fdl.Tag):
  """Numerics of the gradient operand g: dlhs.lhs, drhs.lhs."""


class GradientRounding(fdl.Tag):
  """Rounding of the gradient operand g (dlhs.lhs, drhs.lhs).

  Where stochastic rounding goes: set it to `fdl.Config(aqtr.Stochastic)`.
  """


class ActivationSparsity(fdl.Tag):
  """Sparsity of the activation operand: fwd.lhs, drhs.rhs (residual).

  Set it to e.g. `fdl.Config(aqtr.sparsity.NM, n=2, m=4)`.
  """


class WeightSparsity(fdl.Tag):
  """Sparsity of the weight operand: fwd.rhs, dlhs.rhs (residual)."""


ROLE_TAGS = (
  FwdBits,
  BwdBits,
  ActivationNumerics,
  WeightNumerics,
  GradientNumerics,
  GradientRounding,
  ActivationSparsity,
  WeightSparsity,
)

# (pass, operand) -> the role tag of that operand's numerics slot.
_NUMERICS_ROLE = {
  ('fwd', 'lhs'): ActivationNumerics,
  ('fwd', 'rhs'): WeightNumerics,
  ('dlhs', 'lhs'): GradientNumerics,
  ('dlhs', 'rhs'): WeightNumerics,
  ('drhs', 'lhs'): GradientNumerics,
  ('drhs', 'rhs'): ActivationNumerics,
}

# (pass, operand) -> the role tag of that operand's sparsity slot (the
# gradient operands g have none: they are never pruned).
_SPARSITY_ROLE = {
  ('fwd', 'lhs'): ActivationSparsity,
  ('fwd', 'rhs'): WeightSparsity,
  ('dlhs', 'rhs'): WeightSparsity,
  ('drhs', 'rhs'): ActivationSparsity,
}


def tag_roles(cfg: Any) -> None:
  """Adds the role tags to every DotGeneralConfig in `cfg`, in place.

  Works on any tree of Buildables, lists, tuples and dicts (e.g. a model
  config holding several DotGeneralConfigs). Role tags already present
  inside the operands are removed first, so the call is idempotent.

  Args:
    cfg: a Fiddle config tree.

  Example:
    >>> import fiddle as fdl, aqtr
    >>> cfg = aqtr.fiddle.config('int8')
    >>> cfg.fwd.rhs.numerics = fdl.Config(aqtr.numerics.IntSymmetric)
    >>> aqtr.tags.tag_roles(cfg)
    >>> FwdBits in fdl.get_tags(cfg.fwd.rhs.numerics, 'bits')
    True
  """
  from aqtr.core.config import DotGeneralConfig

  for node, _ in daglish.iterate(cfg):
    if is_config_of(node, DotGeneralConfig):
      _tag_dot(node)


def is_config_of(node: Any, cls: type) -> bool:
  """Whether `node` is a Buildable of `cls` (or a subclass)."""
  if not isinstance(node, fdl.Buildable):
    return False
  fn = fdl.get_callable(node)
  return isinstance(fn, type) and issubclass(fn, cls)


def _params(node: fdl.Buildable) -> set[str]:
  return set(inspect.signature(fdl.get_callable(node)).parameters)


def _clear_roles(tree: Any) -> None:
  for node, _ in daglish.iterate(tree):
    if isinstance(node, fdl.Buildable):
      for arg, arg_tags in list(node.__argument_tags__.items()):
        for tag in set(arg_tags) & set(ROLE_TAGS):
          fdl.remove_tag(node, arg, tag)


def _tag_dot(dot: fdl.Buildable) -> None:
  for pass_ in ('fwd', 'dlhs', 'drhs'):
    raw = getattr(dot, pass_, None)
    if not isinstance(raw, fdl.Buildable):
      continue
    for side in ('lhs', 'rhs'):
      operand = getattr(raw, side, None)
      if not isinstance(operand, fdl.Buildable):
        continue
      _clear_roles(operand)
      params = _params(operand)
      if 'numerics' in params:
        fdl.add_tag(operand, 'numerics', _NUMERICS_ROLE[pass_, side])
      if 'rounding' in params and pass_ != 'fwd' and side == 'lhs':
        fdl.add_tag(operand, 'rounding', GradientRounding)
      sparsity_role = _SPARSITY_ROLE.get((pass_, side))
      if 'sparsity' in params and sparsity_role is not None:
        fdl.add_tag(operand, 'sparsity', sparsity_role)
      numerics = getattr(operand, 'numerics', None)
      if isinstance(numerics, fdl.Buildable) and 'bits' in _params(numerics):
        fdl.add_tag(numerics, 'bits', FwdBits if pass_ == 'fwd' else BwdBits)
