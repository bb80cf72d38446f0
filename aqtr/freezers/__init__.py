"""Registry `freezers` and the `Mode` enum (train/calibrate/convert/serve)."""

from aqtr.freezers.base import (
  Freezer,
  Mode,
  NoFreezer,
  get,
  names,
  register,
  registry,
)

__all__ = ['Freezer', 'Mode', 'NoFreezer', 'get', 'names', 'register', 'registry']
