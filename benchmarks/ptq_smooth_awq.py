"""SmoothQuant and AWQ on the job's LMs: validation bpc of the served model.

Trains the stock nnx LM (`aqtr.train.stock_lm`) and/or the main job's
Pax-style LM (`aqtr.train.models.lm`) in float on the stdlib corpus
(`experiment.default()` sizes: 2 blocks, d_model 128, 16 x 64 bytes per
step, `--steps` Adam steps), then quantizes it with `aqtr.ptq.quantize`
(calibration: `--calib` training batches) and reports the served model's
validation bits per byte (8 batches):

  SmoothQuant table: activation outliers injected by an exactly equivalent
    rescaling (`aqtr.ptq.outliers.inject`: 4 channels of each norm's
    output x32 or x64, matching weight rows divided); W8A8 (int8 x int8
    dots, `smoothquant.w8a8`: weights per output channel, activations per
    tensor or per token) with method 'rtn' (no smoothing) and
    'smoothquant' (alpha 0.5).
  AWQ table: the trained model as is; int4 / int3 weights, groups of 128
    or 32 along the input, method 'rtn', 'awq' (20 alphas + clip search)
    and AWQ without the clip search; 'closed' is the share of RTN's gap
    to float that AWQ closes; 'duo': AutoAWQ's duo scaling; the last row
    is the outlier-injected model.

The stock LM's tied logits op stays float (its table is also the
lookup); every weight op of the Pax LM is quantized (its softmax is
untied). Results go to `--out` (JSON) and the tables are printed.

  python benchmarks/ptq_smooth_awq.py                 # both LMs, 1500 steps
  python benchmarks/ptq_smooth_awq.py --model stock --steps 500
  python benchmarks/ptq_smooth_awq.py --cache /tmp/lm  # reuse trained LMs
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import pickle
import time

import fiddle as fdl
import host
import jax
import jax.numpy as jnp
from flax import nnx

import aqtr
import aqtr.ptq as ptq
from aqtr.ptq import outliers, smoothquant
from aqtr.rules import Rule
from aqtr.tilings.subchannel import SubChannel
from aqtr.train import experiment, models, pax_run, stock_lm, tasks


def _train(kind: str, steps: int, cache: str | None):
  """(task, model, float params, train seconds); `cache`: a pickle of the
  trained params (read if it exists, else written)."""
  cfg = experiment.default()
  cfg.steps, cfg.eval_every, cfg.log_every = steps, steps, 50
  cfg.runs = ('float',)
  exp, template, _ = experiment.split(cfg)
  task = tasks.make(exp)
  emb, layers = template.embedding, template.layers
  model = stock_lm.StockLm(  # The sizes of the job's LM.
    vocab_size=emb.num_embeddings,
    d_model=emb.features,
    num_layers=len(layers),
    num_heads=layers[0].attention.num_heads,
    rngs=nnx.Rngs(exp.seed),
  )
  path = cache and pathlib.Path(f'{cache}_{kind}_{steps}.pkl')
  if path and path.exists():
    with open(path, 'rb') as fh:
      params = pickle.load(fh)['params']
    secs = 0.0
  else:
    t0 = time.perf_counter()
    if kind == 'stock':
      r = stock_lm.train('stock_float', exp, task, template)
      params = nnx.to_pure_dict(nnx.state(r.injected, nnx.Param))
    else:
      r = pax_run.train(
        'float', aqtr.presets.float(), exp, task, template, show_progress=False
      )
      params = r.params
    secs = time.perf_counter() - t0
    if path:
      with open(path, 'wb') as fh:
        pickle.dump({'params': jax.device_get(params), 'steps': steps}, fh)
  if kind == 'stock':
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)
    return task, model, params, secs
  return task, template, {'params': params}, secs


class Lm:
  """One trained LM: its params, how to serve a quantized copy, bpc."""

  def __init__(self, kind: str, task, model, params, calib: int):
    self.kind, self.task, self.model = kind, task, model
    it = task.batches()
    self.batches = [next(it)[0] for _ in range(calib)]
    self.params = params
    if kind == 'stock':
      heads = model.blocks[0].heads
      self.fold_map = stock_lm.fold_map(params, num_heads=heads)
    else:
      self.fold_map = models.fold_map(params)

  def rules(self, config):
    keep = [Rule(None, path='embed.*')] if self.kind == 'stock' else []
    return [*keep, Rule(config, weight=True)]

  def _nnx(self, params):
    m = nnx.clone(self.model)
    state = nnx.state(m, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(m, state)
    return m

  def _bpc(self, fn) -> float:
    return tasks.evaluate_logits(jax.jit(fn), self.task.eval_set, 'bpc')['bpc']

  def float_bpc(self, params) -> float:
    if self.kind == 'stock':
      gd, st = nnx.split(self._nnx(params))
      return self._bpc(lambda x: nnx.merge(gd, st)(x))
    module = fdl.build(self.model)
    return self._bpc(lambda x: module.apply(params, x))

  def quantized_bpc(self, params, config, method) -> tuple[float, float]:
    """(bpc of the served model, seconds of `aqtr.ptq.quantize`)."""
    t0 = time.perf_counter()
    if self.kind == 'stock':
      served, _ = ptq.quantize(
        self._nnx(params), self.rules(config), self.batches, method=method
      )
      secs = time.perf_counter() - t0
      gd, st = nnx.split(served)
      return self._bpc(lambda x: nnx.merge(gd, st)(x)), secs
    (tmpl, variables), _ = ptq.quantize(
      self.model,
      self.rules(config),
      self.batches,
      variables=params,
      method=method,
    )
    secs = time.perf_counter() - t0
    module = fdl.build(tmpl)
    return self._bpc(lambda x: module.apply(variables, x)), secs


def weight_only(bits: int, tile: int) -> aqtr.DotGeneralConfig:
  """int`bits` weights (symmetric, absmax), groups of `tile` inputs."""
  cfg = aqtr.presets.int4_weight_only()
  num = dataclasses.replace(cfg.fwd.rhs.numerics, bits=bits)
  if bits != 4:
    num = dataclasses.replace(num, storage='int8')
  rhs = dataclasses.replace(
    cfg.fwd.rhs, numerics=num, tiling=SubChannel(tile_size=tile)
  )
  return dataclasses.replace(
    cfg,
    fwd=dataclasses.replace(cfg.fwd, rhs=rhs),
    dlhs=dataclasses.replace(cfg.dlhs, rhs=rhs),
  )


def smoothquant_rows(lm: Lm, res: dict) -> list[str]:
  f = lm.float_bpc(lm.params)
  p, _ = outliers.inject(lm.params, lm.fold_map, channels=4)
  fo = lm.float_bpc(p)
  res.update(float=f, float_outliers=fo)
  rows = [
    f'| float | - | {f:.4f} | - |',
    f'| float, outliers | - | {fo:.4f} | {100 * (fo / f - 1):+.2f}% |',
  ]
  for acts in ('tensor', 'token'):
    cfg = smoothquant.w8a8(acts)
    for method in ('rtn', ptq.SmoothQuant(alpha=0.5)):
      b, secs = lm.quantized_bpc(p, cfg, method)
      name = 'smoothquant' if method != 'rtn' else 'none (rtn)'
      res[f'w8a8_{acts}_{name}'] = b
      rows.append(
        f'| W8A8 per-{acts} | {name} | {b:.4f} | {100 * (b / f - 1):+.2f}% |'
      )
  return rows


def awq_rows(lm: Lm, res: dict) -> list[str]:
  f = res.get('float') or lm.float_bpc(lm.params)
  rows = []
  methods = {
    'rtn': 'rtn',
    'awq': ptq.Awq(),
    'awq duo': ptq.Awq(duo=True),
    'awq no clip': ptq.Awq(clip=False),
  }
  injected, _ = outliers.inject(lm.params, lm.fold_map, channels=4)
  cases = [(4, 128, False), (3, 128, False), (4, 32, False), (3, 32, False)]
  for bits, tile, out in [*cases, (4, 128, True)]:
    got = {}
    params = injected if out else lm.params
    for name, method in methods.items():
      b, secs = lm.quantized_bpc(params, weight_only(bits, tile), method)
      key = f'w{bits}_g{tile}{"_outliers" if out else ""}_{name}'
      got[name] = res[key] = b
      res[f'{key}_s'] = secs
    gap = got['rtn'] - f
    cells = [f'{got["rtn"]:.4f}']
    for name in ('awq', 'awq duo', 'awq no clip'):
      closed = 100 * (got['rtn'] - got[name]) / gap if gap > 0 else 0.0
      cells.append(f'{got[name]:.4f} ({closed:.0f}%)')
    label = f'W{bits} g{tile}' + (', outliers' if out else '')
    rows.append(f'| {label} | ' + ' | '.join(cells) + ' |')
  return rows


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument('--model', choices=('stock', 'pax', 'both'), default='both')
  ap.add_argument('--steps', type=int, default=1500)
  ap.add_argument('--calib', type=int, default=16)
  ap.add_argument('--out', default='ptq_smooth_awq.json')
  ap.add_argument(
    '--cache', default=None, help='prefix of trained-params pickles'
  )
  args = ap.parse_args()
  kinds = ('stock', 'pax') if args.model == 'both' else (args.model,)
  results = {'host': host.cpu_model(), 'steps': args.steps}
  print(
    f'host: {results["host"]}; {args.steps} float steps, '
    f'{args.calib} calibration batches of 16 x 64 bytes',
    flush=True,
  )
  for kind in kinds:
    task, model, params, secs = _train(kind, args.steps, args.cache)
    lm = Lm(kind, task, model, params, args.calib)
    res = results[kind] = {'train_s': secs}
    sq = smoothquant_rows(lm, res)
    print(f'\n{kind} LM, SmoothQuant (outliers injected), bpc:\n')
    print('| weights x activations | smoothing | bpc | vs float |')
    print('|---|---|---|---|')
    print('\n'.join(sq), flush=True)
    aw = awq_rows(lm, res)
    print(f'\n{kind} LM, AWQ (float bpc {res["float"]:.4f}):\n')
    print('| weights | RTN | AWQ (closed) | AWQ duo | AWQ no clip |')
    print('|---|---|---|---|---|')
    print('\n'.join(aw), flush=True)
    with open(args.out, 'w') as fh:
      json.dump(results, fh, indent=1)


if __name__ == '__main__':
  jnp.zeros(())  # Initialise the backend before timing anything.
  main()
