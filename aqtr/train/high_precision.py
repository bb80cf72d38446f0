"""High-precision layers: the blocks a low-bit run keeps float, by rule.

Low-bit training recipes keep a few sensitive layers in higher precision:
NVIDIA's NVFP4 recipe (arXiv 2509.25149) keeps about 15 % of the linear
layers, mostly the final blocks, in BF16; Quartet (arXiv 2505.14669) and
most FP4 work keep the embedding and the output head out of FP4.
`HighPrecision` names such layers of a main-job model by position, and
`rules` turns them into `aqtr.pax` injection rules that leave those ops
float (first match wins, so they go before the run's own rule):

  first_blocks  the first n transformer blocks (MLP: hidden layers)
  last_blocks   the last n blocks
  head          the output projection (the LM's logits op, the MLP's
                classifier layer)

In an LM template the blocks are `layers[i]` and the head is `softmax`;
in an MLP template the layers but the last are the blocks and the last
one is the head. The embedding lookup is a gather and stays float anyway.

Example:
  >>> from aqtr.train import models
  >>> t = models.lm(vocab_size=256, seq_len=8, d_model=32, num_layers=3,
  ...               num_heads=2)
  >>> [r.path for r in HighPrecision(last_blocks=1, head=True).rules(t)]
  ['layers\\\\.2', 'softmax']
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import fiddle as fdl

import aqtr
from aqtr.rules import Rule

__all__ = [
  'check_high_precision',
  'RECIPE_CONFIGS',
  'RECIPE_KEEP',
  'RECIPE_RUNS',
  'HighPrecision',
  'high_precision',
]


def _count(name: str, v: Any) -> None:
  if not isinstance(v, int) or isinstance(v, bool) or v < 0:
    raise ValueError(f'HighPrecision.{name} must be an int >= 0, got {v!r}.')


@dataclasses.dataclass(frozen=True, kw_only=True)
class HighPrecision:
  """Which blocks of a model stay float in a quantized run.

  Attributes:
    first_blocks: the first n blocks stay float.
    last_blocks: the last n blocks stay float.
    head: the output projection stays float.
  """

  first_blocks: int = 0
  last_blocks: int = 0
  head: bool = False

  def __post_init__(self):
    _count('first_blocks', self.first_blocks)
    _count('last_blocks', self.last_blocks)
    if not isinstance(self.head, bool):
      raise ValueError(
        f'HighPrecision.head must be True or False, got {self.head!r}.'
      )

  @property
  def any(self) -> bool:
    """Whether any layer is kept float."""
    return bool(self.first_blocks or self.last_blocks or self.head)

  def label(self) -> str:
    """A short description, e.g. 'last 1 block + head' ('-': none)."""
    parts = []
    for n, where in ((self.first_blocks, 'first'), (self.last_blocks, 'last')):
      if n:
        parts.append(f'{where} {n} block{"s" if n > 1 else ""}')
    if self.head:
      parts.append('head')
    return ' + '.join(parts) or '-'

  def float_paths(self, template: Any) -> list[str]:
    """The op-path regexes kept float in `template` (a main-job model).

    Raises:
      ValueError: the template has no `layers` list, or fewer blocks than
        `first_blocks + last_blocks` asks for.
    """
    layers = getattr(template, 'layers', None)
    if not isinstance(layers, list | tuple):
      raise ValueError(
        'HighPrecision: the model template has no `layers` list (an '
        f'aqtr.train.models lm or mlp is expected), got {template!r:.100}.'
      )
    has_softmax = 'softmax' in getattr(template, '__arguments__', {})
    n = len(layers) if has_softmax else len(layers) - 1
    if self.first_blocks + self.last_blocks > n:
      raise ValueError(
        f'HighPrecision: first_blocks ({self.first_blocks}) + last_blocks '
        f"({self.last_blocks}) exceed the model's {n} blocks; keep fewer."
      )
    keep = sorted(
      set(range(self.first_blocks)) | set(range(n - self.last_blocks, n))
    )
    paths = [rf'layers\.{i}' for i in keep]
    if self.head:
      paths.append('softmax' if has_softmax else rf'layers\.{n}')
    return paths

  def rules(self, template: Any) -> list[Rule]:
    """Injection rules (config None: float) for `float_paths(template)`."""
    return [
      Rule(None, path=p, name=f'high precision {p}')
      for p in self.float_paths(template)
    ]


# The main job's 4-bit recipe runs (`aqtr.train.experiment.RUNS`): the
# presets, and the NVFP4 recipe less one ingredient each ('nvfp4_training'
# is the recipe less its high-precision layers). They keep the blocks of
# `Experiment.high_precision` float, by default `RECIPE_KEEP`.
RECIPE_CONFIGS = {
  'nvfp4_recipe': aqtr.presets.nvfp4_training,
  'nvfp4_recipe_no_rht': functools.partial(
    aqtr.presets.nvfp4_training, rht=False
  ),
  'nvfp4_recipe_no_sr': functools.partial(
    aqtr.presets.nvfp4_training, stochastic_rounding=False
  ),
  'nvfp4_recipe_no_2d': functools.partial(
    aqtr.presets.nvfp4_training, weight_blocks_2d=False
  ),
  'mxfp4_recipe': aqtr.presets.mxfp4_training,
}
RECIPE_RUNS = tuple(RECIPE_CONFIGS)
RECIPE_KEEP = HighPrecision(last_blocks=1, head=True)


def high_precision(
  cfg: fdl.Config,
  first_blocks: int = 0,
  last_blocks: int = 0,
  head: bool = False,
) -> None:
  """Fiddler: the blocks the recipe runs and the custom run keep float.

  Args:
    cfg: `fdl.Config(aqtr.train.experiment.Experiment)`.
    first_blocks: the first n blocks stay float.
    last_blocks: the last n blocks stay float.
    head: the output projection stays float.

  Example:
    >>> from aqtr.train import experiment
    >>> cfg = experiment.tiny()
    >>> high_precision(cfg, head=True)
    >>> cfg.high_precision.head, cfg.high_precision.last_blocks
    (True, 0)
  """
  cfg.high_precision = fdl.Config(
    HighPrecision,
    first_blocks=first_blocks,
    last_blocks=last_blocks,
    head=head,
  )


def check_high_precision(hp: Any) -> None:
  """Raises one line unless `hp` (Experiment.high_precision) is valid."""
  if hp is not None and not isinstance(hp, HighPrecision):
    raise ValueError(
      'high_precision must be an aqtr.train.high_precision.HighPrecision '
      'or None (set it with --config="fiddler:high_precision('
      f'last_blocks=1, head=True)"), got {hp!r}.'
    )
