"""Quantized `ragged_dot`: the grouped (mixture-of-experts) matmul.

Math: rows of lhs [M, K] are split into G consecutive groups of
`group_sizes[e]` rows; group e is multiplied by rhs[e] [K, N]:
out[i] = lhs[i] . rhs[e(i)]. The forward and both gradients run as
quantized dots through aqtr's custom VJP (see `ragged.py` for the passes
and where the scales live).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from aqtr.core import prims
from aqtr.core.config import DotGeneralConfig
from aqtr.core.dot_general import quantized_ragged_dot
from aqtr.core.qtensor import QTensor
from aqtr.core.quantizer import check_float
from aqtr.core.ragged import (
  RaggedPlan,
  ragged_contract,
  ragged_operand,
  stored_operand,
)
from aqtr.core.rounding import as_typed_key
from aqtr.core.sharding import check_meshes, check_out_sharding, run_typed
from aqtr.core.slots import Slot


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
  if jnp.ndim(lhs) != 2:
    raise ValueError(
      f'ragged_dot: lhs must be 2-D [M, K], got shape {jnp.shape(lhs)}.'
    )
  if jnp.ndim(rhs) != 3:
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
) -> jax.Array:
  """Drop-in for `jax.lax.ragged_dot` quantized as `config` says.

  out[i, :] = lhs[i, :] . rhs[e(i)], where rows are assigned to groups
  (experts) in order: the first group_sizes[0] rows to rhs[0], and so on.
  The forward pass (config.fwd) quantizes lhs per row and rhs per expert
  and output channel; dlhs (config.dlhs) is the ragged dot g . rhs[e]^T
  with g quantized per row; drhs (config.drhs) contracts each expert's
  tokens, lhs_e^T . g_e, with g quantized per output channel (tilings
  that split the token axis are rejected there).

  Args:
    lhs: [M, K] float tokens.
    rhs: [G, K, N] float expert weights.
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

  Returns:
    [M, N] in `preferred_element_type` or the operands' result type.

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
  for slot in (Slot.FWD_LHS, Slot.FWD_RHS):
    t = None if config is None else slot.tensor(config)
    if t is not None and t.sparse:
      raise ValueError(
        f'config.{slot.path}.sparsity: ragged_dot does not prune operands '
        f"yet, got {t.sparsity!r}; allowed: NoSparsity() ('none')."
      )
  for slot in (Slot.FWD_LHS, Slot.DLHS_LHS, Slot.DRHS_LHS):
    t = None if config is None else slot.tensor(config).transform
    if t is not None and t.transforms:
      raise ValueError(
        f'config.{slot.path}.transform: ragged_dot does not rotate operands '
        f"yet, got {t!r}; allowed: NoTransform() ('none')."
      )
  for name, x in (('lhs', lhs), ('rhs', rhs)):
    if isinstance(x, QTensor):
      raise ValueError(
        f'ragged_dot: {name} is a stored QTensor, which ragged_dot does not '
        'take; pass the float operand (it is quantized on the fly).'
      )
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  group_sizes = _as_sizes(group_sizes)
  _check_shapes(lhs, rhs, group_sizes)
  check_out_sharding(out_sharding, 2, 'ragged_dot: [M, N]')
  _check_group_sizes(group_sizes, lhs.shape[0])
  if config is None or config.is_float or lhs.size == 0 or rhs.size == 0:
    return prims.ragged_dot(
      lhs,
      rhs,
      group_sizes,
      precision=precision,
      preferred_element_type=preferred_element_type,
      out_sharding=out_sharding,
    )
  check_float(lhs, 'lhs')
  check_float(rhs, 'rhs')
  check_meshes(lhs, rhs)
  if config.needs_key and key is None:
    raise ValueError(
      'config uses stochastic rounding and needs a PRNG key: pass '
      'key=jax.random.key(seed) (a raw jax.random.PRNGKey works too).'
    )
  key = as_typed_key(key) if config.needs_key else None
  plan = RaggedPlan.create(lhs, rhs, config, precision, preferred_element_type)
  preferred = plan.preferred

  def run(lhs, rhs, group_sizes, key):
    return quantized_ragged_dot(lhs, rhs, group_sizes, key, plan)

  def out_type():  # lax's output type (explicit axes: its sharding)
    return jax.eval_shape(
      functools.partial(
        lax.ragged_dot,
        preferred_element_type=preferred,
        out_sharding=out_sharding,
      ),
      lhs,
      rhs,
      group_sizes,
    )

  args = (lhs, rhs, jnp.asarray(group_sizes), key)
  return run_typed(run, args, out_type, out_sharding)


def freeze_ragged(
  rhs: jax.Array, config: DotGeneralConfig, k_lhs: int | None = None
) -> dict:
  """The stored form of ragged_dot's expert weights: what TRAIN computes.

  Returns {'values', 'scale'} (and 'zero_point' for affine numerics): the
  forward's quantized rhs [G, T, t, N] in its tiled view, so that
  `served_ragged_dot` with it equals the TRAIN forward bit for bit.

  Args:
    rhs: [G, K, N] float expert weights.
    config: the op's DotGeneralConfig (its fwd.rhs quantizes the weights).
    k_lhs: K (default rhs.shape[1]).

  Example:
    >>> import jax.numpy as jnp, aqtr
    >>> f = freeze_ragged(jnp.ones((2, 4, 5)), aqtr.presets.int8())
    >>> f['values'].dtype, f['values'].shape
    (dtype('int8'), (2, 1, 4, 5))
  """
  rhs = jnp.asarray(rhs)
  k = rhs.shape[1] if k_lhs is None else k_lhs
  lhs = jax.ShapeDtypeStruct((1, k), rhs.dtype)
  plan = RaggedPlan.create(lhs, rhs, config)
  q = ragged_operand(rhs, 'kf', config.fwd.rhs, None, plan.tile)
  out = {'values': q.values, 'scale': q.scale}
  if q.zero_point is not None:
    out['zero_point'] = q.zero_point
  return out


def served_ragged_dot(
  lhs: jax.Array,
  frozen: dict,
  group_sizes: jax.Array,
  config: DotGeneralConfig,
  *,
  precision=None,
  preferred_element_type=None,
) -> jax.Array:
  """ragged_dot's forward with stored expert weights (`freeze_ragged`).

  Equals `ragged_dot(lhs, rhs, group_sizes, config)` bit for bit when
  `frozen` is `freeze_ragged(rhs, config)`; no gradient (serving).

  Args:
    lhs: [M, K] float tokens.
    frozen: the stored weights.
    group_sizes: [G] integers.
    config: the config the weights were frozen with.
    precision, preferred_element_type: as in `lax.ragged_dot`.

  Returns:
    [M, N].
  """
  lhs = jnp.asarray(lhs)
  values = frozen['values']
  g, _, _, n = values.shape
  rhs = jax.ShapeDtypeStruct((g, lhs.shape[1], n), frozen['scale'].dtype)
  group_sizes = _as_sizes(group_sizes)
  plan = RaggedPlan.create(lhs, rhs, config, precision, preferred_element_type)
  q_l = ragged_operand(lhs[None], 'fk', config.fwd.lhs, None, plan.tile)
  q_r = stored_operand(
    values,
    frozen['scale'],
    frozen.get('zero_point'),
    'kf',
    config.fwd.rhs.numerics.dot_dtype,
  )
  out = ragged_contract(q_l, q_r, group_sizes, config.fwd, plan.precision)
  dtype = plan.preferred or jnp.result_type(lhs.dtype, rhs.dtype)
  return out.astype(dtype)
