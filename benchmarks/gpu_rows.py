"""The rows of benchmarks/gpu.py: one dot's fwd+VJP per implementation.

Every row is a function of bf16 operands `x[M, K]`, `w[K, N]` and a
cotangent `g[M, N]` that returns the output and both gradients (`jax.vjp`
of one dot, then its VJP), except the two limits, which take operands
already quantized and laid out: the three bare low-precision dots of a
fwd+VJP, every operand contracting its minor axis (`x . w^T`, `g . w`,
`g^T . x^T` in the layout cuBLASLt's IMMA / fp8 kernels want), no
quantization or scaling.

Run as a script's module (`import gpu_rows` from benchmarks/).

Example:
  >>> import gpu_rows
  >>> f, args = gpu_rows.make('aqtr int8', gpu_rows.data((32, 64, 32)))
  >>> [a.dtype for a in f(*args)]
  [dtype(bfloat16), dtype(bfloat16), dtype(bfloat16)]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

import aqtr

DN = (((1,), (0,)), ((), ()))  # x[M, K] . w[K, N]
TN = (((1,), (1,)), ((), ()))  # a[P, C] . b[Q, C]: both contract minor.

# Dot shapes (M, K, N) by name; `lm` is an LM's MLP up-projection (16k
# tokens, d_model 2048, hidden 8192).
SHAPES = {
  '4096': (4096, 4096, 4096),
  '8192': (8192, 8192, 8192),
  'lm': (16384, 2048, 8192),
  'smoke': (128, 256, 192),
}
# What issue 41's targets are set on, first in every run; then the rest.
MAIN = ('bf16', 'limit int8', 'limit fp8', 'aqtr int8', 'aqtr fp8', 'qwix fp8')
REST = (
  'aqtr int8_fwd',
  'aqtr int8 sr',
  'aqtr fp8_delayed',
  'aqtr mxfp8',
  'aqtr nvfp4 w-only',
  'aqt int8',
  'aqt fp8',
  'qwix int8',
)
ROWS = MAIN + REST


class Skip(Exception):  # noqa: N818 (a reason, not an error)
  """A row that cannot run here (a package or preset is missing)."""


def limit_of(row: str) -> str | None:
  """The limit row a row is compared with ('limit int8'), or None."""
  if row.startswith('limit') or 'mx' in row or 'nvfp4' in row:
    return None
  if 'int8' in row:
    return 'limit int8'
  return 'limit fp8' if 'fp8' in row else None


def parse_shape(text: str) -> tuple[int, int, int]:
  """'8192' -> SHAPES['8192']; '512x1024x256' -> (512, 1024, 256)."""
  if text in SHAPES:
    return SHAPES[text]
  try:
    m, k, n = (int(v) for v in text.split('x'))
  except ValueError:
    raise ValueError(
      f'--shapes: {text!r} is neither one of {sorted(SHAPES)} nor MxKxN '
      '(e.g. 512x1024x256).'
    ) from None
  return m, k, n


def data(shape: tuple[int, int, int]) -> dict[str, jax.Array]:
  """bf16 x[M, K], w[K, N], g[M, N] (normal, fixed keys) for one shape."""
  m, k, n = shape
  kx, kw, kg = jax.random.split(jax.random.key(0), 3)
  bf = jnp.bfloat16
  return {
    'x': jax.random.normal(kx, (m, k), bf),
    'w': (jax.random.normal(kw, (k, n), jnp.float32) / k**0.5).astype(bf),
    'g': jax.random.normal(kg, (m, n), bf),
  }


def fwd_vjp(dot: Callable) -> Callable:
  """f(x, w, g) -> (dot(x, w), dx, dw): one dot's fwd+VJP."""

  def f(x, w, g):
    y, vjp = jax.vjp(dot, x, w)
    return (y, *vjp(g))

  return f


def _limit(kind: str, d: dict) -> tuple[Callable, tuple]:
  x, w, g = d['x'], d['w'], d['g']
  if kind == 'int8':

    def q(a, _):
      s = 127 / jnp.max(jnp.abs(a.astype(jnp.float32)))
      return jnp.round(a * s).astype(jnp.int8)

    xd = wd = gd = None
    out = jnp.int32
  else:

    def q(a, dt):
      return a.astype(dt)

    xd = wd = jnp.float8_e4m3fn
    gd = jnp.float8_e5m2
    out = jnp.bfloat16
  args = (q(x, xd), q(w.T, wd), q(w, wd), q(g, gd), q(g.T, gd), q(x.T, xd))

  def three(xq, wt, wq, gq, gt, xt):
    def dot(a, b):
      return lax.dot_general(a, b, TN, preferred_element_type=out)

    return dot(xq, wt), dot(gq, wq), dot(gt, xt)

  return three, jax.block_until_ready(args)


