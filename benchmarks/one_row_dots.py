"""One-row (batch-1 decoding) dots on XLA:CPU: which form runs fast.

A chain of 16 dots x[1, K] . W (W alternately 512 x 2048 and 2048 x 512,
16 distinct matrices: 16 Mi weights), each output squashed by tanh and fed
to the next, under one `jit`; the integer forms quantize x per row to int8
first (absmax) and rescale the int32 result. Forms:

  f32                  float32 weights (the baseline)
  i8 1 row             int8 x int8 -> int32 as it is
  i8 pad R             x padded with zero rows to R rows (R = 2, 3, 4, 8,
                       16; the extra output rows dropped)
  i8 pad 2 [N, K]      two rows, the weight stored transposed
  i8 -> f32 / bf16     int8 weights converted to float before the dot
  reduce of product    sum_k x[k] * w[n, k] as a multiply and a reduce
  i4 (jnp.int4) pad 2  int4 weights, int8 activations
  i4 -> i8 pad 2       int4 weights converted to int8 before the dot
  i4 nibbles pad 2     two int4 codes per int8 byte (column j and j + N/2),
                       unpacked by shifts into two int8 dots

Every form's operands are pinned by an optimization barrier (as aqtr's
engine pins them). Times: the best of `--rounds` interleaved rounds of 10
calls; `x f32` = f32's time over the form's.

Run: python benchmarks/one_row_dots.py [--rounds 6]
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time

import host
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

I32 = jnp.int32
SHAPES = [(512, 2048) if i % 2 == 0 else (2048, 512) for i in range(16)]


def _quantize(x):
  s = jnp.max(jnp.abs(x)) / 127
  return jnp.round(x / s).astype(jnp.int8), s


def _pad(x, rows):
  return jnp.concatenate([x, jnp.zeros((rows - 1, x.shape[1]), x.dtype)], 0)


def _int_chain(dot, rows=1):
  def f(x, ws):
    for w in ws:
      xq, s = _quantize(x)
      xq = _pad(xq, rows) if rows > 1 else xq
      xq, w = lax.optimization_barrier((xq, w))
      y = dot(xq, w)[:1].astype(jnp.float32)
      x = jnp.tanh(y * s * 1e-3)
    return x

  return jax.jit(f)


def _float_chain(dot):
  def f(x, ws):
    for w in ws:
      x = jnp.tanh(dot(*lax.optimization_barrier((x, w))) * 1e-2)
    return x

  return jax.jit(f)


def _nibbles(w):
  n = w.shape[1] // 2
  return ((w[:, n:] << 4) | (w[:, :n] & 0xF)).astype(jnp.int8)


def _nibble_dot(x, p):
  lo, hi = (p << 4) >> 4, p >> 4
  return jnp.concatenate(
    [
      lax.dot(x, lo, preferred_element_type=I32),
      lax.dot(x, hi, preferred_element_type=I32),
    ],
    1,
  )


def cases(rng):
  w8 = [jnp.asarray(rng.integers(-127, 128, s), jnp.int8) for s in SHAPES]
  w4 = [jnp.asarray(rng.integers(-7, 8, s), jnp.int8) for s in SHAPES]
  wf = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in SHAPES]
  w8t = [jnp.asarray(np.ascontiguousarray(np.asarray(w).T)) for w in w8]
  nt = (((1,), (1,)), ((), ()))

  def idot(x, w):
    return lax.dot(x, w, preferred_element_type=I32)

  out = {'f32': (_float_chain(lambda x, w: x @ w), wf)}
  out['i8 1 row'] = (_int_chain(idot), w8)
  for rows in (2, 3, 4, 8, 16):
    out[f'i8 pad {rows}'] = (_int_chain(idot, rows), w8)
  out['i8 pad 2 [N, K]'] = (
    _int_chain(
      lambda x, w: lax.dot_general(x, w, nt, preferred_element_type=I32), 2
    ),
    w8t,
  )
  out['i8 -> f32'] = (_float_chain(lambda x, w: x @ w.astype(jnp.float32)), w8)
  out['i8 -> bf16'] = (
    _float_chain(
      lambda x, w: lax.dot(
        x.astype(jnp.bfloat16),
        w.astype(jnp.bfloat16),
        preferred_element_type=jnp.float32,
      )
    ),
    w8,
  )
  out['reduce of product'] = (
    _float_chain(
      lambda x, w: (x[:, None, :] * w.astype(jnp.float32)[None]).sum(2)
    ),
    w8t,
  )
  out['i4 (jnp.int4) pad 2'] = (
    _int_chain(idot, 2),
    [w.astype(jnp.int4) for w in w4],
  )
  out['i4 -> i8 pad 2'] = (
    _int_chain(lambda x, w: idot(x, w.astype(jnp.int8)), 2),
    [w.astype(jnp.int4) for w in w4],
  )
  out['i4 nibbles pad 2'] = (
    _int_chain(_nibble_dot, 2),
    [_nibbles(w) for w in w4],
  )
  return out


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--rounds', type=int, default=6)
  args = p.parse_args()
  print(f'CPU: {host.cpu_model()}; jax {jax.__version__}')
  print(f'command: python benchmarks/one_row_dots.py {" ".join(sys.argv[1:])}')
  print(f'date: {datetime.date.today()}\n')
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((1, 512)), jnp.float32)
  forms = cases(rng)
  best = {}
  for _ in range(args.rounds):
    for name, (f, ws) in forms.items():
      jax.block_until_ready(f(x, ws))
      t = time.perf_counter()
      for _ in range(10):
        out = f(x, ws)
      jax.block_until_ready(out)
      best[name] = min(best.get(name, 1e9), (time.perf_counter() - t) / 10)
  print('| form | ms per chain of 16 | x f32 |')
  print('|---|---|---|')
  for name, t in best.items():
    print(f'| {name} | {1e3 * t:.2f} | {best["f32"] / t:.2f} |')


if __name__ == '__main__':
  main()
