"""This process's place in a tensor-parallel group and the collectives the layers use.

Imports only torch: models and the model engine build on it; how the group is formed
(the TCPStore rendezvous, spawned workers) lives in `atom/model_engine`.
"""

from atom.distributed.tensor_parallel import ShardingError, TensorParallelGroup, shard_range

__all__ = ["ShardingError", "TensorParallelGroup", "shard_range"]
