"""One quantized dot in a Mode: the framework-free core of the adapters.

The Flax adapters (`aqtr.flax.linen`, `aqtr.flax.nnx`) store variables;
this module says what to compute and what to store, per mode, for the two
forward operands of one `dot_general` and their freezers:

  TRAIN      out = dot_general(lhs, rhs, config)        (on the fly)
  CALIBRATE  same output; each 'calibration' operand updates its running
             statistics (mean bound, count)
  CONVERT    writes the frozen entry: 'weights' operands {qvalue, scale}
             (`quantize_operand`; and zero_point for affine numerics),
             'calibration' operands {bound}; returns
             the SERVE output computed from it
  SERVE      reads the frozen entry: QTensor operands for 'weights', and for
             'calibration' operands with bound b (constant along the
             contraction): out = b_out * dot(x / b, ..) with that operand's
             calibration set to Constant(1.0), exact by linearity.

The frozen entry is stored under `entry_name(config)` = 'frozen_<8 hex>', a
digest of `config.fwd`: serving with a different forward config than the
one converted with is detected statically (variable names are static under
jit) and reported, instead of silently computing other numbers.

Not imported by `aqtr.freezers` (it imports the engine, which imports the
freezer base classes).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from aqtr.calibrations.constant import Constant
from aqtr.core.config import DotGeneralConfig
from aqtr.core.dimension_numbers import DotLayout, OperandLayout
from aqtr.core.dot_general import dot_general
from aqtr.core.operand import quantize_operand
from aqtr.core.qtensor import QTensor
from aqtr.freezers.base import Mode, NoFreezer
from aqtr.freezers.calibration import CalibrationFreezer
from aqtr.freezers.weights import WeightsFreezer

SIDES = ('lhs', 'rhs')
PREFIX = 'frozen_'


@dataclasses.dataclass(frozen=True)
class Result:
  """What one call computed and what the adapter must store.

  Attributes:
    out: the dot's output.
    frozen: CONVERT: the new frozen entry (store under `entry_name`).
    stats: CALIBRATE: {side: new statistics} for 'calibration' operands.
  """

  out: jax.Array
  frozen: dict | None = None
  stats: dict | None = None


def validate(config: DotGeneralConfig) -> None:
  """Freezers only on quantized forward operands; raises otherwise."""
  if not isinstance(config, DotGeneralConfig):
    raise TypeError(f'config must be an aqtr.DotGeneralConfig, got {config!r}.')
  for name in ('dlhs', 'drhs'):
    for side in SIDES:
      f = getattr(getattr(config, name), side).freezer
      if not isinstance(f, NoFreezer):
        raise ValueError(
          f'config.{name}.{side}.freezer is {f!r}; only the forward '
          'operands (config.fwd.lhs / config.fwd.rhs) can be frozen.'
        )
  for side in SIDES:
    t = getattr(config.fwd, side)
    if not isinstance(t.freezer, NoFreezer) and not t.quantized:
      raise ValueError(
        f'config.fwd.{side}.freezer is {t.freezer!r} but config.fwd.{side} '
        'is not quantized: there is nothing to freeze. Use NoFreezer().'
      )


def freezers(config: DotGeneralConfig) -> dict:
  """{side: freezer} for the forward operands that freeze something."""
  return {
    s: getattr(config.fwd, s).freezer
    for s in SIDES
    if not isinstance(getattr(config.fwd, s).freezer, NoFreezer)
  }


def fingerprint(config: DotGeneralConfig) -> str:
  """8 hex digits identifying `config.fwd` (stable across processes)."""
  return hashlib.sha256(repr(config.fwd).encode()).hexdigest()[:8]


def entry_name(config: DotGeneralConfig) -> str:
  """The variable name of the frozen entry: 'frozen_<fingerprint>'."""
  return PREFIX + fingerprint(config)


def key_use(config: DotGeneralConfig, mode: Mode) -> str | None:
  """'required' if a PRNG key is needed, 'dummy' if any key will do, None.

  The forward pass needs a key when a forward operand rounds
  stochastically; the backward passes only in TRAIN (the other modes do
  not differentiate, and the engine's check is met with a fixed key).
  """

  def sr(raw):
    return any(
      t.quantized and t.rounding.stochastic for t in (raw.lhs, raw.rhs)
    )

  if sr(config.fwd) or (
    mode is Mode.TRAIN and (sr(config.dlhs) or sr(config.drhs))
  ):
    return 'required'
  if sr(config.dlhs) or sr(config.drhs):
    return 'dummy'
  return None


def find_frozen(
  entries: Mapping | None,
  config: DotGeneralConfig,
  where: str,
  collection: str,
  how: str,
) -> dict:
  """The frozen entry for `config` among an op's `entries`, or a clear error.

  Args:
    entries: the op's variables in the frozen collection (name -> value).
    config: the config serving now.
    where: the op's path, for messages.
    collection: the collection name, for messages.
    how: how to produce the frozen values, for messages.
  """
  name = entry_name(config)
  entries = dict(entries or {})
  if name in entries:
    return entries[name]
  others = sorted(k for k in entries if str(k).startswith(PREFIX))
  if others:
    raise ValueError(
      f'{where}: the frozen values in collection {collection!r} '
      f'({", ".join(others)}) were converted with a different forward '
      f'quantization config than the one serving now ({name}; '
      f'config.fwd = {config.fwd!r}). Serve with the config used for '
      f'CONVERT, or convert again. {how}'
    )
  raise ValueError(
    f'{where}: mode SERVE reads frozen values from variable collection '
    f'{collection!r} (entry {name!r}), but there are none. {how}'
  )


def _free_shape(lay: OperandLayout) -> tuple[int, ...]:
  return tuple(lay.shape[a] for a in lay.free)


def _broadcast(b: jax.Array, lay: OperandLayout) -> jax.Array:
  """A bound over free axes (or scalar) reshaped to broadcast with x."""
  if b.ndim == 0:
    return b.reshape((1,) * len(lay.shape))
  free = set(lay.free)
  return b.reshape(
    tuple(d if a in free else 1 for a, d in enumerate(lay.shape))
  )


def _statistic(freezer, x, lay: OperandLayout, cfg) -> jax.Array:
  return freezer.statistic(lay.to_canonical(x, 'fk'), cfg.calibration)


def stats_shape(freezer, lay: OperandLayout) -> tuple[int, ...]:
  return freezer.stats_shape(_free_shape(lay))


def _static_config(config: DotGeneralConfig, sides) -> DotGeneralConfig:
  fwd = config.fwd
  for s in sides:
    t = dataclasses.replace(getattr(fwd, s), calibration=Constant(bound=1.0))
    fwd = dataclasses.replace(fwd, **{s: t})
  return dataclasses.replace(config, fwd=fwd)


def _freeze(side, f, x, config, dn, stats, key, where, how_stats):
  if isinstance(f, WeightsFreezer):
    q = quantize_operand(x, dn, config, operand=side, key=key)
    parts = {'qvalue': q.qvalue, 'scale': q.scale}
    if q.zero_point is not None:  # Affine numerics (int_asymmetric).
      parts['zero_point'] = q.zero_point
    return parts
  if isinstance(f, CalibrationFreezer):
    s = (stats or {}).get(side)
    count = None if s is None else s['count']
    empty = s is None or (
      not isinstance(count, jax.core.Tracer) and int(count) == 0
    )
    if empty:
      raise ValueError(
        f'{where}: CONVERT freezes the static range of the {side} operand '
        'from its CALIBRATE statistics, but none were collected. '
        f'{how_stats}'
      )
    return f.frozen(s)
  raise TypeError(
    f'{where}: unknown freezer {f!r} on config.fwd.{side}; the adapters '
    'know NoFreezer, WeightsFreezer and CalibrationFreezer.'
  )


def _serve(lhs, rhs, dn, config, frozen, key, precision, preferred, where):
  lay = DotLayout.create(jnp.shape(lhs), jnp.shape(rhs), dn)
  ops = {'lhs': lhs, 'rhs': rhs}
  bounds = {}
  for side, f in freezers(config).items():
    part = frozen.get(side) if isinstance(frozen, Mapping) else None
    side_lay = getattr(lay, side)
    want = f.frozen_parts
    if part is None or any(p not in part for p in want):
      raise ValueError(
        f'{where}: the frozen entry lacks the {side} operand parts {want}; '
        'convert again with this config.'
      )
    if isinstance(f, WeightsFreezer):
      form = 'fk' if side == 'lhs' else side_lay.natural_form()
      ops[side] = QTensor(
        part['qvalue'], part['scale'], side_lay, form, part.get('zero_point')
      )
    else:
      b = jnp.asarray(part['bound'], jnp.float32)
      shape = stats_shape(f, side_lay)
      if b.shape != shape:
        raise ValueError(
          f'{where}: the frozen {side} bound has shape {b.shape}, this call '
          f"needs {shape} (the operand's free axes with per_channel)."
        )
      b = jnp.where(b > 0, b, jnp.ones_like(b))
      bounds[side] = b
      ops[side] = ops[side] / _broadcast(b, side_lay)
  cfg = _static_config(config, bounds)
  pet = preferred
  if bounds and pet is None:
    pet = jnp.float32
  out = dot_general(
    ops['lhs'],
    ops['rhs'],
    dn,
    cfg,
    key=key,
    precision=precision,
    preferred_element_type=pet,
  )
  nb = len(lay.lhs.batch)
  nl, nr = len(lay.lhs.free), len(lay.rhs.free)
  for side, b in bounds.items():
    if b.ndim == 0:
      b = b.reshape((1,) * out.ndim)
    elif side == 'lhs':
      b = b.reshape((1,) * nb + _free_shape(lay.lhs) + (1,) * nr)
    else:
      b = b.reshape((1,) * (nb + nl) + _free_shape(lay.rhs))
    out = out * b
  return out


def run(
  mode: Mode,
  lhs: jax.Array,
  rhs: jax.Array,
  dn,
  config: DotGeneralConfig,
  *,
  frozen: Mapping | None = None,
  stats: Mapping | None = None,
  key: jax.Array | None = None,
  precision=None,
  preferred_element_type=None,
  initializing: bool = False,
  where: str = 'aqtr op',
  how_stats: str = 'Run the model in CALIBRATE mode on sample batches first.',
) -> Result:
  """Runs one dot_general in `mode` (see the module docstring).

  Args:
    mode: an aqtr.freezers.Mode.
    lhs, rhs, dn: the float operands and dimension numbers.
    config: the DotGeneralConfig (validated with `validate`).
    frozen: SERVE: the entry found by `find_frozen`.
    stats: CALIBRATE / CONVERT: {side: statistics} of 'calibration' sides.
    key: PRNG key (see `key_use`).
    precision, preferred_element_type: as in `lax.dot_general`.
    initializing: the adapter is creating variables (Flax init): SERVE and
      CONVERT compute the TRAIN output and store nothing; CALIBRATE does
      not count the call.
    where, how_stats: context for error messages.

  Returns:
    A Result: the output and what to store.

  Example:
    >>> import jax.numpy as jnp, aqtr
    >>> cfg = aqtr.freezers.configure(aqtr.presets.int8(), rhs='weights')
    >>> x, w, dn = jnp.ones((2, 4)), jnp.ones((4, 3)), (((1,), (0,)), ((), ()))
    >>> r = run(Mode.CONVERT, x, w, dn, cfg)
    >>> r.frozen['rhs']['qvalue'].dtype
    dtype('int8')
    >>> bool((run(Mode.SERVE, x, 0 * w, dn, cfg, frozen=r.frozen).out ==
    ...       run(Mode.TRAIN, x, w, dn, cfg).out).all())
    True
  """
  if not isinstance(mode, Mode):
    raise TypeError(f'mode must be an aqtr.freezers.Mode, got {mode!r}.')
  out_dtype = (
    jnp.dtype(preferred_element_type)
    if preferred_element_type is not None
    else jnp.result_type(lhs, rhs)
  )
  kw = dict(precision=precision, preferred_element_type=preferred_element_type)
  fz = freezers(config)
  if (
    mode is Mode.TRAIN
    or not fz
    or (initializing and mode is not Mode.CALIBRATE)
  ):
    return Result(dot_general(lhs, rhs, dn, config, key=key, **kw))
  lay = DotLayout.create(jnp.shape(lhs), jnp.shape(rhs), dn)
  ops = {'lhs': lhs, 'rhs': rhs}
  if mode is Mode.CALIBRATE:
    out = dot_general(lhs, rhs, dn, config, key=key, **kw)
    new = {}
    for side, f in fz.items():
      if not f.collects:
        continue
      side_lay = getattr(lay, side)
      old = (stats or {}).get(side)
      if old is None:
        old = f.init_stats(stats_shape(f, side_lay))
      if not initializing:
        cfg = getattr(config.fwd, side)
        old = f.update_stats(old, _statistic(f, ops[side], side_lay, cfg))
      new[side] = old
    return Result(out, stats=new)
  if mode is Mode.CONVERT:
    entry = {
      side: _freeze(
        side, f, ops[side], config, dn, stats, key, where, how_stats
      )
      for side, f in fz.items()
    }
    out = _serve(
      lhs, rhs, dn, config, entry, key, precision, preferred_element_type, where
    )
    return Result(out.astype(out_dtype), frozen=entry)
  out = _serve(
    lhs, rhs, dn, config, frozen, key, precision, preferred_element_type, where
  )
  return Result(out.astype(out_dtype))


def nbytes(tree) -> int:
  """Bytes of the arrays in `tree` (sub-byte dtypes such as int4 packed)."""
  total = 0
  for x in jax.tree_util.tree_leaves(tree):
    if not hasattr(x, 'dtype') or not hasattr(x, 'shape'):
      continue
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      if isinstance(x, jax.Array):
        total += jax.random.key_data(x).nbytes * 8
      continue
    dt = jnp.dtype(x.dtype)
    bits = dt.itemsize * 8
    if jnp.issubdtype(dt, jnp.integer):
      bits = jnp.iinfo(dt).bits
    elif jnp.issubdtype(dt, jnp.floating):
      bits = jnp.finfo(dt).bits
    total += math.prod(x.shape) * bits
  return (total + 7) // 8
