"""This process's place in the tensor- and pipeline-parallel groups and their traffic.

Imports only torch: models and the model engine build on it; how the groups are formed
(the TCPStore rendezvous, spawned workers) lives in `atom/model_engine`.
"""

from atom.distributed.pipeline_parallel import PipelineError, PipelineGroup, stage_layer_range
from atom.distributed.tensor_parallel import ShardingError, TensorParallelGroup, shard_range

__all__ = [
    "PipelineError",
    "PipelineGroup",
    "ShardingError",
    "TensorParallelGroup",
    "shard_range",
    "stage_layer_range",
]
