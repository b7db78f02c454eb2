"""Root cause (judge stage, rare path): from the module where a NaN/Inf was born to the op, the source
line, the cause and the samples — all by replaying the anomalous step, never on a healthy one.

The pieces, in the order a replay uses them:

- :mod:`~gradwatch.rootcause.state`: what a forward call is replayed under (autocast) and what a
  replay changes and puts back (RNG, buffers, in-place flags);
- :mod:`~gradwatch.rootcause.capture`: what is kept of each forward call of the root module;
- :mod:`~gradwatch.rootcause.locate`: the module where it was born (forward or backward);
- :mod:`~gradwatch.rootcause.ops` and :mod:`~gradwatch.rootcause.nodes`: the op inside it
  (a ``TorchDispatchMode`` in forward; the autograd node, and the forward line that made it, in
  backward), with :mod:`~gradwatch.rootcause.frames` (the user's source line) and
  :mod:`~gradwatch.rootcause.facts` (what about the op's inputs explains it);
- :mod:`~gradwatch.rootcause.cause`: data, precision, not reproducible, or model;
- :mod:`~gradwatch.rootcause.samples` and :mod:`~gradwatch.rootcause.pergrad`: the samples to blame;
- :mod:`~gradwatch.rootcause.words`: how findings say it; :mod:`~gradwatch.rootcause.skiplist`:
  samples left out afterwards.

:class:`gradwatch.step.origin.Tracker` drives them.
"""
