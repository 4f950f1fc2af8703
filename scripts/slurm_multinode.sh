#!/usr/bin/env bash
# Multi-node training on a SLURM cluster: N nodes x G GPUs, one process per GPU, every stage and every config.
#
#   sbatch --nodes=2 --gpus-per-node=8 --ntasks-per-node=8 scripts/slurm_multinode.sh configs/ppo/<name>.yaml [--key=value ...]
#
# srun starts one task per GPU on every node; Lightning's SLURM environment reads the ranks from SLURM
# (SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID) and the main node's address from the job's node
# list, so nothing else needs setting. The run is the same program as on one node: the trainer preset
# (default configs/trainer/fsdp_bf16.yaml: FSDP2 + bf16; PRESET=... to change, e.g. PRESET=none with a config
# that sets its own strategy) is stacked after the stage config, then --trainer.num_nodes / --trainer.devices
# are set from the allocation, then any extra arguments. Under PPO the update equals the one-process update of
# the global batch (one permutation of the global rollout per epoch, token-weighted losses, global
# whitening/normalisation/KL: docs/scale.md); `tests/distributed` checks it on CPU for 2 processes on one
# machine and for 2 nodes x 1 process launched with `torchrun --nnodes 2` -- this script itself has NOT run on
# a cluster (no SLURM here); its argument handling is tested with a stand-in srun (tests/distributed/test_slurm_script.py).
#
# Each GPU holds data.batch_size prompts: the global rollout is nodes x GPUs x batch_size, and
# ppo.ppo_minibatch_size is per GPU as well. Paths in the config (data, exports) must be on a file system every
# node sees; only global rank 0 writes exports and logs. Interconnect: NCCL picks the fabric; set
# NCCL_SOCKET_IFNAME / NCCL_IB_HCA here if your cluster needs it. Preemption: with --signal=SIGUSR1@90 (below)
# Lightning saves a checkpoint and requeues the job; or resume by hand with --ckpt_path <dir>/last.ckpt.
#
#SBATCH --job-name=rlhf-lit
#SBATCH --nodes=2
#SBATCH --gpus-per-node=8
#SBATCH --ntasks-per-node=8          # must equal --gpus-per-node: Lightning wants one task per device
#SBATCH --cpus-per-task=8
#SBATCH --time=24:00:00
#SBATCH --output=%x-%j.out
#SBATCH --signal=SIGUSR1@90
set -euo pipefail

CONFIG=${1:?usage: sbatch [--nodes=N --gpus-per-node=G --ntasks-per-node=G] scripts/slurm_multinode.sh <config.yaml> [--key=value ...]}
shift
PRESET=${PRESET:-configs/trainer/fsdp_bf16.yaml}
NODES=${SLURM_JOB_NUM_NODES:?run this under sbatch (SLURM_JOB_NUM_NODES is not set)}
TASKS_PER_NODE=${SLURM_NTASKS_PER_NODE:?set --ntasks-per-node to the number of GPUs per node}
TASKS_PER_NODE=${TASKS_PER_NODE%%(*}   # SLURM may write "8(x2)"
RLHF_LIT=${RLHF_LIT:-rlhf-lit}

ARGS=(fit --config "$CONFIG")
if [[ "$PRESET" != "none" ]]; then
  ARGS+=(--config "$PRESET")
fi
ARGS+=(--trainer.accelerator=gpu "--trainer.num_nodes=$NODES" "--trainer.devices=$TASKS_PER_NODE" "$@")

echo "rlhf-lit on $NODES node(s) x $TASKS_PER_NODE GPU(s): $RLHF_LIT ${ARGS[*]}"
srun --kill-on-bad-exit=1 "$RLHF_LIT" "${ARGS[@]}"
