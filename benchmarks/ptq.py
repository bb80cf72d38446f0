"""GPTQ on the main job's LM: time per layer, and output error vs Qwix.

The main job's LM (`experiment.default()`: byte-level transformer, 2
layers, d_model 128; `--model large`: 4 layers, d_model 256) at its
initialization (`--train-steps N`: after N float Adam steps), calibrated
on `--batches` batches of 16 x 64 bytes of the stdlib corpus.

Table 1 (time): `aqtr.ptq.quantize(..., method='gptq')` end to end (the
calibration pass, RTN convert, every weight op solved), and per layer the
solve time with compile and warm, for int4 per-channel.

Table 2 (error): per layer the relative output error
`tr(dW^T X^T X dW) / tr(W^T X^T X W)` of round to nearest and GPTQ, aqtr
(`aqtr.ptq.gptq` on the rule's grid) and Qwix (`qwix.contrib.gptq_core.
quantize_weight`, the same H, block 128, percdamp 0.01), int4 per-channel
and int4 with groups of 64 along d_in, both on Qwix's int4 grid (absmax /
7.5, values -8..7: registered here as a user numerics, `QwixInt4`, which
aqtr's GPTQ uses unchanged). Qwix recomputes a group's
scale when the group is reached; aqtr keeps RTN's by default (columns
'gptq aqtr', 'ratio'), and 'aqtr dyn' is aqtr with `static_groups=False`
(the paper's groups). Per-channel all agree. Ratios: aqtr's error over
Qwix's.

  python benchmarks/ptq.py
  python benchmarks/ptq.py --model large --batches 8
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import host
import jax
import jax.numpy as jnp
import numpy as np
import optax

import aqtr
import aqtr.ptq as ptq
from aqtr.data import loader, stdlib
from aqtr.numerics.int_symmetric import IntSymmetric
from aqtr.ptq import gptq
from aqtr.ptq.grid import Grid
from aqtr.ptq.stats import relative_error
from aqtr.tilings.subchannel import SubChannel
from aqtr.train import experiment, models


def _setup(model: str, batches: int, train_steps: int):
  cfg = experiment.large() if model == 'large' else experiment.default()
  cfg.seq_len = 64
  exp, template, _ = experiment.split(cfg)
  corpus = stdlib.load(max_bytes=2_000_000)
  it = loader.windows(corpus.train, 16, 64, seed=0)
  module = models.build(template)
  x0, _ = next(it)
  params = module.init(jax.random.key(0), x0)
  if train_steps:
    opt = optax.adam(1e-3)
    state = opt.init(params)

    def loss(p, x, y):
      logits = module.apply(p, x)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def step(p, s, x, y):
      g = jax.grad(loss)(p, x, y)
      u, s = opt.update(g, s, p)
      return optax.apply_updates(p, u), s

    for _ in range(train_steps):
      x, y = next(it)
      params, state = step(params, state, x, y)
  calib = [jnp.asarray(next(it)[0]) for _ in range(batches)]
  return template, params, calib


def _rules(cfg):
  return [aqtr.pax.Rule(cfg, tag=aqtr.pax.tags.WeightOp)]


@aqtr.numerics.register('int4_qwix_grid')
@dataclasses.dataclass(frozen=True, kw_only=True)
class QwixInt4(IntSymmetric):
  """Qwix's int4 grid as a user-registered numerics: s = absmax / 7.5,
  q = clip(round_half_even(x / s), -8, 7) (aqtr's own int4 clips to +-7)."""

  bits: int = 4
  storage: str = 'int4'
  preserve_max_val: bool = False

  def quantize(self, v, noise=None):
    del noise
    return jnp.clip(jnp.round(v), -8, 7).astype(jnp.int4)


def _qwix_grid(group: int):
  """A weight-only config on Qwix's int4 grid (per-channel or grouped)."""
  cfg = aqtr.presets.int4_weight_only()
  n = QwixInt4()
  tiling = cfg.fwd.rhs.tiling if group == 0 else SubChannel(tile_size=group)
  rhs = dataclasses.replace(cfg.fwd.rhs, numerics=n, tiling=tiling)
  return dataclasses.replace(cfg, fwd=dataclasses.replace(cfg.fwd, rhs=rhs))


def _qwix(w2, h, group):
  from qwix._src.core import qarray  # noqa: PLC0415
  from qwix.contrib import gptq_core  # noqa: PLC0415

  d_in = w2.shape[0]
  tiles = {} if group >= d_in else {1: group}
  how = qarray.HowToQuantize(
    qtype=jnp.int4, channelwise_axes=[0], tiled_axes=tiles
  )
  w = w2.T  # Qwix: [rows = d_out, columns = d_in]
  qa, _ = gptq_core.quantize_weight(w, h, how, blocksize=128, percdamp=0.01)
  wq = qarray.dequantize(qa).T
  rtn = qarray.dequantize(qarray.quantize(w, how)).T
  return rtn, wq


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument('--model', choices=('default', 'large'), default='default')
  ap.add_argument('--batches', type=int, default=16)
  ap.add_argument('--train-steps', type=int, default=0)
  ap.add_argument('--no-qwix', action='store_true')
  a = ap.parse_args()
  print(f'host: {host.cpu_model()}')
  print(
    f'model: {a.model}, {a.batches} x 16 x 64 calibration bytes, '
    f'{a.train_steps} float training steps'
  )
  template, params, calib = _setup(a.model, a.batches, a.train_steps)

  int4 = aqtr.presets.int4_weight_only()
  t0 = time.perf_counter()
  _, rep = ptq.quantize(template, _rules(int4), calib, variables=params)
  total = time.perf_counter() - t0
  print(
    f'\naqtr.ptq.quantize(method=gptq), int4 per-channel, end to end: '
    f'{total:.1f} s ({rep.seconds:.1f} s in the solver)\n'
  )
  target = ptq.PaxTarget(models.inject(template, int4)[0], params)
  got = ptq.collect(target, calib)
  print(
    f'{"layer":34s} {"d_in x d_out":>12s} {"solve s":>8s} '
    f'{"rtn err":>8s} {"gptq err":>8s}'
  )
  for path, site in got.sites.items():
    g = Grid.of(site, got.weights[path])
    s = got.stats[path]
    args = (g.w2, s.hessian, g.scale2, g.zero2, g.numerics)
    jax.block_until_ready(gptq.solve(*args, block_size=128))  # compiled
    t0 = time.perf_counter()
    wq = jax.block_until_ready(gptq.solve(*args, block_size=128)).wq
    warm = time.perf_counter() - t0
    rtn = relative_error(g.dequant(g.rtn) - g.w2, g.w2, s.xtx)
    err = relative_error(wq - g.w2, g.w2, s.xtx)
    d_in, d_out = g.w2.shape
    print(
      f'{path:34s} {f"{d_in}x{d_out}":>12s} {warm:8.3f} {rtn:8.4f} {err:8.4f}'
    )
  if a.no_qwix:
    return
  print(
    f'\n{"layer":34s} {"format":>9s} {"rtn aqtr":>9s} {"rtn qwix":>9s} '
    f'{"gptq aqtr":>9s} {"gptq qwix":>9s} {"ratio":>6s} {"aqtr dyn":>9s} '
    f'{"ratio":>6s}'
  )
  ratios, dyn_ratios = [], []
  for group in (0, 64):
    for path, site in got.sites.items():
      w = got.weights[path]
      s = got.stats[path]
      d_in = s.d_in
      gsize = d_in if group == 0 else group
      cfg = _qwix_grid(group)
      g = Grid.of(dataclasses.replace(site, config=cfg), w)
      args = (g.w2, s.hessian, g.scale2, g.zero2, g.numerics)
      wq = gptq.solve(*args).wq
      group, regroup = g.regroup()
      dyn = gptq.solve(*args, group=group, regroup=regroup).wq
      q_rtn, q_wq = _qwix(g.w2, s.hessian, gsize)
      e = [
        relative_error(x - g.w2, g.w2, s.xtx)
        for x in (g.dequant(g.rtn), q_rtn, wq, q_wq, dyn)
      ]
      ratios.append(e[2] / e[3])
      fmt = 'int4' if group == 0 else f'int4 g{group}'
      print(
        f'{path:34s} {fmt:>9s} {e[0]:9.4f} {e[1]:9.4f} {e[2]:9.4f} '
        f'{e[3]:9.4f} {e[2] / e[3]:6.3f} {e[4]:9.4f} {e[4] / e[3]:6.3f}'
      )
      dyn_ratios.append(e[4] / e[3])
  print(
    f'\naqtr / qwix GPTQ error: mean {np.mean(ratios):.3f}, worst '
    f'{np.max(ratios):.3f}; with dynamic groups (static_groups=False): '
    f'mean {np.mean(dyn_ratios):.3f}, worst {np.max(dyn_ratios):.3f}'
  )


if __name__ == '__main__':
  main()
