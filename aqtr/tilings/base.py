"""The `tilings` registry: which elements of an operand share one scale.

The base type `Tiling` and the view axes `ROLES` are the core's
(`aqtr.core.algorithms`); this module holds the registry.
"""

from __future__ import annotations

from aqtr.core.algorithms import ROLES, Tiling
from aqtr.core.registry import Registry

__all__ = ['ROLES', 'Tiling', 'get', 'names', 'register', 'registry']

registry: Registry = Registry('tilings', Tiling)
register = registry.register
get = registry.get
names = registry.names
