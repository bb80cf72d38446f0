"""The host a benchmark ran on, as every table names it.

Run as scripts (`python benchmarks/x.py`), the benchmarks import this as
`import host`.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys

import jax


def cpu_model() -> str:
  """The host CPU model as `lscpu` names it (family, model, CPU count)."""
  try:
    out = subprocess.run(['lscpu'], capture_output=True, text=True).stdout
  except OSError:
    return platform.processor() or 'unknown CPU'
  info = {}
  for line in out.splitlines():
    k, _, v = line.partition(':')
    info[k.strip()] = v.strip()
  name = info.get('Model name', platform.processor() or 'unknown CPU')
  if 'CPU family' in info:
    name += f' (family {info["CPU family"]}, model {info.get("Model", "?")})'
  return f'{name}, {info.get("CPU(s)", "?")} CPUs'


def header(script: str) -> None:
  """Prints what every table states: CPU model, jax, command, UTC time.

  Args:
    script: the benchmark's file name ('kv_read.py').
  """
  print(f'CPU: {cpu_model()}; jax {jax.__version__}; {jax.devices()[0]}')
  print(f'command: python benchmarks/{script} {shlex.join(sys.argv[1:])}')
  print(f'date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC')


def cpu_flags() -> str:
  """The CPU's int8 / bf16 dot extensions among its flags."""
  from aqtr.core import native_dot  # Only the benchmarks that ask.

  flags = native_dot.cpu_flags()
  if not flags:
    return 'unknown'
  want = ('avx512f', 'avx512_vnni', 'avx_vnni', 'avx512_bf16', 'amx_int8')
  return ' '.join(x for x in want if x in flags) or 'none of them'


def load_average() -> str:
  """The 1, 5 and 15 minute load averages ('?' where the OS has none)."""
  try:
    return ' / '.join(f'{v:.1f}' for v in os.getloadavg())
  except (AttributeError, OSError):
    return '?'
