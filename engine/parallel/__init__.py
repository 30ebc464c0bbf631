"""Tensor-, expert- and data-parallel serving across several processes (one per GPU).

Data flow: ``ParallelLayout`` (layout.py: degrees, validated against the ModelConfig,
chosen from the deployment's accelerator count or taken from the cost model) ->
``init_parallel`` (process_group.py: torch.distributed, NCCL on CUDA / gloo on CPU, the
rank's groups) -> ``shard_weights`` (sharding.py: the rank's slice of the flat weights
dict) -> the ``parallel`` forward-pass bundle (engine/forward_passes/parallel) adds the
collectives -> ``ParallelLLMEngine`` (engine.py: the replica's rank 0 schedules and
broadcasts each step's batch; the other ranks follow).

Importing this package does not import torch (layout.py is torch-free).
"""
