"""trainguard inside a Slurm allocation, on top of :mod:`trainguard.hosts`.

- :mod:`~trainguard.slurm.allocation`: the allocation from Slurm's environment (pure but
  for the node list's expansion by ``scontrol show hostnames``);
- :mod:`~trainguard.slurm.run`: the batch script's ``trainguard run`` (the controller, a
  step per other node, drain and requeue);
- :mod:`~trainguard.slurm.commands`: the ``scontrol`` and ``srun`` calls, each a thin edge;
- :mod:`~trainguard.slurm.submit`: ``trainguard submit --slurm`` (the batch script).
"""
