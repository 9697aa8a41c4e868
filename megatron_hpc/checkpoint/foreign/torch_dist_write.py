"""A torch_dist folder's data written a part at a time through torch.distributed.checkpoint's own file writer.

`dcp.save` takes the whole state dict at once, so writing a 70B model with Adam that way holds all of it. Here each
part (a decoder layer's slice of every stacked key, or one other key) is handed to the writer as the chunks it is
of the global tensors, as one saving rank of megatron-core would: a stacked key's layer N is the box at offset
(N, 0, ...) of the [num_layers, ...] tensor, which is also how megatron-core itself saves them (one chunk per layer,
tests/fixtures/megatron_core_torch_dist). Each part goes into its own `__P_0.distcp` file and is let go; the
`.metadata` index, made from every part's chunk records (no data), is written last by the same writer's `finish`.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from megatron_hpc.checkpoint.store import torch_crc_off

Box = tuple[tuple[int, ...], torch.Size]
"""(offsets of the part in its key's global tensor, the global tensor's size)."""


class PartWriter:
    """Writes parts into `folder` (an empty staging folder); `finish()` writes the index."""

    def __init__(self, folder: Path) -> None:
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

        class Planner(DefaultSavePlanner):
            """The default planner's object handling (torch.save of a non-tensor), with the data looked up by key
            in the part being written rather than in a whole state dict."""

            part: dict[str, Any]

            def lookup_object(self, index: Any) -> Any:
                return self.part[index.fqn]

        self._writer = FileSystemWriter(str(folder))
        self._writer.set_up_storage_writer(True)
        self._planner = Planner(flatten_state_dict=False)
        self._planner.part = {}
        self._plans: list[Any] = []
        self._results: list[Any] = []

    def write(self, part: dict[str, tuple[torch.Tensor, Box | None] | Any]) -> None:
        """One part: key -> (tensor, its box, None for the whole tensor) or an object (torch.save'd, as
        megatron-core saves a ShardedObject)."""
        from torch.distributed.checkpoint.filesystem import _StoragePrefix
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

        items, data = [], {}
        for key, value in part.items():
            if not isinstance(value, tuple):
                items.append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))
                data[key] = value
                continue
            tensor, box = value
            tensor = tensor.contiguous()
            offsets, size = box if box is not None else ((0,) * tensor.ndim, tensor.shape)
            items.append(WriteItem(
                index=MetadataIndex(key, torch.Size(offsets)), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=torch.Size(offsets),
                                                                        sizes=tensor.shape),
                                            properties=TensorProperties.create_from_tensor(tensor),
                                            size=torch.Size(size))))
            data[key] = tensor
        # The file name prefix the writer's global planning gives rank i's plan: each part is a rank here.
        plan = SavePlan(items, storage_data=_StoragePrefix(f"__{len(self._plans)}_"))
        self._planner.part = data
        # torch.save's own zip crc32 (miniz's code) is most of the write's CPU time; the records inside a .distcp are
        # read by torch.load alone, which never checks it (torch.serialization.set_crc32_options says so), so the
        # writer (one thread: it writes in this one) runs without it. Our own files get theirs filled in instead
        # (store/zip_crc.py); a .distcp is not a zip any tool opens.
        with warnings.catch_warnings(), torch_crc_off():  # one process on purpose; torch warns anyway
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            self._results.append(self._writer.write_data(plan, self._planner).value())
        self._planner.part = {}
        self._plans.append(SavePlan(items))

    def finish(self) -> None:
        """The `.metadata` index of every part written (torch's own global plan of the parts' items)."""
        from torch.distributed.checkpoint.default_planner import create_default_global_save_plan

        _, metadata = create_default_global_save_plan(self._plans)
        self._writer.finish(metadata, self._results)

