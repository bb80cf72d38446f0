"""Cost of the random Hadamard transform (RHT) in an emulated NVFP4 step.

Part 1: the transform alone and fused with the NVFP4 quantization that
reads it, on a [M, K] f32 operand along its last axis (the forward
contraction) and its first axis (the tokens, contracted by the wgrad
GEMM), for block sizes 16/32/128 and both methods ('butterfly',
'matmul').

Part 2 (the target): the three GEMMs of an NVFP4 fwd+VJP at M = K = N,
each an `aqtr.dot_general` with NVFP4 operands (16-element blocks,
e4m3 x f32 scales):
  fwd    y  = x . w                (contracting K)
  dgrad  dx = g . w^T              (contracting N)
  wgrad  dw = x^T . g              (contracting the M tokens)
in one jitted function, without and with RHT-16 on both wgrad inputs
along the tokens (the NVFP4 recipe, arXiv 2509.25149), same process,
interleaved rounds, medians. `added` = (with - without) / without. The
engine's own NVFP4 fwd+VJP (`jax.vjp` of `aqtr.dot_general`) is timed
for reference, and `presets.nvfp4_training` (nearest rounding, to time
the transform alone) with and without its RHT-16 on the wgrad inputs;
`presets.mxfp4_training` (RHT-32 on the backward passes) with and
without its Quartet forward rotation.

  python benchmarks/transforms.py
  python benchmarks/transforms.py --size 1024 --rounds 15
"""

from __future__ import annotations

import argparse
import time

import host
import jax
import jax.numpy as jnp
import numpy as np

import aqtr
from aqtr import numerics, tilings, transforms

_NV = aqtr.TensorConfig(
  numerics=numerics.NvFp4(), tiling=tilings.SubChannel(tile_size=16)
)
_FLOAT = aqtr.TensorConfig(numerics=numerics.NoNumerics())


def _config(bwd: aqtr.TensorConfig) -> aqtr.DotGeneralConfig:
  raw = aqtr.DotGeneralRaw
  return aqtr.DotGeneralConfig(
    fwd=raw(lhs=_NV, rhs=_NV),
    dlhs=raw(lhs=bwd, rhs=bwd),
    drhs=raw(lhs=bwd, rhs=bwd),
  )


def _time(fns: dict, args: tuple, rounds: int) -> dict[str, float]:
  """Median ms per call of each jitted fn, interleaved rounds."""
  for f in fns.values():
    jax.block_until_ready(f(*args))
  times = {name: [] for name in fns}
  for _ in range(rounds):
    for name, f in fns.items():
      t0 = time.perf_counter()
      jax.block_until_ready(f(*args))
      times[name].append(time.perf_counter() - t0)
  return {k: 1e3 * float(np.median(v)) for k, v in times.items()}


def transform_table(size: int, rounds: int) -> list[str]:
  x = jnp.asarray(np.random.default_rng(0).standard_normal((size, size)))
  x = x.astype(jnp.float32)
  fns = {}
  for axis in (1, 0):

    def quant(x, axis=axis):
      return aqtr.quantize(x, _NV, contracting_axes=(axis,)).qvalue

    fns[(axis, 'nvfp4 quantize', '')] = jax.jit(quant)
    for n in (16, 32, 128):
      for method in ('matmul', 'butterfly'):
        h = transforms.Hadamard(block_size=n, method=method)

        def rht(x, h=h, axis=axis):
          return h.apply(x, axis)

        def both(x, h=h, axis=axis, quant=quant):
          return quant(h.apply(x, axis))

        fns[(axis, f'RHT-{n}', method)] = jax.jit(rht)
        fns[(axis, f'RHT-{n} + nvfp4 quantize', method)] = jax.jit(both)
  ms = _time(fns, (x,), rounds)
  rows = [
    '| axis | op | method | ms | x quantize |',
    '|---|---|---|---|---|',
  ]
  for (axis, op, method), t in ms.items():
    base = ms[(axis, 'nvfp4 quantize', '')]
    name = 'last (K)' if axis == 1 else 'first (tokens)'
    rows.append(f'| {name} | {op} | {method} | {t:.2f} | {t / base:.2f} |')
  return rows


