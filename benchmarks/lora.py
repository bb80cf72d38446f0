"""LoRA / QLoRA vs full fine-tuning: bytes and step time.

`--model=stock`: the stock nnx Llama-style LM of `aqtr.train.stock_lm`
(bytes, vocab 256, 2 blocks, d_model 128, 4 heads, SwiGLU 512, tied
embedding); `--model=pax`: the main job's LM (`aqtr.train.models.lm`, an
`aqtr.pax` template: 2 blocks, d_model 128, 4 heads, GELU 512, untied;
adapters injected into the template). Batch 16 x 128 random tokens, one
jitted step (forward, backward, AdamW update) as:

  full        every parameter float, AdamW on all of them
  lora        r=8 adapters on every block projection, float base frozen
  qlora_nf4   the same adapters; base nf4 (g64) as 4-bit codes, scales
              double-quantized (8 bits, 256 per block)
  qlora_nf4_fp32_scales   the same without double quantization

Columns: median step time over interleaved rounds (ms; same process),
its ratio to full fine-tuning, the same in process CPU time (all
threads; steadier than wall time on a shared machine), and bytes
(`aqtr.lora.sizes`): trainable adapters, AdamW state, the frozen adapted
weights as stored (bits per weight), the other float parameters
(embedding, norms), and the training total (adapters + optimizer +
frozen base + other) over full fine-tuning's (float weights + two AdamW
moments). Last line: QLoRA's step over LoRA's, wall (cpu).

Run: python benchmarks/lora.py [--model=stock|pax] [--rounds 5] [--steps 5]
  [--json]
(`--json`: the median step times, one JSON row per run, for
benchmarks/before_after.py and benchmarks/perf_targets.py.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import host
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from aqtr import lora
from aqtr.train import models
from aqtr.train.stock_lm import StockLm

BATCH, SEQ, VOCAB = 16, 128, 256
CONFIGS = {
  'lora': lora.LoraConfig(rank=8),
  'qlora_nf4': lora.LoraConfig(rank=8, base='nf4', double_quant=True),
  'qlora_nf4_fp32_scales': lora.LoraConfig(rank=8, base='nf4'),
}


def _setups_stock(x):
  """{run: (apply(p, rest, x), trainable, rest, sizes or None)}."""
  model = StockLm(VOCAB, 128, 2, 4, rngs=nnx.Rngs(0))
  out = {}
  for name, cfg in {'full': None, **CONFIGS}.items():
    m = model if cfg is None else lora.attach(model, {'.*blocks.*': cfg}, x[:1])
    graphdef, p, rest = nnx.split(
      m, nnx.Param if cfg is None else lora.Adapter, ...
    )

    def apply(p, rest, x, graphdef=graphdef):
      return nnx.merge(graphdef, p, rest)(x)

    out[name] = (apply, p, rest, None if cfg is None else lora.sizes(m, x[:1]))
  return out


def _setups_pax(x):
  """As `_setups_stock`, for the main job's Pax LM template."""
  template = models.lm(VOCAB, SEQ, 128, 2, 4)
  variables = jax.jit(models.build(template).init)(jax.random.key(0), x[:1])
  full = models.build(template)
  out = {
    'full': (
      lambda p, rest, x: full.apply({'params': p}, x),
      variables['params'],
      {},
      None,
    )
  }
  for name, cfg in CONFIGS.items():
    lt, lv = lora.attach(
      template, {'layers.*': cfg}, x[:1], variables=variables
    )
    module = models.build(lt)
    p, frozen = lora.partition(lv['params'])

    def apply(p, rest, x, module=module):
      return module.apply(dict(rest, params=lora.combine(p, rest['params'])), x)

    sizes = lora.sizes(lt, x[:1], variables=lv)
    out[name] = (apply, p, dict(lv, params=frozen), sizes)
  return out


def _step(apply, tx):
  def step(p, rest, o, x, y):
    def loss(p):
      logits = apply(p, rest, x)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    value, g = jax.value_and_grad(loss)(p)
    upd, o = tx.update(g, o, p)
    return optax.apply_updates(p, upd), o, value

  return step


def bench(rounds: int, steps: int, model: str = 'stock'):
  key = jax.random.key(0)
  x = jax.random.randint(key, (BATCH, SEQ), 0, VOCAB)
  y = jnp.roll(x, -1, axis=1)
  tx = optax.adamw(1e-3)
  compiled, state, times, cpu, sizes = {}, {}, {}, {}, {}
  setups = _setups_pax(x) if model == 'pax' else _setups_stock(x)
  for name, (apply, p, rest, sz) in setups.items():
    o = tx.init(p)
    c = jax.jit(_step(apply, tx), donate_argnums=(0, 2))
    compiled[name] = c.lower(p, rest, o, x, y).compile()
    state[name] = jax.tree.map(jnp.copy, (p, rest, o))  # Unshared buffers.
    times[name], cpu[name] = [], []
    sizes[name] = sz
  for _ in range(rounds):
    for name, c in compiled.items():
      p, rest, o = state[name]
      p, o, loss = c(p, rest, o, x, y)
      jax.block_until_ready(loss)
      t, u = time.perf_counter(), time.process_time()
      for _ in range(steps):
        p, o, loss = c(p, rest, o, x, y)
      jax.block_until_ready(loss)
      times[name].append((time.perf_counter() - t) / steps * 1e3)
      cpu[name].append((time.process_time() - u) / steps * 1e3)
      state[name] = (p, rest, o)
  med = {
    n: (statistics.median(times[n]), statistics.median(cpu[n])) for n in times
  }
  return med, sizes


def table(times, sizes, model: str = 'stock') -> str:
  """Markdown rows; `times`: {run: (wall ms, process CPU ms)} per step."""
  full = next(s for s in sizes.values() if s is not None).full
  fw, fc = times['full']
  lines = [
    f'Host: {host.cpu_model()}; model: {model}; load average '
    f'{host.load_average()}',
    '',
    '| run | step ms | x full | cpu ms | cpu x full | trainable B | AdamW B '
    '| frozen base B | bits/base weight | other B | total / full FT |',
    '|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|',
  ]
  for name, (ms, cms) in times.items():
    s = sizes[name]
    head = f'| {name} | {ms:.1f} | {ms / fw:.2f} | {cms:.1f} | {cms / fc:.2f} '
    if s is None:
      lines.append(head + f'| {full // 3} | {2 * full // 3} | | 32 | | 1.000 |')
      continue
    lines.append(
      head + f'| {s.adapters} | {s.optimizer} | {s.base} | '
      f'{s.base_bits:.3f} | {s.other} | {s.ratio:.3f} |'
    )
  if 'lora' in times and 'qlora_nf4' in times:
    (lw, lc), (qw, qc) = times['lora'], times['qlora_nf4']
    lines += ['', f'qlora_nf4 / lora: {qw / lw:.2f} (cpu {qc / lc:.2f})']
  return '\n'.join(lines)


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument('--model', choices=('stock', 'pax'), default='stock')
  ap.add_argument('--rounds', type=int, default=5)
  ap.add_argument('--steps', type=int, default=5)
  ap.add_argument(
    '--json',
    action='store_true',
    help='one JSON row per run, step times only (for before_after.py)',
  )
  args = ap.parse_args(argv)
  times, sizes = bench(args.rounds, args.steps, args.model)
  if args.json:
    for name, (ms, cpu_ms) in times.items():
      row = {'model': args.model, 'run': name, 'ms': ms, 'cpu_ms': cpu_ms}
      print(json.dumps(row))
    return
  print(table(times, sizes, args.model))


if __name__ == '__main__':
  main()
