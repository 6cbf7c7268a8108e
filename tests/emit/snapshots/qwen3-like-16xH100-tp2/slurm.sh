#!/bin/bash
#SBATCH --job-name=meshplan
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
# plan 1: qwen3-8b-like on 16x H100-SXM5-80GB (dgx-h100), dp8 tp2 pp1 sp z1 mbs1 rc=none; predicted <estimate>
set -euo pipefail
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR
export MASTER_PORT=29500
# export NCCL_SOCKET_IFNAME=...   # the interface that reaches the other nodes (site-specific)
# export NCCL_IB_HCA=...          # InfiniBand adapters to use (site-specific)
export CUDA_DEVICE_MAX_CONNECTIONS=1
MEGATRON_ARGS=(
  --tensor-model-parallel-size 2
  --pipeline-model-parallel-size 1
  --context-parallel-size 1
  --sequence-parallel
  --tp-comm-overlap
  --micro-batch-size 1
  --global-batch-size 64
  --seq-length 4096
  --use-distributed-optimizer
  --overlap-grad-reduce
  --overlap-param-gather
  --optimizer adam
  --bf16
  --cross-entropy-loss-fusion
  --num-layers 36
  --hidden-size 4096
  --ffn-hidden-size 12288
  --num-attention-heads 32
  --group-query-attention
  --num-query-groups 8
  --swiglu
  --normalization RMSNorm
  --norm-epsilon 1e-06
  --qk-layernorm
  --position-embedding-type rope
  --max-position-embeddings 40960
  --rotary-base 1000000
  --untie-embeddings-and-output-weights
  --disable-bias-linear
  --attention-dropout 0.0
  --hidden-dropout 0.0
  --attention-backend auto
)
srun --kill-on-bad-exit=1 torchrun --nnodes "$SLURM_NNODES" --nproc-per-node 8 --rdzv-id "$SLURM_JOB_ID" --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" \
  pretrain_gpt.py "${MEGATRON_ARGS[@]}"
