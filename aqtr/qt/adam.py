"""AdamW with 8-bit and 4-bit optimizer states, as optax transformations.

Adam (Kingma & Ba 2014, arXiv 1412.6980) with decoupled weight decay
(Loshchilov & Hutter 2017, arXiv 1711.05101); the moments are stored
low-bit between steps and decoded in float32 for the update:

  m = b1 m + (1 - b1) g,   v = b2 v + (1 - b2) g^2
  u = -lr (m / (1 - b1^t) / (sqrt(v / (1 - b2^t)) + eps) + wd p)

8-bit (Dettmers et al. 2022, arXiv 2110.02861): both moments block-wise
(blocks of 256) in the dynamic data type, signed for m; unsigned and
without zero for v (a v stored as 0 under a nonzero m would make the
update m / eps explode; Li et al.'s zero-point remedy).
4-bit (Li et al. 2023, arXiv 2309.01507): m in blocks of 128 with the
signed 4-bit dynamic type, rounded stochastically (the paper rounds to
nearest; see `adamw_4bit`); v with rank-1 normalisation and the
zero-point-free linear map (1-D v: blocks of 128). Tensors smaller than
`min_size` elements keep float32 states, as both papers do. Both are
`lowbit_adamw` with their pair of `StateCodec`s; other pairs (say 4-bit m,
8-bit v) are one call away.

Example:
  >>> import jax.numpy as jnp, optax
  >>> from aqtr import qt
  >>> tx = qt.adamw_8bit(1e-3)
  >>> p = {'w': jnp.ones((64, 64))}
  >>> s = tx.init(p)
  >>> u, s = tx.update(p, s, p)
  >>> u['w'].shape
  (64, 64)
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from aqtr.qt.lowbit import LowBitTensor, StateCodec

__all__ = [
  'ADAM_4BIT',
  'ADAM_8BIT',
  'LowBitAdamState',
  'adamw_4bit',
  'adamw_8bit',
  'lowbit_adamw',
  'scale_by_lowbit_adam',
]

# (first moment, second moment) codecs.
ADAM_8BIT = (
  StateCodec(bits=8, table='signed_dynamic', block=256),
  StateCodec(bits=8, table='dynamic_no_zero', block=256),
)
ADAM_4BIT = (
  StateCodec(bits=4, table='signed_dynamic', block=128, rounding='stochastic'),
  StateCodec(bits=4, table='linear', block=0),
)


class LowBitAdamState(NamedTuple):
  """State of `scale_by_lowbit_adam`.

  Attributes:
    count: steps taken.
    key: raw uint32[2] key data of the seed (stochastic rounding).
    mu, nu: the moments, LowBitTensor or float32 leaves.
  """

  count: jax.Array
  key: jax.Array
  mu: Any
  nu: Any


def _check_codec(name, codec, tables):
  if not isinstance(codec, StateCodec):
    raise TypeError(
      f'{name} must be an aqtr.qt.StateCodec, got {type(codec).__name__}.'
    )
  if codec.table not in tables:
    raise ValueError(
      f'{name}.table must be one of {tables}, got {codec.table!r}.'
    )


def _check_float(tree, what: str) -> None:
  """Raises naming the first leaf of `tree` that is not floating point."""
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    dtype = jnp.result_type(x)
    if not jnp.issubdtype(dtype, jnp.floating):
      raise TypeError(
        f'low-bit Adam: {what} leaf {jax.tree_util.keystr(path)} has dtype '
        f'{dtype}; Adam updates need float leaves (cast it to float32, or '
        'leave it out of the optimizer, e.g. with optax.masked).'
      )


def scale_by_lowbit_adam(
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  *,
  mu_codec: StateCodec = ADAM_8BIT[0],
  nu_codec: StateCodec = ADAM_8BIT[1],
  min_size: int = 4096,
  seed: int = 0,
) -> optax.GradientTransformation:
  """Adam's update direction with moments stored by the given codecs.

  Each step decodes both moments once, updates them in float32 and
  encodes them once (the state never holds anything else).

  Args:
    b1, b2, eps: as in `optax.scale_by_adam`.
    mu_codec: how the first moment m is stored (table 'signed_dynamic').
    nu_codec: how the second moment v is stored (a table without zero:
      'dynamic_no_zero' or 'linear').
    min_size: tensors with fewer elements keep float32 moments.
    seed: seeds stochastic rounding: step t, leaf i, moment j draw from
      fold_in(fold_in(fold_in(key(seed), t), i), j).
  """
  # m is signed; v must never decode to 0 (m / eps would explode).
  _check_codec('mu_codec', mu_codec, ('signed_dynamic',))
  _check_codec('nu_codec', nu_codec, ('dynamic_no_zero', 'linear'))
  for name, b in (('b1', b1), ('b2', b2)):
    if isinstance(b, bool) or not isinstance(b, numbers.Real):
      raise ValueError(f'{name} must be a float in [0, 1), got {b!r}.')
  if isinstance(seed, bool) or not isinstance(seed, int):
    raise TypeError(f'low-bit Adam: seed must be an int, got {seed!r}.')
  if not 0 <= b1 < 1 or not 0 <= b2 < 1:
    raise ValueError(f'b1 and b2 must be in [0, 1), got b1={b1}, b2={b2}.')
  if isinstance(min_size, bool) or not isinstance(min_size, int):
    raise ValueError(f'min_size must be an int >= 0, got {min_size!r}.')
  if min_size < 0:
    raise ValueError(f'min_size must be an int >= 0, got {min_size!r}.')
  if not (isinstance(eps, numbers.Real) and 0 <= eps < float('inf')):
    raise ValueError(f'eps must be a finite float >= 0, got {eps!r}.')

  def small(x) -> bool:
    return x.size < min_size

  def enc(x, codec, like, key):
    return x.astype(jnp.float32) if small(like) else codec.encode(x, key)

  def dec(s):
    return s.decode() if isinstance(s, LowBitTensor) else s

  def init_fn(params):
    _check_float(params, 'parameter')

    def zeros(codec):  # Fresh buffers for each moment (donation-safe).
      def one(p):
        if small(p):
          return jnp.zeros(p.shape, jnp.float32)
        return codec.zeros(p.shape)

      return jax.tree.map(one, params)

    return LowBitAdamState(
      count=jnp.zeros((), jnp.int32),
      key=jax.random.key_data(jax.random.key(seed)),
      mu=zeros(mu_codec),
      nu=zeros(nu_codec),
    )

  def update_fn(updates, state, params=None):
    del params
    _check_float(updates, 'update')
    count = optax.safe_increment(state.count)
    t = count.astype(jnp.float32)
    c1, c2 = 1 - b1**t, 1 - b2**t
    step_key = jax.random.fold_in(jax.random.wrap_key_data(state.key), count)

    def one(i, g, ms, vs):
      key = jax.random.fold_in(step_key, i)
      g32 = g.astype(jnp.float32)
      m = b1 * dec(ms) + (1 - b1) * g32
      v = b2 * dec(vs) + (1 - b2) * g32 * g32
      u = (m / c1) / (jnp.sqrt(v / c2) + eps)
      m = enc(m, mu_codec, g, jax.random.fold_in(key, 0))
      v = enc(v, nu_codec, g, jax.random.fold_in(key, 1))
      return u.astype(g.dtype), m, v

    gl, treedef = jax.tree.flatten(updates)
    ml = treedef.flatten_up_to(state.mu)
    vl = treedef.flatten_up_to(state.nu)
    out = [one(i, *a) for i, a in enumerate(zip(gl, ml, vl, strict=True))]
    un = jax.tree.unflatten(treedef, [o[0] for o in out])
    mu = jax.tree.unflatten(treedef, [o[1] for o in out])
    nu = jax.tree.unflatten(treedef, [o[2] for o in out])
    return un, state._replace(count=count, mu=mu, nu=nu)

  return optax.GradientTransformation(init_fn, update_fn)


def lowbit_adamw(
  learning_rate: optax.ScalarOrSchedule,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  weight_decay: float = 1e-4,
  mask=None,
  *,
  mu_codec: StateCodec = ADAM_8BIT[0],
  nu_codec: StateCodec = ADAM_8BIT[1],
  min_size: int = 4096,
  seed: int = 0,
) -> optax.GradientTransformation:
  """`optax.adamw` with moments stored by the given `StateCodec`s.

  Args:
    learning_rate: a float or an optax schedule.
    b1, b2, eps, weight_decay, mask: as in `optax.adamw`.
    mu_codec, nu_codec: storage of the first and second moments.
    min_size: tensors with fewer elements keep float32 moments.
    seed: seeds the codecs' stochastic rounding.

  Example:
    >>> from aqtr.qt.lowbit import StateCodec
    >>> tx = lowbit_adamw(1e-3, mu_codec=StateCodec(bits=4, block=128))
  """
  return optax.chain(
    scale_by_lowbit_adam(
      b1,
      b2,
      eps,
      mu_codec=mu_codec,
      nu_codec=nu_codec,
      min_size=min_size,
      seed=seed,
    ),  # fmt: skip
    optax.add_decayed_weights(weight_decay, mask),
    optax.scale_by_learning_rate(learning_rate),
  )


def adamw_8bit(
  learning_rate: optax.ScalarOrSchedule,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  weight_decay: float = 1e-4,
  mask=None,
  *,
  min_size: int = 4096,
) -> optax.GradientTransformation:
  """`optax.adamw` with 8-bit block-wise moments (Dettmers et al. 2022).

  `lowbit_adamw` with the `ADAM_8BIT` codecs.

  Args:
    learning_rate: a float or an optax schedule.
    b1, b2, eps, weight_decay, mask: as in `optax.adamw`.
    min_size: tensors with fewer elements keep float32 moments.
  """
  mu, nu = ADAM_8BIT
  return lowbit_adamw(
    learning_rate, b1, b2, eps, weight_decay, mask,
    mu_codec=mu, nu_codec=nu, min_size=min_size,
  )  # fmt: skip


def adamw_4bit(
  learning_rate: optax.ScalarOrSchedule,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  weight_decay: float = 1e-4,
  mask=None,
  *,
  min_size: int = 4096,
  seed: int = 0,
) -> optax.GradientTransformation:
  """`optax.adamw` with 4-bit moments (Li et al. 2023, arXiv 2309.01507).

  `lowbit_adamw` with the `ADAM_4BIT` codecs: m in blocks of 128 with the
  signed dynamic map, v rank-1 normalised with the zero-point-free linear
  map. One deviation from the paper's default (nearest rounding): m is
  rounded stochastically. m is re-encoded every step, and with nearest
  rounding an entry below half the gap to its next code never grows (as
  QT weights stall under nearest rounding): on digits the momentum of
  small entries stayed ~10x too small and the final loss ~10% above
  optax.adamw's; stochastic rounding keeps E[m] exact and the loss within
  2%. v stays nearest (stochastic v measured worse).

  Args:
    learning_rate: a float or an optax schedule.
    b1, b2, eps, weight_decay, mask: as in `optax.adamw`.
    min_size: tensors with fewer elements keep float32 moments.
    seed: seeds the stochastic rounding of m.
  """
  mu, nu = ADAM_4BIT
  return lowbit_adamw(
    learning_rate, b1, b2, eps, weight_decay, mask,
    mu_codec=mu, nu_codec=nu, min_size=min_size, seed=seed,
  )  # fmt: skip
