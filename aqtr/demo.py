"""Demo: quantize one dot_general and print float vs int8 vs fp8 error.

Run: `python -m aqtr.demo` (or `aqtr-demo`). It prints, for a random
activation x weight product, the relative error of the forward output and
of both gradients under each preset, and checks that the int8 dot really
runs on int8 operands.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from jax import lax

import aqtr

PRESETS = (
  'float',
  'int8',
  'int8_fwd',
  'fp8',
  'int8_weight_only',
  'int4_weight_only',
  'w4a8',
)


def _rel(a, b) -> float:
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def run(m: int = 256, k: int = 512, n: int = 256, seed: int = 0) -> list[dict]:
  """Relative errors of each preset against the float dot."""
  kx, kw, kg = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(kx, (m, k))
  w = jax.random.normal(kw, (k, n)) / jnp.sqrt(k)
  g = jax.random.normal(kg, (m, n))
  dn = (((1,), (0,)), ((), ()))
  ref, ref_vjp = jax.vjp(lambda a, b: lax.dot_general(a, b, dn), x, w)
  rdx, rdw = ref_vjp(g)
  rows = []
  for name in PRESETS:
    cfg = getattr(aqtr.presets, name)()
    f = jax.jit(lambda a, b, cfg=cfg: aqtr.dot_general(a, b, dn, cfg))
    out, vjp = jax.vjp(f, x, w)
    dx, dw = vjp(g)
    rows.append(
      dict(preset=name, out=_rel(out, ref), dx=_rel(dx, rdx), dw=_rel(dw, rdw))
    )
  return rows


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--m', type=int, default=256)
  p.add_argument('--k', type=int, default=512)
  p.add_argument('--n', type=int, default=256)
  p.add_argument('--seed', type=int, default=0)
  a = p.parse_args(argv)
  print(f'x[{a.m}x{a.k}] . w[{a.k}x{a.n}], relative error vs float32')
  print(f'{"preset":<18}{"out":>10}{"d lhs":>10}{"d rhs":>10}')
  for r in run(a.m, a.k, a.n, a.seed):
    print(f'{r["preset"]:<18}{r["out"]:>10.4f}{r["dx"]:>10.4f}{r["dw"]:>10.4f}')
  jaxpr = jax.make_jaxpr(
    lambda x, w: aqtr.dot_general(
      x, w, (((1,), (0,)), ((), ())), aqtr.presets.int8()
    )
  )(jnp.ones((8, 16)), jnp.ones((16, 4)))
  print('int8 dot in the jaxpr:', 'i8[' in str(jaxpr) and 'i32[' in str(jaxpr))


if __name__ == '__main__':
  main()
