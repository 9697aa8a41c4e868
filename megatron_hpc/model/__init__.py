"""The GPT model built from the tensor-parallel layers."""
