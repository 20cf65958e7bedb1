"""gravac's DDP communication hook in training frameworks.

Each submodule imports its framework on import, so ``import gravac`` (and this package) never
needs one; install them with the ``integrations`` extra (``pip install 'gravac[integrations]'``).

- :mod:`gravac.integrations.lightning`: :class:`~gravac.integrations.lightning.GravacCallback`,
  a Lightning callback that registers :func:`gravac.ddp.gravac_hook` on the strategy's
  ``DistributedDataParallel`` model (on CPU too, where ``DDPStrategy(ddp_comm_hook=...)`` is
  ignored).
- :mod:`gravac.integrations.hf`: :class:`~gravac.integrations.hf.GravacCallback`, a Hugging
  Face ``TrainerCallback`` that registers it on the model the ``Trainer`` wrapped.
"""

from __future__ import annotations

__all__: list[str] = []
