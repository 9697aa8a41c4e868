"""Evaluation of a trained checkpoint: loss on the run's valid and test splits, and Megatron's zero-shot tasks
(WikiText-style windowed perplexity, LAMBADA-style last-word accuracy) on local files."""
