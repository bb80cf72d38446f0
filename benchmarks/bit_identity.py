"""Bit-identity of presets' values and gradients under two source trees.

Runs the jitted fwd+VJP (output and both gradients) of every preset below
on four layouts (x w, x w^T, batched, few rows) and three inputs (finite, values
spread over 1e-30..1e30 with a cotangent near 1e30, NaN / inf in x, w and
the cotangent), once with `aqtr/` of `--rev` (extracted like
benchmarks/before_after.py) and once with this working tree, and compares
every array byte for byte (NaN payloads and signs included).

Run: python benchmarks/bit_identity.py --rev main
(`--dump PATH` writes this tree's arrays to an .npz instead.)
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile
import zlib

import numpy as np
from before_after import unpack

ROOT = pathlib.Path(__file__).resolve().parent.parent
PRESETS = (
  'int8',
  'int8_fwd',
  'int8 sr',
  'fp8',
  'fp8_full',
  'fp8_nanoo',
  'switchback',
  'aqt_v4',
  'int8_sparse_2_4',
  'int8_weight_only',
  'int4_weight_only',
  'int4_asym_weight_only(group=32)',
  'nvfp4',
  'mxfp8',
)
DNS = {
  'x w': ((((1,), (0,)), ((), ())), (64, 64), (64, 64), (64, 64)),
  'x w^T': ((((1,), (1,)), ((), ())), (64, 64), (64, 64), (64, 64)),
  'batched': (
    (((2,), (1,)), ((0,), (0,))),
    (2, 32, 32),
    (2, 32, 32),
    (2, 32, 32),
  ),
  # Operands of fewer than 4096 values (AbsMax's one-reduction CPU form).
  'rows': ((((1,), (0,)), ((), ())), (32, 64), (64, 32), (32, 32)),
}


def _config(name: str):
  import aqtr

  if name == 'int8 sr':
    return aqtr.presets.fully_quantized(8, 8, stochastic_rounding=True)
  if name == 'int4_asym_weight_only(group=32)':
    return aqtr.presets.int4_asym_weight_only(group=32)
  return getattr(aqtr.presets, name)()


def _inputs(name: str, layout: str, kind: str, shapes):
  rs = np.random.RandomState(zlib.crc32(f'{name}|{layout}|{kind}'.encode()))
  x, w, g = (rs.standard_normal(s).astype(np.float32) for s in shapes)
  if kind == 'wide':
    e = rs.randint(-30, 30, size=x.shape).astype(np.float32)
    x *= np.float32(10.0) ** e
    g *= np.float32(1e30)
  if kind == 'non-finite':
    x.reshape(-1)[5], x.reshape(-1)[77] = np.nan, np.inf
    w.reshape(-1)[9], g.reshape(-1)[13] = -np.inf, np.nan
  return x, w, g


def dump(path: str) -> None:
  """This tree's arrays, one per (preset, layout, input, output)."""
  import jax

  import aqtr

  key = jax.random.key(3)
  out = {}
  for name in PRESETS:
    cfg = _config(name)
    for layout, (dn, *shapes) in DNS.items():
      for kind in ('finite', 'wide', 'non-finite'):
        x, w, g = _inputs(name, layout, kind, shapes)

        def f(x, w, g, dn=dn, cfg=cfg):
          def dot(x, w):
            return aqtr.dot_general(x, w, dn, cfg, key=key)

          y, vjp = jax.vjp(dot, x, w)
          return (y, *vjp(g))

        for i, a in enumerate(jax.jit(f)(x, w, g)):
          out[f'{name}|{layout}|{kind}|{("y", "dx", "dw")[i]}'] = a
  np.savez(path, **{k: np.asarray(v) for k, v in out.items()})


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--rev', default='main', help='the "before" revision')
  p.add_argument('--dump', help='write this tree arrays to an .npz; stop')
  a = p.parse_args(argv)
  if a.dump:
    dump(a.dump)
    return
  with tempfile.TemporaryDirectory() as tmp:
    unpack(a.rev, tmp)
    files = {}
    for side, src in (('before', tmp), ('after', str(ROOT))):
      files[side] = os.path.join(tmp, f'{side}.npz')
      subprocess.run(
        [sys.executable, __file__, '--dump', files[side]],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=src),
        check=True,
      )
    b, f = np.load(files['before']), np.load(files['after'])
    differ = sorted(
      k for k in b.files if k not in f.files or b[k].tobytes() != f[k].tobytes()
    )
    print(
      f'`python benchmarks/bit_identity.py --rev {a.rev}`: {len(b.files)} '
      f'arrays ({len(PRESETS)} configurations x {len(DNS)} layouts x 3 '
      f'inputs x (y, dx, dw)), {len(differ)} differ'
    )
    for k in differ:
      print('  differs:', k)
    if differ or set(b.files) != set(f.files):
      sys.exit(1)


if __name__ == '__main__':
  main()
