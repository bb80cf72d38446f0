"""One-line checks of plain arguments (flags, counts) of public functions.

A flag must be True or False: a truthy string such as 'no' would silently
turn the feature on. A count must be an int in range: a bool or a float
would silently truncate.

Example:
  >>> check_flags('presets.nvfp4_training', rht='no')
  Traceback (most recent call last):
  ...
  TypeError: presets.nvfp4_training: rht must be True or False, got 'no'.
"""

from __future__ import annotations

__all__ = ['check_flags', 'check_int']


def check_flags(where: str, **flags) -> None:
  """Raises naming `where` and the flag unless each flag is a bool.

  Args:
    where: the function or field the flags belong to.
    **flags: name=value of each flag.
  """
  for name, v in flags.items():
    if not isinstance(v, bool):
      raise TypeError(f'{where}: {name} must be True or False, got {v!r}.')


def check_int(where: str, name: str, v, low: int, high=None, none=False):
  """Raises naming `where` and `name` unless low <= v (<= high) is an int.

  Args:
    where: the function or field the argument belongs to.
    name: the argument.
    v: its value.
    low, high: the allowed range (high None: unbounded).
    none: None is allowed too.

  Example:
    >>> check_int('f', 'bits', 9, 1, 8)
    Traceback (most recent call last):
    ...
    ValueError: f: bits must be an int in 1..8, got 9.
  """
  if none and v is None:
    return
  ok = isinstance(v, int) and not isinstance(v, bool) and v >= low
  if ok and (high is None or v <= high):
    return
  allowed = f'>= {low}' if high is None else f'in {low}..{high}'
  raise ValueError(
    f'{where}: {name} must be {"None or " if none else ""}an int '
    f'{allowed}, got {v!r}.'
  )
