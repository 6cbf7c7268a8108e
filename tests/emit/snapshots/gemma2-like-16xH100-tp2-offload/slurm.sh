#!/bin/bash
#SBATCH --job-name=meshplan
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
# plan 1: gemma2-9b-like on 16x H100-SXM5-80GB (dgx-h100), dp8 tp2 pp1 sp z1 mbs1 rc=none offload; predicted <estimate>
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
  --seq-length 8192
  --use-distributed-optimizer
  --overlap-grad-reduce
  --overlap-param-gather
  --optimizer adam
  --optimizer-cpu-offload
  --optimizer-offload-fraction 1.0
  --use-precision-aware-optimizer
  --bf16
  --cross-entropy-loss-fusion
  --num-layers 42
  --hidden-size 3584
  --ffn-hidden-size 14336
  --num-attention-heads 16
  --kv-channels 256
  --group-query-attention
  --num-query-groups 8
  --swiglu
  --normalization RMSNorm
  --norm-epsilon 1e-06
  --position-embedding-type rope
  --max-position-embeddings 8192
  --disable-bias-linear
  --attention-dropout 0.0
  --hidden-dropout 0.0
  --attention-backend auto
  --window-size 4095,0
  --window-attn-skip-freq 2
)
srun --kill-on-bad-exit=1 torchrun --nnodes "$SLURM_NNODES" --nproc-per-node 8 --rdzv-id "$SLURM_JOB_ID" --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" \
  pretrain_gpt.py "${MEGATRON_ARGS[@]}"
