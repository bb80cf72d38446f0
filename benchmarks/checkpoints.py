"""Bytes on disk: aqtr's checkpoint export vs compressed-tensors' compressor.

The same torch weights are compressed by compressed-tensors'
`PackedQuantizationCompressor` and saved with `safetensors.torch`; aqtr
loads that file (`aqtr.checkpoints.load`) and exports it again. Also the
GPTQ and AWQ layouts of the same weights, against their nominal size
(codes + scales + zero points; GPTQ adds
g_idx, 4 bytes per input row). Needs the extra `checkpoints-reference`.

  python benchmarks/checkpoints.py [--d=1024]
"""

import argparse
import datetime
import os
import platform
import subprocess
import sys
import tempfile

import numpy as np
import torch
from compressed_tensors import quantization as ctq
from compressed_tensors.compressors.pack_quantized import (
  PackedQuantizationCompressor,
)
from compressed_tensors.quantization.utils.helpers import calculate_qparams
from flax import nnx
from safetensors.torch import save_file

from aqtr import checkpoints
from aqtr.checkpoints import files


def _cpu() -> str:
  try:
    out = subprocess.run(['lscpu'], capture_output=True, text=True).stdout
    for line in out.splitlines():
      if line.startswith('Model name'):
        return line.split(':', 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or 'unknown'


def _reference(folder, d, bits, sym, group):
  torch.manual_seed(0)
  w = torch.randn(d, d)
  args = ctq.QuantizationArgs(
    num_bits=bits, symmetric=sym, strategy='group', group_size=group
  )
  g = w.reshape(d, -1, group)
  scale, zp = calculate_qparams(g.amin(-1), g.amax(-1), args)
  scheme = ctq.QuantizationScheme(targets=['Linear'], weights=args)
  sd = {'weight': w, 'weight_scale': scale}
  if not sym:
    sd['weight_zero_point'] = zp
  out = PackedQuantizationCompressor.compress(sd, scheme)
  save_file(
    {f'fc.{k}': v.contiguous() for k, v in out.items()},
    os.path.join(folder, files.WEIGHTS),
    metadata={'format': 'pt'},
  )
  qc = ctq.QuantizationConfig(
    config_groups={'group_0': scheme}, format='pack-quantized'
  ).to_dict()
  files.write_config(folder, {'quantization_config': qc})


def main():
  p = argparse.ArgumentParser()
  p.add_argument('--d', type=int, default=1024)
  a = p.parse_args()
  d = a.d
  print(f'command: {" ".join([sys.executable, *sys.argv])}')
  print(f'cpu: {_cpu()}   date: {datetime.date.today()}')
  print(f'weight: one Linear {d} x {d}, group 128, float32 scales\n')
  rows = []
  name = lambda p: 'fc.weight'  # noqa: E731
  for bits, sym in ((4, True), (4, False), (8, True)):
    with (
      tempfile.TemporaryDirectory() as ref,
      tempfile.TemporaryDirectory() as out,
    ):
      _reference(ref, d, bits, sym, 128)
      model = nnx.eval_shape(
        lambda: nnx.Linear(d, d, use_bias=False, rngs=nnx.Rngs(0))
      )
      x = np.zeros((1, d), np.float32)
      served = checkpoints.load(model, ref, x, names=name)
      ref_b = os.path.getsize(os.path.join(ref, files.WEIGHTS))
      for fmt in ('compressed-tensors', 'gptq', 'awq'):
        if fmt == 'awq' and bits != 4:
          continue
        sub = os.path.join(out, fmt)
        info = checkpoints.export(served, sub, format=fmt, names=name)
        g = d // 128
        nominal = (
          d * d * bits // 8 + 4 * g * d + (0 if sym else g * d * bits // 8)
        )
        if fmt != 'compressed-tensors' and sym:
          nominal += g * d * bits // 8  # gptq / awq always store qzeros
        base = ref_b if fmt == 'compressed-tensors' else nominal
        rows.append(
          (
            f'int{bits} {"sym" if sym else "asym"}',
            fmt,
            info['bytes'],
            base,
            'reference file' if fmt == 'compressed-tensors' else 'nominal',
            100 * (info['bytes'] - base) / base,
          )
        )
  print(
    f'{"weights":10s} {"layout":20s} {"aqtr bytes":>11s} '
    f'{"vs bytes":>10s} {"vs":>15s} {"diff %":>7s}'
  )
  for r in rows:
    print(
      f'{r[0]:10s} {r[1]:20s} {r[2]:11d} {r[3]:10d} {r[4]:>15s} {r[5]:7.3f}'
    )


if __name__ == '__main__':
  main()
