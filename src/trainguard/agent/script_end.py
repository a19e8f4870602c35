"""How a warm-started worker's script ends: like ``python -u SCRIPT``, minus a torch deadlock.

:mod:`trainguard.agent.template` runs the script in a process forked from the node's
template. After the script's code, the worker ends the way CPython ends ``python -u
SCRIPT``: an uncaught exception is printed by ``sys.excepthook`` and exits 1, a
``SystemExit`` exits with its code, a ``KeyboardInterrupt`` ends the process by SIGINT,
then the interpreter's own finalization joins the non-daemon threads, runs the ``atexit``
handlers and flushes the streams (the worker *is* an interpreter ending: nothing here
re-implements that). What this module adds is one guard, :class:`GroupKeeper`, against a
deadlock in torch that a fresh interpreter can meet as well.

The deadlock (torch 2.13, gloo; seen as a textbook DDP script hanging after its last
epoch, in 5 of 8 warm runs under ``trainguard run --nnodes 2 --nproc-per-node 2``)::

    MainThread                                    gloo worker thread
      <module> (the script's ``main()`` line)       c10d::ProcessGroupGloo::runLoop
      pybind11_object_dealloc  (the DDP Reducer)    ~AsyncAllreduceWork
      c10d::Reducer::~Reducer                       ~ThreadLocalState
      c10d::ProcessGroupGloo::~ProcessGroupGloo     c10::SafePyObject dispose -> decref
      std::thread::join         (holds the GIL)     gil_scoped_acquire  (waits for the GIL)

Every backward pass stashes a Python object (the autograd ``contextvars`` context,
``torch.autograd.graph._engine_run_backward``) in the thread-local state that each gloo
work captures, so the gloo thread that finishes a DDP all-reduce needs the GIL to free
the work. ``destroy_process_group()`` drops torch's own references to the group but the
DDP Reducer keeps one, and a Reducer is freed while its thread holds the GIL
(pybind11's dealloc): when it is the group's last owner, ``~ProcessGroupGloo`` joins the
gloo threads under the GIL. If the main thread gets there before a gloo thread has freed
its last work (within CPython's 5 ms switch interval of the last all-reduce, with no GIL
release between), neither moves again. Whether it does is a race of microseconds:
measured here (``python -m bench.exit_race``: 4 gloo ranks on one machine, a tutorial
script whose DDP model is held by a trainer object local to ``main()``, with
``destroy_process_group()`` before ``main()`` returns) it hung in 0 of 20 fresh
interpreters, but in 19 of 30 when the script imported ``torch._dynamo`` at its top, and
in 21 of 30 workers forked as the template forked them before this module, which imports
``torch._dynamo`` ahead (it is what makes the first optimizer of a warm worker cheap);
with :class:`GroupKeeper`, in 0 of 20.

:class:`GroupKeeper` takes the race away instead of shifting it: while the script runs,
the groups ``destroy_process_group()`` forgets are kept by this module, so a Reducer is
never their last owner. When the script's code has ended, they are let go of from
Python, whose group objects free the group with the GIL released (torch's
``intrusive_ptr_no_gil_destructor``: the gloo threads finish their work and the join
returns), and the thread lets go of the GIL for a moment so that a gloo thread still
waiting for it (its group is alive: a DDP model held at module level) is done before the
interpreter finalizes, which ends a thread that waits for the GIL then, in the middle
of a C++ destructor. Groups the script never destroyed stay torch's, as in a fresh
interpreter.

Only the warm runner installs it: a cold worker is exactly the user's command.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any, Final

__all__ = ["GroupKeeper"]

_C10D: Final = "torch.distributed.distributed_c10d"
_DIST: Final = "torch.distributed"

LET_GO_SECONDS: Final = 0.1
"""How long the ending script's thread lets go of the GIL when it used process groups:
20 of CPython's 5 ms switch intervals, for a gloo thread waiting for the GIL to take it
(the same grace :func:`trainguard.resilient.group.end_default_group` gives)."""


class GroupKeeper:
    """Keeps the process groups that ``destroy_process_group()`` forgets until the script
    ends (see the module doc), then lets them go with the GIL released."""

    def __init__(self, c10d: ModuleType, dist: ModuleType | None) -> None:
        self._c10d = c10d
        self._dist = dist
        self._kept: list[object] = []
        self._used = False
        self._original: Callable[..., Any] = c10d.destroy_process_group

    @classmethod
    def install(cls) -> GroupKeeper | None:
        """Wrap ``destroy_process_group`` when the template imported torch.distributed;
        None when it did not (the script then imports torch itself, unguarded, exactly
        as a fresh interpreter would)."""
        c10d = sys.modules.get(_C10D)
        if c10d is None or not callable(getattr(c10d, "destroy_process_group", None)):
            return None
        keeper = cls(c10d, sys.modules.get(_DIST))
        keeper._wrap()
        return keeper

    def _wrap(self) -> None:
        original = self._original

        @functools.wraps(original)
        def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
            doomed = self._groups_of(*args, **kwargs)
            result = original(*args, **kwargs)
            self._kept.extend(doomed)  # only once torch let go of them: it may refuse
            self._used = True
            return result

        setattr(self._c10d, "destroy_process_group", destroy_process_group)  # noqa: B010
        dist = self._dist
        if dist is not None and getattr(dist, "destroy_process_group", None) is original:
            setattr(dist, "destroy_process_group", destroy_process_group)  # noqa: B010

    def _groups_of(self, group: object = None, *_: Any, **kwargs: Any) -> list[object]:
        """The groups a ``destroy_process_group(group)`` call is about to forget."""
        group = kwargs.get("group", group)
        world = getattr(self._c10d, "_world", None)
        pg_map = getattr(world, "pg_map", None)
        if not isinstance(pg_map, dict):
            return []
        member = getattr(self._c10d, "GroupMember", None)
        if group is None or group is getattr(member, "WORLD", object()):
            return list(pg_map)
        return [group] if group in pg_map else []

    @property
    def kept(self) -> int:
        """How many destroyed groups are held now."""
        return len(self._kept)

    def release(self) -> None:
        """At the end of the script: let go of the kept groups (each is freed with the GIL
        released, when this was its last owner), then of the GIL for a moment if the
        script used process groups. Idempotent."""
        used = self._used or bool(self._live_groups())
        self._kept.clear()
        if used:
            time.sleep(LET_GO_SECONDS)

    def _live_groups(self) -> list[object]:
        pg_map = getattr(getattr(self._c10d, "_world", None), "pg_map", None)
        return list(pg_map) if isinstance(pg_map, dict) else []
