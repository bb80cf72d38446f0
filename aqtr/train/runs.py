"""Run objects: what each run of `aqtr-train` builds, trains and does after.

A run name (`--config="set:runs=('float','int8')"`) names a run class in
`registry` (`aqtr.core.registry.Registry`); `get(name)` builds its object,
a frozen dataclass saying

  config     the DotGeneralConfig factory of its weight ops (Pax runs; the
             config shown for the others)
  trains     'all' parameters, 'qt' (weights kept only quantized,
             `aqtr.qt`), or 'adapters' (LoRA: the base frozen)
  init_from  the run whose trained float model it starts from (LoRA), or
             None: the experiment's initial parameters
  post       steps after training (`POST`): 'report' (injection.txt),
             'serve' (convert, serving checkpoint, serve == train),
             'save_base' (the float model LoRA runs start from), 'ptq'
             (the experiment's PTQ stage of this run, rows last), 'lora'
             (the LoRA run's frozen / merged numbers)

and `execute(ctx)` trains it with the job's loop (`aqtr.train.loop.fit`,
through `pax_run`, `stock_lm` or `lora_job`). Classes: `PaxRun` (the job's
template quantized by one config: presets, QT, recipes), `CustomRun`
(`Experiment.custom`), `StockRun` (the stock nnx LM by rules), `MoeRun`
(the stock MoE decoder by DeepSeek's FP8 recipes), `LoraRun`.
Register another run with `register(name, cls, **defaults)`.

Example:
  >>> r = get('nvfp4_recipe')
  >>> type(r).__name__, r.trains, r.post
  ('PaxRun', 'all', ('report', 'serve'))
  >>> get('stock_qlora_nf4').init_from
  'stock_float'
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
from collections.abc import Callable
from typing import Any

import aqtr
from aqtr.core.registry import Registry
from aqtr.flax import common
from aqtr.lora import config as lora_config
from aqtr.train import (
  lora_job,
  models,
  pax_run,
  ptq_stage,
  qt_runs,
  serving,
  stock_moe,
)
from aqtr.train import stock_lm as stock
from aqtr.train.high_precision import RECIPE_CONFIGS, RECIPE_KEEP, HighPrecision
from aqtr.train.loop import RunResult

__all__ = [
  'NAMES',
  'POST',
  'Context',
  'CustomRun',
  'LoraRun',
  'MoeRun',
  'Outcome',
  'PaxRun',
  'Run',
  'StockRun',
  'get',
  'names',
  'register',
  'registry',
]

TRAINS = ('all', 'qt', 'adapters')
# Runs the experiment adds (`Experiment.run_names`), not named in `runs`.
EXTRA = ('stock_custom', 'custom')


@dataclasses.dataclass
class Context:
  """What a run needs from the job (one per run: `run_dir` differs)."""

  exp: Any
  task: Any
  template: Any
  params: Any  # The experiment's initial float parameters.
  run_dir: pathlib.Path
  say: Callable[..., None]
  on_record: Callable[[dict], None]
  show_progress: bool = True
  bases: dict = dataclasses.field(default_factory=dict)  # run -> float model
  late: list = dataclasses.field(default_factory=list)  # () -> rows


@dataclasses.dataclass
class Outcome:
  """A trained run: its result, serving check, float bytes, samples."""

  result: RunResult
  float_bytes: int
  serve: dict | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Run:
  """A run of the main job (see the module docstring).

  Attributes:
    config: () -> the DotGeneralConfig of its weight ops.
    trains: 'all', 'qt' or 'adapters'.
    init_from: the run whose trained float model it starts from, or None.
    post: names of `POST` steps, in order.
    lm_only: the run needs task 'lm'.
    baseline: the speed baseline ('x float') and the PTQ stage's source.
  """

  config: Callable[[], aqtr.DotGeneralConfig] = aqtr.presets.float
  trains: str = 'all'
  init_from: str | None = None
  post: tuple[str, ...] = ('report', 'serve')
  lm_only: bool = False
  baseline: bool = False

  def __post_init__(self):
    if self.trains not in TRAINS:
      raise ValueError(f'Run.trains must be one of {TRAINS}: {self.trains!r}.')
    bad = [p for p in self.post if p not in POST]
    if bad:
      raise ValueError(f'Run.post: unknown steps {bad}; steps: {list(POST)}.')

  @property
  def name(self) -> str:
    return type(self).registered_name

  def dot_config(self, exp) -> aqtr.DotGeneralConfig:
    """The DotGeneralConfig of its weight ops (shown in config.txt)."""
    del exp
    return self.config()

  def keep(self, exp) -> HighPrecision | None:
    """The blocks it keeps float (`aqtr.train.high_precision`)."""
    del exp

  def execute(self, ctx: Context) -> Outcome:
    """Trains the run."""
    raise NotImplementedError

  def serve(self, ctx: Context, r: RunResult) -> dict | None:
    """Converts the trained run and checks serve == train (None: no)."""
    del ctx, r

  def base(self, r: RunResult) -> Any:
    """The float model a LoRA run starting from this one fine-tunes."""
    raise ValueError(f'runs: {self.name!r} is no float base for LoRA runs.')


registry: Registry = Registry('runs', Run)
NAMES: list[str] = []  # Registered names, in registration order.


def register(name: str, cls: type, **defaults: Any) -> type:
  """Registers run `name`: a subclass of `cls` with these field defaults.

  Example (how the preset runs are registered):
    >>> cls = registry.get('int8')  # register('int8', PaxRun, config=...)
    >>> cls.__qualname__, cls().dot_config(None).fwd.lhs.numerics.bits
    ('PaxRun[int8]', 8)
  """
  fields = [(k, Any, dataclasses.field(default=v)) for k, v in defaults.items()]
  sub = dataclasses.make_dataclass(
    f'{cls.__name__}_{name}',
    fields,
    bases=(cls,),
    frozen=True,
    kw_only=True,
    namespace={'__module__': cls.__module__},
  )
  sub.__name__ = sub.__qualname__ = cls.__name__
  sub.__qualname__ = f'{cls.__qualname__}[{name}]'
  registry.register(name)(sub)
  if name not in NAMES:
    NAMES.append(name)
  return sub


def names() -> tuple[str, ...]:
  """The run names `Experiment.runs` takes, in registration order."""
  return tuple(n for n in NAMES if n not in EXTRA)


def get(name: str) -> Run:
  """The run object of run `name` (one line listing the names if unknown)."""
  return registry.get(name)()


@dataclasses.dataclass(frozen=True, kw_only=True)
class PaxRun(Run):
  """The job's template quantized by `config` (`pax_run.train`).

  Attributes:
    spec: a quantized-training / 8-bit-optimizer run (`qt_runs`), or None.
    recipe: keeps `Experiment.high_precision` float, by default
      `RECIPE_KEEP` (the 4-bit recipes).
  """

  spec: qt_runs.RunSpec | None = None
  recipe: bool = False

  def keep(self, exp) -> HighPrecision | None:
    return (exp.high_precision or RECIPE_KEEP) if self.recipe else None

  def execute(self, ctx: Context) -> Outcome:
    exp = ctx.exp
    r = pax_run.train(
      self.name,
      self.dot_config(exp),
      exp,
      ctx.task,
      ctx.template,
      params=ctx.params,
      on_record=ctx.on_record,
      show_progress=ctx.show_progress,
      spec=self.spec,
      keep=self.keep(exp),
    )
    return Outcome(result=r, float_bytes=common.nbytes(ctx.params))

  def serve(self, ctx: Context, r: RunResult) -> dict | None:
    if not models.has_frozen_weights(r.injected):
      return None
    return serving.check(
      r.injected,
      r.params,
      r.config,
      r.logits_fn,
      ctx.task.eval_set,
      ctx.run_dir / 'serving',
      r.collections,
      model=ctx.template if ctx.task.name == 'lm' else None,
      keep=self.keep(ctx.exp),
    )

  def base(self, r: RunResult) -> Any:
    return r.params


@dataclasses.dataclass(frozen=True, kw_only=True)
class CustomRun(PaxRun):
  """The run of `Experiment.custom`, keeping `Experiment.high_precision`."""

  def dot_config(self, exp) -> aqtr.DotGeneralConfig:
    return exp.custom

  def keep(self, exp) -> HighPrecision | None:
    return exp.high_precision


@dataclasses.dataclass(frozen=True, kw_only=True)
class StockRun(Run):
  """The stock nnx LM quantized by rules (`aqtr.train.stock_lm`).

  Attributes:
    rules: its `aqtr.rules.Rule`s; None: float.
    custom: the rules are `Experiment.stock_rules`.
  """

  rules: tuple | None = None
  custom: bool = False
  lm_only: bool = True

  def rules_of(self, exp) -> tuple | None:
    return tuple(exp.stock_rules) if self.custom else self.rules

  def execute(self, ctx: Context) -> Outcome:
    r = stock.train(
      self.name,
      ctx.exp,
      ctx.task,
      ctx.template,
      rules=self.rules_of(ctx.exp),
      on_record=ctx.on_record,
      show_progress=ctx.show_progress,
    )
    return Outcome(result=r, float_bytes=stock.float_bytes(r))

  def serve(self, ctx: Context, r: RunResult) -> dict | None:
    if self.rules_of(ctx.exp) is None:
      return None
    return stock.serve(r, ctx.task)

  def base(self, r: RunResult) -> Any:
    return r.injected


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoeRun(Run):
  """The stock MoE decoder by a recipe's rules (`aqtr.train.stock_moe`)."""

  lm_only: bool = True

  def execute(self, ctx: Context) -> Outcome:
    r = stock_moe.train(
      self.name,
      ctx.exp,
      ctx.task,
      ctx.template,
      on_record=ctx.on_record,
      show_progress=ctx.show_progress,
    )
    return Outcome(result=r, float_bytes=stock.float_bytes(r))

  def serve(self, ctx: Context, r: RunResult) -> dict | None:
    if self.name == 'moe_float':
      return None
    return stock.serve(r, ctx.task)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraRun(Run):
  """LoRA / QLoRA fine-tune of a float run's model (`lora_job`).

  Attributes:
    stock: fine-tunes the stock nnx LM (else the job's Pax LM).
    base_format: the frozen base's storage: None (float) or 'nf4'.
  """

  stock: bool = False
  base_format: str | None = None
  trains: str = 'adapters'
  lm_only: bool = True
  post: tuple[str, ...] = ('lora',)

  def execute(self, ctx: Context) -> Outcome:
    want, exp = self.init_from, ctx.exp
    if want not in ctx.bases:
      path = lora_job.base_path(exp.init_from, want)
      ctx.bases[want] = lora_job.load_base(
        path, ctx.template, exp.seed, stock=self.stock
      )
    r, serve = lora_job.run(
      self,
      exp,
      ctx.bases[want],
      ctx.run_dir,
      template=ctx.template,
      on_record=ctx.on_record,
      show_progress=ctx.show_progress,
    )
    return Outcome(result=r, float_bytes=serve['float_bytes'], serve=serve)


