"""Bytes on the wire of the FSDP weight all-gathers: fp8 recipes vs float.

A two-projection block (d 128 -> 512 -> 128, stock `nnx.Linear`s, the
kernels sharded over all 8 devices along their output axis, the batch
along the same axis: FSDP) is quantized by each recipe's rules; one
jitted train step (forward + gradient) is compiled and the all-gather ops
of the optimized HLO are read (`aqtr.core.sharding.collectives`: dtype
and bytes of each). The recipes set `quantized_gather`: each weight is
quantized on its shard and its fp8 values + f32 scales are gathered.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    python -m papers.fp8_recipes.gather

Example:
  >>> sorted(RECIPES)
  ['deepseek_v3_fp8', 'float', 'maxtext_deepseek_fp8']
"""

from __future__ import annotations

import collections
import platform

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

import aqtr
import aqtr.flax
from aqtr.core import sharding
from aqtr.rules import Rule

__all__ = ['RECIPES', 'Block', 'all_gathers', 'collectives', 'main', 'table']

D, H, B = 128, 512, 64
RECIPES = {
  'float': lambda: None,
  'maxtext_deepseek_fp8': lambda: aqtr.presets.maxtext_deepseek_fp8(224.0),
  'deepseek_v3_fp8': lambda: aqtr.presets.deepseek_v3_fp8(tile=16),
}


class Block(nnx.Module):
  """Up and down projections; kernels sharded along their output axis."""

  def __init__(self, rngs):
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, 'd'))
    lin = dict(use_bias=False, kernel_init=init, rngs=rngs)
    self.up = nnx.Linear(D, H, **lin)
    self.down = nnx.Linear(H, D, **lin)

  def __call__(self, x):
    h = jax.nn.relu(self.up(x, out_sharding=P('d')))
    return self.down(h, out_sharding=P('d'))


def collectives(name: str) -> list[tuple[str, str, int]]:
  """(op, dtype, bytes) of each collective of a train step under `name`."""
  mesh = jax.make_mesh((8,), ('d',))
  with jax.set_mesh(mesh):
    model = Block(nnx.Rngs(0))
    cfg = RECIPES[name]()
    if cfg is not None:
      model = aqtr.flax.quantize(model, Rule(cfg, weight=True))
    x = jax.device_put(jax.random.normal(jax.random.key(1), (B, D)), P('d'))
    graphdef, state = nnx.split(model)

    def loss(state, x):
      return jnp.sum(nnx.merge(graphdef, state)(x) ** 2)

    text = jax.jit(jax.grad(loss)).lower(state, x).compile().as_text()
  return sharding.collectives(text)


def all_gathers(name: str) -> list[tuple[str, int]]:
  """(dtype, bytes) of each all-gather of a train step under `name`."""
  return [(d, n) for op, d, n in collectives(name) if op == 'all-gather']


def table() -> list[dict]:
  """One row per recipe: all-gather bytes by dtype, all-reduce bytes,
  total collective bytes and its ratio to float's."""
  rows, ref = [], None
  for name in RECIPES:
    got = collectives(name)
    by = collections.Counter()
    for op, dtype, n in got:
      if op == 'all-gather':
        by[dtype] += n
    total = sum(n for _, _, n in got)
    ref = ref or total
    rows.append(
      {
        'recipe': name,
        'all-gathers': sum(op == 'all-gather' for op, _, _ in got),
        'gathered by dtype': ', '.join(
          f'{k} {v}' for k, v in sorted(by.items())
        ),
        'gathered': sum(by.values()),
        'all-reduced': sum(n for op, _, n in got if op == 'all-reduce'),
        'total': total,
        'x float': total / ref,
      }
    )
  return rows


def main() -> None:
  if jax.device_count() < 8:
    raise SystemExit(
      'papers.fp8_recipes.gather needs 8 devices: run with '
      'XLA_FLAGS=--xla_force_host_platform_device_count=8.'
    )
  from aqtr.train import report  # noqa: PLC0415

  print(f'{platform.processor() or platform.machine()}, jax {jax.__version__}')
  cols = ('recipe', 'all-gathers', 'gathered by dtype', 'gathered')
  cols += ('all-reduced', 'total', 'x float')
  print(report.table(table(), cols, {'x float': '.3f'}))


if __name__ == '__main__':
  main()
