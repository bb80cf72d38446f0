"""Sub-channel dots on CPU: summing the per-tile products.

A sub-channel (tiled) dot computes one partial product per tile of the
contraction, `P [B, T, M, N]`, scales it and sums over the tiles.
XLA:CPU reduces over that non-minor axis T element by element; the
engine (`aqtr.core.passes.tile_sum`) adds whole slices instead. Part 1
times the two sums alone; part 2 a whole `aqtr.einsum` forward + backward
(`jax.grad` of the mean square) for weight configs with tiles, against
the float dot: as the engine runs it (a dot whose operands enter it in
float, such as nf4 or int4 weight-only, or an fp8 dot of an emulated
format, such as fp4 held in float8_e4m3fn, is one dot of the dequantized
operands: `aqtr.core.passes.dense_tiles`), and with `dense_tiles` patched
off (one dot per tile, scaled, summed by `tile_sum`: the engine before
2026-11-27 for the float dots, before 2026-11-28 for fp4). Same process,
interleaved rounds, median wall ms; `cpu x float` is the ratio of process
CPU time (all threads), the steadier figure on a shared host.

Run: python benchmarks/subchannel_sum.py [--rounds 5] [--dots-only] [--json]
(`--json`: part 2's medians, one JSON row per config, for
benchmarks/before_after.py and benchmarks/perf_targets.py.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import host
import jax
import jax.numpy as jnp

import aqtr
from aqtr.core import backward, passes
from aqtr.lora.config import nf4
from aqtr.tilings.subchannel import SubChannel

M, K, N = 2048, 512, 512
# None in an aqtr tree before 2026-11-27: every tiled dot was per tile.
passes_dense = getattr(passes, 'dense_tiles', None)


def _time(f, args, rounds: int, reps: int = 3) -> float:
  jax.block_until_ready(f(*args))
  got = []
  for _ in range(rounds):
    t = time.perf_counter()
    for _ in range(reps):
      out = f(*args)
    jax.block_until_ready(out)
    got.append((time.perf_counter() - t) / reps * 1e3)
  return statistics.median(got)


def _wall_cpu(f, args, reps: int = 3) -> tuple[float, float]:
  """(wall ms, process CPU ms) per call of `f`, over `reps` calls."""
  jax.block_until_ready(f(*args))
  t, u = time.perf_counter(), time.process_time()
  for _ in range(reps):
    out = f(*args)
  jax.block_until_ready(out)
  return (
    (time.perf_counter() - t) / reps * 1e3,
    (time.process_time() - u) / reps * 1e3,
  )


def _sums(rounds: int) -> list[str]:
  lines = [
    '| tiles T | P shape | sum(axis=1) ms | tile_sum ms | speed-up |',
    '|---:|---|---:|---:|---:|',
  ]
  for t in (2, 8, 32, 128):
    m = M if t <= 32 else M // 4
    p = jax.random.normal(jax.random.key(t), (1, t, m, N))
    a = _time(jax.jit(lambda p: p.sum(axis=1)), (p,), rounds)
    b = _time(jax.jit(passes.tile_sum), (p,), rounds)
    lines.append(
      f'| {t} | {tuple(p.shape)} | {a:.1f} | {b:.1f} | {a / b:.1f}x |'
    )
  return lines


def _tiled(cfg, tile: int):
  """`cfg` with its weight (rhs) in sub-channel tiles of `tile` inputs."""
  w = dataclasses.replace(
    cfg.fwd.rhs, tiling=SubChannel(tile_size=tile, tile_count=0)
  )
  return dataclasses.replace(
    cfg,
    fwd=dataclasses.replace(cfg.fwd, rhs=w),
    dlhs=dataclasses.replace(cfg.dlhs, rhs=w),
  )


def _fp4_both(tile: int):
  """fp4 (E2M1, held in float8_e4m3fn) on both operands of every pass, in
  tiles of `tile` along each pass's contraction (the backward passes
  quantize their operands afresh)."""
  t = dataclasses.replace(
    aqtr.presets.fp8().fwd.lhs,
    numerics=aqtr.numerics.Fp(exponent_bits=2, mantissa_bits=1),
    tiling=SubChannel(tile_size=tile, tile_count=0),
  )
  raw = aqtr.DotGeneralRaw(lhs=t, rhs=t, use_fwd_quant=False)
  return aqtr.DotGeneralConfig(fwd=raw, dlhs=raw, drhs=raw)


def _configs():
  return {
    'nf4 g64 (weight only)': nf4(64),
    'int4 g128 (weight only)': _tiled(aqtr.presets.int4_weight_only(), 128),
    'fp4 e2m1 g32 (both operands)': _fp4_both(32),
    'int8 per-channel (no tiles)': aqtr.presets.int8_weight_only(),
  }


def _per_tile(on: bool) -> None:
  """Patches the engine's dense float path off (`on`) or back."""
  for module in (passes, backward):
    module.dense_tiles = (lambda: False) if on else passes_dense


