"""One quantized dot in a Mode: the framework-free core of the adapters.

The adapters (`aqtr.flax.linen`, `aqtr.flax.nnx`, the `aqtr.pax` ops)
store variables; this module routes one `dot_general` call, per mode, to
the freezers of its two forward operands (each gets one `OperandCall`;
the dot's layout is computed once per call):

  TRAIN      out = dot_general(lhs, rhs, config)        (on the fly)
  CALIBRATE  same output; each collecting operand updates its statistics
             (`Freezer.start_stats`, `Freezer.collect`)
  CONVERT    the frozen entry {side: Freezer.freeze(..)}; returns the SERVE
             output computed from it
  SERVE      each freezer's `Freezer.serve(..)` gives the operand (a float
             array or a QTensor), optionally its TensorConfig and an output
             scale s: out = s * dot_general(operand, .., config').

E.g. 'weights' stores {qvalue, scale} (`quantize_operand`; and zero_point
for affine numerics) and serves the
QTensor; 'calibration' stores {bound} b and serves b * dot(x / b, ..) with
the operand's calibration set to Constant(1.0), exact by linearity.

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

from aqtr.core.config import DotGeneralConfig
from aqtr.core.dimension_numbers import DotLayout
from aqtr.core.dot_general import dot_general
from aqtr.core.engine_state import state_paths
from aqtr.core.qtensor import QTensor
from aqtr.core.sparsify import sites_of
from aqtr.freezers.base import Mode, NoFreezer
from aqtr.freezers.call import OperandCall

SIDES = ('lhs', 'rhs')
PREFIX = 'frozen_'


@dataclasses.dataclass(frozen=True)
class Result:
  """What one call computed and what the adapter must store.

  Attributes:
    out: the dot's output.
    frozen: CONVERT: the new frozen entry (store under `entry_name`).
    stats: CALIBRATE: {side: new statistics} for 'calibration' operands.
    state: TRAIN / CALIBRATE with a stateful config: the dot's new
      calibration state (`aqtr.state`); the adapter stores it.
  """

  out: jax.Array
  frozen: dict | None = None
  stats: dict | None = None
  state: dict | None = None


# A pytree, so `jax.jit(run, static_argnums=(0, 3, 4))` works.
jax.tree_util.register_dataclass(
  Result, data_fields=['out', 'frozen', 'stats', 'state'], meta_fields=[]
)


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


def _calls(lhs, rhs, dn, config, key, where, how_stats, state) -> dict:
  """{side: OperandCall} of the frozen operands (the layout made once)."""
  lay = DotLayout.create(jnp.shape(lhs), jnp.shape(rhs), dn)
  ops = {'lhs': lhs, 'rhs': rhs}
  return {
    side: OperandCall(
      side,
      ops[side],
      lay,
      dn,
      config,
      key,
      where,
      how_stats,
      (state or {}).get(f'fwd.{side}'),
      sites_of(state).get(side),
    )
    for side in freezers(config)
  }


def _train_dot(lhs, rhs, dn, config, key, state, kw) -> Result:
  """The on-the-fly dot; with calibration state, its new state too."""
  if state is None:
    return Result(dot_general(lhs, rhs, dn, config, key=key, **kw))
  out, new = dot_general(lhs, rhs, dn, config, key=key, state=state, **kw)
  return Result(out, state=new)


def _served_state(state, config, ops) -> dict | None:
  """The state a served dot needs: none for stored (frozen) operands, nor
  for operands whose served calibration is no longer stateful."""
  if state is None:
    return None
  stored = tuple(isinstance(ops[s], QTensor) for s in SIDES)
  return {p: v for p, v in state.items() if p in state_paths(config, stored)}


def _served_dot(calls, entry, lhs, rhs, dn, config, key, kw, state=None):
  """SERVE: each freezer turns its stored parts into the dot's operand."""
  ops = {'lhs': lhs, 'rhs': rhs}
  fwd = config.fwd
  scales = {}
  for side, call in calls.items():
    f = call.tensor.freezer
    part = entry.get(side) if isinstance(entry, Mapping) else None
    want = f.frozen_parts
    if part is None or any(p not in part for p in want):
      raise call.error(
        f'the frozen entry lacks the {side} operand parts {want}; convert '
        'again with this config.'
      )
    served = f.serve(call, part)
    ops[side] = served.operand
    if served.tensor is not None:
      fwd = dataclasses.replace(fwd, **{side: served.tensor})
    if served.out_scale is not None:
      scales[side] = jnp.asarray(served.out_scale, jnp.float32)
  if scales and kw['preferred_element_type'] is None:
    kw = dict(kw, preferred_element_type=jnp.float32)
  cfg = dataclasses.replace(config, fwd=fwd)
  st = _served_state(state, cfg, ops)
  if st is not None:
    kw = dict(kw, state=st)
  out = dot_general(ops['lhs'], ops['rhs'], dn, cfg, key=key, **kw)
  out = out[0] if st is not None else out
  return out * _out_scale(scales, calls, out.ndim) if scales else out


