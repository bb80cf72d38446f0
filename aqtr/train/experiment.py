"""The experiment config of the main job and its named variants.

`Experiment` holds everything a comparison needs except where to write:
task, model template, which runs, optimizer and schedule, data settings.
It is configured with Fiddle: `--config=config:NAME` picks one of the
functions below (they return `fdl.Config(Experiment)`), `set:` changes a
field, `fiddler:` applies a function of this module (`custom`, or the
registry-name fiddlers of `aqtr.fiddlers` on the `custom` run's tree).

Named configs (float + int8 + fp8 runs each; wall times measured on a
shared 2-core CPU under heavy load, an idle machine is faster):

  default  byte-level transformer LM on the stdlib corpus, 2 layers,
           d_model 128, 250 steps of 16 x 64 bytes  (~3.5 min loaded)
  tiny     the same at toy size, 40 steps (tests; ~40 s loaded)
  digits   MLP 64-256-256-10 on scikit-learn's digits, 300 steps (~40 s)
  long     the default model, 2000 steps of 32 x 64 bytes (estimate:
           ~30-60 min on 2 CPU cores)
  large    4 layers, d_model 256, seq 256, batch 32, 2000 steps (estimate:
           hours on CPU; meant for a GPU)

Example:
  >>> from aqtr.train import experiment
  >>> cfg = experiment.tiny()
  >>> cfg.steps, cfg.runs
  (40, ('float', 'int8', 'fp8'))
"""

from __future__ import annotations

import copy
import dataclasses
import math
import numbers
import types
from collections.abc import Callable
from typing import Any

import fiddle as fdl

import aqtr
from aqtr import fiddle as aqtr_fiddle
from aqtr.data import stdlib

# Registry-name fiddlers, usable on the `custom` run's tree (the flags
# resolve them by name in this module).
from aqtr.fiddlers import (  # noqa: F401
  set_fields,
  set_tag,
  use,
  use_calibration,
  use_numerics,
  use_rounding,
  use_sparsity,
  use_tiling,
)
from aqtr.pax.host import is_template
from aqtr.rules import Rule
from aqtr.train import lora_job, models, ptq_stage
from aqtr.train import mesh as mesh_lib
from aqtr.train import runs as runs_lib
from aqtr.train.high_precision import (
  RECIPE_KEEP,
  RECIPE_RUNS,
  HighPrecision,
  check_high_precision,
  high_precision,
)

__all__ = [
  'CONFIGS',
  'RECIPE_KEEP',
  'RECIPE_RUNS',
  'RUNS',
  'TASKS',
  'Experiment',
  'check_field',
  'custom',
  'default',
  'digits',
  'high_precision',
  'kept_float',
  'large',
  'long',
  'run_config',
  'split',
  'tiny',
]

TASKS = ('lm', 'digits')

# The runs an experiment may name in `runs` (`aqtr.train.runs`: run
# objects registered by name; register one there to offer another run).
RUNS: tuple[str, ...] = tuple(
  n for n in runs_lib.NAMES if n not in runs_lib.EXTRA
)


# Numeric fields: (type, allowed range as text, range test).
_RANGES: dict[str, tuple[type, str, Callable[[Any], bool]]] = {
  'steps': (int, '>= 1', lambda v: v >= 1),
  'batch_size': (int, '>= 1', lambda v: v >= 1),
  'seq_len': (int, '>= 2', lambda v: v >= 2),
  'learning_rate': (float, '> 0', lambda v: v > 0),
  'warmup_steps': (int, '>= 0', lambda v: v >= 0),
  'weight_decay': (float, '>= 0', lambda v: v >= 0),
  'grad_clip': (float, '> 0', lambda v: v > 0),
  'eval_every': (int, '>= 1', lambda v: v >= 1),
  'eval_batches': (int, '>= 1', lambda v: v >= 1),
  'log_every': (int, '>= 1', lambda v: v >= 1),
  'seed': (int, '>= 0', lambda v: v >= 0),
  'max_corpus_bytes': (int, '>= 1 or None', lambda v: v >= 1),
  'val_percent': (int, 'in 1..99', lambda v: 1 <= v <= 99),
  'sample_tokens': (int, '>= 0', lambda v: v >= 0),
  'ptq_batches': (int, '>= 1', lambda v: v >= 1),
  'lora_rank': (int, '>= 1', lambda v: v >= 1),
}


