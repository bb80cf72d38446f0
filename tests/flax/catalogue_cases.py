"""The research catalogue as rule configs: one per registry entry.

`ENTRIES` names every registered calibration, numerics, rounding and
sparsity as 'family:name'; `config(entry)` is an op config that uses it
(int8 per channel elsewhere). The contract test puts several entries on
different ops of one model (a rule per op path), so one compiled train
step, one convert and one serve check cover many entries.
"""

from __future__ import annotations

import aqtr
from aqtr import calibrations, fiddlers, numerics, sparsity, tilings

FAMILIES = {
  'calibrations': calibrations,
  'numerics': numerics,
  'rounding': fiddlers.roundings,
  'sparsity': sparsity,
}
ENTRIES = tuple(
  f'{fam}:{name}' for fam, reg in FAMILIES.items() for name in reg.names()
)


def tensor(**kw) -> aqtr.TensorConfig:
  """An operand config: int8 per channel unless `kw` says otherwise; the
  tiling a block format asks for; MinMax for affine numerics."""
  n = kw.pop('numerics', None) or numerics.IntSymmetric()
  if 'calibration' not in kw:
    asym = n.quantizes and n.asymmetric
    kw['calibration'] = calibrations.MinMax() if asym else calibrations.AbsMax()
  block = n.block_size if n.quantizes else None
  tiling = (
    tilings.SubChannel(tile_size=block) if block else tilings.PerChannel()
  )
  return aqtr.TensorConfig(numerics=n, tiling=tiling, **kw)


_FLOAT = aqtr.TensorConfig(numerics=numerics.NoNumerics())


def config(entry: str) -> aqtr.DotGeneralConfig:
  """An op config exercising the registry entry 'family:name'."""
  fam, name = entry.split(':')
  obj = FAMILIES[fam].get(name)()
  raw = aqtr.DotGeneralRaw
  if fam == 'sparsity':
    fwd = raw(lhs=tensor(), rhs=tensor(sparsity=obj))
    bwd = raw(lhs=_FLOAT, rhs=_FLOAT)
  elif fam == 'numerics':
    fwd = raw(lhs=tensor(numerics=obj), rhs=tensor(numerics=obj))
    bwd = raw(lhs=_FLOAT, rhs=_FLOAT)
  elif fam == 'rounding':
    # Serving rounds to nearest: stochastic rounding on the gradients.
    fwd = raw(lhs=tensor(), rhs=tensor())
    bwd = raw(lhs=tensor(rounding=obj), rhs=tensor())
  else:
    t = tensor(calibration=obj)
    fwd = raw(lhs=t, rhs=t)
    # Learned calibrations train forward operands only (as in LSQ, PACT);
    # stateful ones reuse the forward quantization of the residual.
    learns = getattr(obj, 'has_learned', False)
    bwd = raw(lhs=t, rhs=t, use_fwd_quant=True)
    bwd = raw(lhs=_FLOAT, rhs=_FLOAT) if learns else bwd
  return aqtr.DotGeneralConfig(fwd=fwd, dlhs=bwd, drhs=bwd)


def chunks(n: int) -> list[tuple[str, ...]]:
  """`ENTRIES` in groups of at most `n` (one model run each)."""
  return [ENTRIES[i : i + n] for i in range(0, len(ENTRIES), n)]
