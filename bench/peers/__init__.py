"""trainguard against the systems users would pick instead (the ``peers`` scenario).

The peers run in their own environment (:mod:`bench.peers.env`), their scripts
(``*_train.py``, ``*_ckpt.py``) importing torch and the peer only; the modules that
drive them (``*_peer.py``, :mod:`bench.peers.checkpoints`, :mod:`bench.peers.runner`)
run in the project's. ``docs/benchmarks.md`` ("Against other systems") says what each
peer's settings are and where its semantics differ.
"""
