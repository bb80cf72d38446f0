"""Quantized `ragged_dot`: the grouped (mixture-of-experts) matmul.

Math: rows of lhs [M, K] are split into G consecutive groups of
`group_sizes[e]` rows; group e is multiplied by rhs[e] [K, N]:
out[i] = lhs[i] . rhs[e(i)]. It is a geometry of the one dot plan
(`core.plan.Plan` with dimension numbers `RAGGED`, passes in
`core.geometry`): the forward and both gradients are the plan's passes,
quantized by the same quantizer, calibrations, tilings, state, rounding
and sparsity as `dot_general`, under the same custom VJP.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from aqtr.core import prims, slot_state
from aqtr.core.config import DotGeneralConfig
from aqtr.core.dimension_numbers import RAGGED, ragged_layout
from aqtr.core.dot_general import quantized_dot
from aqtr.core.operand import quantize_planned
from aqtr.core.plan import Plan
from aqtr.core.qtensor import QTensor
from aqtr.core.quantizer import check_float
from aqtr.core.rounding import as_typed_key
from aqtr.core.sharding import check_meshes, check_out_sharding, run_typed
from aqtr.core.slots import Side


def _as_sizes(group_sizes):
  """A list or tuple of group sizes as an int32 array (arrays as given)."""
  if not isinstance(group_sizes, list | tuple):
    return group_sizes
  try:
    sizes = np.asarray(group_sizes)
  except ValueError:  # Ragged nesting.
    sizes = np.asarray(None)
  if sizes.size == 0 and sizes.ndim == 1:
    sizes = sizes.astype(np.int32)
  if sizes.dtype == object or not np.issubdtype(sizes.dtype, np.integer):
    raise TypeError(
      'ragged_dot: group_sizes must be integers (an int array, list or '
      f'tuple), got {group_sizes!r}.'
    )
  return jnp.asarray(sizes, jnp.int32)


def _check_shapes(lhs, rhs, group_sizes) -> None:
  rhs = jax.ShapeDtypeStruct(_shape(rhs), jnp.float32)
  if jnp.ndim(lhs) != 2:
    raise ValueError(
      f'ragged_dot: lhs must be 2-D [M, K], got shape {jnp.shape(lhs)}.'
    )
  if rhs.ndim != 3:
    raise ValueError(
      f'ragged_dot: rhs must be 3-D [G, K, N], got shape {jnp.shape(rhs)}.'
    )
  if jnp.ndim(group_sizes) != 1 or jnp.shape(group_sizes)[0] != rhs.shape[0]:
    raise ValueError(
      f'ragged_dot: group_sizes must be 1-D [G] with G = rhs.shape[0] = '
      f'{rhs.shape[0]}, got shape {jnp.shape(group_sizes)}.'
    )
  if not jnp.issubdtype(jnp.result_type(group_sizes), jnp.integer):
    raise TypeError(
      f'ragged_dot: group_sizes must have an integer dtype, got '
      f'{jnp.result_type(group_sizes)}.'
    )
  if lhs.shape[1] != rhs.shape[1]:
    raise ValueError(
      f'ragged_dot: lhs.shape[1] = {lhs.shape[1]} must equal rhs.shape[1] '
      f'= {rhs.shape[1]} (the contraction K).'
    )


def _check_group_sizes(group_sizes, m: int) -> None:
  """Checks concrete group sizes; traced ones are left unchecked."""
  try:
    sizes = np.asarray(group_sizes)
  except jax.errors.ConcretizationTypeError:
    return
  except jax.errors.TracerArrayConversionError:
    return
  if (sizes < 0).any():
    raise ValueError(
      f'ragged_dot: group_sizes must be non-negative, got {sizes.tolist()}.'
    )
  if int(sizes.sum()) != m:
    raise ValueError(
      f'ragged_dot: group_sizes must sum to the rows of lhs ({m}), got '
      f'{sizes.tolist()} (sum {int(sizes.sum())}).'
    )


def _shape(x) -> tuple[int, ...]:
  """An operand's shape (a stored QTensor: its float layout's)."""
  return x.layout.shape if isinstance(x, QTensor) else tuple(jnp.shape(x))


def ragged_dot(
  lhs: jax.Array,
  rhs: jax.Array,
  group_sizes: jax.Array,
  config: DotGeneralConfig | None = None,
  *,
  key: jax.Array | None = None,
  precision=None,
  preferred_element_type=None,
  out_sharding=None,
  state: dict | None = None,
):
  """Drop-in for `jax.lax.ragged_dot` quantized as `config` says.

  out[i, :] = lhs[i, :] . rhs[e(i)], where rows are assigned to groups
  (experts) in order: the first group_sizes[0] rows to rhs[0], and so on.
  The plan is dot_general's with the group axis as rhs's batch axis
  (`core.geometry`): the forward pass (config.fwd) quantizes lhs as
  [1, M, K] (per row with per_channel) and rhs as [G, K, N] (per expert
  and output channel); dlhs (config.dlhs) is the ragged dot g . rhs[e]^T
  with g quantized per row; drhs (config.drhs) contracts each expert's
  tokens, lhs_e^T . g_e, with g quantized per output channel over all
  tokens (tilings that split the token axis are refused there).
  Stateful calibrations (delayed scaling, EMA statistics: one scale per
  expert with per_channel rhs), learned ones (LSQ, PACT), stochastic
  rounding and sparsity work as in `dot_general`.

  Args:
    lhs: [M, K] float tokens.
    rhs: [G, K, N] float expert weights, or a stored QTensor of them
      (`aqtr.quantize_operand(w, RAGGED, config)` or `freeze_ragged`;
      serving: no gradient reaches it).
    group_sizes: [G] integers (an int array, or a list or tuple of ints,
      converted to int32). When concrete they must be non-negative and
      sum to M (checked). Under `jit` they are not checked: as in
      `lax.ragged_dot`, rows past sum(group_sizes) get zero output and
      zero gradient.
    config: a DotGeneralConfig; None (or an all-float config) is exactly
      `lax.ragged_dot`, values and gradients.
    key: PRNG key (typed or raw uint32[2]); required by stochastic rounding.
    precision, preferred_element_type: as in `lax.ragged_dot`.
    out_sharding: as in `lax.ragged_dot` (explicit axes need it): the
      output's sharding; under auto axes a sharding constraint.
    state: the state tree `aqtr.state.init(lhs, rhs, RAGGED, config)` when
      the config has stateful or learned calibrations or a sparsity
      schedule (see `aqtr.state`).

  Returns:
    [M, N] in `preferred_element_type` or the operands' result type; with
    `state`, the pair (out, new_state).

  Example:
    >>> import jax.numpy as jnp, aqtr
    >>> x, w = jnp.ones((3, 4)), jnp.ones((2, 4, 5))
    >>> aqtr.ragged_dot(x, w, jnp.array([1, 2]), aqtr.presets.int8()).shape
    (3, 5)
  """
  if config is not None and not isinstance(config, DotGeneralConfig):
    raise TypeError(
      f'config must be an aqtr.DotGeneralConfig or None, got {config!r}.'
    )
  stored = (isinstance(lhs, QTensor), isinstance(rhs, QTensor))
  if stored[0]:
    raise ValueError(
      'ragged_dot: lhs is a stored QTensor; only the grouped rhs (expert '
      'weights) can be stored: pass the float tokens as lhs.'
    )
  if stored[1] and config is None:
    raise ValueError(
      'ragged_dot: a QTensor rhs needs the config it was quantized with: '
      'pass config=...'
    )
  lhs = jnp.asarray(lhs)
  rhs = rhs if stored[1] else jnp.asarray(rhs)
  group_sizes = _as_sizes(group_sizes)
  _check_shapes(lhs, rhs, group_sizes)
  check_out_sharding(out_sharding, 2, 'ragged_dot: [M, N]')
  _check_group_sizes(group_sizes, lhs.shape[0])
  slot_state.check_tree(config, state, stored, 'aqtr.RAGGED')
  empty = lhs.size == 0 or (not stored[1] and rhs.size == 0)
  if not stored[1] and (config is None or config.is_float or empty):
    out = prims.ragged_dot(
      lhs,
      rhs,
      group_sizes,
      precision=precision,
      preferred_element_type=preferred_element_type,
      out_sharding=out_sharding,
    )
    return out if state is None else (out, state)
  check_float(lhs, 'lhs')
  if not stored[1]:
    check_float(rhs, 'rhs')
    check_meshes(lhs, rhs)
  key = as_typed_key(key)
  if config.needs_key and key is None:
    raise ValueError(
      'config uses stochastic rounding and needs a PRNG key: pass '
      'key=jax.random.key(seed) (a raw jax.random.PRNGKey works too).'
    )
  key = key if config.needs_key else None
  plan = Plan.create(
    lhs, rhs, RAGGED, config, precision, preferred_element_type
  )
  typed = {} if state is None else slot_state.from_tree(state)
  slot_state.check_state(plan, typed)
  rhs_struct = plan.rhs.struct if stored[1] else rhs

  def out_type():  # lax's output type (explicit axes: its sharding)
    return jax.eval_shape(
      functools.partial(
        lax.ragged_dot,
        preferred_element_type=plan.out_dtype,
        out_sharding=out_sharding,
      ),
      lhs,
      rhs_struct,
      group_sizes,
    )

  sizes = jnp.asarray(group_sizes)
  if state is not None:

    def run_state(lhs, rhs, sizes, key, typed):
      out, new = quantized_dot(lhs, rhs, key, typed, sizes, plan)
      return out, slot_state.to_tree(new)

    args = (lhs, rhs, sizes, key, typed)
    return run_typed(run_state, args, out_type, out_sharding, state)

  def run(lhs, rhs, sizes, key):
    return quantized_dot(lhs, rhs, key, {}, sizes, plan)[0]

  return run_typed(run, (lhs, rhs, sizes, key), out_type, out_sharding)


def freeze_ragged(
  rhs: jax.Array, config: DotGeneralConfig, k_lhs: int | None = None
) -> dict:
  """The stored form of ragged_dot's expert weights: what TRAIN computes.

  Returns {'values', 'scale'} (and 'zero_point' for affine numerics): the
  forward's quantized rhs [G, T, t, N] in its tiled view, so that
  `served_ragged_dot` with it equals the TRAIN forward bit for bit. The
  same as `aqtr.quantize_operand(rhs, RAGGED, config)`'s QTensor fields.

  Args:
    rhs: [G, K, N] float expert weights.
    config: the op's DotGeneralConfig (its fwd.rhs quantizes the weights).
    k_lhs: K (default rhs.shape[1]; must equal it).

  Example:
    >>> import jax.numpy as jnp, aqtr
    >>> f = freeze_ragged(jnp.ones((2, 4, 5)), aqtr.presets.int8())
    >>> f['values'].dtype, f['values'].shape
    (dtype('int8'), (2, 1, 4, 5))
  """
  rhs = jnp.asarray(rhs)
  k = rhs.shape[1] if k_lhs is None else k_lhs
  lhs = jax.ShapeDtypeStruct((1, k), rhs.dtype)
  plan = Plan.create(lhs, rhs, RAGGED, config)
  q = quantize_planned(rhs, plan, Side.RHS)
  out = {'values': q.qvalue, 'scale': q.scale}
  if q.zero_point is not None:
    out['zero_point'] = q.zero_point
  return out


def served_ragged_dot(
  lhs: jax.Array,
  frozen: dict,
  group_sizes: jax.Array,
  config: DotGeneralConfig,
  *,
  key: jax.Array | None = None,
  precision=None,
  preferred_element_type=None,
) -> jax.Array:
  """ragged_dot's forward with stored expert weights (`freeze_ragged`).

  Equals `ragged_dot(lhs, rhs, group_sizes, config)` bit for bit when
  `frozen` is `freeze_ragged(rhs, config)`: the same plan and forward
  pass, the weights given as a stored QTensor; no gradient (serving).

  Args:
    lhs: [M, K] float tokens.
    frozen: the stored weights.
    group_sizes: [G] integers.
    config: the config the weights were frozen with.
    key: a PRNG key when the config rounds stochastically (its gradients:
      any key; serving runs no backward pass).
    precision, preferred_element_type: as in `lax.ragged_dot`.

  Returns:
    [M, N].
  """
  lhs = jnp.asarray(lhs)
  values = frozen['values']
  g, _, _, n = values.shape
  layout = ragged_layout(lhs.shape, (g, lhs.shape[1], n), RAGGED).rhs
  rhs = QTensor(values, frozen['scale'], layout, 'kf', frozen.get('zero_point'))
  return ragged_dot(
    lhs,
    rhs,
    group_sizes,
    config,
    key=key,
    precision=precision,
    preferred_element_type=preferred_element_type,
  )