def measure_dots(rounds: int) -> tuple[dict, dict]:
  """Median wall and CPU ms per config ('float', '<config> per tile')."""
  x = jax.random.normal(jax.random.key(0), (M, K))
  w = jax.random.normal(jax.random.key(1), (K, N))

  def grad_of(cfg):  # Compiled ahead: immune to later cache clears.
    def loss(x, w):
      return jnp.mean(aqtr.einsum('mk,kn->mn', x, w, config=cfg) ** 2)

    return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).compile()

  tiled = {}
  if passes_dense is not None:  # Else the engine itself is per tile.
    _per_tile(True)
    jax.clear_caches()  # The engine's inner jit re-traces with the patch.
    try:
      tiled = {n: grad_of(c) for n, c in _configs().items()}
    finally:
      _per_tile(False)
      jax.clear_caches()
  fns = {'float': grad_of(None)}
  fns.update({n: grad_of(c) for n, c in _configs().items()})
  tiled = {f'{n} per tile': f for n, f in tiled.items()}
  times = {k: [] for k in [*fns, *tiled]}
  for _ in range(rounds):  # Interleaved, one repeat each per round.
    for k, f in (*fns.items(), *tiled.items()):
      times[k].append(_wall_cpu(f, (x, w)))
  wall = {k: statistics.median(t[0] for t in v) for k, v in times.items()}
  cpu = {k: statistics.median(t[1] for t in v) for k, v in times.items()}
  return wall, cpu


def _dots(rounds: int) -> list[str]:
  names = list(_configs())
  wall, cpu = measure_dots(rounds)
  lines = [
    f'float dot fwd+bwd: {wall["float"]:.1f} ms (cpu {cpu["float"]:.1f} ms)',
    '',
    '| config | engine ms | x float | cpu x float | one dot per tile ms '
    '| x float | cpu x float |',
    '|---|---:|---:|---:|---:|---:|---:|',
  ]
  for n in names:
    row = [n]
    for k in (n, f'{n} per tile'):
      if k not in wall:  # No dense path to patch off (an older tree).
        row += ['', '', '']
        continue
      row += [
        f'{wall[k]:.1f}',
        f'{wall[k] / wall["float"]:.2f}',
        f'{cpu[k] / cpu["float"]:.2f}',
      ]
    lines.append('| ' + ' | '.join(row) + ' |')
  return lines


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument('--rounds', type=int, default=5)
  ap.add_argument('--dots-only', action='store_true', help='skip part 1')
  ap.add_argument(
    '--json',
    action='store_true',
    help='part 2 only, one JSON row per config (for before_after.py)',
  )
  args = ap.parse_args(argv)
  if args.json:
    wall, cpu = measure_dots(args.rounds)
    for k in wall:
      print(json.dumps({'config': k, 'ms': wall[k], 'cpu_ms': cpu[k]}))
    return
  host.header('subchannel_sum.py')
  print(f'M, K, N = {M}, {K}, {N}; load {host.load_average()}\n')
  if not args.dots_only:
    print('\n'.join(_sums(args.rounds)))
    print()
  print('\n'.join(_dots(args.rounds)))
  print(f'\nload at the end: {host.load_average()}')


if __name__ == '__main__':
  main()
