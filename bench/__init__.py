"""Benchmarks (make bench-*). Like the worker, they run torch with passive OpenMP waiting, so a
second process on the same cores does not turn every parallel op into a long stall."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
