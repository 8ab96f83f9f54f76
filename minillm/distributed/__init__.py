"""Chapter 13: serving beyond one GPU, with tensor parallelism on ``torch.distributed``.

- `minillm.distributed.parallel_state`: the process group, each rank's device, the environment
  NCCL ranks start with.
- `minillm.distributed.tp`: who holds which heads and rows, the sharding of a checkpoint, the
  parallel layers (Megatron-LM's column/row-parallel linears, vocabulary-parallel embedding
  and logits), one rank's model.
- `minillm.distributed.worker`: one rank's shard of the model and of the KV pool, and the
  command loop of the ranks other than 0.
- `minillm.distributed.commands`: how rank 0's commands reach them (a pipe per rank, or the
  gloo control group under ``torchrun``).
- `minillm.distributed.driver`: rank 0's `TensorParallelModel`, which the engine runs in
  place of the model, and `load_parallel_model`, which starts the ranks.

``LLMEngine.from_pretrained(path, EngineConfig(tensor_parallel_size=2))`` (or ``minillm serve
--tensor-parallel 2``) is all a user needs.
"""
from minillm.distributed.driver import TensorParallelModel, load_parallel_model, shutdown
from minillm.distributed.parallel_state import DISTRIBUTED_ENV, set_distributed_env
from minillm.distributed.tp import (
    HeadShard, check_tensor_parallel, head_shard, kv_head_owners, shard_config, shard_shapes, shard_state_dict,
    vocab_shard,
)

__all__ = ["DISTRIBUTED_ENV", "HeadShard", "TensorParallelModel", "check_tensor_parallel", "head_shard",
           "kv_head_owners", "load_parallel_model", "set_distributed_env", "shard_config", "shard_shapes",
           "shard_state_dict", "shutdown", "vocab_shard"]
