"""Admission control: what the pool can serve (estimator.py) and who goes first (fair_queue.py);
the controller that combines them is services/gateway/overload.py."""
