"""Quantized training (QT): optax updates on weights kept only quantized.

No float master copy: each step dequantizes the stored weights, lets any
optax transformation compute the update, and stores the result quantized
again with a freshly computed scale:

  w = dequant(q_t, s_t);  u = inner(g, w);  (q_{t+1}, s_{t+1}) = Q_SR(w + u)

Stochastic rounding keeps `E[w_{t+1}] = w + u`, so updates far below one
quantization step still move the weights on average; with round-to-nearest
they vanish and training stalls (Gupta et al. 2015, arXiv 1502.02551; the
int8 recipe of torchao's quantized training). Step t draws its rounding
noise from `fold_in(key(seed), t)` (then one fold per leaf), so a run is
reproducible from its seed. A step whose gradients, updates or new weights
`w + u` are not finite (a finite update can overflow) is skipped: weights
and inner state are untouched and the state's `skipped` counter grows.

The update of a QTParam is the new QTParam, marked as an update (its
`role`): apply updates with `aqtr.qt.apply_updates`; `optax.apply_updates`
raises a pytree structure error naming it (instead of adding int codes).

Example:
  >>> import jax, jax.numpy as jnp, optax
  >>> from aqtr import qt
  >>> params, _ = qt.quantize_params({'kernel': jnp.ones((32, 4))})
  >>> tx = qt.quantized_training(optax.adam(1e-3), seed=0)
  >>> state = tx.init(params)
  >>> grads = {'kernel': jnp.ones((32, 4))}
  >>> updates, state = tx.update(grads, state, params)
  >>> params = qt.apply_updates(params, updates)
  >>> params['kernel'].qvalue.dtype, int(state.count)
  (dtype('int8'), 1)
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from aqtr.qt.params import PARAM, UPDATE, dequantize, is_qt, requantize

__all__ = [
  'NearestRoundingWarning',
  'QTState',
  'apply_updates',
  'quantized_training',
  'step_key',
]

_ROUNDINGS = ('stochastic', 'nearest')


class NearestRoundingWarning(UserWarning):
  """Round-to-nearest QT: updates below half a step are lost."""


class QTState(NamedTuple):
  """State of `quantized_training`.

  Attributes:
    inner: the inner transformation's state.
    key: raw uint32[2] key data of the seed.
    count: steps taken (skipped ones included).
    skipped: steps skipped for non-finite gradients or updates.
  """

  inner: Any
  key: jax.Array
  count: jax.Array
  skipped: jax.Array


def step_key(state: QTState) -> jax.Array:
  """The rounding key of the next step: fold_in(key(seed), count)."""
  return jax.random.fold_in(jax.random.wrap_key_data(state.key), state.count)


def _all_finite(*trees) -> jax.Array:
  ok = [
    jnp.all(jnp.isfinite(x))
    for t in trees
    for x in jax.tree.leaves(t)
    if jnp.issubdtype(x.dtype, jnp.inexact)
  ]
  return jnp.all(jnp.stack(ok)) if ok else jnp.bool_(True)


def _select(ok, new, old):
  return jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)


def quantized_training(
  inner: optax.GradientTransformation,
  *,
  rounding: str = 'stochastic',
  seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
  """Wraps `inner` to train parameters stored as `QTParam`s.

  Put it outermost (`inner` may be any chain: clipping, schedules, Adam,
  `aqtr.qt.adamw_8bit`); apply its updates with `aqtr.qt.apply_updates`:
  for a QTParam the update is the new quantized parameter itself, for a
  float leaf it is the usual additive update.

  Args:
    inner: the optax transformation of the float (dequantized) weights.
    rounding: 'stochastic' (default) or 'nearest' (the ablation: warns,
      it stalls at small learning rates).
    seed: seeds the rounding noise.

  Returns:
    An optax GradientTransformationExtraArgs; `update` needs `params`.
  """
  if not hasattr(inner, 'init') or not hasattr(inner, 'update'):
    raise TypeError(
      'quantized_training: inner must be an optax GradientTransformation '
      f'(e.g. optax.adam(1e-3)), got {inner!r}.'
    )
  if isinstance(seed, bool) or not isinstance(seed, int):
    raise TypeError(f'quantized_training: seed must be an int, got {seed!r}.')
  if rounding not in _ROUNDINGS:
    raise ValueError(
      f'quantized_training: rounding must be one of {_ROUNDINGS}, got '
      f'{rounding!r}.'
    )
  if rounding == 'nearest':
    warnings.warn(
      'quantized_training(rounding="nearest"): updates smaller than half a '
      'quantization step are rounded away and training stalls; use '
      '"stochastic" unless this is the ablation.',
      NearestRoundingWarning,
      stacklevel=2,
    )
  stochastic = rounding == 'stochastic'
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    return QTState(
      inner=inner.init(dequantize(params)),
      key=jax.random.key_data(jax.random.key(seed)),
      count=jnp.zeros((), jnp.int32),
      skipped=jnp.zeros((), jnp.int32),
    )

  def update_fn(updates, state, params=None, **extra):
    if params is None:
      raise ValueError('quantized_training.update needs params=.')
    w = dequantize(params)
    u, new_inner = inner.update(updates, state.inner, w, **extra)
    key = step_key(state)
    leaves, treedef = jax.tree.flatten(params, is_leaf=is_qt)
    flat_w = treedef.flatten_up_to(w)
    flat_u = treedef.flatten_up_to(u)
    new_w = [wi + ui for wi, ui in zip(flat_w, flat_u, strict=True)]
    ok = _all_finite(updates, u, new_w)
    out = []
    for i, (p, wi, ui) in enumerate(zip(leaves, new_w, flat_u, strict=True)):
      if is_qt(p):
        k = jax.random.fold_in(key, i) if stochastic else None
        new = _select(ok, requantize(p, wi, k), p)
        out.append(dataclasses.replace(new, role=UPDATE))
      else:
        out.append(jnp.where(ok, ui, jnp.zeros_like(ui)))
    new_state = QTState(
      inner=_select(ok, new_inner, state.inner),
      key=state.key,
      count=state.count + 1,
      skipped=state.skipped + (~ok).astype(jnp.int32),
    )
    return jax.tree.unflatten(treedef, out), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def apply_updates(params, updates):
  """`optax.apply_updates` that also takes QT updates (new QTParams).

  Example:
    >>> import jax.numpy as jnp
    >>> apply_updates({'b': jnp.ones(2)}, {'b': jnp.ones(2)})['b'].tolist()
    [2.0, 2.0]
  """

  def one(p, u):
    if is_qt(p):
      if not is_qt(u):
        raise TypeError(
          'the update of a QTParam must be a QTParam: make the updates with '
          'aqtr.qt.quantized_training.'
        )
      return dataclasses.replace(u, role=PARAM)
    if p is None:
      return None
    return jnp.asarray(p + u).astype(jnp.asarray(p).dtype)

  return jax.tree.map(
    one, params, updates, is_leaf=lambda x: is_qt(x) or x is None
  )
