"""Judging: from a step's record to findings and the action the step takes.

Takes in a :class:`~gradwatch.store.records.StepRecord`; the detectors (:mod:`gradwatch.detectors`)
turn it into findings, the rules (:mod:`gradwatch.rules`) pick an action for each
(:mod:`gradwatch.actions`), and the judge (:mod:`~gradwatch.judging.judge`) hands the step its decision
and the findings to the writer thread. The gate (:mod:`~gradwatch.judging.gate`) turns a run's
findings into the CI verdict (``gradwatch check --rules`` judges a stored run again under other
rules: :mod:`gradwatch.cli.rejudge`). Hands on findings (:mod:`gradwatch.store.findings`) to the
store; imports nothing of the step stage.
"""
