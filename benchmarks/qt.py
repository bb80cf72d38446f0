"""Quantized training (QT) and low-bit Adam: step time and memory.

The main job's default LM (`aqtr.pax` TransformerLm: bytes, vocab 256,
2 blocks, d_model 128, 4 heads, MLP 512; batch 16 x 64 tokens, random
tokens) trained by a jitted step (forward, backward, optimizer update),
for every pair of

  weights:   float; QAT int8 (`aqtr.presets.int8()` injected, float
             params); QT int8 (int8 per-channel params, weight-only, SR);
             QT int8 w8a8 (same params, int8 x int8 forward); QT int4
             (group 64, weight-only, SR)
  optimizer: optax.adamw; aqtr.qt.adamw_8bit

Columns: min step time over interleaved rounds (ms), bytes of the params
and of the optimizer state as stored between steps, and the compiled
step's peak (arguments + temporaries, from XLA's memory analysis; outputs
alias the donated arguments). Embeddings and norms stay float in QT.

Run: python benchmarks/qt.py [--rounds 5] [--steps 10]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import optax

import aqtr
from aqtr import qt
from aqtr.qt.formats import dot_config
from aqtr.train import models

BATCH, SEQ, VOCAB = 16, 64, 256


def _model(config):
  tpl = models.lm(VOCAB, SEQ, d_model=128, num_layers=2, num_heads=4)
  injected, _ = models.inject(tpl, config)
  return models.build(injected)


@dataclasses.dataclass
class Row:
  name: str
  step_ms: float = 0.0
  params_mb: float = 0.0
  opt_mb: float = 0.0
  peak_mb: float = 0.0


def _setups(params):
  """name -> (module, params, optimizer)."""
  rows = {}
  weights = {
    'float': (None, None, False),
    'QAT int8': (aqtr.presets.int8(), None, False),
    'QT int8': (None, qt.int8(), True),
    'QT int8 w8a8': (dot_config(qt.int8()), qt.int8(), True),
    'QT int4 g64': (None, qt.int4(64), True),
  }
  opts = {'adamw': lambda: optax.adamw(1e-3), 'adamw_8bit': qt.adamw_8bit}
  for wname, (config, fmt, is_qt) in weights.items():
    module = _model(config)
    p = params
    if is_qt:
      p, _ = qt.quantize_params(params, [qt.Rule(fmt=fmt)])
    for oname, make in opts.items():
      tx = make() if oname == 'adamw' else make(1e-3)
      if is_qt:
        tx = qt.quantized_training(tx)
      rows[f'{wname} + {oname}'] = (module, p, tx)
  return rows


def _step(module, tx):
  def step(p, s, x, y):
    def loss_fn(w):
      logits = module.apply({'params': w}, x)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    loss, g = jax.value_and_grad(loss_fn)(qt.dequantize(p))
    u, s = tx.update(g, s, p)
    return qt.apply_updates(p, u), s, loss

  return step


def bench(rounds: int, steps: int) -> list[Row]:
  key = jax.random.key(0)
  x = jax.random.randint(key, (BATCH, SEQ), 0, VOCAB)
  y = jnp.roll(x, -1, axis=1)
  params = _model(None).init(key, x)['params']
  compiled, state, rows = {}, {}, {}
  for name, (module, p, tx) in _setups(params).items():
    s = tx.init(p)
    c = jax.jit(_step(module, tx), donate_argnums=(0, 1))
    c = c.lower(p, s, x, y).compile()
    mem = c.memory_analysis()
    peak = mem.argument_size_in_bytes + mem.temp_size_in_bytes
    rows[name] = Row(
      name,
      params_mb=qt.tree_bytes(p) / 2**20,
      opt_mb=qt.tree_bytes(s) / 2**20,
      peak_mb=peak / 2**20,
      step_ms=float('inf'),
    )
    compiled[name] = c
    state[name] = jax.tree.map(jnp.copy, (p, s))  # Unshared buffers.
  for _ in range(rounds):
    for name, c in compiled.items():
      p, s = state[name]
      p, s, loss = c(p, s, x, y)  # Warm-up / previous round's tail.
      jax.block_until_ready(loss)
      t = time.perf_counter()
      for _ in range(steps):
        p, s, loss = c(p, s, x, y)
      jax.block_until_ready(loss)
      dt = (time.perf_counter() - t) / steps
      state[name] = (p, s)
      rows[name].step_ms = min(rows[name].step_ms, dt * 1e3)
  return list(rows.values())


def table(rows: list[Row]) -> str:
  base = rows[0]
  lines = [
    '| weights + optimizer | step ms | x float | params MB | optimizer '
    'MB | param+opt MB | peak MB |',
    '|---|---:|---:|---:|---:|---:|---:|',
  ]
  for r in rows:
    lines.append(
      f'| {r.name} | {r.step_ms:.1f} | {base.step_ms / r.step_ms:.2f} | '
      f'{r.params_mb:.3f} | {r.opt_mb:.3f} | {r.params_mb + r.opt_mb:.3f} | '
      f'{r.peak_mb:.2f} |'
    )
  return '\n'.join(lines)


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument('--rounds', type=int, default=5)
  ap.add_argument('--steps', type=int, default=10)
  args = ap.parse_args(argv)
  print(table(bench(args.rounds, args.steps)))


if __name__ == '__main__':
  main()