def check_field(name: str, value: Any) -> None:
  """Raises ValueError naming `name` unless `value` has its type and range.

  Ints must be integers (not bools, not 2.5); floats may be given as ints
  and must be finite.

  Example:
    >>> check_field('steps', 'abc')
    Traceback (most recent call last):
    ...
    ValueError: steps must be an int >= 1, got 'abc'.
  """
  kind, allowed, test = _RANGES[name]
  if value is None and allowed.endswith('or None'):
    return
  number = numbers.Integral if kind is int else numbers.Real
  ok = isinstance(value, number) and not isinstance(value, bool)
  if kind is int:
    what = f'an int {allowed}'
  else:
    ok = ok and math.isfinite(value)
    what = f'a finite number {allowed}'
  if not (ok and test(value)):
    raise ValueError(f'{name} must be {what}, got {value!r}.')


@dataclasses.dataclass(frozen=True, kw_only=True)
class Experiment:
  """One comparison: the same model, data and seed under several configs.

  Attributes:
    task: 'lm' (byte-level stdlib LM, reports bits per byte/char) or
      'digits' (MLP classifier, reports accuracy).
    model: the float model template (a Fiddle config, see
      `aqtr.train.models`); None: the task's default model.
    runs: names of `RUNS` to run, in order ('float' first gives the speed
      baseline): the presets of `aqtr.presets` and the quantized-training
      runs of `qt_runs` ('qt_int8', 'qt_int8_w8a8', 'float_adam8bit'),
      'int8_sparse_2_4_warm' (2:4 weights after 50 dense int8 steps),
      the 4-bit recipes 'nvfp4_recipe', 'mxfp4_recipe' (with their
      high-precision layers, see `high_precision`), the NVFP4 ablations
      'nvfp4_recipe_no_rht' / '_no_sr' / '_no_2d', 'nvfp4_naive', the
      stock nnx LM runs 'stock_float', 'stock_int8' (task 'lm';
      `aqtr.train.stock_lm`), and the LoRA fine-tunes of the float LM
      'lora', 'qlora_nf4' and of the stock LM 'stock_lora',
      'stock_qlora_nf4' (`aqtr.train.lora_job`; see `init_from`).
    custom: a user-chosen DotGeneralConfig (Fiddle tree), run last under
      the name 'custom'; None: no custom run.
    steps: optimizer steps per run.
    batch_size: sequences (lm) or images (digits) per step.
    seq_len: bytes per sequence (lm).
    learning_rate: peak Adam learning rate (linear warmup, cosine decay).
    warmup_steps: warmup length.
    weight_decay: AdamW decay.
    grad_clip: global gradient norm clip.
    eval_every: evaluate on the validation set every this many steps.
    eval_batches: validation batches per evaluation (lm).
    log_every: record the train loss every this many steps.
    seed: parameters, data order and stochastic rounding keys.
    max_corpus_bytes: train text read from the stdlib (lm); None: all.
    val_percent: share of stdlib files held out (lm).
    sample_tokens: new bytes of each sample in summary.md (lm: greedy and
      two sampled continuations of a fixed prompt, decoded from the
      serving checkpoint when there is one); 0: no samples.
    mesh: () one device; (n,) data parallel over n devices; (d, m) data x
      model parallel (see `aqtr.train.mesh`); the product must be the
      device count (checked when the run starts).
    distributed: call `jax.distributed.initialize()` first (multi-host;
      the coordinator comes from JAX's environment variables).
    stock_rules: `aqtr.rules.Rule`s quantizing the stock nnx LM
      (`aqtr.train.stock_lm`), run under the name 'stock_custom' (after
      the runs, before 'custom'); (): no such run. Add them with
      --config="fiddler:stock_rule('int4_weight_only', path='.*mlp.*')".
    ptq: post-training quantization methods (`aqtr.ptq`: 'rtn', 'gptq',
      ...) applied to the trained 'float' run, each in every format of
      `ptq_formats`; rows 'ptq:<method>:<format>' (`aqtr.train.ptq_stage`).
    ptq_formats: names of `aqtr.train.ptq_stage.FORMATS`.
    ptq_batches: training batches the ptq methods calibrate on.
    init_from: the float models the LoRA runs (`aqtr.train.lora_job`)
      fine-tune: an earlier job's folder (its 'float/float_params' for
      'lora', 'qlora_nf4'; 'stock_float/float_params' for the stock
      ones) or one such `float_params` checkpoint; None: the job's own
      'float' / 'stock_float' run (which must come before them in `runs`).
    finetune_family: the stdlib package the LoRA runs fine-tune on (and
      that the job's LM corpus then leaves out).
    lora_rank: the LoRA runs' adapter rank r (alpha = 2r).
    high_precision: the blocks kept float (`aqtr.train.high_precision`)
      by the recipe runs (`RECIPE_RUNS`) and the custom run; None: the
      recipes keep `RECIPE_KEEP` (last block + head), custom keeps none.
      Set it with --config="fiddler:high_precision(last_blocks=2)".
  """

  task: str = 'lm'
  model: Any = None
  runs: tuple[str, ...] = ('float', 'int8', 'fp8')
  custom: aqtr.DotGeneralConfig | None = None
  steps: int = 250
  batch_size: int = 16
  seq_len: int = 64
  learning_rate: float = 3e-3
  warmup_steps: int = 20
  weight_decay: float = 0.0
  grad_clip: float = 1.0
  eval_every: int = 50
  eval_batches: int = 8
  log_every: int = 10
  seed: int = 0
  max_corpus_bytes: int | None = 2_000_000
  val_percent: int = 10
  sample_tokens: int = 48
  mesh: tuple[int, ...] = ()
  distributed: bool = False
  stock_rules: tuple[Rule, ...] = ()
  ptq: tuple[str, ...] = ()
  ptq_formats: tuple[str, ...] = ('w4g128',)
  ptq_batches: int = 8
  init_from: str | None = None
  finetune_family: str = 'email'
  lora_rank: int = 8
  high_precision: HighPrecision | None = None

  def __post_init__(self):
    if self.task not in TASKS:
      raise ValueError(f'task must be one of {TASKS}, got {self.task!r}.')
    if self.model is not None and not is_template(self.model):
      raise ValueError(
        f'model must be a Fiddle model template or None, got {self.model!r}.'
      )
    runs = self.runs
    if isinstance(runs, list):
      object.__setattr__(self, 'runs', tuple(runs))
    if not isinstance(self.runs, tuple) or not all(
      isinstance(n, str) for n in self.runs
    ):
      raise ValueError(
        f"runs must be a tuple of run names, e.g. ('float',), got {runs!r}."
      )
    for name in self.runs:
      if name not in runs_lib.registry or name in runs_lib.EXTRA:
        known = ', '.join(runs_lib.names())
        raise ValueError(
          f'runs: unknown run {name!r}; runs: {known} (a config '
          'of your own goes in `custom`, e.g. '
          '--config="fiddler:custom(\'int8\')").'
        )
    if len(set(self.runs)) != len(self.runs):
      raise ValueError(f'runs has duplicates: {self.runs}.')
    if self.custom is not None and not isinstance(
      self.custom, aqtr.DotGeneralConfig
    ):
      raise ValueError(
        'custom must be a DotGeneralConfig or None (set it with '
        f'--config="fiddler:custom(\'int8\')"), got {self.custom!r}.'
      )
    rules = self.stock_rules
    if isinstance(rules, list):
      object.__setattr__(self, 'stock_rules', tuple(rules))
    if not isinstance(self.stock_rules, tuple) or not all(
      isinstance(r, Rule) for r in self.stock_rules
    ):
      raise ValueError(
        'stock_rules must be a tuple of aqtr.rules.Rule (add one with '
        f'--config="fiddler:stock_rule(\'int8\')"), got {rules!r}.'
      )
    lm = [n for n in self.run_names if runs_lib.get(n).lm_only]
    if lm and self.task != 'lm':
      raise ValueError(
        f"runs: {', '.join(lm)} need task 'lm', got {self.task!r}."
      )
    lora_runs = {n: runs_lib.get(n) for n in self.runs}
    lora_job.check_fields(
      self, {n: r for n, r in lora_runs.items() if r.trains == 'adapters'}
    )
    if not self.runs and self.custom is None and not self.stock_rules:
      raise ValueError('nothing to run: runs is empty and custom is None.')
    for name in _RANGES:
      check_field(name, getattr(self, name))
    if isinstance(self.mesh, list):
      object.__setattr__(self, 'mesh', tuple(self.mesh))
    if not isinstance(self.mesh, tuple):
      raise ValueError(f'mesh must be a tuple of ints, got {self.mesh!r}.')
    error = mesh_lib.shape_error(self.mesh)  # Devices: checked at run time.
    if error:
      raise ValueError(error)
    ptq_stage.check_fields(self)
    if not isinstance(self.distributed, bool):
      raise ValueError(
        f'distributed must be True or False, got {self.distributed!r}.'
      )
    check_high_precision(self.high_precision)

  @property
  def holds_out_family(self) -> bool:
    """Whether the job's LM corpus leaves out `finetune_family`: its own
    runs train the float models that LoRA runs fine-tune on it."""
    return self.init_from is None and any(
      runs_lib.get(n).trains == 'adapters' for n in self.runs
    )

  @property
  def run_names(self) -> tuple[str, ...]:
    """Names of the runs in order; 'stock_custom', 'custom' last if set."""
    return (
      self.runs
      + (('stock_custom',) if self.stock_rules else ())
      + (('custom',) if self.custom is not None else ())
    )


