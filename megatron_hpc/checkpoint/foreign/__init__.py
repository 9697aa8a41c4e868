"""Checkpoints of other trainers, read and turned into ours: the Megatron family (the Neuron reference,
Megatron-LM, megatron-core: find and read their shards, name the family, map their keys, QKV order and optimizer
state, distributed-optimizer buffers included; megatron-core's torch_dist folders in and out) and Hugging Face
model folders (GPT-2, GPT-NeoX; in and out).

The top room: it reads through store/ and hands whole checkpoints to conversion/ (stream.reshard), and neither
imports it. Everything outside the room imports from here, never from a module inside it.
"""

from megatron_hpc.checkpoint.foreign.hf_export import export_hf
from megatron_hpc.checkpoint.foreign.hf_import import copy_tokenizer, import_hf, is_hf_folder
from megatron_hpc.checkpoint.foreign.hf_shards import SHARD_BYTES
from megatron_hpc.checkpoint.foreign.importer import import_foreign
from megatron_hpc.checkpoint.foreign.megatron_family import (
    OURS,
    arg,
    family_of,
    foreign_folder,
    is_torch_dist,
    rank_files,
    read_foreign,
)
from megatron_hpc.checkpoint.foreign.torch_dist import import_torch_dist, torch_dist_summary
from megatron_hpc.checkpoint.foreign.torch_dist_export import export_torch_dist
from megatron_hpc.checkpoint.foreign.torch_dist_stream import READ_BUDGET

__all__ = [
    "OURS",
    "READ_BUDGET",
    "SHARD_BYTES",
    "arg",
    "copy_tokenizer",
    "export_hf",
    "export_torch_dist",
    "family_of",
    "foreign_folder",
    "import_foreign",
    "import_hf",
    "import_torch_dist",
    "is_hf_folder",
    "is_torch_dist",
    "rank_files",
    "read_foreign",
    "torch_dist_summary",
]
