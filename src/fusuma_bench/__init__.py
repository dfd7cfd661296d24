"""Benchmarks: each writes a result file (metric names carry units, plus ``meta``);
reports and plots are made from those files, never during a run."""