def _out_scale(scales, calls, rank: int) -> jax.Array:
  """The product of the operands' output scales, shaped like the output."""
  lay = next(iter(calls.values())).dot
  nb = len(lay.lhs.batch)
  nl, nr = len(lay.lhs.free), len(lay.rhs.free)
  total = jnp.ones((1,) * rank, jnp.float32)
  for side, s in scales.items():
    if s.ndim == 0:
      s = s.reshape((1,) * rank)
    elif side == 'lhs':
      s = s.reshape((1,) * nb + calls[side].free_shape + (1,) * nr)
    else:
      s = s.reshape((1,) * (nb + nl) + calls[side].free_shape)
    total = total * s
  return total


def _checked_parts(call, parts) -> dict:
  f = call.tensor.freezer
  ok = isinstance(parts, Mapping) and (
    set(f.frozen_parts) <= set(parts) <= set(f.frozen_parts + f.optional_parts)
  )
  if not ok:
    got = sorted(parts) if isinstance(parts, Mapping) else parts
    raise TypeError(
      f'{call.where}: {type(f).__name__}.freeze must return a dict with '
      f'exactly the keys frozen_parts={f.frozen_parts} (and optionally '
      f'{f.optional_parts}), got {got!r}.'
    )
  return dict(parts)


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
  state: Mapping | None = None,
) -> Result:
  """Runs one dot_general in `mode` (see the module docstring).

  Each frozen operand's freezer decides what happens to it
  (`Freezer.start_stats` / `collect` / `freeze` / `serve`); this function
  only routes: the adapters store what it returns.

  Args:
    mode: an aqtr.freezers.Mode.
    lhs, rhs, dn: the float operands and dimension numbers.
    config: the DotGeneralConfig (validated with `validate`).
    frozen: SERVE: the entry found by `find_frozen`.
    stats: CALIBRATE / CONVERT: {side: statistics} of collecting sides.
    key: PRNG key (see `key_use`).
    precision, preferred_element_type: as in `lax.dot_general`.
    initializing: the adapter is creating variables (Flax init): SERVE and
      CONVERT compute the TRAIN output and store nothing; CALIBRATE does
      not count the call.
    where, how_stats: context for error messages.
    state: the dot's calibration state tree (`aqtr.state.init`) when its
      config has stateful or learned calibrations. TRAIN and CALIBRATE
      return the new state; CONVERT freezes each frozen operand with the
      bound its state gives (so SERVE equals TRAIN at that state) and
      SERVE reads the state of the operands it still quantizes.

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
  state = None if state is None else dict(state)
  if (
    mode is Mode.TRAIN
    or not freezers(config)
    or (initializing and mode is not Mode.CALIBRATE)
  ):
    return _train_dot(lhs, rhs, dn, config, key, state, kw)
  calls = _calls(lhs, rhs, dn, config, key, where, how_stats, state)
  stats = stats or {}
  if mode is Mode.CALIBRATE:
    trained = _train_dot(lhs, rhs, dn, config, key, state, kw)
    out = trained.out
    new = {}
    for side, call in calls.items():
      f = call.tensor.freezer
      if not f.collects:
        continue
      old = stats.get(side)
      if old is None:
        old = f.start_stats(call)
      new[side] = old if initializing else f.collect(old, call)
    return Result(out, stats=new, state=trained.state)
  if mode is Mode.CONVERT:
    entry = {
      side: _checked_parts(
        call, call.tensor.freezer.freeze(call, stats.get(side))
      )
      for side, call in calls.items()
    }
    out = _served_dot(calls, entry, lhs, rhs, dn, config, key, kw, state)
    return Result(out.astype(out_dtype), frozen=entry)
  out = _served_dot(calls, frozen, lhs, rhs, dn, config, key, kw, state)
  return Result(out.astype(out_dtype))


def removable(config: DotGeneralConfig, side: str = 'rhs') -> bool:
  """Whether SERVE never reads the float `side` operand (it can be dropped).

  Example:
    >>> import aqtr
    >>> removable(aqtr.freezers.configure(aqtr.presets.int8(), rhs='weights'))
    True
  """
  f = freezers(config).get(side)
  return f is not None and not f.reads_float


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