def gemm_table(size: int, rounds: int) -> list[str]:
  rng = np.random.default_rng(0)
  m = k = n = size
  x, w, g = (
    jnp.asarray(rng.standard_normal(s), jnp.float32)
    for s in ((m, k), (k, n), (m, n))
  )
  cfg = _config(_FLOAT)

  def three(x, w, g, rht=None):
    dg = aqtr.dot_general
    y = dg(x, w, (((1,), (0,)), ((), ())), cfg)
    dx = dg(g, w, (((1,), (1,)), ((), ())), cfg)
    if rht is not None:
      x, g = rht.apply(x, 0, operand='x'), rht.apply(g, 0, operand='g')
    dw = dg(x, g, (((0,), (0,)), ((), ())), cfg)
    return y, dx, dw

  engine_cfg = _config(_NV)

  def engine(x, w, g):
    y, vjp = jax.vjp(
      lambda x, w: aqtr.dot_general(x, w, (((1,), (0,)), ((), ())), engine_cfg),
      x,
      w,
    )
    return y, *vjp(g)

  def f32(x, w, g):
    y, vjp = jax.vjp(lambda x, w: x @ w, x, w)
    return y, *vjp(g)

  fns = {'3 NVFP4 GEMMs': jax.jit(three)}
  for method in ('matmul', 'butterfly'):
    h = transforms.Hadamard(block_size=16, method=method)
    fns[f'3 NVFP4 GEMMs + RHT-16 on the wgrad inputs ({method})'] = jax.jit(
      lambda x, w, g, h=h: three(x, w, g, h)
    )
    fns[f'RHT-16 of x and g alone ({method})'] = jax.jit(
      lambda x, w, g, h=h: (h.apply(x, 0), h.apply(g, 0))
    )
  fns['engine NVFP4 fwd+VJP'] = jax.jit(engine)
  for rht in (False, True):
    recipe = aqtr.presets.nvfp4_training(rht=rht, stochastic_rounding=False)

    def engine_recipe(x, w, g, recipe=recipe):
      dn = (((1,), (0,)), ((), ()))
      y, vjp = jax.vjp(lambda x, w: aqtr.dot_general(x, w, dn, recipe), x, w)
      return y, *vjp(g)

    fns[f'engine nvfp4_training(rht={rht}) fwd+VJP'] = jax.jit(engine_recipe)
  for fwd_h in (False, True):  # Quartet: RHT-32 on the forward GEMM too.
    mx = aqtr.presets.mxfp4_training(forward_hadamard=fwd_h)

    def engine_mx(x, w, g, mx=mx):
      dn, key = (((1,), (0,)), ((), ())), jax.random.key(0)
      y, vjp = jax.vjp(
        lambda x, w: aqtr.dot_general(x, w, dn, mx, key=key), x, w
      )
      return y, *vjp(g)

    name = f'engine mxfp4_training(forward_hadamard={fwd_h}) fwd+VJP'
    fns[name] = jax.jit(engine_mx)
  fns['lax f32 fwd+VJP'] = jax.jit(f32)
  ms = _time(fns, (x, w, g), rounds)
  base, ref = ms['3 NVFP4 GEMMs'], ms['lax f32 fwd+VJP']
  rows = [
    f'| {m}x{k}x{n} | ms | vs 3 NVFP4 GEMMs | x lax f32 fwd+VJP |',
    '|---|---|---|---|',
  ]
  for name, t in ms.items():
    rows.append(
      f'| {name} | {t:.2f} | {100 * (t - base) / base:+.1f}% | {t / ref:.3f} |'
    )
  return rows


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--size', type=int, default=1024)
  p.add_argument('--rounds', type=int, default=11)
  p.add_argument('--gemm-only', action='store_true')
  a = p.parse_args(argv)
  print(f'Host: {host.cpu_model()}, jax {jax.__version__}')
  if not a.gemm_only:
    print(f'\nTransform alone, [{a.size}, {a.size}] f32:\n')
    print('\n'.join(transform_table(a.size, a.rounds)))
  print(f'\nEmulated NVFP4 fwd+VJP GEMMs at {a.size}^3:\n')
  print('\n'.join(gemm_table(a.size, a.rounds)))


if __name__ == '__main__':
  main()
