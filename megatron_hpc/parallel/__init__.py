"""Tensor/data parallelism: process groups, paired collectives, TP layers, vocab-parallel loss."""