def _report(run: Run, ctx: Context, out: Outcome) -> None:
  (ctx.run_dir / 'injection.txt').write_text(str(out.result.report) + '\n')


def _serve(run: Run, ctx: Context, out: Outcome) -> None:
  r = out.result
  if r.diverged:
    return
  out.serve = run.serve(ctx, r)
  if out.serve is None:
    return
  s = out.serve
  (ctx.run_dir / 'serving.json').write_text(json.dumps(s, indent=1))
  ctx.say(
    f'  {r.name}: serving checkpoint {s["checkpoint"]}: '
    f'{s["serving_bytes"] / 1024:.1f} KB, serve == train: '
    f'{s["serve_equal"]} (max |diff| {s["max_abs_diff"]:g})',
    flush=True,
  )


def _save_base(run: Run, ctx: Context, out: Outcome) -> None:
  """Keeps (and saves) the float model when a later run starts from it."""
  users = [n for n in ctx.exp.runs if get(n).init_from == run.name]
  if users and not out.result.diverged:
    ctx.bases[run.name] = run.base(out.result)
    lora_job.save_base(ctx.bases[run.name], ctx.run_dir)


def _ptq(run: Run, ctx: Context, out: Outcome) -> None:
  exp, r = ctx.exp, out.result
  if not exp.ptq or r.diverged:
    return
  out_dir = ctx.run_dir.parent

  def rows():
    ctx.say(f'post-training quantization of the {run.name} run:', flush=True)
    return ptq_stage.run(exp, ctx.task, ctx.template, r, out_dir, ctx.say)

  ctx.late.append(rows)


