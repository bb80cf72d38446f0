"""Decoding speed and memory: float vs int8 weights, float vs int8 KV cache.

The main job's LM architecture (`aqtr.train.models.lm`: pre-LayerNorm
blocks, untied logits, byte vocabulary 256) at a size where weights
dominate: d_model 512, 4 layers, 8 heads (head_dim 64), MLP 2048, learned
positions up to the longest context. Random weights (speed does not depend
on them). Rows:

  float w + float kv   the float model (TRAIN mode, no quantization)
  int8 w + float kv    frozen int8 weights (CONVERT -> SERVE, as
                       aqtr-train serves), float32 cache
  int8 w + int8 kv     the same weights, int8 cache read as the default
                       `read='auto'` does (int8 dots in decode steps)
  int8 w + int8 kv deq   int8 cache read by dequantizing
  int8 w + int8 kv dots  int8 cache, QK^T and PV as int8 x int8 dots
  int8 w + int4 kv     int4 cache (packed), dequantized
  int4 w + int8 kv     int4 weights (`presets.int4_weight_only`: float
                       activations), int8 cache; XLA hoists the weights'
                       decode to float32 out of the decode loop, so the
                       loop runs float dots on a float32 copy it holds
  w4a8 + int8 kv       int4 weights, int8 activations (`w4a8` below): an
                       int8 dot on codes widened to int8 (hoisted out of
                       the loop: the call holds an int8 copy)

The bandwidth limit of a cell: the bytes a step must read (weights + the
whole cache) over the memory bandwidth measured in the same process (the
faster of a jitted and a NumPy sum over 256 MiB of float32, measured after
every round and the best kept), as tokens/s;
`x limit` is the cell's tokens/s over it (1.0: at the limit; the targets
ask for >= 0.5). With a 32 MiB L3 cache the int8 weights (13 MiB) stay in
cache between steps, so a cell may beat the DRAM limit.

The dot limit (`dot_limit`, printed after the table): the step's weight
dots alone, chained in one jitted call on fresh weights of the model's
shapes and bytes (float32 dots of `batch` rows; int8 x int8 -> int32 dots
as the engine runs them: the native few-row dot where it runs, else XLA's
of max(batch, 2) rows), no quantization,
attention or cache. `int8 dots x float` is the most an int8-weight step
could gain over float with the dot kernels it runs.

Each cell decodes `--steps` tokens per sequence after an 8-token prompt,
with a cache of `context` slots: the cache has a fixed size and every step
reads all of its slots (masked), so a step costs the same at any fill.
tokens/s counts all sequences of the batch; times are the decode loop
only (`lax.while_loop` under jit, compiled ahead), minimum over
`--rounds` interleaved rounds (every cell once per round, in turn).
`cpu ms/step` is the process CPU time of the loop (all threads, minimum
over the rounds) and `cpu x float` the float row's over the cell's: on a
host shared with other jobs, where a cell's wall time also counts the
time it waited for a core, the steadier ratio.

Run: python benchmarks/decode.py [--rounds 3] [--steps 32] [--rows 'int8 w'
...] (the load average is printed: the host is shared, compare ratios of
one run)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
import time

import decode_dots
import host
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import aqtr
import aqtr.flax.linen as aqtr_linen
from aqtr.core import native_dot
from aqtr.flax import common
from aqtr.freezers import Mode
from aqtr.pax import decode
from aqtr.pax.kv_cache import KVCacheConfig
from aqtr.train import models


def bandwidth() -> float:
  """Memory read bandwidth in bytes/s: the faster of a jitted and a NumPy
  sum over 256 MiB of float32 (best of 5 each)."""
  x = np.ones((64, 2**20), np.float32)
  jitted = jax.jit(jnp.sum)
  xj = jnp.asarray(x)
  runs = [(jitted, xj), (np.sum, x)]
  best = float('inf')
  for f, a in runs:
    jax.block_until_ready(f(a))
    for _ in range(5):
      t = time.perf_counter()
      jax.block_until_ready(f(a))
      best = min(best, time.perf_counter() - t)
  return x.nbytes / best


def dot_limit(
  d_model: int, layers: int, batch: int, vocab: int = 256, rounds: int = 5
) -> dict[str, float]:
  """Seconds per step of the step's weight dots alone, as XLA:CPU runs them.

  One jitted chain of the model's weight-dot shapes (q, k, v, o: d x d;
  MLP: d x 4d, 4d x d; logits: d x vocab, per layer), each dot's output
  feeding the next input, on fresh weights of the same bytes as the
  model's: 'float' float32 dots of `batch` rows; 'int8' int8 x int8 ->
  int32 dots against weights stored [N, K], as frozen integer-dot
  weights are (`aqtr.freezers.weights.minor_k`), by the native few-row
  dot where the engine takes it (`aqtr.core.native_dot`), else XLA's of
  max(batch, 2) rows (the engine runs a one-row integer dot as two). No
  quantization, attention or cache: the step time a cell could reach with
  these dot kernels (min of `rounds`).
  """
  rng = np.random.default_rng(0)
  shapes = [(d_model, d_model)] * 4 + [(d_model, 4 * d_model)]
  shapes = shapes + [(4 * d_model, d_model)]
  shapes = shapes * layers + [(d_model, vocab)]
  native = native_dot.ready() and batch <= native_dot.max_rows()
  rows = {'float': batch, 'int8': batch if native else max(batch, 2)}
  dtypes = {'float': jnp.float32, 'int8': jnp.int8}

  def chain(x, ws):
    for w in ws:
      k = 1 if x.dtype == jnp.int8 else 0  # int8: stored [N, K].
      if x.shape[1] != w.shape[k]:  # Feeds the output back (any K).
        x = jnp.tile(x, (1, w.shape[k] // x.shape[1] + 1))[:, : w.shape[k]]
      if k and native_dot.usable(x[None], w[None]):  # As the engine runs.
        y = native_dot.rows_dot(x[None], w[None])[0]
      else:
        y = lax.dot_general(
          x, w, (((1,), (k,)), ((), ())), preferred_element_type=y_dtype(x)
        )
      x = y.astype(x.dtype)
    return x

  def y_dtype(x):
    return jnp.int32 if x.dtype == jnp.int8 else jnp.float32

  best = {}
  calls = {}
  for kind, dt in dtypes.items():
    stored = shapes if kind == 'float' else [s[::-1] for s in shapes]
    ws = [jnp.asarray(rng.integers(-127, 128, s), dt) for s in stored]
    x = jnp.ones((rows[kind], d_model), dt)
    calls[kind] = (jax.jit(chain).lower(x, ws).compile(), x, ws)
    best[kind] = float('inf')
  for _ in range(rounds):
    for kind, (f, x, ws) in calls.items():
      jax.block_until_ready(f(x, ws))
      t = time.perf_counter()
      for _ in range(10):
        out = f(x, ws)
      jax.block_until_ready(out)
      best[kind] = min(best[kind], (time.perf_counter() - t) / 10)
  return best


def _frozen(template, params, config, x):
  injected, _ = models.inject(template, config)
  conv = models.build(models.serving_template(injected, Mode.CONVERT))
  served = jax.jit(lambda v: aqtr_linen.convert(conv, v, x))(params)
  lm = models.build(models.serving_template(injected, Mode.SERVE))
  return lm, served


def models_by_weights(max_len: int, d_model: int, layers: int, heads: int):
  template = models.lm(
    vocab_size=256,
    seq_len=max_len,
    d_model=d_model,
    num_layers=layers,
    num_heads=heads,
  )
  x = jnp.zeros((1, max_len), jnp.int32)
  float_lm = models.build(template)
  params = jax.jit(float_lm.init)(jax.random.key(0), x)
  return {
    'float': (float_lm, params),
    'int8': _frozen(template, params, aqtr.presets.int8(), x),
    'int4': _frozen(template, params, aqtr.presets.int4_weight_only(), x),
    'w4a8': _frozen(template, params, w4a8(), x),
  }


def w4a8() -> aqtr.DotGeneralConfig:
  """int4 weights x int8 activations: `aqtr.presets.w4a8()`, composed
  here for an aqtr tree older than the preset (`before_after.py`)."""
  if hasattr(aqtr.presets, 'w4a8'):
    return aqtr.presets.w4a8()
  w4 = aqtr.presets.int4_weight_only()
  a8 = aqtr.presets.int8().fwd.lhs
  return dataclasses.replace(w4, fwd=dataclasses.replace(w4.fwd, lhs=a8))


ROWS = [
  ('float w + float kv', 'float', KVCacheConfig()),
  ('int8 w + float kv', 'int8', KVCacheConfig()),
  ('int8 w + int8 kv', 'int8', KVCacheConfig(numerics='int8')),
  (
    'int8 w + int8 kv deq',
    'int8',
    KVCacheConfig(numerics='int8', read='dequantize'),
  ),
  (
    'int8 w + int8 kv dots',
    'int8',
    KVCacheConfig(numerics='int8', read='int8_dots'),
  ),
  ('int8 w + int4 kv', 'int8', KVCacheConfig(numerics='int4')),
  ('int4 w + int8 kv', 'int4', KVCacheConfig(numerics='int8')),
  ('w4a8 + int8 kv', 'w4a8', KVCacheConfig(numerics='int8')),
]


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--rounds', type=int, default=3)
  p.add_argument('--steps', type=int, default=32)
  p.add_argument('--batches', type=int, nargs='+', default=[1, 8])
  p.add_argument('--contexts', type=int, nargs='+', default=[256, 1024])
  p.add_argument('--d_model', type=int, default=512)
  p.add_argument('--layers', type=int, default=4)
  p.add_argument('--heads', type=int, default=8)
  decode_dots.row_options(p)
  args = p.parse_args()
  rows = decode_dots.chosen_rows(ROWS, args.rows)
  print(f'CPU: {host.cpu_model()}; jax {jax.__version__}; {jax.devices()[0]}')
  print(
    f'CPU flags: {host.cpu_flags()}; native few-row int dot: '
    f'{"yes" if native_dot.ready() else "no"}'
  )
  print(f'command: python benchmarks/decode.py {" ".join(sys.argv[1:])}')
  print(f'date: {datetime.date.today()}')
  weights = models_by_weights(
    max(args.contexts), args.d_model, args.layers, args.heads
  )
  wbytes = {k: common.nbytes(v) for k, (_, v) in weights.items()}
  rng = np.random.default_rng(0)
  cells, decoders = [], {}
  for context in args.contexts:
    for batch in args.batches:
      prompt = min(8, context - args.steps)
      prompts = rng.integers(0, 256, (batch, prompt)).tolist()
      for label, w, kv in rows:
        cells.append((label, w, kv, batch, context, prompts))
  best: dict = {}
  cpu: dict = {}  # Process CPU seconds of the decode loop, min over rounds.
  bw = 0.0
  for r in range(args.rounds):
    for label, w, kv, batch, context, prompts in cells:
      lm, variables = weights[w]
      key = (w, kv, context)
      if key not in decoders:
        decoders[key] = decode.Decoder(lm, length=context, kv=kv)
      out = decoders[key].generate(variables, prompts, args.steps + 1)
      assert len(out.tokens[0]) == args.steps + 1, out.stopped
      cell = (label, batch, context)
      if cell not in best or out.decode_s < best[cell][0].decode_s:
        best[cell] = (out, w)
      cpu[cell] = min(cpu.get(cell, float('inf')), out.decode_cpu_s)
    bw = max(bw, bandwidth())  # Each round: the best under this load.
    print(f'round {r + 1}/{args.rounds} done', flush=True)
  if args.json:
    for label, batch, context in best:
      out = best[(label, batch, context)][0]
      base = best[('float w + float kv', batch, context)][0]
      c = cpu[(label, batch, context)]
      c0 = cpu[('float w + float kv', batch, context)]
      row = {'row': label, 'batch': str(batch), 'context': str(context)}
      decode_dots.json_row(row, out, base, c, c0, args.steps)
    return
  dots = {b: dot_limit(args.d_model, args.layers, b) for b in args.batches}
  print(
    f'memory bandwidth: {bw / 1e9:.1f} GB/s (256 MiB sum, best of the rounds)'
  )
  print(f'load average (1, 5, 15 min): {os.getloadavg()}')
  print(
    f'\nd_model {args.d_model}, {args.layers} layers, {args.heads} heads; '
    f'{args.steps} decode steps per cell; min of {args.rounds} rounds\n'
  )
  print(
    '| weights + cache | batch | context | tokens/s | x float | ms/step '
    '| weight MB | KV MB | KV x f32 | limit tokens/s | x limit '
    '| cpu ms/step | cpu x float |'
  )
  print('|---|---|---|---|---|---|---|---|---|---|---|---|---|')
  for context in args.contexts:
    for batch in args.batches:
      base = best[('float w + float kv', batch, context)][0]
      base_cpu = cpu[('float w + float kv', batch, context)]
      for label, _, _ in rows:
        out, w = best[(label, batch, context)]
        ms = 1e3 * out.decode_s / args.steps
        c = cpu[(label, batch, context)]
        limit = batch * bw / (wbytes[w] + out.kv_bytes)
        print(
          f'| {label} | {batch} | {context} | {out.tokens_per_s:.0f} | '
          f'{out.tokens_per_s / base.tokens_per_s:.2f} | {ms:.2f} | '
          f'{wbytes[w] / 2**20:.1f} | {out.kv_bytes / 2**20:.2f} | '
          f'{out.kv_bytes / base.kv_bytes:.3f} | {limit:.0f} | '
          f'{out.tokens_per_s / limit:.2f} | {1e3 * c / args.steps:.2f} | '
          f'{base_cpu / c:.2f} |'
        )
  print(
    "\nWeight dots alone (`dot_limit`: the step's weight-dot shapes "
    'chained, no quantization, attention or cache):\n'
  )
  print('| batch | float dots ms | int8 dots ms | int8 dots x float |')
  print('|---|---|---|---|')
  for b in args.batches:
    f, i = dots[b]['float'], dots[b]['int8']
    print(f'| {b} | {1e3 * f:.2f} | {1e3 * i:.2f} | {f / i:.2f} |')


if __name__ == '__main__':
  main()
