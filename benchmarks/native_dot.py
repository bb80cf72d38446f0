"""The native few-row integer dot against XLA:CPU's dots, isolated.

For each weight shape [N, K] and row count M: a chain of `--weights`
distinct weights (more bytes than the caches hold, as in decoding), each
dotted with the same M activation rows under one `jit`, times:

  native i8    aqtr's kernel (`aqtr.core.native_dot`), int8 weights [N, K]
  native i4    the same, int4 weights read packed
  xla i8       XLA's int8 dot as aqtr ran it before the kernel (operands
               pinned by a barrier, a zero row added at M = 1)
  f32          XLA's float32 dot, weights [N, K]

Each cell is the median of `--rounds` calls divided by the chain length;
GB/s is the weight bytes one dot reads over its time. `xla/native` is
the speedup of the kernel over what ran before; `f32/native` over float.
The kernel's results equal XLA's int8 dot's bit for bit (checked here).

With `--tiles T` each int weight is T tiles [T, N, K/T] (a scale per group
of K/T, as w4a8 runs): T short tile dots in one call.

Run: python benchmarks/native_dot.py [--rows 1 2 4 8 16] [--rounds 15]
[--tiles 32]
(`AQTR_NATIVE_ISA=avx2` times the AVX2 form on an AVX-512 VNNI host.)
"""

from __future__ import annotations

import argparse
import statistics
import time

import host
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from aqtr.core import native_dot

SHAPES = [(4096, 4096), (11008, 4096), (2048, 2048), (512, 512)]


def _xla_int8(a, w):
  m = a.shape[1]
  if m == 1:
    a = jnp.concatenate([a, jnp.zeros_like(a)], 1)
  a, w = lax.optimization_barrier((a, w))
  out = lax.dot_general(
    a, w, (((2,), (2,)), ((0,), (0,))), preferred_element_type=jnp.int32
  )
  return out[:, :m]


def _f32(a, w):
  return lax.dot_general(a, w, (((2,), (2,)), ((0,), (0,))))


def _chain(dot):
  def f(a, ws):
    return sum(dot(a, w).astype(jnp.float32) for w in ws)

  return jax.jit(f)


def _time(f, a, ws, rounds: int) -> float:
  jax.block_until_ready(f(a, ws))
  times = []
  for _ in range(rounds):
    t = time.perf_counter()
    jax.block_until_ready(f(a, ws))
    times.append(time.perf_counter() - t)
  return statistics.median(times) / len(ws)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--rows', type=int, nargs='+', default=[1, 2, 4, 8, 16])
  p.add_argument('--rounds', type=int, default=15)
  p.add_argument('--weights', type=int, default=6)
  p.add_argument(
    '--tiles',
    type=int,
    default=1,
    help='T: each int weight as T tiles [T, N, K/T] (a scale per group of '
    'K/T along K, as sub-channel formats such as w4a8 run: T tile dots)',
  )
  args = p.parse_args()
  host.header('native_dot.py')
  flags, form = native_dot.cpu_flags(), native_dot.form()
  print(
    f'avx512_vnni: {"yes" if "avx512_vnni" in flags else "no"}; '
    f'kernel form: {form[0] if form else "none"}; '
    f'load: {host.load_average()}'
  )
  if not native_dot.ready():
    raise SystemExit('the native dot is not available on this host')
  rng = np.random.default_rng(0)
  print(
    '| N x K | M | native i8 ms (GB/s) | native i4 ms (GB/s) | '
    'xla i8 ms | f32 ms (GB/s) | xla/native i8 | f32/native i8 | '
    'f32/native i4 |'
  )
  print('|---|---:|---:|---:|---:|---:|---:|---:|---:|')
  tiles = args.tiles
  for n, k in SHAPES:
    tk = (tiles, n, k // tiles)
    w8 = [
      jnp.asarray(rng.integers(-127, 128, tk), jnp.int8)
      for _ in range(args.weights)
    ]
    w4 = [
      jnp.asarray(rng.integers(-7, 8, tk), jnp.int4)
      for _ in range(args.weights)
    ]
    wf = [
      jnp.asarray(rng.standard_normal((1, n, k)), jnp.float32)
      for _ in range(args.weights)
    ]
    for m in args.rows:
      a = jnp.asarray(rng.integers(-127, 128, (tiles, m, k // tiles)), jnp.int8)
      native, xla = _chain(native_dot.rows_dot), _chain(_xla_int8)
      if not np.array_equal(native(a, w8), xla(a, w8)):
        raise SystemExit(f'native != xla at {n}x{k}, M={m}')
      t8 = _time(native, a, w8, args.rounds)
      t4 = _time(native, a, w4, args.rounds)
      tx = _time(xla, a, w8, args.rounds)
      af = jnp.ones((1, m, k), jnp.float32)  # Float: one dot over all of K.
      tf = _time(_chain(_f32), af, wf, args.rounds)
      gb = n * k / 1e9
      print(
        f'| {n} x {k} | {m} | {t8 * 1e3:.3f} ({gb / t8:.1f}) | '
        f'{t4 * 1e3:.3f} ({gb / 2 / t4:.1f}) | {tx * 1e3:.3f} | '
        f'{tf * 1e3:.3f} ({4 * gb / tf:.1f}) | {tx / t8:.2f} | '
        f'{tf / t8:.2f} | {tf / t4:.2f} |',
        flush=True,
      )


if __name__ == '__main__':
  main()
