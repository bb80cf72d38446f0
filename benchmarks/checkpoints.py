"""Bytes on disk: aqtr's checkpoint export vs compressed-tensors' compressor.

The same torch weights are compressed by compressed-tensors'
`PackedQuantizationCompressor` and saved with `safetensors.torch`; aqtr
loads that file (`aqtr.checkpoints.load`) and exports it again (int
`pack-quantized`, and NVFP4 `nvfp4-pack-quantized` from
`NVFP4PackedCompressor`). Also the GPTQ and AWQ layouts of the same
weights, against their nominal size (codes + scales + zero points; GPTQ
adds g_idx, 4 bytes per input row), and an act-order GPTQ checkpoint
(desc_act, a permuted g_idx) loaded and exported again, against its own
file. Needs the extra `checkpoints-reference`.

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


def _nvfp4_reference(folder, d):
  from compressed_tensors.compressors.nvfp4.base import (  # noqa: PLC0415
    NVFP4PackedCompressor,
  )
  from compressed_tensors.quantization.utils.helpers import (  # noqa: PLC0415
    generate_gparam,
  )

  torch.manual_seed(0)
  w = torch.randn(d, d)
  scheme = ctq.preset_name_to_scheme('NVFP4A16', ['Linear'])
  gs = generate_gparam(w.min(), w.max())
  g = w.reshape(d, -1, 16)
  scale, _ = calculate_qparams(
    g.amin(-1), g.amax(-1), scheme.weights, global_scale=gs
  )
  out = NVFP4PackedCompressor.compress(
    {'weight': w, 'weight_scale': scale, 'weight_global_scale': gs}, scheme
  )
  save_file(
    {f'fc.{k}': v.contiguous() for k, v in out.items()},
    os.path.join(folder, files.WEIGHTS),
    metadata={'format': 'pt'},
  )
  qc = ctq.QuantizationConfig(
    config_groups={'group_0': scheme}, format='nvfp4-pack-quantized'
  ).to_dict()
  files.write_config(folder, {'quantization_config': qc})


def _act_order(folder, gptq_folder, d):
  """The GPTQ file at `gptq_folder` with its rows given a permuted
  g_idx (AutoGPTQ's desc_act form), written to `folder`."""
  import dataclasses  # noqa: PLC0415

  (w,) = checkpoints.read(gptq_folder)[0].values()
  perm = np.random.default_rng(0).permutation(d)
  w = dataclasses.replace(w, g_idx=w.rows[np.argsort(perm)].astype(np.int32))
  tensors, qc = checkpoints.Gptq().encode({'fc': w})
  files.write(os.path.join(folder, files.WEIGHTS), tensors)
  files.write_config(folder, {'quantization_config': qc})


def main():
  p = argparse.ArgumentParser()
  p.add_argument('--d', type=int, default=1024)
  a = p.parse_args()
  d = a.d
  print(f'command: {" ".join([sys.executable, *sys.argv])}')
  print(f'cpu: {_cpu()}   date: {datetime.date.today()}')
  print(f'weight: one Linear {d} x {d}, group 128 (NVFP4: 16), f32 scales\n')
  rows = []
  name = lambda p: 'fc.weight'  # noqa: E731
  gptq_dir = tempfile.TemporaryDirectory()
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
        if fmt == 'gptq' and bits == 4 and not sym:  # For act-order below.
          checkpoints.export(
            served, os.path.join(gptq_dir.name, fmt), format=fmt, names=name
          )
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
  for kind in ('nvfp4', 'act-order'):
    with (
      tempfile.TemporaryDirectory() as ref,
      tempfile.TemporaryDirectory() as out,
    ):
      if kind == 'nvfp4':
        _nvfp4_reference(ref, d)
      else:
        _act_order(ref, os.path.join(gptq_dir.name, 'gptq'), d)
      model = nnx.eval_shape(
        lambda: nnx.Linear(d, d, use_bias=False, rngs=nnx.Rngs(0))
      )
      x = np.zeros((1, d), np.float32)
      served = checkpoints.load(model, ref, x, names=name)
      fmt = 'compressed-tensors' if kind == 'nvfp4' else 'gptq'
      info = checkpoints.export(served, out, format=fmt, names=name)
      base = os.path.getsize(os.path.join(ref, files.WEIGHTS))
      rows.append(
        (
          'nvfp4' if kind == 'nvfp4' else 'int4 asym',
          fmt if kind == 'nvfp4' else 'gptq desc_act',
          info['bytes'],
          base,
          'reference file' if kind == 'nvfp4' else 'loaded file',
          100 * (info['bytes'] - base) / base,
        )
      )
  gptq_dir.cleanup()
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
