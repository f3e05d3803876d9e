"""The CPU attention path: paged_attention.c (decode and verification rows, compiled on first use
by kernel.py) behind CpuPagedAttention (backend.py), with the PyTorch reference for the rest."""