def _lm(**model: Any) -> fdl.Config:
  # The position table's size follows Experiment.seq_len, see `split`.
  return models.lm(vocab_size=stdlib.VOCAB_SIZE, seq_len=1, **model)


def default() -> fdl.Config:
  """The bare command's experiment: the stdlib byte LM, float/int8/fp8."""
  return fdl.Config(
    Experiment,
    model=_lm(d_model=128, num_layers=2, num_heads=4),
  )


def tiny() -> fdl.Config:
  """A toy LM for tests and smoke runs (~20 s on 2 cores)."""
  return fdl.Config(
    Experiment,
    model=_lm(d_model=32, num_layers=1, num_heads=2),
    steps=40,
    batch_size=8,
    seq_len=32,
    learning_rate=1e-2,
    warmup_steps=5,
    eval_every=20,
    eval_batches=4,
    log_every=5,
    max_corpus_bytes=200_000,
  )


def digits() -> fdl.Config:
  """MLP on scikit-learn's 8x8 digits; reports validation accuracy."""
  return fdl.Config(
    Experiment,
    task='digits',
    model=models.mlp(num_classes=10, hidden=(256, 256)),
    steps=300,
    batch_size=64,
    learning_rate=3e-3,
    eval_every=50,
  )


def long() -> fdl.Config:
  """The default experiment trained 8x longer on 2x larger batches."""
  cfg = default()
  cfg.steps, cfg.batch_size, cfg.eval_every, cfg.log_every = 2000, 32, 250, 25
  cfg.warmup_steps, cfg.max_corpus_bytes = 100, None
  return cfg


