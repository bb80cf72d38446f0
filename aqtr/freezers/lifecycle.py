"""One quantized dot in a Mode: the framework-free core of the adapters.

The adapters (`aqtr.flax.linen`, `aqtr.flax.nnx`, the `aqtr.pax` ops)
store variables; this module routes one `dot_general` call (a `DotCall`,
whose plan is made once), per mode, to the freezers of its two forward
operands (each gets an `OperandCall` view of it):

  TRAIN      out = dot_general(lhs, rhs, config)        (on the fly)
  CALIBRATE  same output; each collecting operand updates its statistics
             (`Freezer.start_stats`, `Freezer.collect`)
  CONVERT    the frozen entry {side: Freezer.freeze(..)}, its 'qvalue'
             stored through the numerics' codec (`aqtr.core.codecs`:
             packed 4-bit 'codes' for int4 / nf4 / e2m1, decoded bit for
             bit in SERVE); returns the SERVE output computed from it
  SERVE      each freezer's `Freezer.serve(..)` gives the operand (a float
             array or a QTensor), optionally its TensorConfig and an output
             scale s: out = s * dot_general(operand, .., config').

E.g. 'weights' stores {qvalue, scale} (`quantize_operand`; and zero_point
for affine numerics) and serves the
QTensor (an entry written from outside, such as an imported act-order
GPTQ checkpoint, may add 'perm' int32 [K]: the weight's rows stored in
the order perm along its one contracting axis, served as
`dot(x[..., perm], w[perm]) = dot(x, w)`); 'calibration' stores {bound}
b and serves b * dot(x / b, ..) with the operand's calibration set to
Constant(1.0), exact by linearity.

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

from aqtr.core import codecs, slot_state
from aqtr.core.config import DotGeneralConfig
from aqtr.core.dot_general import dot_general
from aqtr.core.qtensor import QTensor
from aqtr.core.ragged_dot import ragged_dot
from aqtr.freezers.base import Mode, NoFreezer
from aqtr.freezers.call import DotCall, FreezerError, OperandCall

SIDES = ('lhs', 'rhs')
__all__ = [
  'DotCall',
  'FreezerError',
  'OperandCall',
  'Result',
  'entry_name',
  'find_frozen',
  'freezers',
  'in_op',
  'key_use',
  'nbytes',
  'removable',
  'run',
  'validate',
]
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


def _calls(call: DotCall) -> dict:
  """{side: OperandCall} of the frozen operands."""
  return {side: call.operand(side) for side in freezers(call.config)}


def _dot(call: DotCall, **kw):
  """`dot_general` (`ragged_dot` with group sizes) of the call (`kw`
  overrides its fields)."""
  c = call.replace(**kw)
  common = dict(
    key=c.key,
    precision=c.precision,
    preferred_element_type=c.preferred_element_type,
    out_sharding=c.out_sharding,
    state=c.state,
  )
  if c.group_sizes is not None:
    return ragged_dot(c.lhs, c.rhs, c.group_sizes, c.config, **common)
  return dot_general(c.lhs, c.rhs, c.dimension_numbers, c.config, **common)


def _train_dot(call: DotCall) -> Result:
  """The on-the-fly dot; with calibration state, its new state too."""
  if call.state is None:
    return Result(_dot(call))
  out, new = _dot(call)
  return Result(out, state=new)


def _served_state(state, config, ops) -> dict | None:
  """The state a served dot needs: none for stored (frozen) operands, nor
  for operands whose served calibration is no longer stateful."""
  if state is None:
    return None
  stored = tuple(isinstance(ops[s], QTensor) for s in SIDES)
  keep = slot_state.paths(config, stored)
  return {p: v for p, v in state.items() if p in keep}


def _served_dot(call: DotCall, calls: dict, entry) -> jax.Array:
  """SERVE: each freezer turns its stored parts into the dot's operand."""
  ops = {'lhs': call.lhs, 'rhs': call.rhs}
  fwd = call.config.fwd
  scales = {}
  for side, op in calls.items():
    f = op.tensor.freezer
    part = entry.get(side) if isinstance(entry, Mapping) else None
    packed = None
    if isinstance(part, Mapping):  # Packed codes back to the values.
      packed = part.get('int4')
      part = codecs.decode_parts(part, op.tensor.numerics)
    want = f.frozen_parts
    if part is None or any(p not in part for p in want):
      raise op.error(
        f'the frozen entry lacks the {side} operand parts {want}; convert '
        'again with this config.'
      )
    served = f.serve(op, part)
    ops[side] = _with_packed(served.operand, part, packed)
    if side == 'rhs' and part.get('perm') is not None:
      ops['lhs'] = _permuted(call, calls, ops['lhs'], part['perm'])
    if served.tensor is not None:
      fwd = dataclasses.replace(fwd, **{side: served.tensor})
    if served.out_scale is not None:
      scales[side] = jnp.asarray(served.out_scale, jnp.float32)
  preferred = call.preferred_element_type
  if scales and preferred is None:
    preferred = jnp.float32
  cfg = dataclasses.replace(call.config, fwd=fwd)
  st = _served_state(call.state, cfg, ops)
  out = _dot(
    call,
    lhs=ops['lhs'],
    rhs=ops['rhs'],
    config=cfg,
    preferred_element_type=preferred,
    state=st,
  )
  out = out[0] if st is not None else out
  return out * _out_scale(scales, calls, out.ndim) if scales else out