def nvfp4_weight_only() -> aqtr.DotGeneralConfig:
  """NVFP4 weights (16-blocks, e4m3 x f32 scales), float activations.

  There is no preset for it: `int8_weight_only()` with the weight's
  numerics and tiling replaced.
  """
  base = aqtr.presets.int8_weight_only()
  w = dataclasses.replace(
    base.fwd.rhs,
    numerics=aqtr.numerics.NvFp4(clip_gradient=False),
    tiling=aqtr.tilings.SubChannel(tile_size=16, tile_count=0),
  )
  return dataclasses.replace(
    base,
    fwd=dataclasses.replace(base.fwd, rhs=w),
    dlhs=dataclasses.replace(base.dlhs, rhs=w),
  )


def _aqtr(name: str, d: dict) -> tuple[Callable, tuple]:
  args = (d['x'], d['w'], d['g'])
  if name == 'int8 sr':
    cfg = aqtr.presets.fully_quantized(8, 8, stochastic_rounding=True)

    def f(x, w, g, key):
      return fwd_vjp(lambda x, w: aqtr.dot_general(x, w, DN, cfg, key=key))(
        x, w, g
      )

    return f, (*args, jax.random.key(1))
  if name == 'nvfp4 w-only':
    cfg = nvfp4_weight_only()
  elif not hasattr(aqtr.presets, name):
    raise Skip(f'no preset aqtr.presets.{name} in this checkout')
  else:
    cfg = getattr(aqtr.presets, name)()
  if name != 'fp8_delayed':
    return fwd_vjp(lambda x, w: aqtr.dot_general(x, w, DN, cfg)), args
  state = aqtr.state.init(d['x'], d['w'], DN, cfg)

  def stateful(x, w, g, st):
    def dot(x, w, st):
      return aqtr.dot_general(x, w, DN, cfg, state=st)

    y, vjp, new = jax.vjp(dot, x, w, st, has_aux=True)
    return (y, *vjp(g), new)

  return stateful, (*args, state)


def _aqt(name: str) -> Callable:
  try:
    from aqt.jax.v2 import config as aqt_config
  except ImportError:
    raise Skip('aqtp (AQT) is not installed') from None
  if name == 'int8':
    dg = aqt_config.fully_quantized(
      fwd_bits=8, bwd_bits=8, use_stochastic_rounding=False
    )
  else:  # fp8: AQT's recipe quantizes the forward pass only.
    dg = aqt_config.config_fwd_fp8()
  return lambda x, w: dg(x, w, DN)


def _qwix(name: str) -> Callable:
  try:
    from qwix._src.core import dot_general_qt
  except ImportError:
    raise Skip('qwix is not installed') from None
  if name == 'int8':
    kw = dict(lhs_qtype='int8', rhs_qtype='int8')
    kw |= dict(dlhs_grad_qtype='int8', drhs_grad_qtype='int8')
  else:
    kw = dict(lhs_qtype=jnp.float8_e4m3fn, rhs_qtype=jnp.float8_e4m3fn)
    kw |= dict(dlhs_grad_qtype=jnp.float8_e5m2, drhs_grad_qtype=jnp.float8_e5m2)
  cfg = dot_general_qt.DotGeneralQtConfig(**kw)
  return lambda x, w: dot_general_qt.dot_general_qt(x, w, DN, cfg)


def make(row: str, d: dict) -> tuple[Callable, tuple]:
  """The function of a row and its arguments (raises Skip if it can't run).

  Args:
    row: one of ROWS.
    d: the shape's operands, from `data`.

  Returns:
    (f, args): `jax.jit(f)(*args)` is the measured program.
  """
  lib, _, name = row.partition(' ')
  args = (d['x'], d['w'], d['g'])
  if row == 'bf16':
    return fwd_vjp(lambda x, w: lax.dot_general(x, w, DN)), args
  if lib == 'limit':
    return _limit(name, d)
  if lib == 'aqtr':
    return _aqtr(name, d)
  if lib in ('aqt', 'qwix') and name in ('int8', 'fp8'):
    return fwd_vjp((_aqt if lib == 'aqt' else _qwix)(name)), args
  raise ValueError(f'--rows: unknown row {row!r}; rows are {list(ROWS)}.')
