"""Serving-tree bytes of converted models, per weight format.

For a stock nnx MLP and a real third-party model (Hugging Face Flax Llama
from `tests/models/zoo.py`, the `models` extra), each weight format is
applied to every weight op (`aqtr.flax.quantize` + `convert`, which checks
serve == train bit for bit under jit) and the table gives, over the float
tree's bytes:

- device: the bytes the serving tree's arrays hold on the device (what
  `x.nbytes` reports: a `jnp.int4` array takes one byte per value on
  XLA:CPU);
- sizes: the serving bytes `aqtr.flax.sizes` reports;
- kernels: `sizes`' frozen kernel bytes over the float kernels it removed.

  python benchmarks/serving_bytes.py
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, '..', 'tests', 'models'))

import jax  # noqa: E402
from flax import nnx  # noqa: E402

import aqtr  # noqa: E402
import aqtr.flax as af  # noqa: E402
from aqtr.flax import Rule  # noqa: E402
from aqtr.lora.config import nf4  # noqa: E402

FORMATS = {
  'int8': lambda: Rule('int8_weight_only', weight=True),
  'int4': lambda: Rule('int4_weight_only', weight=True),
  'nf4 g64': lambda: Rule(nf4(64), weight=True),
  'fp8': lambda: Rule('fp8', weight=True),
  'nvfp4': lambda: Rule('nvfp4', weight=True),
}


def _cpu() -> str:
  try:
    out = subprocess.run(['lscpu'], capture_output=True, text=True).stdout
  except OSError:
    return platform.processor()
  return next(
    (
      ln.split(':', 1)[1].strip()
      for ln in out.splitlines()
      if 'Model name' in ln
    ),
    '?',
  )


def _device_bytes(tree) -> int:
  return sum(
    int(x.nbytes) for x in jax.tree.leaves(tree) if hasattr(x, 'nbytes')
  )


class Mlp(nnx.Module):
  """A stock nnx MLP (nnx.Linear layers, biases)."""

  def __init__(self, d=256, h=1024, rngs=None):
    self.up = nnx.Linear(d, h, rngs=rngs)
    self.mid = nnx.Linear(h, h, rngs=rngs)
    self.down = nnx.Linear(h, d, rngs=rngs)

  def __call__(self, x):
    return self.down(jax.nn.relu(self.mid(jax.nn.relu(self.up(x)))))


def _nnx_row(fmt):
  model = Mlp(rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (4, 256))
  float_b = _device_bytes(nnx.state(model))
  q = af.quantize(model, [FORMATS[fmt]()])
  served = af.convert(q, x)  # Raises unless serve == train.
  s = af.sizes(served)
  return _device_bytes(nnx.state(served)) / float_b, s, float_b


def _linen_row(z, fmt):
  mod = z.build()
  x = z.sample()
  v = jax.jit(mod.init)(jax.random.key(0), x)
  float_b = _device_bytes(v)
  q = af.quantize(mod, [FORMATS[fmt]()])
  sm, sv = af.convert(q, x, variables=v)
  s = af.sizes(sm, sv)
  return _device_bytes(sv) / float_b, s, float_b


def main():
  import zoo  # noqa: PLC0415

  warnings.simplefilter('ignore', UserWarning)
  print('command: python benchmarks/serving_bytes.py')
  print(f'aqtr: {os.path.dirname(aqtr.__file__)}')
  print(f'CPU: {_cpu()}; jax {jax.__version__}; {datetime.date.today()}')
  print()
  print('| model | format | device / float | sizes / float | kernels |')
  print('|---|---|---|---|---|')
  real = {z.name: z for z in zoo.MODELS}['hf_llama_gqa']
  for name, row in (('nnx MLP', _nnx_row), ('hf_llama_gqa', None)):
    for fmt in FORMATS:
      try:
        if row is None:
          dev, s, fb = _linen_row(real, fmt)
        else:
          dev, s, fb = row(fmt)
      except Exception as e:  # noqa: BLE001  (a table row, not a test)
        print(f'| {name} | {fmt} | failed: {str(e).splitlines()[0][:60]} |')
        continue
      print(
        f'| {name} ({fb} B float) | {fmt} | {dev:.3f} | '
        f'{s.serving_bytes / fb:.3f} | {s.kernel_ratio:.3f} |'
      )


if __name__ == '__main__':
  main()
