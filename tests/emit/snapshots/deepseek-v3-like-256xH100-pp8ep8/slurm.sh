#!/bin/bash
#SBATCH --job-name=meshplan
#SBATCH --nodes=32
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
# plan 1: deepseek-v3-like on 256x H100-SXM5-80GB (dgx-h100), dp32 tp1 pp8 ep8 z1 mbs1 rc=full first=7 last=6; predicted <estimate>
set -euo pipefail
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR
export MASTER_PORT=29500
# export NCCL_SOCKET_IFNAME=...   # the interface that reaches the other nodes (site-specific)
# export NCCL_IB_HCA=...          # InfiniBand adapters to use (site-specific)
MEGATRON_ARGS=(
  --tensor-model-parallel-size 1
  --pipeline-model-parallel-size 8
  --decoder-first-pipeline-num-layers 7
  --decoder-last-pipeline-num-layers 6
  --context-parallel-size 1
  --expert-model-parallel-size 8
  --expert-tensor-parallel-size 1
  --micro-batch-size 1
  --global-batch-size 1024
  --seq-length 4096
  --recompute-granularity full
  --recompute-method uniform
  --recompute-num-layers 1
  --use-distributed-optimizer
  --overlap-grad-reduce
  --overlap-param-gather
  --optimizer adam
  --bf16
  --cross-entropy-loss-fusion
  --num-layers 61
  --hidden-size 7168
  --ffn-hidden-size 18432
  --num-attention-heads 128
  --swiglu
  --normalization RMSNorm
  --norm-epsilon 1e-06
  --position-embedding-type rope
  --max-position-embeddings 4096
  --untie-embeddings-and-output-weights
  --disable-bias-linear
  --attention-dropout 0.0
  --hidden-dropout 0.0
  --attention-backend auto
  --num-experts 256
  --moe-router-topk 8
  --moe-ffn-hidden-size 2048
  --moe-layer-freq '([0]*3+[1]*58)'
  --moe-shared-expert-intermediate-size 2048
  --moe-shared-expert-overlap
  --moe-grouped-gemm
  --moe-token-dispatcher-type alltoall
  --moe-router-load-balancing-type aux_loss
  --mtp-num-layers 1
  --multi-latent-attention
  --q-lora-rank 1536
  --kv-lora-rank 512
  --qk-head-dim 128
  --qk-pos-emb-head-dim 64
  --v-head-dim 128
)
srun --kill-on-bad-exit=1 torchrun --nnodes "$SLURM_NNODES" --nproc-per-node 8 --rdzv-id "$SLURM_JOB_ID" --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" \
  pretrain_gpt.py "${MEGATRON_ARGS[@]}"
