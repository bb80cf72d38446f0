"""The real-model matrix: every preset on real third-party models.

For each model of `tests/models/zoo.py` (Hugging Face Flax LMs and ViT,
DeepMind's Gemma 2 / Gemma 3 and Griffin at toy size; the `models` extra)
and each preset, prints:

- ops: quantized ops / weight ops of the report;
- fwd / grad: int8 or fp8 dots (or int4 weight roundings) in the forward
  and the gradient jaxpr, as `got/expected` from the report;
- err: max |logits - float logits| / max |float logits|;
- s==t: the converted model's jitted logits equal the training model's
  (run in this process with XLA's default flags; else the ULP distance);
- served: serving-tree bytes / float bytes;
per model int4 weight-only PTQ: the logit error of RTN, GPTQ and AWQ; and
per model QLoRA (nf4 base, rank 4, on the blocks' weight ops): the loss
before and after 5 Adam steps, and the merged (re-quantized nf4) model's
logit error vs the unmerged one.

  python benchmarks/real_models.py [--models hf_gpt2 gemma3] [--no-ptq]
                                   [--ptq-only] [--no-lora] [--lora-only]
"""

from __future__ import annotations

import argparse
import collections
import datetime
import os
import platform
import re
import subprocess
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, '..', 'tests', 'models'))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import zoo  # noqa: E402

import aqtr.flax as af  # noqa: E402
import aqtr.lora as lora  # noqa: E402
import aqtr.ptq as ptq  # noqa: E402
from aqtr.core.lowering import sub_jaxprs  # noqa: E402
from aqtr.flax import Rule, hosts  # noqa: E402
from aqtr.flax.serving import check_served  # noqa: E402
from aqtr.freezers import lifecycle  # noqa: E402

PRESETS = {
  'int8': [Rule('int8')],
  'int8_w': [Rule('int8', weight=True)],
  'int4_wo': [Rule('int4_weight_only', weight=True)],
  'fp8': [Rule('fp8')],
}


def _cpu() -> str:
  try:
    out = subprocess.run(['lscpu'], capture_output=True, text=True).stdout
  except OSError:
    return platform.processor()
  model = next(
    (
      ln.split(':', 1)[1].strip()
      for ln in out.splitlines()
      if 'Model name' in ln
    ),
    '?',
  )
  vnni = 'avx512_vnni' in out
  return f'{model} (avx512_vnni: {"yes" if vnni else "no"})'


def _count(jaxpr, found=None) -> collections.Counter:
  found = collections.Counter() if found is None else found
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == 'dot_general':
      dts = {str(v.aval.dtype) for v in eqn.invars}
      if 'int8' in dts:
        found['int8'] += 1
      if any('float8' in d for d in dts):
        found['fp8'] += 1
    if name == 'convert_element_type' and 'int4' in str(
      eqn.params.get('new_dtype')
    ):
      found['int4'] += 1
    for sub in sub_jaxprs(eqn):
      _count(sub, found)
  return found


def _rel(a, b) -> float:
  return float(jnp.abs(a - b).max() / jnp.abs(b).max())


_loss = zoo.loss


def _ulp_text(message: str) -> str:
  """'3 ULP' from convert's check message (ULP of the largest output)."""
  return re.search(r'by up to (\d+) ULP', message).group(1) + ' ULP'


def _bytes(tree) -> int:
  return lifecycle.nbytes(tree)  # int4 counted packed


def _row(z, mod, v, x, name, rules) -> str:
  q = af.quantize(mod, rules)
  rep = af.report(q, x, variables=v)
  nq = sum(e.quantized for e in rep.ops)
  nw = sum(1 for e in rep.ops if e.weight)
  what = {'fp8': 'fp8', 'int4_wo': 'int4'}.get(name, 'int8')
  fwd = _count(jax.make_jaxpr(lambda v: q.apply(v, x))(v).jaxpr)[what]
  grad = _count(
    jax.make_jaxpr(jax.grad(lambda v: _loss(z, q.apply(v, x), x)))(v).jaxpr
  )[what]
  y0 = jax.jit(mod.apply)(v, x)
  y = jax.jit(q.apply)(v, x)
  sm, sv = af.convert(q, x, variables=v, check=False)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    try:
      check_served(hosts.of(q, v), hosts.of(sm, sv), (x,), {})
      same = 'yes'
    except ValueError as e:
      same = 'NO: ' + _ulp_text(str(e))
  for w in caught:
    if 'ULP' in str(w.message):
      same = _ulp_text(str(w.message))
  served = _bytes(sv) / _bytes(v)
  return (
    f'| {z.name} | {name} | {nq}/{len(rep.ops)} ({nw} w) | {fwd} | {grad} '
    f'| {_rel(y, y0):.4f} | {same} | {served:.2f} |'
  )


