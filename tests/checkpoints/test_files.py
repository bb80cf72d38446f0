"""Safetensors files: rewriting a path leaves arrays read from it intact."""

import subprocess
import sys
import textwrap

import numpy as np

from aqtr.checkpoints import files


def test_rewrite_keeps_the_old_arrays_and_reads_the_new(tmp_path):
  path = str(tmp_path / 'm.safetensors')
  files.write(path, {'a': np.arange(8, dtype=np.int32)})
  old = files.read(path)['a']
  files.write(path, {'a': np.arange(8, 16, dtype=np.int32)})  # same size
  assert old.tolist() == list(range(8))
  assert files.read(path)['a'].tolist() == list(range(8, 16))
  assert sorted(p.name for p in tmp_path.iterdir()) == ['m.safetensors']


def test_rewrite_with_a_smaller_file_does_not_kill_the_process(tmp_path):
  """A file truncated under a live map raises SIGBUS when the map is read:
  run in a child so that a regression fails the test, not the session."""
  code = textwrap.dedent(f"""
    import numpy as np
    from aqtr.checkpoints import files
    path = {str(tmp_path / 'm.safetensors')!r}
    files.write(path, {{'a': np.full(1 << 16, 7, np.float32)}})
    old = files.read(path)['a']
    files.write(path, {{'b': np.ones(2, np.int8)}})
    assert float(old.sum()) == 7 * (1 << 16), old.sum()
    assert files.read(path)['b'].tolist() == [1, 1]
  """)
  out = subprocess.run(
    [sys.executable, '-c', code], capture_output=True, text=True, check=False
  )
  assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
