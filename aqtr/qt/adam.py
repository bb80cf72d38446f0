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
signed 4-bit dynamic type; v with rank-1 normalisation and the
zero-point-free linear map (1-D v: blocks of 128). Tensors smaller than
`min_size` elements keep float32 states, as both papers do.

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

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from aqtr.qt.lowbit import LowBitTensor, dynamic_table, linear_table

__all__ = [
  'LowBitAdamState',
  'adamw_4bit',
  'adamw_8bit',
  'scale_by_lowbit_adam',
]


class LowBitAdamState(NamedTuple):
  """count, and the moments (LowBitTensor or float32 leaves)."""

  count: jax.Array
  mu: Any
  nu: Any


def _codecs(bits: int):
  if bits == 8:
    return (
      dict(bits=8, table=dynamic_table(8, True), block=256),
      dict(bits=8, table=dynamic_table(8, False, zero=False), block=256),
    )
  return (
    dict(bits=4, table=dynamic_table(4, True), block=128),
    dict(bits=4, table=linear_table(4), block=0),
  )


_encode = jax.jit(
  LowBitTensor.encode, static_argnames=('bits', 'table', 'block')
)


def _is_lb(x) -> bool:
  return isinstance(x, LowBitTensor)


def scale_by_lowbit_adam(
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  *,
  bits: int = 8,
  min_size: int = 4096,
) -> optax.GradientTransformation:
  """Adam's update direction with `bits`-bit moments (8 or 4).

  Args:
    b1, b2, eps: as in `optax.scale_by_adam`.
    bits: 8 (Dettmers et al.) or 4 (Li et al.).
    min_size: tensors with fewer elements keep float32 moments.
  """
  if bits not in (4, 8):
    raise ValueError(
      f'scale_by_lowbit_adam: bits must be 4 or 8, got {bits!r}.'
    )
  if not 0 <= b1 < 1 or not 0 <= b2 < 1:
    raise ValueError(f'b1 and b2 must be in [0, 1), got b1={b1}, b2={b2}.')
  if not isinstance(min_size, int) or min_size < 0:
    raise ValueError(f'min_size must be an int >= 0, got {min_size!r}.')
  mcodec, vcodec = _codecs(bits)

  def small(x) -> bool:
    return x.size < min_size

  def enc(x, codec, like):
    if small(like):
      return x.astype(jnp.float32)
    return _encode(x, **codec)

  def dec(s):
    return s.decode() if _is_lb(s) else s

  def init_fn(params):
    def zeros(codec):  # Fresh buffers for each moment (donation-safe).
      def one(p):
        if small(p):
          return jnp.zeros(p.shape, jnp.float32)
        return LowBitTensor.zeros(p.shape, **codec)

      return jax.tree.map(one, params)

    return LowBitAdamState(
      count=jnp.zeros((), jnp.int32), mu=zeros(mcodec), nu=zeros(vcodec)
    )

  def update_fn(updates, state, params=None):
    del params
    count = optax.safe_increment(state.count)
    t = count.astype(jnp.float32)
    c1, c2 = 1 - b1**t, 1 - b2**t

    def one(g, ms, vs):
      g32 = g.astype(jnp.float32)
      m = b1 * dec(ms) + (1 - b1) * g32
      v = b2 * dec(vs) + (1 - b2) * g32 * g32
      u = (m / c1) / (jnp.sqrt(v / c2) + eps)
      return u.astype(g.dtype), enc(m, mcodec, g), enc(v, vcodec, g)

    gl, treedef = jax.tree.flatten(updates)
    ml = treedef.flatten_up_to(state.mu)
    vl = treedef.flatten_up_to(state.nu)
    out = [one(g, m, v) for g, m, v in zip(gl, ml, vl, strict=True)]
    un = jax.tree.unflatten(treedef, [o[0] for o in out])
    mu = jax.tree.unflatten(treedef, [o[1] for o in out])
    nu = jax.tree.unflatten(treedef, [o[2] for o in out])
    return un, LowBitAdamState(count=count, mu=mu, nu=nu)

  return optax.GradientTransformation(init_fn, update_fn)


def _adamw(bits, learning_rate, b1, b2, eps, weight_decay, mask, min_size):
  return optax.chain(
    scale_by_lowbit_adam(b1, b2, eps, bits=bits, min_size=min_size),
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

  Args:
    learning_rate: a float or an optax schedule.
    b1, b2, eps, weight_decay, mask: as in `optax.adamw`.
    min_size: tensors with fewer elements keep float32 moments.
  """
  return _adamw(8, learning_rate, b1, b2, eps, weight_decay, mask, min_size)


def adamw_4bit(
  learning_rate: optax.ScalarOrSchedule,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  weight_decay: float = 1e-4,
  mask=None,
  *,
  min_size: int = 4096,
) -> optax.GradientTransformation:
  """`optax.adamw` with 4-bit moments (Li et al. 2023, arXiv 2309.01507).

  Args:
    learning_rate: a float or an optax schedule.
    b1, b2, eps, weight_decay, mask: as in `optax.adamw`.
    min_size: tensors with fewer elements keep float32 moments.
  """
  return _adamw(4, learning_rate, b1, b2, eps, weight_decay, mask, min_size)
