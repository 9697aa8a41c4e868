"""Checkpoints of other trainers: the Neuron reference, Megatron-LM, megatron-core and Hugging Face."""
