"""Importing an adapter without its extra names the pip command to run."""

import subprocess
import sys

import pytest

from aqtr import extras

# (module made unimportable, what is imported, the extra that provides it),
# in an order where the blocked module was not imported by an earlier case.
CASES = [
  ('etils', 'aqtr.flags', 'flags'),
  ('gin', 'aqtr.gin', 'gin'),
  ('flax', 'aqtr.pax', 'flax'),
  ('flax', 'aqtr.flax.linen', 'flax'),
  ('orbax', 'aqtr.flax.checkpoint', 'flax'),
  ('optax', 'aqtr.train.__main__', 'train'),  # What `aqtr-train` imports.
]

SCRIPT = """
import importlib, sys
for blocked, target in {cases}:
  saved = {{k: v for k, v in sys.modules.items()
           if k == blocked or k.startswith(blocked + '.')}}
  for k in saved:
    del sys.modules[k]
  sys.modules[blocked] = None  # `import blocked` now raises ImportError.
  try:
    importlib.import_module(target)
    print('imported without', blocked)
  except ImportError as e:
    print(type(e).__name__ + ':', str(e).replace('\\n', ' '))
  del sys.modules[blocked]
  sys.modules.update(saved)
"""


def test_missing_extra_names_the_pip_command():
  cases = [(blocked, target) for blocked, target, _ in CASES]
  proc = subprocess.run(
    [sys.executable, '-c', SCRIPT.format(cases=cases)],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  lines = proc.stdout.strip().splitlines()
  assert len(lines) == len(CASES), proc.stdout
  for line, (blocked, what, extra) in zip(lines, CASES, strict=True):
    assert line.startswith('MissingExtraError: '), line
    assert f"pip install 'aqtr[{extra}]'" in line and blocked in line
    assert what.removesuffix('.__main__').split('.')[1] in line


def test_message():
  try:
    import no_such_module_for_aqtr  # noqa: F401
  except ImportError as e:
    err = extras.missing('gin', 'aqtr.gin', e)
  assert isinstance(err, ImportError)
  assert str(err) == (
    "aqtr.gin needs the 'gin' extra (no_such_module_for_aqtr is not "
    "importable): pip install 'aqtr[gin]'"
  )
  with pytest.raises(ImportError):
    raise err
