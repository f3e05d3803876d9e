"""Benchmarks (make bench-*). Like the worker, they run torch with OpenMP's short spin
(services/worker/openmp.py), so a second process on the same cores does not turn every parallel
op into a long stall."""

from services.worker.openmp import set_wait_policy

set_wait_policy()
