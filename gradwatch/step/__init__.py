"""Step: everything that runs inside the user's training step, up to the step's record.

Takes in the model and the user's loop as torch runs it: the probe's hooks see each forward, backward
and optimizer step (:mod:`~gradwatch.step.probe`, :mod:`~gradwatch.step.iteration`); the lifecycle
opens a step, measures its statistics (:mod:`~gradwatch.step.measure`, :mod:`~gradwatch.step.stats`,
:mod:`~gradwatch.step.activations`, :mod:`~gradwatch.step.preclip`), captures what a replay needs to
find where a NaN was born (:mod:`~gradwatch.step.origin`), and carries out the judge's decision on the
live training state (:mod:`~gradwatch.step.control`, :mod:`~gradwatch.step.snapshots`,
:mod:`~gradwatch.step.buffers`). Hands on one :class:`~gradwatch.store.records.StepRecord` per step to
the judge (:mod:`gradwatch.judging`) and the writer thread (:mod:`gradwatch.store`).
"""
