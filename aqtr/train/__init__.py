"""The main job: quantized vs float training on offline data.

Run it with `aqtr-train` or `python -m aqtr.train` (see `__main__` for the
flags). From Python:

  >>> from aqtr.train import experiment, job
  >>> cfg = experiment.tiny()
  >>> rows = job.run(cfg, 'out')  # doctest: +SKIP

Modules: `experiment` (the config and named variants), `runs` (the run
objects, registered by name), `models` (Pax-style templates + injection),
`high_precision` (blocks kept float), `tasks` (data and metric), `loop`
(the training loop of every run), `pax_run` (the template's runs),
`stock_lm`, `lora_job` (the stock LM's and LoRA runs), `serving`
(convert, orbax, serve == train), `generate` (restore a serving
checkpoint, samples; `aqtr-generate` is `generate_cli`), `report`
(outputs), `job` (all runs). Needs the `train` extra (flax, optax, orbax,
matplotlib, rich, and scikit-learn for the digits task). Not imported by
`import aqtr`.
"""

from aqtr import extras

try:  # Name the extra to install when one is missing.
  import fiddle.absl_flags  # noqa: F401
  import flax  # noqa: F401
  import matplotlib  # noqa: F401
  import optax  # noqa: F401
  import orbax.checkpoint  # noqa: F401
except ImportError as e:
  raise extras.missing('train', 'aqtr.train (aqtr-train)', e) from e

from aqtr.train import experiment, job
from aqtr.train.experiment import Experiment
from aqtr.train.job import run

__all__ = ['Experiment', 'experiment', 'job', 'run']
