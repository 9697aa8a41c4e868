"""The trainer. Import `megatron_hpc.train.entry.run_training`; this package root stays light."""
