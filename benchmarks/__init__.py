"""Measurement harnesses of a source checkout, beside the library (not installed with it).

``invink-audit bench`` runs them (it finds this folder next to the ``invink_audit`` package and exits 2 with one
line where there is none, as in a wheel install):

* :mod:`benchmarks.engine`: private decoding against the bare forward passes it needs (:func:`~benchmarks.engine.benchmark`);
* :mod:`benchmarks.dtypes`: the whole workload in float32 and bfloat16 side by side;
* :mod:`benchmarks.ops`: kernel-launching operations per decoding step, ours and a plain padded decode's;
* :mod:`benchmarks.reference`: the reference ``invink`` package timed on the same workload;
* :mod:`benchmarks.workload`: what they share (the workload's texts and its whole run);
* :mod:`benchmarks.command`: the ``bench`` command's checks, runs and reports.

Figures measured with them are in ``docs/results/engine-benchmarks.md``.
"""