def _lora(run: Run, ctx: Context, out: Outcome) -> None:
  r, s = out.result, out.serve
  if r.diverged:
    return
  gptq = s['merged_gptq_bpc']
  solved = '' if gptq is None else f', merged (GPTQ) {gptq:.4f}'
  ctx.say(
    f'  {r.name}: {ctx.exp.finetune_family}/ validation bpc: frozen base '
    f'{s["frozen_bpc"]:.4f}, fine-tuned {r.final["bpc"]:.4f}, '
    f'merged (RTN) {s["merged_bpc"]:.4f}{solved}; serve == train: '
    f'{s["serve_equal"]}',
    flush=True,
  )


# Post-training steps: (run, context, outcome) -> None.
POST: dict[str, Callable[[Run, Context, Outcome], None]] = {
  'report': _report,
  'serve': _serve,
  'save_base': _save_base,
  'ptq': _ptq,
  'lora': _lora,
}

_FLOAT_POST = ('report', 'serve', 'save_base', 'ptq')
# The presets; the float one is the baseline, LoRA base and PTQ source.
_PRESET_FIELDS = {'float': {'post': _FLOAT_POST, 'baseline': True}}
for _name in aqtr.presets.__all__:
  _fields = _PRESET_FIELDS.get(_name, {})
  register(_name, PaxRun, config=getattr(aqtr.presets, _name), **_fields)
