"""Step-time overhead of delayed fp8 scaling vs dynamic (current) fp8.

A jitted MLP train step (forward, backward, SGD), every weight dot through
`aqtr.dot_general`: `fp8` (per-channel absmax of the current tensor, the
dynamic recipe) vs `fp8_delayed` (per-tensor bound from a 16-step amax
history, Peng et al. 2023, arXiv 2310.18313; the state threaded through
the step and updated from the forward output and the state's cotangent).
Also `fp8 per-tensor` (dynamic, same tiling as delayed) to separate the
tiling's cost from the state's. Interleaved rounds, minimum over rounds.

Run: python benchmarks/delayed_scaling.py [--rounds 10] [--batch 256]
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import time

import jax
import jax.numpy as jnp

import aqtr

DN = (((1,), (0,)), ((), ()))
SIZES = (784, 1024, 1024, 10)


def _per_tensor(cfg):
  def t(tc):
    return dataclasses.replace(tc, tiling=aqtr.tilings.get('per_tensor')())

  def raw(r):
    return dataclasses.replace(r, lhs=t(r.lhs), rhs=t(r.rhs))

  return aqtr.DotGeneralConfig(
    fwd=raw(cfg.fwd), dlhs=raw(cfg.dlhs), drhs=raw(cfg.drhs)
  )


def make_step(cfg, stateful: bool):
  def loss(ws, states, x, y):
    h, news = x, []
    for i, w in enumerate(ws):
      if stateful:
        h, new = aqtr.dot_general(h, w, DN, cfg, state=states[i])
        news.append(new)
      else:
        h = aqtr.dot_general(h, w, DN, cfg)
      if i < len(ws) - 1:
        h = jax.nn.relu(h)
    return jnp.mean((h - y) ** 2), news

  @jax.jit
  def step(ws, states, x, y):
    (_, news), (gw, gs) = jax.value_and_grad(loss, (0, 1), has_aux=True)(
      ws, states, x, y
    )
    ws = [w - 1e-3 * g for w, g in zip(ws, gw, strict=True)]
    if stateful:
      states = [aqtr.state.merge(n, g) for n, g in zip(news, gs, strict=True)]
    return ws, states

  return step


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument('--rounds', type=int, default=10)
  ap.add_argument('--batch', type=int, default=256)
  args = ap.parse_args()
  k = jax.random.split(jax.random.key(0), len(SIZES) + 1)
  ws = [
    jax.random.normal(k[i], (a, b)) / a**0.5
    for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:], strict=True))
  ]
  x = jax.random.normal(k[-1], (args.batch, SIZES[0]))
  y = jnp.zeros((args.batch, SIZES[-1]))
  delayed = aqtr.presets.fp8_delayed()
  hs = [x]
  for w in ws[:-1]:
    hs.append(jnp.zeros((args.batch, w.shape[1])))
  states = [
    aqtr.state.init(h, w, DN, delayed) for h, w in zip(hs, ws, strict=True)
  ]
  runs = {
    'fp8 (dynamic, per-channel)': (make_step(aqtr.presets.fp8(), False), []),
    'fp8 (dynamic, per-tensor)': (
      make_step(_per_tensor(aqtr.presets.fp8()), False),
      [],
    ),
    'fp8_delayed (per-tensor)': (make_step(delayed, True), states),
  }
  best = {}
  for step, st in runs.values():
    jax.block_until_ready(step(ws, st, x, y))  # Compile.
  for _ in range(args.rounds):
    for name, (step, st) in runs.items():
      t0 = time.perf_counter()
      jax.block_until_ready(step(ws, st, x, y))
      dt = time.perf_counter() - t0
      best[name] = min(best.get(name, dt), dt)
  print(f'device: {jax.devices()[0].device_kind}; {platform.processor()}')
  print(f'MLP {SIZES}, batch {args.batch}, min over {args.rounds} rounds')
  base = best['fp8 (dynamic, per-tensor)']
  print(f'| {"config":30s} | ms/step | vs dynamic per-tensor |')
  print(f'|{"-" * 32}|---------|-----------------------|')
  for name, t in best.items():
    print(f'| {name:30s} | {t * 1e3:7.2f} | {100 * (t / base - 1):+20.1f}% |')


if __name__ == '__main__':
  main()