def _ptq_row(z, mod, v, x) -> str:
  """int4 PTQ of the blocks' weight ops (the ops a user would pick)."""
  rules = [Rule('int4_weight_only', path=z.blocks or None, weight=True)]
  batches = [z.sample(s) for s in (1, 2)]
  y0 = jax.jit(mod.apply)(v, x)
  cells = []
  for method in ('rtn', 'gptq', 'awq'):
    try:
      (sm, sv), rep = ptq.quantize(
        mod, rules, batches, variables=v, method=method
      )
    except ValueError as e:
      cells.append('refused: ' + str(e).splitlines()[0][:60])
      continue
    layer = sum(r.error for r in rep.layers) / max(len(rep.layers), 1)
    cells.append(
      f'{_rel(jax.jit(sm.apply)(sv, x), y0):.4f} (layer {layer:.4f})'
    )
  return f'| {z.name} | ' + ' | '.join(cells) + ' |'


def _lora_row(z, mod, v, x) -> str:
  """QLoRA (nf4) on the blocks: 5 steps, then merge (re-quantized nf4)."""
  cfg = lora.LoraConfig(rank=4, base='nf4')
  try:
    lm, lv = lora.attach(mod, {z.blocks or '.*': cfg}, x, variables=v)
  except ValueError as e:
    return f'| {z.name} | refused: {str(e).splitlines()[0][:80]} | | |'
  trained, values = zoo.fit_adapters(z, lm, lv, x)
  sm, sv = lora.merge(lm, x, variables=trained)
  y = jax.jit(lm.apply)(trained, x)
  err = _rel(jax.jit(sm.apply)(sv, x), y)
  return f'| {z.name} | {values[0]:.4f} -> {values[-1]:.4f} | {err:.4f} |'


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--models', nargs='*', default=None)
  p.add_argument('--no-ptq', action='store_true')
  p.add_argument('--no-lora', action='store_true')
  p.add_argument(
    '--lora-only', action='store_true', help='only the QLoRA table'
  )
  p.add_argument(
    '--ptq-only', action='store_true', help='only the int4 PTQ table'
  )
  a = p.parse_args(argv)
  if a.lora_only:
    a.no_ptq, a.presets = True, False
  else:
    a.presets = not a.ptq_only
  models = [
    z
    for z in zoo.MODELS
    if z.available() and (a.models is None or z.name in a.models)
  ]
  flags = ' '.join(argv or sys.argv[1:])
  print(f'command: python benchmarks/real_models.py {flags}')
  print(f'CPU: {_cpu()}; date: {datetime.date.today()}; jax {jax.__version__}')
  if a.presets:
    print(
      '\n| model | preset | quantized ops | fwd dots | grad dots | err vs '
      'float | serve == train (jit) | serving bytes / float |'
    )
    print('|---|---|---|---|---|---|---|---|')
  ptq_rows, lora_rows = [], []
  with jax.numpy_rank_promotion('allow'):
    for z in models:
      t0 = time.time()
      mod, x = z.build(), z.sample()
      v = jax.jit(mod.init)(jax.random.key(0), x)
      for name, rules in PRESETS.items() if a.presets else ():
        try:
          print(_row(z, mod, v, x, name, rules), flush=True)
        except Exception as e:  # noqa: BLE001 - the table reports it
          print(
            f'| {z.name} | {name} | CRASH: {type(e).__name__}: '
            f'{str(e).splitlines()[0][:120]} |',
            flush=True,
          )
      if not a.no_ptq:
        try:
          ptq_rows.append(_ptq_row(z, mod, v, x))
        except Exception as e:  # noqa: BLE001
          ptq_rows.append(
            f'| {z.name} | CRASH: {str(e).splitlines()[0][:120]} |'
          )
      if not (a.no_lora or a.ptq_only):
        try:
          lora_rows.append(_lora_row(z, mod, v, x))
        except Exception as e:  # noqa: BLE001
          lora_rows.append(
            f'| {z.name} | CRASH: {str(e).splitlines()[0][:120]} | |'
          )
      print(f'<!-- {z.name}: {time.time() - t0:.0f} s -->', flush=True)
  if ptq_rows:
    print(
      '\nint4 weight-only PTQ of the blocks: logit error vs float (mean '
      'relative layer-output error on the calibration data):\n'
    )
    print('| model | RTN | GPTQ | AWQ |\n|---|---|---|---|')
    print('\n'.join(ptq_rows))
  if lora_rows:
    print(
      '\nQLoRA (nf4 base, rank 4) on the blocks: loss over 5 Adam steps, '
      'and the merged model (nf4) vs the unmerged one (relative):\n'
    )
    print('| model | loss: step 1 -> 5 | merged vs unmerged |\n|---|---|---|')
    print('\n'.join(lora_rows))


if __name__ == '__main__':
  np.set_printoptions(precision=4)
  main()
