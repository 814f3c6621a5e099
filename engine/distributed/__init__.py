"""Tensor parallelism: the model's weights and its adapters' split over ranks.

``shard.py`` says which rows and columns each rank holds; ``group.py`` is the process
group (gloo on the CPU, NCCL on CUDA); ``worker.py`` is a rank other than 0 (a local
process, or a torchrun rank on another node) running each step rank 0 sends it;
``driver.py`` is rank 0's side: it starts the workers, mirrors adapter slot writes to them,
sends every step's plan before running its own share, and restarts them when one dies.
See ``docs/tensor-parallel.md``.
"""
