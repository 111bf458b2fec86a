"""Trainer integrations: thin adapters that call :func:`streamwatch.observe` and ``watch.step()`` for you.

* :mod:`streamwatch.integrations.lightning`: ``StreamwatchCallback`` for a Lightning ``Trainer``
  (``pip install 'streamwatch-torch[lightning]'``).
* :mod:`streamwatch.integrations.transformers`: ``StreamwatchCallback`` for a Hugging Face ``Trainer``
  (``pip install 'streamwatch-torch[transformers]'``).
* Accelerate needs no adapter: ``streamwatch.observe(accelerator.unwrap_model(model), optimizer)`` with
  the torch optimizer you created (docs/integrations.md).

Each callback takes :func:`streamwatch.observe`'s keyword arguments (``every=``, ``sinks=``, ``metrics=``,
...), creates the :class:`streamwatch.Watch` when training begins, with the trainer's model and optimizer,
and closes it when training ends; ``callback.watch`` is that Watch (kept after training for
``statistics()`` and ``snapshot()``). There is no second code path: what the watch records is exactly what
``observe()`` records in a hand-written loop.

Importing this package imports neither Lightning nor transformers; each submodule imports its trainer
library, and without it raises an ``ImportError`` naming the extra to install.
"""

from __future__ import annotations

__all__: list[str] = []
