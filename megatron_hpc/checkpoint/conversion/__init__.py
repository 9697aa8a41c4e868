"""Whole checkpoints of ours rewritten offline, in one process: read every rank (whole, or a tensor at a time as the
writers ask: read_lazy), write them at another TP x PP size one output rank at a time (stream.reshard) or in the
other file format (convert_lazy), and the layouts that say how a weight or an Adam moment splits over TP ranks
(tp_layout), pipeline stages (pp_layout) and parameter groups (optim_layout).

Above store/ (it reads and writes through store's face), below foreign/ (whose importers hand their result to
stream.reshard). Everything outside the room imports from here, never from a module inside it.
"""

from megatron_hpc.checkpoint.conversion import optim_layout, pp_layout, stream, tp_layout
from megatron_hpc.checkpoint.conversion.host_memory import give_back_freed, reused_memory
from megatron_hpc.checkpoint.conversion.lazy import convert_lazy, read_lazy
from megatron_hpc.checkpoint.conversion.optim_layout import for_model, with_masters
from megatron_hpc.checkpoint.conversion.tokenizers import hf_tokenizer_files, resolved_tokenizer_files, tokenizer_files
from megatron_hpc.checkpoint.conversion.whole import (
    WholeCheckpoint,
    locate,
    model_config,
    read_whole,
)

__all__ = [
    "WholeCheckpoint",
    "convert_lazy",
    "for_model",
    "give_back_freed",
    "hf_tokenizer_files",
    "locate",
    "model_config",
    "optim_layout",
    "pp_layout",
    "read_lazy",
    "read_whole",
    "resolved_tokenizer_files",
    "reused_memory",
    "stream",
    "tokenizer_files",
    "tp_layout",
    "with_masters",
]
