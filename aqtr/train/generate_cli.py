"""`aqtr-generate`: text from an `aqtr-train` LM run's serving checkpoint.

Restores the frozen int8/fp8 weights of `<out>/<run>/serving` (written by
`aqtr-train` for every weight-quantized LM run), or with `--checkpoint` a
stock LM's quantized checkpoint (`aqtr.train.generate_stock`), decodes
each prompt with a float or quantized KV cache, and prints the text, the
decode throughput and the memory of the weights and of the cache.

  aqtr-generate --serving=aqtr_train_out/NAME/int8/serving \\
    --prompt='def __init__(self' --max_new=40
  aqtr-generate --serving=... --prompt='import ' --prompt='class ' \\
    --kv=int8 --kv_read=int8_dots --temperature=0.8 --top_k=20 --seed=1
  aqtr-generate --serving=... --kv=int4 --kv_scales=block --kv_block=8
  aqtr-generate --checkpoint=FOLDER --ids=5,9,2 --kv=int8  # a stock LM

Exit status: 0 text generated; 2 a mistake (one line on stderr naming the
flag or the file, no traceback).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

from absl import app, flags

from aqtr.pax import decode, kv_cache
from aqtr.train import generate, generate_stock

_FLAGS: dict[str, flags.FlagHolder] = {}


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> dict:
  """Defines the command's flags once; returns their holders by name."""
  if _FLAGS:
    return _FLAGS
  d = {
    'string': flags.DEFINE_string,
    'multi': flags.DEFINE_multi_string,
    'int': flags.DEFINE_integer,
    'float': flags.DEFINE_float,
    'enum': flags.DEFINE_enum,
  }
  specs = [
    ('string', 'serving', None, 'The serving folder <out>/<run>/serving.'),
    (
      'string',
      'checkpoint',
      None,
      'A stock LM checkpoint folder (aqtr.checkpoints.export of a Hugging '
      'Face Flax LM) instead of --serving.',
    ),
    ('multi', 'ids', [], 'Prompt token ids 5,9,2 (--checkpoint); repeat.'),
    ('multi', 'prompt', [generate.PROMPT], 'Prompt text; repeat for a batch.'),
    ('int', 'max_new', 40, 'New tokens (bytes) per prompt, >= 1.'),
    ('float', 'temperature', 0.0, '0: greedy; else sample logits / T.'),
    ('int', 'top_k', 0, 'Sample among the k likeliest tokens (0: all).'),
    ('int', 'seed', 0, 'Sampling seed.'),
    ('int', 'cache_len', 0, 'Cache slots (0: the model max_len).'),
    ('string', 'kv', 'none', f'KV cache numerics: {kv_cache.NUMERICS}.'),
    ('string', 'kv_scales', 'token', f'KV scales: {kv_cache.SCALES}.'),
    ('int', 'kv_block', 16, 'Slots per scale with --kv_scales=block.'),
    ('string', 'kv_read', 'auto', f'KV read: {kv_cache.READS}.'),
    ('float', 'kv_bound', 0.0, 'A static bound (> 0) instead of absmax.'),
  ]
  for kind, name, default, help_ in specs:
    _FLAGS[name] = d[kind](name, default, help_, flag_values=flag_values)
  return _FLAGS


def _fail(message: str) -> None:
  print(f'aqtr-generate: {message}', file=sys.stderr, flush=True)
  sys.exit(2)


def _kv(f: dict) -> kv_cache.KVCacheConfig:
  b = f['kv_bound'].value
  if b != 0 and not (math.isfinite(b) and b > 0):
    raise ValueError(
      f'--kv_bound must be a finite bound > 0 (static scales) or 0 (absmax '
      f'per token), got {b}'
    )
  static = b > 0
  return kv_cache.KVCacheConfig(
    numerics=f['kv'].value,
    scales=f['kv_scales'].value,
    block_size=f['kv_block'].value,
    calibration='static' if static else 'absmax',
    bound=f['kv_bound'].value,
    read=f['kv_read'].value,
  )


def run(f: dict) -> None:
  """Generates and prints; ValueError (one line) on any mistake."""
  if not (f['serving'].value or f['checkpoint'].value):
    raise ValueError('--serving: give <out>/<run>/serving of an aqtr-train run')
  for name in ('max_new', 'top_k', 'seed', 'cache_len'):
    low = 1 if name == 'max_new' else 0
    if f[name].value < low:
      raise ValueError(f'--{name} must be >= {low}, got {f[name].value}')
  t = f['temperature'].value
  if not (math.isfinite(t) and t >= 0):
    raise ValueError(
      f'--temperature must be a finite number >= 0 (0: greedy), got {t}'
    )
  if f['checkpoint'].value:
    generate_stock.run(f)
    return
  try:
    kv = _kv(f)
  except ValueError as e:
    raise ValueError(f'--kv*: {e}') from e
  served = generate.load(f['serving'].value)
  dec = generate.decoder(served.model, kv, f['cache_len'].value or None)
  sampling = decode.Sampling(
    temperature=f['temperature'].value,
    top_k=f['top_k'].value,
    seed=f['seed'].value,
  )
  prompts = f['prompt'].value
  out = dec.generate(
    served.variables,
    [generate.encode(p) for p in prompts],
    f['max_new'].value,
    sampling,
  )
  for prompt, tokens in zip(prompts, out.tokens, strict=True):
    print(f'--- {prompt!r}')
    print(prompt + generate.text(tokens))
  if out.stopped:
    print(f'note: {out.stopped}')
  b, n = len(prompts), len(out.tokens[0])
  print(
    f'speed: {out.tokens_per_s:.1f} tokens/s decoding (batch {b}, {n} new '
    f'tokens each; prefill + first token {out.prefill_s:.3f} s; compile '
    f'{out.compile_s:.1f} s)'
  )
  per_token = out.kv_bytes / (b * dec.length)
  print(
    f'memory: weights {served.weight_bytes / 1024:.1f} KB (serving '
    f'variables), KV cache {out.kv_bytes / 1024:.1f} KB ({kv.numerics}, '
    f'{dec.length} slots x {b} sequences, {per_token:.0f} B per token)'
  )


def _main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    _fail(f'unexpected arguments: {" ".join(argv[1:])} (flags: --help)')
  try:
    run(define_flags())
  except ValueError as e:
    _fail(' '.join(str(e).split()))


def main(argv: Sequence[str] | None = None) -> None:
  """Entry point of `aqtr-generate` (`python -m aqtr.train.generate_cli`)."""
  argv = list(sys.argv if argv is None else argv)
  define_flags()
  launcher = sys.modules.get('__main__')
  if launcher is not None and not launcher.__doc__:
    launcher.__doc__ = __doc__
  for holder in _FLAGS.values():
    flags.FLAGS.register_key_flag_for_module(argv[0], flags.FLAGS[holder.name])
  if not any(a.startswith(('--verbosity', '-v', '--v=')) for a in argv):
    argv.insert(1, '--verbosity=-1')  # absl WARNING: no orbax INFO lines.
  try:
    app.run(_main, argv=argv)
  except KeyboardInterrupt:
    _fail('interrupted')


if __name__ == '__main__':
  main()
