"""What the linen, nnx and Pax adapters share: one body for every op.

Every quantized op runs as one `aqtr.dot_general` through
`aqtr.freezers.lifecycle` (einsum: dimension numbers + a transpose of the
output; conv: im2col, `aqtr.core.conv`), so one set of freezer semantics
serves Dense, DenseGeneral, Einsum and Conv alike. The op bodies here
(`dot_general_op`, `einsum_op`, `conv_op`, and `quantized_dot` under them)
take an `OpHost`: the few things that differ between frameworks (where the
variables live, where PRNG keys come from, what the error messages say).

Example:
  >>> einsum_plan('btd,dhf->bthf', 3, 3)
  ((((2,), (0,)), ((), ())), None)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from aqtr.core import conv as conv_lib
from aqtr.core import einsum as einsum_lib
from aqtr.core import prims, slot_state
from aqtr.core.config import DotGeneralConfig
from aqtr.freezers import Mode, lifecycle
from aqtr.state import init as init_state

# Variable collections (linen) / Variable types' names (nnx).
FROZEN = 'aqtr'
STATS = 'aqtr_stats'
# Stateful calibrations: stats (linen collection / nnx CalibState) and the
# learned parameters (a param / nnx.Param of this name).
STATE = 'aqtr_state'
LEARNED = 'aqtr_learned'
# Linen CONVERT only: which ops' float kernels serving does not read.
PLAN = 'aqtr_convert'
# The default rng stream of stochastic rounding.
RNG = 'quant'


def is_float(config: DotGeneralConfig | None) -> bool:
  """True when the op is the plain lax / jnp one (no config, all float)."""
  return config is None or config.is_float


def einsum_plan(subscripts: str, lhs_ndim: int, rhs_ndim: int):
  """(dimension numbers, output permutation or None) of a 2-operand einsum.

  `aqtr.einsum` computes `dot_general(lhs, rhs, dn).transpose(perm)`; the
  adapters do the same so the dot can be frozen.
  """
  ls, rs, os = einsum_lib.parse(subscripts, lhs_ndim, rhs_ndim)
  dn = einsum_lib.dimension_numbers(subscripts, lhs_ndim, rhs_ndim)
  batch = [c for c in ls if c in rs and c in os]
  got = (
    ''.join(batch)
    + ''.join(c for c in ls if c not in rs)
    + ''.join(c for c in rs if c not in ls)
  )
  perm = None if got == os else tuple(got.index(c) for c in os)
  return dn, perm


def constrain(out: jax.Array, out_sharding) -> jax.Array:
  """Applies an op's `out_sharding=` (as nnx passes it) to its output."""
  if out_sharding is None:
    return out
  return jax.lax.with_sharding_constraint(out, out_sharding)


def check_mode(mode) -> None:
  """Raises a TypeError naming `mode` unless it is an aqtr.Mode."""
  if not isinstance(mode, Mode):
    raise TypeError(
      f'mode must be an aqtr.Mode (TRAIN, CALIBRATE, CONVERT, SERVE), got '
      f'{mode!r}.'
    )


class OpHost:
  """What an adapter op gives the shared body: its state and its words.

  Attributes:
    config: the op's DotGeneralConfig.
    mode: the op's aqtr.Mode.
    where: the op's name and path, for error messages.
    frozen_collection: where SERVE reads frozen values, for messages.
    how_convert, how_calibrate: how to produce them, for messages.
  """

  config: DotGeneralConfig
  mode: Mode
  where: str
  frozen_collection: str
  how_convert: str
  how_calibrate: str

  @property
  def initializing(self) -> bool:
    """Variables are being created (linen `init`): nothing is stored."""
    return False

  def frozen_entries(self) -> Mapping | None:
    """SERVE: the op's frozen entries (entry name -> values)."""
    raise NotImplementedError

  def stats(self, mode: Mode) -> Mapping | None:
    """CALIBRATE / CONVERT: {side: statistics}; may raise if not mutable."""
    raise NotImplementedError

  def calib_state(self, make: CalibStateInit) -> dict:
    """The op's calibration state tree (stateful configs only).

    `make()` gives ({path: stats}, {path: learned}) for new variables.
    """
    raise NotImplementedError

  def store(self, result: lifecycle.Result) -> None:
    """Stores what `lifecycle.run` returned (statistics, frozen entry)."""
    raise NotImplementedError

  def mark_removable(self, rhs_shape: tuple[int, ...]) -> None:
    """CONVERT: SERVE will not read the float rhs of this shape."""
    del rhs_shape

  def draw_key(self) -> jax.Array | None:
    """A fresh PRNG key from the op's stream, or None when it has none."""
    raise NotImplementedError

  def missing_key(self) -> str:
    """How to give the op PRNG keys (the end of an error message)."""
    raise NotImplementedError


def prng_key(host: OpHost) -> jax.Array | None:
  """The key of one call: drawn when needed, fixed when any key will do."""
  use = lifecycle.key_use(host.config, host.mode)
  if use is None:
    return None
  key = host.draw_key()
  if key is not None:
    return key
  if use == 'dummy' or host.initializing:
    return jax.random.key(0)
  raise ValueError(
    f'{host.where}: the config rounds stochastically and needs '
    f'{host.missing_key()}'
  )


