"""Decoding a stock LM (Hugging Face Flax Llama) through its own cache.

`aqtr.flax.decode.Decoder` on `transformers.FlaxLlamaForCausalLM`, random
weights, at the size of `benchmarks/decode.py` (hidden 512, 4 layers, 8
heads of 64, MLP 2048, vocabulary 256). Rows:

  float w + float kv    the float model, its float cache
  int8 w + ...          `aqtr.flax.quantize(module, Rule('int8',
                        weight=True))` on the blocks' projections (the
                        attention's own dots stay float),
                        `aqtr.flax.convert` (frozen int8 weights); the
                        cache stored by `CacheRule`:
                        float, int8 per token, int8 per 32-slot block,
                        packed int4 per token
  int4 w + int8 kv      `presets.int4_weight_only()` on every dot of the
                        blocks (the attention's too)
  w4a8 + float kv       int4 weights x int8 activations (`decode.w4a8()`)
                        on the projections' weights, as the int8 rows

Each cell decodes `--steps` greedy tokens after an 8-token prompt with a
cache of `--context` slots; tokens/s of the decode loop (compiled ahead),
minimum over `--rounds` interleaved rounds. The stored cache is
dequantized and requantized whole at each step (the model's own attention
reads floats), so a quantized cache costs time here; it saves memory.
`weight MB held`: the bytes the arrays hold on this backend (XLA:CPU
keeps an int4 code in a byte).

Run: python benchmarks/decode_stock.py [--rounds 3] [--context 256]
     [--hidden 512 --layers 4 --heads 8] [--rows 'int8 w + int8 kv'] [--json]
"""

from __future__ import annotations

import argparse
import datetime
import sys

import decode_dots
import host
import jax
import jax.numpy as jnp
import numpy as np
import transformers
from decode import w4a8

import aqtr
import aqtr.flax
from aqtr.flax import kv_cache
from aqtr.flax.decode import Decoder
from aqtr.rules import Rule

CacheRule = kv_cache.CacheRule


def models(context: int, hidden: int = 512, layers: int = 4, heads: int = 8):
  cfg = transformers.LlamaConfig(
    vocab_size=256,
    hidden_size=hidden,
    intermediate_size=4 * hidden,
    num_hidden_layers=layers,
    num_attention_heads=heads,
    num_key_value_heads=heads,
    max_position_embeddings=context,
  )
  with jax.numpy_rank_promotion('allow'):
    hf = transformers.FlaxLlamaForCausalLM(cfg, seed=0)
  ids = jnp.ones((1, 8), jnp.int32)
  pos = jnp.arange(8)[None]
  out = {'float': (hf.module, {'params': hf.params})}
  for name, config in [
    ('int8', aqtr.presets.int8()),
    ('int4', aqtr.presets.int4_weight_only()),
    ('w4a8', w4a8()),
  ]:
    # int8: the projections' weights only (the attention's own dots, over
    # the whole cache, stay float as in benchmarks/decode.py). int4: every
    # dot of the blocks, as before (weight=True makes convert's serve ==
    # train check fail by 6 ULP on this model: reported, not yet fixed).
    weight = None if name == 'int4' else True
    rule = Rule(config, path='.*/layers/.*', weight=weight)
    q = aqtr.flax.quantize(hf.module, [rule])
    with jax.numpy_rank_promotion('allow'):
      out[name] = aqtr.flax.convert(
        q, ids, ids, pos, variables={'params': hf.params}
      )
  return out


ROWS = [
  ('float w + float kv', 'float', CacheRule(numerics='none')),
  ('int8 w + float kv', 'int8', CacheRule(numerics='none')),
  ('int8 w + int8 kv', 'int8', CacheRule(numerics='int8')),
  ('int8 w + int8 kv /32 slots', 'int8', CacheRule(numerics='int8', block=32)),
  ('int8 w + int4 kv', 'int8', CacheRule(numerics='int4')),
  ('int4 w + int8 kv', 'int4', CacheRule(numerics='int8')),
  ('w4a8 + float kv', 'w4a8', CacheRule(numerics='none')),
]


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--rounds', type=int, default=3)
  p.add_argument('--steps', type=int, default=32)
  p.add_argument('--batches', type=int, nargs='+', default=[1, 8])
  p.add_argument('--context', type=int, default=256)
  p.add_argument('--hidden', type=int, default=512, help='MLP: 4x hidden')
  p.add_argument('--layers', type=int, default=4)
  p.add_argument('--heads', type=int, default=8)
  decode_dots.row_options(p)
  args = p.parse_args()
  rows = decode_dots.chosen_rows(ROWS, args.rows)
  print(
    f'CPU: {host.cpu_model()}; flags: {host.cpu_flags()}; jax {jax.__version__}'
  )
  print(f'command: python benchmarks/decode_stock.py {" ".join(sys.argv[1:])}')
  print(f'date: {datetime.date.today()}')
  weights = models(args.context, args.hidden, args.layers, args.heads)
  wbytes = {k: kv_cache.cache_bytes(v) for k, (_, v) in weights.items()}
  rng = np.random.default_rng(0)
  decoders, best, cpu = {}, {}, {}
  with jax.numpy_rank_promotion('allow'):
    for r in range(args.rounds):
      for batch in args.batches:
        prompts = rng.integers(0, 256, (batch, 8)).tolist()
        for label, w, rule in rows:
          module, variables = weights[w]
          key = (label, batch)
          if key not in decoders:
            decoders[key] = Decoder(module, length=args.context, kv=rule)
          out = decoders[key].generate(variables, prompts, args.steps + 1)
          if key not in best or out.decode_s < best[key].decode_s:
            best[key] = out
          cpu[key] = min(cpu.get(key, float('inf')), out.decode_cpu_s)
      print(f'round {r + 1}/{args.rounds} done', flush=True)
  if args.json:
    for (label, batch), out in best.items():
      base = best[('float w + float kv', batch)]
      c0 = cpu[('float w + float kv', batch)]
      c = cpu[(label, batch)]
      row = {'row': label, 'batch': str(batch)}
      decode_dots.json_row(row, out, base, c, c0, args.steps)
    return
  print(
    f'\nFlaxLlamaForCausalLM hidden {args.hidden}, {args.layers} layers, '
    f'{args.heads} heads, MLP {4 * args.hidden}; '
    f'{args.context} slots; {args.steps} steps; min of {args.rounds}\n'
  )
  print(
    '| weights + cache | batch | tokens/s | x float | ms/step | weight MB held '
    '| KV MB | KV x f32 |'
  )
  print('|---|---|---|---|---|---|---|---|')
  for batch in args.batches:
    base = best[('float w + float kv', batch)]
    for label, w, _ in rows:
      out = best[(label, batch)]
      print(
        f'| {label} | {batch} | {out.tokens_per_s:.0f} | '
        f'{out.tokens_per_s / base.tokens_per_s:.2f} | '
        f'{1e3 * out.decode_s / args.steps:.2f} | {wbytes[w] / 2**20:.1f} | '
        f'{out.kv_bytes / 2**20:.2f} | {out.kv_bytes / base.kv_bytes:.3f} |'
      )


if __name__ == '__main__':
  main()
