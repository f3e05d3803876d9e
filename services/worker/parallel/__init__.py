"""Tensor parallelism over the devices of one machine (engine.tensor_parallel_size).

group.py     the group a model shard computes in (all-reduce, all-gather; SINGLE at size 1)
step.py      the per-step messages rank 0 broadcasts (prepared forward inputs, logits rows)
channel.py   their broadcasts
driver.py    rank 0: spawns the other ranks, drives them from the runner's model calls, fails whole
rank.py      ranks 1..N-1: their shard and KV cache share, running what rank 0 broadcasts
validate.py  what is refused at start (sizes, devices, options, shapes)

The parallel layers themselves are in services/worker/model/layers.py.
"""