@dataclasses.dataclass(frozen=True)
class CalibStateInit:
  """Makes an op's initial calibration state from its first operands."""

  lhs: jax.Array
  rhs: jax.Array
  dn: object
  config: DotGeneralConfig

  @property
  def learns(self) -> bool:
    """Whether some stateful calibration of the config learns parameters."""
    return any(
      slot.tensor(self.config).calibration.has_learned
      for slot in slot_state.calibrated_slots(self.config)
    )

  def __call__(self) -> tuple[dict, dict]:
    full = init_state(self.lhs, self.rhs, self.dn, self.config)
    stats = {p: v['stats'] for p, v in full.items()}
    learned = {p: v['learned'] for p, v in full.items() if v['learned']}
    return stats, learned


def assemble(stats: Mapping, learned: Mapping) -> dict:
  """The engine's state tree from an op's stats and learned parameters."""
  return {
    p: {'stats': stats[p], 'learned': dict(learned.get(p, {}))} for p in stats
  }


def stats_of(state: Mapping) -> dict:
  """{path: stats} of an engine state tree (what the adapters store)."""
  return {p: v['stats'] for p, v in state.items()}


def quantized_dot(host: OpHost, lhs, rhs, dn, precision, preferred):
  """One `dot_general` of an adapter op in its mode (see lifecycle.run)."""
  cfg, mode = host.config, host.mode
  lifecycle.validate(cfg)
  check_mode(mode)
  state = None
  if slot_state.paths(cfg):
    state = host.calib_state(CalibStateInit(lhs, rhs, dn, cfg))
  frozen = stats = None
  if lifecycle.freezers(cfg) and not host.initializing:
    if mode is Mode.SERVE:
      frozen = lifecycle.find_frozen(
        host.frozen_entries(),
        cfg,
        host.where,
        host.frozen_collection,
        host.how_convert,
      )
    elif mode in (Mode.CALIBRATE, Mode.CONVERT):
      stats = host.stats(mode)
  call = lifecycle.DotCall(
    lhs, rhs, dn, cfg, prng_key(host), precision, preferred, state
  )
  try:
    r = lifecycle.run(
      call, mode, frozen=frozen, stats=stats, initializing=host.initializing
    )
  except lifecycle.FreezerError as e:  # The op's context, added here.
    raise lifecycle.in_op(e, host.where, host.how_calibrate) from None
  host.store(r)
  if r.frozen is not None and lifecycle.removable(cfg):
    host.mark_removable(tuple(jnp.shape(rhs)))
  return r.out


def dot_general_op(
  host: OpHost,
  lhs,
  rhs,
  dimension_numbers,
  precision=None,
  preferred_element_type=None,
  out_sharding=None,
):
  """The body of a `lax.dot_general` drop-in op."""
  if is_float(host.config):
    return prims.dot_general(
      lhs,
      rhs,
      dimension_numbers,
      precision=precision,
      preferred_element_type=preferred_element_type,
      out_sharding=out_sharding,
    )
  out = quantized_dot(
    host, lhs, rhs, dimension_numbers, precision, preferred_element_type
  )
  return constrain(out, out_sharding)


def einsum_op(
  host: OpHost,
  subscripts,
  lhs,
  rhs,
  precision=None,
  preferred_element_type=None,
  out_sharding=None,
):
  """The body of a two-operand `jnp.einsum` drop-in op (one dot)."""
  if is_float(host.config):
    return prims.einsum(
      subscripts,
      lhs,
      rhs,
      precision=precision,
      preferred_element_type=preferred_element_type,
      out_sharding=out_sharding,
    )
  dn, perm = einsum_plan(subscripts, jnp.ndim(lhs), jnp.ndim(rhs))
  out = quantized_dot(host, lhs, rhs, dn, precision, preferred_element_type)
  if perm is not None:
    out = out.transpose(perm)
  return constrain(out, out_sharding)


def conv_op(host: OpHost, lhs, rhs, *args, **kwargs):
  """The body of a `lax.conv_general_dilated` drop-in op.

  `args`, `kwargs`: lax's arguments after lhs and rhs (`ConvArgs`).
  """

  def dot(patches, kernel, dn, precision, preferred):
    return quantized_dot(host, patches, kernel, dn, precision, preferred)

  return conv_lib.conv_via(
    dot,
    is_float(host.config),
    lhs,
    rhs,
    conv_lib.ConvArgs.bind(*args, **kwargs),
  )


@dataclasses.dataclass(frozen=True)
class Report:
  """Sizes of a conversion, in bytes (int4 counted packed, 2 per byte).

  Attributes:
    float_kernel_bytes: the float kernels removed from the tree.
    frozen_kernel_bytes: their frozen qvalues and scales.
    serving_bytes: everything in the serving tree.
  """

  float_kernel_bytes: int
  frozen_kernel_bytes: int
  serving_bytes: int

  @property
  def kernel_ratio(self) -> float:
    return self.frozen_kernel_bytes / max(self.float_kernel_bytes, 1)

  def __str__(self) -> str:
    return (
      f'kernels: {self.float_kernel_bytes} B float -> '
      f'{self.frozen_kernel_bytes} B frozen ({self.kernel_ratio:.3f}x); '
      f'serving tree: {self.serving_bytes} B'
    )


def removed_bytes(shape, dtype) -> int:
  """Bytes of a removed kernel of `shape` and `dtype`."""
  return lifecycle.nbytes(jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype)))


nbytes = lifecycle.nbytes
