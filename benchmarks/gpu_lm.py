"""The LM train step of benchmarks/gpu.py: bf16 vs aqtr int8 vs fp8.

A decoder-only transformer LM written as a function of `dot(lhs, rhs,
dn)`: every weight matmul (q, k, v, o, the MLP's two, the output
projection) is one 2-D dot through it, and each row swaps only the dot
(`lax.dot_general`, or `aqtr.dot_general` with a preset). Attention is
`jax.nn.dot_product_attention` (causal), layer norm without parameters,
GELU MLP, f32 parameters cast to bf16 for the step's compute, AdamW
(optax). A step is forward, backward and update, jitted with the
parameters and the optimizer state donated.

Run as a script's module (`import gpu_lm` from benchmarks/).

Example:
  >>> import gpu_lm
  >>> step, state, batch = gpu_lm.setup('bf16', gpu_lm.SMOKE)
  >>> state, loss = step(*state, *batch)
  >>> bool(loss > 0)
  True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from jax import lax

import aqtr

DN = (((1,), (0,)), ((), ()))


@dataclasses.dataclass(frozen=True, kw_only=True)
class LmSize:
  """The LM's sizes: vocabulary, width, depth, heads, MLP, batch x seq."""

  vocab: int
  d_model: int
  layers: int
  heads: int
  hidden: int
  batch: int
  seq: int

  def __str__(self) -> str:
    return (
      f'{self.layers}-layer LM, d_model {self.d_model}, {self.heads} heads, '
      f'MLP {self.hidden}, vocab {self.vocab}, {self.batch} x {self.seq} '
      'tokens'
    )


FULL = LmSize(
  vocab=32768, d_model=2048, layers=2, heads=16, hidden=8192, batch=8, seq=2048
)
SMOKE = LmSize(
  vocab=512, d_model=64, layers=2, heads=4, hidden=256, batch=2, seq=64
)
ROWS = ('bf16', 'int8', 'fp8')


def dot_of(row: str) -> Callable:
  """The row's dot: 'bf16' (lax) or an aqtr preset's name ('int8')."""
  if row == 'bf16':
    return lambda lhs, rhs, dn: lax.dot_general(lhs, rhs, dn)
  if not hasattr(aqtr.presets, row):
    raise ValueError(
      f'--train-rows: {row!r} is neither bf16 nor an aqtr preset name.'
    )
  cfg = getattr(aqtr.presets, row)()
  return lambda lhs, rhs, dn: aqtr.dot_general(lhs, rhs, dn, cfg)


def init(key: jax.Array, s: LmSize) -> dict:
  """f32 parameters: embedding, output projection, per-layer weights."""
  keys = iter(jax.random.split(key, 2 + 6 * s.layers))

  def w(a, b):
    return jax.random.normal(next(keys), (a, b)) / a**0.5

  p = {
    'embed': jax.random.normal(next(keys), (s.vocab, s.d_model)),
    'out': w(s.d_model, s.vocab),
  }
  d, h = s.d_model, s.hidden
  for i in range(s.layers):
    p[f'l{i}'] = {
      'q': w(d, d),
      'k': w(d, d),
      'v': w(d, d),
      'o': w(d, d),
      'wi': w(d, h),
      'wo': w(h, d),
    }
  return p


def _norm(x: jax.Array) -> jax.Array:
  x32 = x.astype(jnp.float32)
  m = x32.mean(-1, keepdims=True)
  v = ((x32 - m) ** 2).mean(-1, keepdims=True)
  return ((x32 - m) * lax.rsqrt(v + 1e-6)).astype(x.dtype)


def loss_fn(dot: Callable, s: LmSize) -> Callable:
  """loss(params, ids, labels): mean next-token cross-entropy."""

  def dense(x, w):
    y = dot(x.reshape(-1, x.shape[-1]), w.astype(jnp.bfloat16), DN)
    return y.reshape(*x.shape[:-1], w.shape[-1])

  def loss(p, ids, labels):
    b, t = ids.shape
    x = p['embed'].astype(jnp.bfloat16)[ids]
    for i in range(s.layers):
      lp = p[f'l{i}']
      h = _norm(x)

      def heads(z):
        return z.reshape(b, t, s.heads, -1)

      q, k, v = (heads(dense(h, lp[n])) for n in 'qkv')
      a = jax.nn.dot_product_attention(q, k, v, is_causal=True)
      x = x + dense(a.reshape(b, t, -1), lp['o'])
      x = x + dense(jax.nn.gelu(dense(_norm(x), lp['wi'])), lp['wo'])
    logits = dense(_norm(x), p['out']).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, labels
    ).mean()

  return loss


def setup(row: str, s: LmSize) -> tuple[Callable, tuple, tuple]:
  """(step, (params, opt_state), (ids, labels)) for one row.

  `step(params, opt_state, ids, labels)` returns ((params, opt_state),
  loss), jitted with the parameters and optimizer state donated.
  """
  opt = optax.adamw(1e-3, b2=0.95, weight_decay=0.1)
  loss = loss_fn(dot_of(row), s)

  def step(params, opt_state, ids, labels):
    value, grads = jax.value_and_grad(loss)(params, ids, labels)
    updates, opt_state = opt.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), value

  params = jax.jit(init, static_argnums=1)(jax.random.key(0), s)
  ids = jax.random.randint(
    jax.random.key(1), (s.batch, s.seq + 1), 0, s.vocab, jnp.int32
  )
  state = (params, jax.jit(opt.init)(params))
  batch = (ids[:, :-1], ids[:, 1:])
  return jax.jit(step, donate_argnums=(0, 1)), state, batch
