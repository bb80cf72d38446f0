"""A census of an optimized HLO module: its GEMMs, loops and big kernels.

Reads the text of a compiled program (`jax.jit(f).lower(...).compile()
.as_text()`) and counts what decides a quantized dot's speed on an
accelerator:

- every GEMM: a custom call to a GEMM library (`__cublas$lt$matmul`,
  `__cublas$lt$matmul$f8`, `__cublas$gemm`, cuDNN), a fusion whose body
  holds a `dot` (a Triton GEMM fusion on XLA:GPU, a YNNPACK fusion on
  XLA:CPU), or a bare `dot`; each with the element types it multiplies
  (the dot's own operands, so a Triton fusion that converts s8 to bf16
  inside shows bf16) and its result type;
- `while` loops;
- the other kernels (fusions and unfused ops outside fusion bodies) that
  read or write a tensor of at least `big_elements` elements: an
  operand-sized tensor when `big_elements` is the smallest of the dot's
  operand and output sizes.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from benchmarks import hlo_census
  >>> f = jax.jit(lambda a, b: a @ b)
  >>> text = f.lower(jnp.ones((8, 8)), jnp.ones((8, 8))).compile().as_text()
  >>> [g.types for g in hlo_census.census(text, 64).gemms]
  ['f32 x f32 -> f32']
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

_HEADER = re.compile(
  r'^(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\)\s*->\s*.*)?\{\s*$'
)
_INSTR = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$')
_START = re.compile(r'^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?:\(|[a-z]\w*\[)')
_ARRAY = re.compile(r'\b([a-z][a-z0-9]*)\[([\d,]*)\]')
_OPCODE = re.compile(r'([\w\-]+)\(')
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_CALLS = re.compile(r'\bcalls=%?([\w.\-]+)')
_KIND = re.compile(r'"kind":"([\w$]+)"')
_LAYOUT = re.compile(r'\[([\d,]*)\](?:\{([\d,]*)[}:])?')
_CONTRACT = re.compile(
  r'(lhs|rhs)_contracting_dim(?:s=\{([\d,]*)\}|ensions":\[([\d",]*)\])'
)
_FUSION_KIND = re.compile(r'\bkind=(k\w+)')
_GEMM_TARGET = re.compile(r'cublas|gemm|matmul', re.IGNORECASE)
# Ops that move no data of their own (aliases, tuples, control flow).
_FREE = frozenset(
  {
    'parameter',
    'constant',
    'tuple',
    'get-tuple-element',
    'bitcast',
    'while',
    'call',
    'conditional',
    'opt-barrier',
    'optimization-barrier',
    'after-all',
    'add-dependency',
  }
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Instr:
  """One HLO instruction: its name, result type, opcode and the rest."""

  name: str
  type: str
  opcode: str
  operands: tuple[str, ...]
  attrs: str
  computation: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class Gemm:
  """One GEMM of the program.

  Attributes:
    name: the instruction (custom call, fusion or dot) that runs it.
    kind: `custom-call <target>`, `fusion <backend kind>` or `dot`.
    types: 'lhs x rhs -> out' element types ('s8 x s8 -> s32'); for a
      fusion whose array inputs have other types (a dot on converted
      operands), those follow: 'f16 x f16 -> f16 [inputs s8, f16]'.
    layout: which operands contract their minor (fastest-varying) axis,
      'K minor: both' (what cuBLASLt's int8 / fp8 kernels want), 'lhs',
      'rhs' or 'none'; then the output's layout if it is not row-major
      ('; out {0,1}').
  """

  name: str
  kind: str
  types: str
  layout: str = ''


@dataclasses.dataclass(frozen=True, kw_only=True)
class BigKernel:
  """A non-GEMM kernel that reads or writes an operand-sized tensor.

  Attributes:
    name: the instruction.
    opcode: 'fusion', 'copy', 'transpose', ...
    reads: element types and shapes of its big inputs ('f32[64,128]').
    writes: the same for its big outputs.
    nbytes: bytes of those big inputs and outputs together.
  """

  name: str
  opcode: str
  reads: tuple[str, ...]
  writes: tuple[str, ...]
  nbytes: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Census:
  """What `census` found in one module."""

  gemms: tuple[Gemm, ...]
  whiles: int
  big: tuple[BigKernel, ...]

  def gemm_summary(self) -> str:
    """The GEMMs grouped: 'kind: types xN; ...' (order of first use)."""
    counts = collections.Counter(
      (_short(g.kind), g.types, g.layout) for g in self.gemms
    )
    return '; '.join(
      f'{k}: {t}' + (f' ({lay})' if lay else '') + (f' x{n}' if n > 1 else '')
      for (k, t, lay), n in counts.items()
    )

  def big_summary(self) -> str:
    """'N (M touch >1)': big kernels, and those with >1 big tensor."""
    multi = sum(1 for b in self.big if len(b.reads) + len(b.writes) > 1)
    return f'{len(self.big)} ({multi} touch >1)'

  def as_dict(self) -> dict:
    """A JSON-ready dict of everything found."""
    return dataclasses.asdict(self)


def _short(kind: str) -> str:
  return kind.replace('custom-call ', '').replace('fusion ', '')


def _split_type(rest: str) -> tuple[str, str]:
  """('(s32[], f32[2])', 'tuple(...)...') from a tuple-typed line."""
  if not rest.startswith('('):
    head, _, tail = rest.partition(' ')
    return head, tail
  depth = 0
  for i, ch in enumerate(rest):
    depth += {'(': 1, ')': -1}.get(ch, 0)
    if depth == 0:
      return rest[: i + 1], rest[i + 1 :].lstrip()
  return rest, ''


def _split_operands(body: str) -> tuple[str, str]:
  """(operand text, attributes) of 'a, b), attr=...' (parens balanced)."""
  depth = 1
  for i, ch in enumerate(body):
    depth += {'(': 1, ')': -1, '{': 1, '}': -1}.get(ch, 0)
    if depth == 0:
      return body[:i], body[i + 1 :]
  return body, ''


def _statements(text: str) -> list[str]:
  """The module's lines, an instruction split over lines joined into one."""
  out = []
  for line in text.splitlines():
    s = line.strip()
    if not s or s.startswith('//'):
      continue
    starts = _START.match(line) or _HEADER.match(line) or s[0] in '}H'
    if out and not starts:
      out[-1] += ' ' + s
    else:
      out.append(line)
  return out


def _operand_names(text: str) -> tuple[str, ...]:
  """'s8[2,3]{1,0} %a, %b, /*index=2*/c' -> ('a', 'b', 'c')."""
  text = re.sub(r'/\*.*?\*/', '', text)
  parts, depth, cur = [], 0, ''
  for ch in text:
    depth += {'(': 1, '[': 1, '{': 1, ')': -1, ']': -1, '}': -1}.get(ch, 0)
    if ch == ',' and depth == 0:
      parts.append(cur)
      cur = ''
    else:
      cur += ch
  parts.append(cur)
  return tuple(p.split()[-1].lstrip('%') for p in parts if p.strip())


def parse(text: str) -> list[Instr]:
  """The instructions of an HLO module's text, with their computation."""
  out, comp = [], ''
  for line in _statements(text):
    header = _HEADER.match(line)
    if header:
      comp = header.group(1)
      continue
    m = _INSTR.match(line)
    if not m or not _START.match(line):
      continue
    typ, rest = _split_type(m.group(2))
    op = _OPCODE.match(rest)
    if not op:
      continue
    operands, attrs = _split_operands(rest[op.end() :])
    out.append(
      Instr(
        name=m.group(1),
        type=typ,
        opcode=op.group(1),
        operands=_operand_names(operands),
        attrs=attrs,
        computation=comp,
      )
    )
  return out


def arrays(type_str: str) -> list[tuple[str, str, int]]:
  """(element type, dims, element count) of each array in a (tuple) type."""
  return [
    (dt, dims, math.prod(int(d) for d in dims.split(',') if d))
    for dt, dims in _ARRAY.findall(type_str)
  ]


def _dtype(type_str: str) -> str:
  found = arrays(type_str)
  return found[0][0] if found else '?'


def _minor(type_str: str) -> tuple[int | None, list[int]]:
  """(minor dimension, layout) of the first array of a type."""
  m = _LAYOUT.search(type_str)
  rank = len([d for d in m.group(1).split(',') if d]) if m else 0
  if not rank:
    return None, []
  if m.group(2):
    layout = [int(d) for d in m.group(2).split(',') if d]
  else:
    layout = list(range(rank - 1, -1, -1))
  return layout[0], layout


def _layout(i: Instr, lhs: str, rhs: str) -> str:
  """'K minor: both' etc. for a dot or GEMM call (see Gemm.layout)."""
  dims = {'lhs': set(), 'rhs': set()}
  for side, a, b in _CONTRACT.findall(i.attrs):
    dims[side] |= {int(d) for d in re.findall(r'\d+', a or b)}
  sides = [
    side
    for side, t in (('lhs', lhs), ('rhs', rhs))
    if _minor(t)[0] in dims[side]
  ]
  name = {2: 'both', 0: 'none'}.get(len(sides), sides[0] if sides else '')
  _, out = _minor(i.type)
  if out and out != sorted(out, reverse=True):
    name += f'; out {{{",".join(map(str, out))}}}'
  return f'K minor: {name}'


_BYTES = {'pred': 1, 's4': 1, 'u4': 1, 'f4e2m1fn': 1, 'f8e8m0fnu': 1}


def _nbytes(dtype: str, n: int) -> int:
  if dtype in _BYTES or dtype.startswith('f8'):
    return n
  bits = re.search(r'\d+', dtype)
  return n * (int(bits.group()) // 8 if bits else 4)


_NUMPY = {
  'f32': 'float32',
  'f16': 'float16',
  'bf16': 'bfloat16',
  's8': 'int8',
  's32': 'int32',
  'f64': 'float64',
}


def _shape_dtype(type_str: str) -> tuple[tuple[int, ...], str]:
  dt, dims, _ = arrays(type_str)[0]
  return tuple(int(d) for d in dims.split(',') if d), _NUMPY.get(dt, dt)


def _dims(attrs: str, name: str) -> tuple[int, ...]:
  m = re.search(name + r'=\{([\d,]*)\}', attrs)
  return tuple(int(d) for d in m.group(1).split(',') if d) if m else ()


def dots(text: str) -> collections.Counter:
  """The `dot` instructions of an HLO module (fusion bodies included),
  counted by what `lax.dot_general` needs to run each alone.

  Operands in a non-default layout are read as row-major (the key holds
  shapes, not layouts). Dots in a computation called more than once (a
  loop body) count once.

  Args:
    text: an optimized HLO module's text (`compiled.as_text()`).

  Returns:
    Counter of ((lhs shape, lhs dtype), (rhs shape, rhs dtype), dimension
    numbers, output dtype) -> instructions; dtypes as numpy names.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> f = jax.jit(lambda a, b: a @ b)
    >>> text = f.lower(jnp.ones((8, 4)), jnp.ones((4, 2))).compile().as_text()
    >>> [(a, b, dn, n) for (a, b, dn, _), n in dots(text).items()]
    [(((8, 4), 'float32'), ((4, 2), 'float32'), (((1,), (0,)), ((), ())), 1)]
  """
  instrs = parse(text)
  types = {i.name: i.type for i in instrs}
  out = collections.Counter()
  for i in instrs:
    if i.opcode != 'dot':
      continue
    a, b = (_shape_dtype(types[o]) for o in i.operands)
    dn = (
      (
        _dims(i.attrs, 'lhs_contracting_dims'),
        _dims(i.attrs, 'rhs_contracting_dims'),
      ),
      (_dims(i.attrs, 'lhs_batch_dims'), _dims(i.attrs, 'rhs_batch_dims')),
    )
    out[a, b, dn, _shape_dtype(i.type)[1]] += 1
  return out


def census(text: str, big_elements: int) -> Census:
  """The GEMMs, `while` loops and big non-GEMM kernels of an HLO module.

  Args:
    text: an optimized HLO module's text (`compiled.as_text()`).
    big_elements: the element count from which a tensor counts as
      operand-sized (the smallest of the dot's operands and output).

  Returns:
    A Census (GEMMs in program order, loop count, big kernels).
  """
  instrs = parse(text)
  by_name = {i.name: i for i in instrs}
  caller = {}  # fused computation -> the fusion instruction calling it
  for i in instrs:
    if i.opcode == 'fusion':
      for c in _CALLS.findall(i.attrs):
        caller[c] = i

  def outermost(comp: str) -> Instr | None:
    fusion, seen = None, set()
    while comp in caller and comp not in seen:
      seen.add(comp)
      fusion = caller[comp]
      comp = fusion.computation
    return fusion

  def types(i: Instr, n: int = 2) -> str:
    ins = [_dtype(by_name[o].type) for o in i.operands[:n] if o in by_name]
    return f'{" x ".join(ins)} -> {_dtype(i.type)}'

  def layout(i: Instr) -> str:
    ops = [by_name[o].type for o in i.operands[:2] if o in by_name]
    return _layout(i, *ops) if len(ops) == 2 else ''

  gemms, gemm_names = [], set()
  for i in instrs:
    if i.opcode in ('dot', 'scaled-dot', 'ragged-dot'):
      fusion = outermost(i.computation)
      if fusion is None:
        gemms.append(
          Gemm(name=i.name, kind=i.opcode, types=types(i), layout=layout(i))
        )
        gemm_names.add(i.name)
      elif fusion.name not in gemm_names:
        kind = _KIND.search(fusion.attrs) or _FUSION_KIND.search(fusion.attrs)
        label = kind.group(1) if kind else '?'
        t = types(i)
        ins = list(
          dict.fromkeys(
            dt
            for o in fusion.operands
            if o in by_name
            for dt, dims, _ in arrays(by_name[o].type)
            if dims
          )
        )
        if set(ins) != set(t.split(' -> ')[0].split(' x ')):
          t += f' [inputs {", ".join(ins)}]'
        gemms.append(
          Gemm(
            name=fusion.name,
            kind=f'fusion {label}',
            types=t,
            layout=layout(i),
          )
        )
        gemm_names.add(fusion.name)
    elif i.opcode == 'custom-call' and i.computation not in caller:
      target = _TARGET.search(i.attrs)
      if target and _GEMM_TARGET.search(target.group(1)):
        gemms.append(
          Gemm(
            name=i.name,
            kind=f'custom-call {target.group(1)}',
            types=types(i),
            layout=layout(i),
          )
        )
        gemm_names.add(i.name)
  order = {i.name: n for n, i in enumerate(instrs)}
  gemms.sort(key=lambda g: order[g.name])
  big = []
  for i in instrs:
    if (
      i.computation in caller
      or i.opcode in _FREE
      or i.name in gemm_names
      or i.opcode.endswith(('-done', '-update'))
    ):
      continue
    reads = [
      a
      for o in dict.fromkeys(i.operands)
      if o in by_name
      for a in arrays(by_name[o].type)
      if a[2] >= big_elements
    ]
    writes = [a for a in arrays(i.type) if a[2] >= big_elements]
    if reads or writes:
      big.append(
        BigKernel(
          name=i.name,
          opcode=i.opcode,
          reads=tuple(f'{dt}[{dims}]' for dt, dims, _ in reads),
          writes=tuple(f'{dt}[{dims}]' for dt, dims, _ in writes),
          nbytes=sum(_nbytes(dt, n) for dt, _, n in reads + writes),
        )
      )
  whiles = sum(1 for i in instrs if i.opcode == 'while')
  return Census(gemms=tuple(gemms), whiles=whiles, big=tuple(big))
