"""redroll behind other projects' doors: each module plugs the public API into one trainer.

- :mod:`redroll.integrations.trl`: TRL's ``GRPOTrainer(rollout_func=...)`` and the ``weight_transfer``
  of its async GRPO (``pip install 'redroll[trl]'``).

Nothing here is imported by ``import redroll``; each module imports its trainer's packages only
when it is used.
"""
