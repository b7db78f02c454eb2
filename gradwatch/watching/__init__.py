"""Watching: a watched model's lifecycle, from ``gw.watch`` to its run's close.

The public calls and the weak map of watched models (:mod:`~gradwatch.watching.registry`), the
:class:`~gradwatch.watching.watcher.Watcher` facade, a run's setup before its first step
(:mod:`~gradwatch.watching.startup`) and how the process ends (:mod:`~gradwatch.watching.ending`), the
one door from torch into gradwatch (:mod:`~gradwatch.watching.guard`, :mod:`~gradwatch.watching.register`),
what a pickled copy leaves out (:mod:`~gradwatch.watching.unpickled`) and how parametrized modules map
to layers (:mod:`~gradwatch.watching.parametrized`). The stages (:mod:`gradwatch.step` and after) run
inside; this package only wires them to the model and the process.
"""
