"""DeepSpeed's checkpoint key names (``deepspeed.checkpoint.constants``), for scripts that
read DeepSpeed's own checkpoint files. zpp's checkpoints have their own layout
(:mod:`zpp.zero.checkpoint`: ``meta.json`` and checksummed shard files); these names
describe DeepSpeed's."""
OPTIMIZER_STATE_DICT = "optimizer_state_dict"
FP32_GROUPS = "fp32_groups"
FP32_FLAT_GROUPS = "fp32_flat_groups"
BASE_OPTIMIZER_STATE = "base_optimizer_state"
BASE_OPTIMIZER_STATE_STEP = "base_optimizer_state_step"
SINGLE_PARTITION_OF_FP32_GROUPS = "single_partition_of_fp32_groups"
PARAM_SLICE_MAPPINGS = "param_slice_mappings"
GROUP_PADDINGS = "group_paddings"
PARTITION_COUNT = "partition_count"
ZERO_STAGE = "zero_stage"
CLIP_GRAD = "clip_grad"
FP32_WEIGHT_KEY = "fp32"
LOSS_SCALER = "loss_scaler"
PARAM = "param"
PARAM_SHAPES = "param_shapes"
BUFFER_NAMES = "buffer_names"
FROZEN_PARAM_SHAPES = "frozen_param_shapes"
FROZEN_PARAM_FRAGMENTS = "frozen_param_fragments"
DS_VERSION = "ds_version"
UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"

__all__ = [name for name in dir() if name.isupper()]
