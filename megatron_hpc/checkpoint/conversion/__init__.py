"""Whole checkpoints rewritten: reshard to another TP x PP size, convert the file format, the layouts."""
