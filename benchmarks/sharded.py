"""Step time and bytes communicated on the 8-device host mesh.

One FSDP layer stack trained with SGD: activations x [B, D] split over the
8 devices along the batch, each weight [D, D] split along its output
features over the same axis, so every dot gathers its weight. Three
variants: float (`config=None`), int8 (`aqtr.presets.int8()`), and int8
with `quantized_gather` on the weights (quantize where the shards live,
gather int8 + scales). Bytes are read from the compiled HLO
(`aqtr.core.sharding.collectives`: each collective's result bytes per
device, summed), step time is the minimum over rounds of one jitted
forward + backward + update.

Run (CPU):
  XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
    python benchmarks/sharded.py [--dim 512] [--batch 256] [--layers 4]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import time

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import aqtr  # noqa: E402
from aqtr.core import sharding  # noqa: E402

DN = (((1,), (0,)), ((), ()))


def _gathered(cfg: aqtr.DotGeneralConfig) -> aqtr.DotGeneralConfig:
  rhs = dataclasses.replace(cfg.fwd.rhs, quantized_gather=True)
  return dataclasses.replace(cfg, fwd=dataclasses.replace(cfg.fwd, rhs=rhs))


VARIANTS = {
  'float': None,
  'int8': aqtr.presets.int8(),
  'int8 + int8 all-gather': _gathered(aqtr.presets.int8()),
}


def _step(cfg):
  def loss(ws, x):
    for w in ws:
      x = jnp.tanh(aqtr.dot_general(x, w, DN, cfg, out_sharding=P('d')))
    return jnp.mean(x**2)

  def step(ws, x):
    grads = jax.grad(loss)(ws, x)
    return [w - 0.1 * g for w, g in zip(ws, grads, strict=True)]

  return jax.jit(step, donate_argnums=0)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--dim', type=int, default=512)
  p.add_argument('--batch', type=int, default=256)
  p.add_argument('--layers', type=int, default=4)
  p.add_argument('--rounds', type=int, default=5)
  a = p.parse_args()
  mesh = jax.make_mesh((jax.device_count(),), ('d',))
  rows = []
  with jax.set_mesh(mesh):
    x = jax.device_put(
      jax.random.normal(jax.random.key(0), (a.batch, a.dim)),
      NamedSharding(mesh, P('d')),
    )
    keys = jax.random.split(jax.random.key(1), a.layers)
    for name, cfg in VARIANTS.items():
      ws = [
        jax.device_put(
          jax.random.normal(k, (a.dim, a.dim)) / a.dim**0.5,
          NamedSharding(mesh, P(None, 'd')),
        )
        for k in keys
      ]
      compiled = _step(cfg).lower(ws, x).compile()
      moved = collections.Counter()
      for op, dtype, n in sharding.collectives(compiled.as_text()):
        moved[f'{op} {dtype}'] += n
      best = float('inf')
      for _ in range(a.rounds):
        t = time.perf_counter()
        ws = compiled(ws, x)
        jax.block_until_ready(ws)
        best = min(best, time.perf_counter() - t)
      rows.append((name, best, moved))
  print(
    f'{jax.device_count()} host devices, {a.layers} layers of '
    f'[{a.batch}, {a.dim}] x [{a.dim}, {a.dim}], weights split on N\n'
  )
  print('| variant | step ms | bytes communicated / device | by op |')
  print('|---|---:|---:|---|')
  for name, best, moved in rows:
    total = sum(moved.values())
    detail = ', '.join(f'{k}: {v / 1024:.0f} KiB' for k, v in moved.items())
    print(f'| {name} | {best * 1e3:.1f} | {total / 1024:.0f} KiB | {detail} |')


if __name__ == '__main__':
  main()
