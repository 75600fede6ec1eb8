"""Tensor and pipeline parallelism: process groups (parallel_state), weight sharding
(sharding), pipeline stages (pipeline), the executors that run one worker process a rank
(executor, worker, ray_executor)."""
