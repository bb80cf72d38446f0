"""The research catalogue as rule configs: one per registry entry.

`ENTRIES` names every registered calibration, numerics, rounding and
sparsity as 'family:name'; `config(entry)` is an op config that uses it
(int8 per channel elsewhere). The contract test puts several entries on
different ops of one model (a rule per op path), so one compiled train
step, one convert and one serve check cover many entries.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import aqtr
import aqtr.flax
import aqtr.flax.nnx as qnnx
from aqtr import calibrations, fiddlers, numerics, sparsity, tilings
from aqtr.flax.rule_state import QuantState
from aqtr.rules import Rule

FAMILIES = {
  'calibrations': calibrations,
  'numerics': numerics,
  'rounding': fiddlers.roundings,
  'sparsity': sparsity,
}
# 'schedule:n_m': N:M sparsity with a schedule (its mask is state: starts
# at step 1, recomputed every 2 steps).
ENTRIES = tuple(
  f'{fam}:{name}' for fam, reg in FAMILIES.items() for name in reg.names()
) + ('schedule:n_m',)


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
  raw = aqtr.DotGeneralRaw
  if fam == 'schedule':
    obj = sparsity.get(name)(start_step=1, update_step=2)
    w = tensor(sparsity=obj)  # as aqtr.presets.int8_sparse_2_4
    return aqtr.DotGeneralConfig(
      fwd=raw(lhs=tensor(), rhs=w),
      dlhs=raw(lhs=tensor(), rhs=w, use_fwd_quant=True),
      drhs=raw(lhs=tensor(), rhs=tensor()),
    )
  obj = FAMILIES[fam].get(name)()
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


def same(got, want, seen) -> None:
  """serve == train: bit for bit, or within the few ULP of the largest
  output that `convert` warned about (XLA fused the programs apart)."""
  fused = any('fused' in str(w.message) for w in seen)
  if not fused:
    np.testing.assert_array_equal(got, want)
    return
  ulp = np.finfo(np.float32).eps * float(np.abs(want).max())
  np.testing.assert_allclose(got, want, rtol=0, atol=64 * ulp)


def learns(entries) -> bool:
  return any(e.split(':')[1] in ('lsq', 'pact') for e in entries)


def nnx_contract(model, entries, paths, x, rules=None):
  """Rules per path (or `rules`), state, a train step, convert, serve ==
  train."""
  pairs = zip(entries, paths[: len(entries)], strict=True)
  rules = rules or [Rule(config(e), path=p) for e, p in pairs]
  q = aqtr.flax.quantize(model, rules, rngs=nnx.Rngs(aqtr=0))
  # Inputs are jit arguments: closed over, XLA folds the quantization of
  # constants (differently from the compiled code for some formats).
  fwd = nnx.jit(lambda m, x: m(x))
  # Learned parameters are made by an eager first call (the optimizer
  # must see them); the rest inside jit.
  q(x) if learns(entries) else fwd(q, x)
  diff = nnx.DiffState(0, nnx.Any(nnx.Param, QuantState))

  @nnx.jit
  def step(m, x):
    grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2), argnums=diff)(m)
    qnnx.update_state(m, grads)
    return grads

  grads = step(q, x)
  assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter('always')
    served = aqtr.flax.convert(q, x)
  same(fwd(served, x), fwd(q, x), seen)
  return q


def linen_contract(model, entries, paths, x):
  """`nnx_contract` for a linen model (state: collection 'aqtr_state')."""
  pairs = zip(entries, paths[: len(entries)], strict=True)
  q = aqtr.flax.quantize(model, [Rule(config(e), path=p) for e, p in pairs])
  v = jax.jit(q.init)(jax.random.key(0), x)
  rngs = {'aqtr': jax.random.key(1)}

  def loss(p, s, x):
    out, upd = q.apply(
      {**v, 'params': p, 'aqtr_state': s},
      x,
      mutable=['aqtr_state'],
      rngs=rngs,
    )
    return jnp.sum(out**2), upd['aqtr_state']

  state = v.get('aqtr_state', {})
  grad = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))
  (_, upd), (gp, gs) = grad(v['params'], state, x)
  assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(gp))
  v = {**v, 'aqtr_state': aqtr.state.merge_tree(upd, gs)} if state else v
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter('always')
    sm_, sv = aqtr.flax.convert(q, x, variables=v)
  train = jax.jit(lambda v, x: q.apply(v, x, mutable=['aqtr_state'], rngs=rngs))
  want, _ = train(v, x)
  same(jax.jit(sm_.apply)(sv, x), want, seen)
