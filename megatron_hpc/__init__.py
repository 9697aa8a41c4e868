"""megatron-hpc: plan, launch and train Megatron-style GPT runs on SLURM.

This root module imports nothing heavy: `megatron-hpc --help`, `plan` and the launcher must start
without torch (see STYLE.md section 1).
"""

__version__ = "0.1.0"
