"""Speed of quantized dot_general vs lax.dot_general f32 (and AQT, Qwix).

One process, interleaved rounds (every implementation is timed once per
round, in turn), minimum over rounds; ratios are to `lax.dot_general` f32 of
the same shape and mode. Modes: `fwd` (forward only) and `fwd+vjp`
(`jax.vjp` of the forward, then the VJP with a random cotangent: output and
both gradients). AQT (`aqtp`) and Qwix (`qwix`) columns appear when those
packages are installed (`pip install -e '.[bench]'`).

Run: python benchmarks/dot_general.py [--rounds 7] [--shapes 256x1024x1024]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

import aqtr

DN = (((1,), (0,)), ((), ()))  # x[M, K] . w[K, N], the Dense layout.


def _aqtr(name: str) -> Callable:
  cfg = getattr(aqtr.presets, name)()
  return lambda x, w: aqtr.dot_general(x, w, DN, cfg)


def _aqt(name: str) -> Callable | None:
  try:
    from aqt.jax.v2 import config as aqt_config
  except ImportError:
    return None
  if name == 'int8':
    dg = aqt_config.fully_quantized(
      fwd_bits=8, bwd_bits=8, use_stochastic_rounding=False
    )
  elif name == 'int8_fwd':
    dg = aqt_config.fully_quantized(fwd_bits=8, bwd_bits=None)
  elif name == 'fp8':
    dg = aqt_config.config_fwd_fp8()
  else:
    return None
  return lambda x, w: dg(x, w, DN)


def _qwix(name: str) -> Callable | None:
  try:
    from qwix._src.core import dot_general_qt
  except ImportError:
    return None
  kinds = {
    'int8': dict(
      lhs_qtype='int8',
      rhs_qtype='int8',
      dlhs_grad_qtype='int8',
      drhs_grad_qtype='int8',
    ),
    'int8_fwd': dict(
      lhs_qtype='int8', rhs_qtype='int8', use_original_residuals=True
    ),
    'fp8': dict(
      lhs_qtype=jnp.float8_e4m3fn,
      rhs_qtype=jnp.float8_e4m3fn,
      dlhs_grad_qtype=jnp.float8_e5m2,
      drhs_grad_qtype=jnp.float8_e5m2,
    ),
  }
  cfg = dot_general_qt.DotGeneralQtConfig(**kinds[name])
  return lambda x, w: dot_general_qt.dot_general_qt(x, w, DN, cfg)


def implementations() -> dict[str, Callable]:
  impls = {'lax f32': lambda x, w: lax.dot_general(x, w, DN)}
  for name in ('int8_fwd', 'int8', 'fp8'):
    impls[f'aqtr {name}'] = _aqtr(name)
    for lib, make in (('aqt', _aqt), ('qwix', _qwix)):
      f = make(name)
      if f is not None:
        impls[f'{lib} {name}'] = f
  return impls


def _compile(f: Callable, mode: str, args):
  if mode == 'fwd':
    g = jax.jit(f)
  else:

    def g(x, w, ct):
      out, vjp = jax.vjp(f, x, w)
      return (out, *vjp(ct))

    g = jax.jit(g)
  t = time.perf_counter()
  jax.block_until_ready(g(*args))
  return g, time.perf_counter() - t


def bench(shape, rounds: int, modes=('fwd', 'fwd+vjp')) -> list[dict]:
  m, k, n = shape
  kx, kw, kg = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (m, k), jnp.float32)
  w = jax.random.normal(kw, (k, n), jnp.float32)
  ct = jax.random.normal(kg, (m, n), jnp.float32)
  rows = []
  for mode in modes:
    args = (x, w) if mode == 'fwd' else (x, w, ct)
    fns, compile_s = {}, {}
    for name, f in implementations().items():
      try:
        fns[name], compile_s[name] = _compile(f, mode, args)
      except Exception as e:  # A competitor lacking a mode is reported.
        print(f'  {name} {mode}: failed ({type(e).__name__}: {e})'[:160])
    best = dict.fromkeys(fns, float('inf'))
    for _ in range(rounds):
      for name, g in fns.items():
        t = time.perf_counter()
        jax.block_until_ready(g(*args))
        best[name] = min(best[name], time.perf_counter() - t)
    base, cbase = best['lax f32'], compile_s['lax f32']
    for name in fns:
      rows.append(
        dict(
          shape='x'.join(map(str, shape)),
          mode=mode,
          impl=name,
          ms=best[name] * 1e3,
          ratio=best[name] / base,
          compile_ratio=compile_s[name] / cbase,
        )
      )
  return rows


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--rounds', type=int, default=7)
  p.add_argument(
    '--shapes',
    nargs='*',
    default=['256x1024x1024', '1024x1024x1024', '2048x2048x2048'],
  )
  a = p.parse_args(argv)
  print(
    f'jax {jax.__version__}, {jax.devices()[0].device_kind}, '
    f'rounds={a.rounds}; ratio = min time / lax f32 min time'
  )
  print(
    f'| {"M x K x N":<15}| {"mode":<8}| {"impl":<16}| {"ms":>8} '
    f'| {"x f32":>6} | {"compile x":>9} |'
  )
  print('|' + '---|' * 6)
  for s in a.shapes:
    shape = tuple(int(v) for v in s.split('x'))
    for r in bench(shape, a.rounds):
      print(
        f'| {r["shape"]:<15}| {r["mode"]:<8}| {r["impl"]:<16}| '
        f'{r["ms"]:>8.2f} | {r["ratio"]:>6.2f} | '
        f'{r["compile_ratio"]:>9.2f} |',
        flush=True,
      )


if __name__ == '__main__':
  main()