def _with_packed(operand, part: dict, packed):
  """A served QTensor that holds the decoded int4 codes unchanged, given
  their stored bytes too (`QTensor.packed`): a CPU dot reads those, and
  no serving step decodes the codes. Anything else as it is."""
  if packed is None or not isinstance(operand, QTensor):
    return operand
  if operand.qvalue is not part['qvalue']:  # The freezer changed them.
    return operand
  return dataclasses.replace(operand, packed=packed)


def _permuted(call: DotCall, calls: dict, lhs, perm) -> jax.Array:
  """The float lhs gathered along the contracting axis by the rhs's stored
  row order `perm` (x[..., perm] for a [K, N] weight stored as w[perm])."""
  (lc, rc), _ = call.dimension_numbers
  if len(rc) != 1 or 'lhs' in calls or call.group_sizes is not None:
    raise calls['rhs'].error(
      "a stored row order ('perm') needs one contracting axis, a float lhs "
      'and no ragged groups; store the weight in its own row order.'
    )
  n = jnp.shape(call.rhs)[rc[0]]
  if jnp.shape(perm) != (n,):
    raise calls['rhs'].error(
      f"stored row order 'perm' has shape {jnp.shape(perm)}, the weight's "
      f'contracting axis {n} rows.'
    )
  return jnp.take(lhs, perm, axis=lc[0])


def _out_scale(scales, calls, rank: int) -> jax.Array:
  """The product of the operands' output scales, shaped like the output."""
  lay = next(iter(calls.values())).call.plan.layout
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
      f'{call.slot.path}: {type(f).__name__}.freeze must return a dict with '
      f'exactly the keys frozen_parts={f.frozen_parts} (and optionally '
      f'{f.optional_parts}), got {got!r}.'
    )
  return dict(parts)


def run(
  call: DotCall,
  mode: Mode,
  *,
  frozen: Mapping | None = None,
  stats: Mapping | None = None,
  initializing: bool = False,
) -> Result:
  """Runs one dot_general call in `mode` (see the module docstring).

  Each frozen operand's freezer decides what happens to it
  (`Freezer.start_stats` / `collect` / `freeze` / `serve`); this function
  only routes: the adapters store what it returns. Errors about an
  operand are `FreezerError`s without the op's name: the adapter adds it.

  Args:
    call: the DotCall (operands, dimension numbers, config validated with
      `validate`, key, precision, preferred type, and the calibration
      state tree when the config has stateful or learned calibrations).
    mode: an aqtr.freezers.Mode.
    frozen: SERVE: the entry found by `find_frozen`.
    stats: CALIBRATE / CONVERT: {side: statistics} of collecting sides.
    initializing: the adapter is creating variables (Flax init): SERVE and
      CONVERT compute the TRAIN output and store nothing; CALIBRATE does
      not count the call.

  With state, TRAIN and CALIBRATE return the new state; CONVERT freezes
  each frozen operand with the bound its state gives (so SERVE equals
  TRAIN at that state) and SERVE reads the state of the operands it still
  quantizes.

  Returns:
    A Result: the output and what to store.

  Example:
    >>> import jax.numpy as jnp, aqtr
    >>> cfg = aqtr.freezers.configure(aqtr.presets.int8(), rhs='weights')
    >>> x, w, dn = jnp.ones((2, 4)), jnp.ones((4, 3)), (((1,), (0,)), ((), ()))
    >>> r = run(DotCall(x, w, dn, cfg), Mode.CONVERT)
    >>> r.frozen['rhs']['qvalue'].dtype
    dtype('int8')
    >>> served = run(DotCall(x, 0 * w, dn, cfg), Mode.SERVE, frozen=r.frozen)
    >>> bool((served.out == run(DotCall(x, w, dn, cfg), Mode.TRAIN).out).all())
    True
  """
  if not isinstance(mode, Mode):
    raise TypeError(f'mode must be an aqtr.freezers.Mode, got {mode!r}.')
  if not isinstance(call, DotCall):
    raise TypeError(f'call must be an aqtr.freezers.DotCall, got {call!r}.')
  config = call.config
  out_dtype = (
    jnp.dtype(call.preferred_element_type)
    if call.preferred_element_type is not None
    else jnp.result_type(call.lhs, call.rhs)
  )
  if call.state is not None:
    call = call.replace(state=dict(call.state))
  if (
    mode is Mode.TRAIN
    or not freezers(config)
    or (initializing and mode is not Mode.CALIBRATE)
  ):
    return _train_dot(call)
  calls = _calls(call)
  stats = stats or {}
  if mode is Mode.CALIBRATE:
    trained = _train_dot(call)
    new = {}
    for side, op in calls.items():
      f = op.tensor.freezer
      if not f.collects:
        continue
      old = stats.get(side)
      if old is None:
        old = f.start_stats(op)
      new[side] = old if initializing else f.collect(old, op)
    return Result(trained.out, stats=new, state=trained.state)
  if mode is Mode.CONVERT:
    entry = {  # Stored through the numerics' codec (`aqtr.core.codecs`).
      side: codecs.encode_parts(
        _checked_parts(op, op.tensor.freezer.freeze(op, stats.get(side))),
        op.tensor.numerics,
      )
      for side, op in calls.items()
    }
    out = _served_dot(call, calls, entry)
    return Result(out.astype(out_dtype), frozen=entry)
  out = _served_dot(call, calls, frozen)
  return Result(out.astype(out_dtype))


def in_op(e: ValueError, where: str, how_stats: str = '') -> ValueError:
  """A lifecycle error with the op's context added (the adapters' boundary):
  `where` first, and `how_stats` after a freezer's missing statistics."""
  hint = f' {how_stats}' if getattr(e, 'needs', None) == 'stats' else ''
  return ValueError(f'{where}: {e}{hint}')


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