for _name, _spec in qt_runs.SPECS.items():
  register(
    _name,
    PaxRun,
    config=functools.partial(qt_runs.config, _spec),
    spec=_spec,
    trains='all' if _spec.weights is None else 'qt',
  )
# 2:4 weights + int8 after a dense int8 warm-up of 50 steps, masks
# refreshed every 10 steps (held in the ops' 'aqtr_state').
register(
  'int8_sparse_2_4_warm',
  PaxRun,
  config=functools.partial(
    aqtr.presets.int8_sparse_2_4, start_step=50, update_step=10
  ),
)
# NVFP4 everywhere without the recipe's ingredients (no RHT, no SR, 1x16
# weight blocks): the baseline of `nvfp4_training`.
register(
  'nvfp4_naive',
  PaxRun,
  config=functools.partial(
    aqtr.presets.nvfp4_training,
    rht=False,
    stochastic_rounding=False,
    weight_blocks_2d=False,
  ),
)
for _name, _make in RECIPE_CONFIGS.items():  # The 4-bit recipes, ablations.
  register(_name, PaxRun, config=_make, recipe=True)
register('stock_float', StockRun, post=('report', 'serve', 'save_base'))
register(
  'stock_int8',
  StockRun,
  config=aqtr.presets.int8,
  rules=stock.RULES['stock_int8'],
)
for _name, _stock, _fmt in (
  ('lora', False, None),
  ('qlora_nf4', False, 'nf4'),
  ('stock_lora', True, None),
  ('stock_qlora_nf4', True, 'nf4'),
):
  register(
    _name,
    LoraRun,
    config=lora_config.nf4 if _fmt else aqtr.presets.float,
    stock=_stock,
    base_format=_fmt,
    init_from='stock_float' if _stock else 'float',
  )
for _name in stock_moe.NAMES:  # DeepSeek's FP8 recipes on a stock MoE.
  register(_name, MoeRun)
register('stock_custom', StockRun, custom=True)
register('custom', CustomRun)
