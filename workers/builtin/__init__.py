"""Built-in stages: ``echo`` (returns its input) and ``sleep`` (occupies a slot; fails, crashes or hangs on
request). They exercise the runtime end to end and are the workloads of the benchmarks."""
