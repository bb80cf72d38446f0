"""Optional dependencies: a missing one names the `pip install` to run.

`import aqtr` needs only jax, numpy, ml_dtypes, fiddle and absl. The
adapters check their extra when imported:

  aqtr.flax.*, aqtr.pax   flax (extra `flax`; checkpoint also orbax)
  aqtr.gin                gin-config (extra `gin`)
  aqtr.flags              fiddle[flags] (extra `flags`)
  aqtr.train, aqtr-train  flax, optax, orbax, matplotlib, fiddle[flags]
                          (extra `train`)

Each adapter imports its dependencies in a `try` block and raises
`missing(...)` on ImportError.

Example:
  >>> try:
  ...   import no_such_module_xyz
  ... except ImportError as e:
  ...   print(missing('flax', 'aqtr.flax', e))
  aqtr.flax needs the 'flax' extra (no_such_module_xyz is not importable): \
pip install 'aqtr[flax]'
"""

from __future__ import annotations

__all__ = ['MissingExtraError', 'missing']


class MissingExtraError(ImportError):
  """An optional dependency is missing; the message gives the pip command."""


def missing(extra: str, what: str, err: ImportError) -> MissingExtraError:
  """The error to raise (`from err`) when `what` lacks its `extra`.

  Args:
    extra: the name in `pip install 'aqtr[EXTRA]'` that provides it.
    what: what needs it, for the message ('aqtr.gin').
    err: the ImportError caught; its `name` is the missing module.

  Returns:
    A MissingExtraError (an ImportError): one line naming the missing
    module and the pip command.
  """
  name = getattr(err, 'name', None) or str(err)
  return MissingExtraError(
    f"{what} needs the '{extra}' extra ({name} is not importable): "
    f"pip install 'aqtr[{extra}]'"
  )