def large() -> fdl.Config:
  """A bigger LM run for a GPU or a long CPU session."""
  return fdl.Config(
    Experiment,
    model=_lm(d_model=256, num_layers=4, num_heads=8),
    steps=2000,
    batch_size=32,
    seq_len=256,
    learning_rate=1e-3,
    warmup_steps=100,
    eval_every=250,
    eval_batches=16,
    log_every=25,
    max_corpus_bytes=None,
  )


# The named configs of `--config=config:NAME`, in the order help lists them.
CONFIGS: dict[str, Callable[[], fdl.Config]] = {
  'default': default,
  'tiny': tiny,
  'digits': digits,
  'long': long,
  'large': large,
}


def run_config(
  name: str, custom: aqtr.DotGeneralConfig | None = None
) -> aqtr.DotGeneralConfig:
  """The DotGeneralConfig of the run `name` ('custom': `custom`).

  'stock_custom' (rules, not one config) shows as float here.
  """
  return runs_lib.get(name).dot_config(types.SimpleNamespace(custom=custom))


def kept_float(name: str, exp: Experiment) -> HighPrecision | None:
  """The blocks run `name` keeps float (None: none).

  Example:
    >>> exp = Experiment(runs=('fp8', 'nvfp4_recipe'))
    >>> kept_float('fp8', exp), kept_float('nvfp4_recipe', exp).label()
    (None, 'last 1 block + head')
  """
  return runs_lib.get(name).keep(exp)


def custom(
  cfg: fdl.Config, preset: str = 'int8', *args: Any, **kwargs: Any
) -> None:
  """Fiddler: adds the run 'custom' with `aqtr.presets.<preset>(*args)`.

  The tree is fully expanded, so later `set:custom.fwd.lhs.numerics.bits=4`
  or `fiddler:use_rounding('custom\\.d.hs\\.lhs', 'stochastic')` reach it.

  Example:
    >>> cfg = tiny()
    >>> custom(cfg, 'fully_quantized', fwd_bits=4)
    >>> cfg.custom.fwd.lhs.numerics.bits
    4
  """
  cfg.custom = aqtr_fiddle.config(preset, *args, **kwargs)


def split(cfg: fdl.Config) -> tuple[Experiment, Any, Any]:
  """Builds the experiment, keeping the model template unbuilt.

  Args:
    cfg: `fdl.Config(Experiment)`.

  Returns:
    (experiment, model template, custom DotGeneralConfig or None). The
    template is a copy; an LM's `max_len` is set to `seq_len`.
  """
  if not (isinstance(cfg, fdl.Config) and fdl.get_callable(cfg) is Experiment):
    raise ValueError(f'not an Experiment config: {cfg!r:.200}')
  exp = aqtr_fiddle.build(fdl.copy_with(cfg, model=None))
  if cfg.model is not None and not is_template(cfg.model):
    raise ValueError(
      f'model must be a Fiddle model template or None, got {cfg.model!r}.'
    )
  template = copy.deepcopy(cfg.model)
  if template is None:
    template = models.mlp(10) if exp.task == 'digits' else _lm()
  if exp.task == 'lm' and 'max_len' in fdl.ordered_arguments(template):
    template.max_len = exp.seq_len
  return dataclasses.replace(exp, model=template), template, exp.custom
