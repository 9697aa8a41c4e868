"""Checkpoints, in three rooms, each imported through its face (its `__init__`), never from a module inside it:

- store/: the Megatron layout on disk (paths, manifest, xser and torch files), save, load and async save;
- conversion/: whole checkpoints of ours rewritten offline (reshard, convert the file format) and the layouts;
- foreign/: checkpoints of other trainers (the Neuron reference, Megatron-LM, megatron-core, Hugging Face).

They depend one way, foreign -> conversion -> store; summary.py (`ckpt inspect`, every kind) sits above them.
Nothing is imported here: the launcher imports store's face torch-free (tests/unit/test_checkpoint_rooms.py).
"""
