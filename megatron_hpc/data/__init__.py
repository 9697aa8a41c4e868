"""Token sources: deterministic synthetic tokens (and, later, Megatron .bin/.idx datasets)."""
