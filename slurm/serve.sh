#!/bin/bash
# Serve Megatron's text generation API (PUT /api) from a checkpoint on one cluster node (issue 17).
#
#   sbatch [--partition P] [--time 8:00:00] slurm/serve.sh CKPT [PORT] [more `megatron-hpc serve` flags]
#   SERVE_TP=2 sbatch --cpus-per-task 8 slurm/serve.sh CKPT      # at TP 2: rank 0 serves, rank 1 follows
#
# Generation runs on the node's CPUs (the checkpoint is loaded on the CPU, as `megatron-hpc generate` does).
#
# The job's output names the URL (http://NODE:PORT/api); ask it with
#   megatron-hpc serve --client http://NODE:PORT/api --prompt "Hello" --request '{"top_k": 1}'
# and stop it with `scancel JOBID` (SIGTERM: the server and the following ranks stop cleanly).
# Submit from a folder where the venv that has megatron-hpc is active (or set PYTHON).
#SBATCH --job-name=megatron-hpc-serve
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --time=08:00:00
#SBATCH --output=serve-%j.out
set -euo pipefail

CKPT=${1:?usage: sbatch slurm/serve.sh CKPT [PORT] [serve flags...]}
PORT=${2:-5000}
shift $(( $# >= 2 ? 2 : 1 ))
TP=${SERVE_TP:-1}
PYTHON=${PYTHON:-python3}

echo "megatron-hpc serve: job ${SLURM_JOB_ID:-?} on $(hostname), PUT http://$(hostname):${PORT}/api (TP ${TP})"
if [ "$TP" -gt 1 ]; then
    exec srun --kill-on-bad-exit=1 "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$TP" \
        -m megatron_hpc serve "$CKPT" --port "$PORT" "$@"
fi
exec srun "$PYTHON" -m megatron_hpc serve "$CKPT" --port "$PORT" "$@"
