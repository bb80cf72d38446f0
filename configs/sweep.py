r"""Build an aqtr config from flags, print it, run one quantized step.

Needs `pip install -e '.[flags]'`. The `--config` flag is applied in order
(see aqtr/flags.py): a base `config:`, then any `fiddler:` and `set:`.

  python configs/sweep.py --config=config:int8 \
    --config=set:fwd.lhs.numerics.bits=4 \
    --config="fiddler:use_calibration('fwd\\..*', 'constant', bound=3.0)"

It prints the resolved tree (one line per node or leaf), then the relative
error of the forward output and of both gradients of x[M,K] . w[K,N]
against float32. `--import=FILE.py` loads your own algorithms first;
`--save=run.json` writes the config for `--config=config_file:run.json`.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
from absl import app, flags
from jax import lax

import aqtr
from aqtr import flags as aqtr_flags

_CONFIG = aqtr_flags.DEFINE_config()
_IMPORTS = aqtr_flags.DEFINE_imports()
_SHAPE = flags.DEFINE_list('shape', ['64', '128', '32'], 'M,K,N of the step.')
_SEED = flags.DEFINE_integer('seed', 0, 'PRNG seed of the data and noise.')
_SAVE = flags.DEFINE_string('save', None, 'Write the config as JSON here.')

DN = (((1,), (0,)), ((), ()))  # x[M,K] . w[K,N]


def step(
  config: aqtr.DotGeneralConfig, m: int, k: int, n: int, seed: int = 0
) -> dict[str, float]:
  """Relative errors of out, d lhs and d rhs of x . w vs float32."""
  kx, kw, kg, kn = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(kx, (m, k))
  w = jax.random.normal(kw, (k, n)) / jnp.sqrt(k)
  g = jax.random.normal(kg, (m, n))
  aqtr.validation.check_shapes(config, x.shape, w.shape, DN)

  def quantized(a, b):
    return aqtr.dot_general(a, b, DN, config, key=kn)

  def reference(a, b):
    return lax.dot_general(a, b, DN)

  errors = {}
  out, vjp = jax.vjp(jax.jit(quantized), x, w)
  ref, ref_vjp = jax.vjp(reference, x, w)
  grads, ref_grads = vjp(g), ref_vjp(g)
  pairs = {'out': (out, ref), 'dlhs': (grads[0], ref_grads[0])}
  pairs['drhs'] = (grads[1], ref_grads[1])
  for name, (a, b) in pairs.items():
    errors[name] = float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
  return errors


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  aqtr_flags.import_modules(_IMPORTS.value)
  try:
    m, k, n = (int(s) for s in _SHAPE.value)
  except ValueError:
    sys.exit(f'--shape: give three integers M,K,N, got {_SHAPE.value}.')
  try:
    cfg = _CONFIG.value
    if cfg is None:
      raise app.UsageError('Give a base config, e.g. --config=config:int8.')
    built = aqtr.fiddle.build(cfg)
    aqtr.validation.check_shapes(built, (m, k), (k, n), DN)
  except (ValueError, TypeError, KeyError, AttributeError) as e:
    sys.exit(f'config error: {e}')
  print(aqtr.fiddle.to_text(cfg))
  if _SAVE.value:
    with open(_SAVE.value, 'w') as f:
      f.write(aqtr.fiddle.dumps(cfg))
  errors = step(built, m, k, n, _SEED.value)
  print(f'# x[{m}x{k}] . w[{k}x{n}], relative error vs float32:')
  print('  '.join(f'{name} {err:.4f}' for name, err in errors.items()))


if __name__ == '__main__':
  app.run(main)
