"""What `aqtr.pax.inject` did: the shared report of `aqtr.rules`.

`InjectionReport` is `aqtr.rules.Report` (the format the Flax
interception reports in too): op path -> config, rules left unused.

Example:
  >>> import aqtr
  >>> describe(aqtr.presets.int8()), describe(None)
  ('int8', 'float')
  >>> describe(aqtr.sparsity.configure(aqtr.presets.float(), rhs='n_m'))
  'fwd fxf:2of4 | dlhs fxf:2of4 | drhs fxf'
"""

from __future__ import annotations

from aqtr.rules import OpEntry, Report, describe

InjectionReport = Report

__all__ = ['InjectionReport', 'OpEntry', 'describe']
