"""The `sparsity` registry: which elements of an operand are kept.

The base type `Sparsity` is the core's (`aqtr.core.algorithms`); this
module holds the registry.
"""

from __future__ import annotations

from aqtr.core.algorithms import Sparsity
from aqtr.core.registry import Registry

__all__ = ['Sparsity', 'get', 'names', 'register', 'registry']

registry: Registry = Registry('sparsity', Sparsity)
register = registry.register
get = registry.get
names = registry.names
