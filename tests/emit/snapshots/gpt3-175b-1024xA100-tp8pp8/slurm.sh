#!/bin/bash
#SBATCH --job-name=meshplan
#SBATCH --nodes=128
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
# plan 1: gpt3-175b on 1024x A100-SXM4-80GB (dgx-a100-80gb), dp16 tp8 pp8 z0 mbs1 rc=full; predicted <estimate>
set -euo pipefail
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR
export MASTER_PORT=29500
# export NCCL_SOCKET_IFNAME=...   # the interface that reaches the other nodes (site-specific)
# export NCCL_IB_HCA=...          # InfiniBand adapters to use (site-specific)
export CUDA_DEVICE_MAX_CONNECTIONS=1
MEGATRON_ARGS=(
  --tensor-model-parallel-size 8
  --pipeline-model-parallel-size 8
  --context-parallel-size 1
  --micro-batch-size 1
  --global-batch-size 1536
  --seq-length 2048
  --recompute-granularity full
  --recompute-method uniform
  --recompute-num-layers 1
  --overlap-grad-reduce
  --optimizer adam
  --fp16
  --accumulate-allreduce-grads-in-fp32
  --cross-entropy-loss-fusion
  --num-layers 96
  --hidden-size 12288
  --ffn-hidden-size 49152
  --num-attention-heads 96
  --normalization LayerNorm
  --norm-epsilon 1e-05
  --position-embedding-type learned_absolute
  --max-position-embeddings 2048
  --attention-dropout 0.1
  --hidden-dropout 0.1
  --attention-backend auto
)
srun --kill-on-bad-exit=1 torchrun --nnodes "$SLURM_NNODES" --nproc-per-node 8 --rdzv-id "$SLURM_JOB_ID" --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" \
  pretrain_gpt.py "${MEGATRON_ARGS[@]}"
