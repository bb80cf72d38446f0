"""No quantizer and no bit packing outside aqtr/core and aqtr/numerics.

Rounding values to a grid, casting them to narrow integer dtypes, scaling
by an integer range and packing bits belong to the core's quantizer
(`aqtr.core.quantizer`: `quantize_view`, `quantize_scaled`,
`quantize_bound`, `table_codes`), the numerics and the storage codecs
(`aqtr.core.codecs`). Everything else (KV caches, quantized training, LoRA
storage, PTQ, checkpoints, freezers) calls them, so a NaN / tiny-magnitude
fix or a storage layout lives in one place. The scan reads code only
(strings and comments are dropped).
"""

from __future__ import annotations

import io
import pathlib
import re
import tokenize

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / 'aqtr'
OWNERS = ('core', 'numerics')

# Code that quantizes or packs bits (not in strings or comments).
PATTERNS = {
  'rounding': r'\b(jnp|np|lax)\.(round|rint|around)\(|\bround_even\(',
  'table rounding': r'\bsearchsorted\(',
  'narrow int cast': r'\.astype\(jnp\.u?int[48]\)',
  'int range': (
    r'(?<![\w.])127(\.0*)?\b|clip\([^)]*-\s*128\b|clip\([^)]*-\s*8\s*,\s*7\b'
  ),
  'bit shift': r'(?<!\b1 )<<\s*\w|>>\s*\w',
  'nibble mask': r'&\s*0x[0-9a-fA-F]+\b',
  'bit packing': r'\b(packbits|unpackbits)\(|bitwise_or\.reduce',
}

# Files allowed a pattern, with the reason (each must still match).
ALLOWED = {
  ('testing/tilings.py', 'int range'): 'a test tolerance of max|x| / 127',
}


def _code_lines(path: pathlib.Path) -> list[tuple[int, str]]:
  """(line number, code text) with strings and comments blanked."""
  src = path.read_text()
  lines = src.splitlines()
  blank = [list(line) for line in lines]
  toks = tokenize.generate_tokens(io.StringIO(src).readline)
  for tok in toks:
    if tok.type not in (tokenize.STRING, tokenize.COMMENT):
      continue
    (r0, c0), (r1, c1) = tok.start, tok.end
    for r in range(r0, r1 + 1):
      row = blank[r - 1]
      a = c0 if r == r0 else 0
      b = c1 if r == r1 else len(row)
      row[a:b] = ' ' * (b - a)
  return [(i + 1, ''.join(row)) for i, row in enumerate(blank)]


def _files():
  for path in sorted(ROOT.rglob('*.py')):
    rel = path.relative_to(ROOT)
    if rel.parts[0] not in OWNERS:
      yield rel.as_posix(), path


def _hits() -> dict[tuple[str, str], list[str]]:
  found: dict[tuple[str, str], list[str]] = {}
  for rel, path in _files():
    for n, code in _code_lines(path):
      for name, pattern in PATTERNS.items():
        if re.search(pattern, code):
          found.setdefault((rel, name), []).append(f'{rel}:{n}: {code}')
  return found


def test_no_quantizer_or_bit_packing_outside_the_core():
  bad = [
    line
    for key, lines in _hits().items()
    if key not in ALLOWED
    for line in lines
  ]
  assert not bad, (
    'quantizing / bit-packing code outside aqtr/core and aqtr/numerics '
    '(call aqtr.core.quantizer or aqtr.core.codecs instead):\n' + '\n'.join(bad)
  )


def test_allowed_entries_are_still_needed():
  hits = _hits()
  stale = [key for key in ALLOWED if key not in hits]
  assert not stale, f'remove from ALLOWED: {stale}'


@pytest.mark.parametrize(
  'code',
  [
    'q = jnp.round(x / s).astype(jnp.int8)',
    'p = (c[..., 0] & 0xF) | (c[..., 1] << 4)',
    'q = jnp.clip(v, -127, 127)',
    'q = jnp.clip(v, -8, 7)',
    'i = jnp.searchsorted(mids, x)',
  ],
)
def test_patterns_catch_the_old_quantizers(code, tmp_path):
  f = tmp_path / 'x.py'
  f.write_text(code + '\n')
  (_, line), *_ = _code_lines(f)
  assert any(re.search(p, line) for p in PATTERNS.values())


def test_strings_and_comments_are_not_code(tmp_path):
  f = tmp_path / 'x.py'
  f.write_text('"""q = round(127 x)"""\nx = 1  # >> 4\n')
  assert not any(
    re.search(p, line) for _, line in _code_lines(f) for p in PATTERNS.values()
  )
