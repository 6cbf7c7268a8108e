#!/usr/bin/env bash
# torchrun for plan 1: gpt3-175b on 1024x A100-SXM4-80GB (dgx-a100-80gb), dp16 tp8 pp8 z0 mbs1 rc=full; predicted <estimate>
# Run this on each of the 128 nodes with NODE_RANK=0..127 and MASTER_ADDR set to node 0's address.
set -euo pipefail
: "${MASTER_ADDR:?set MASTER_ADDR to node 0's hostname or IP}"
: "${NODE_RANK:?set NODE_RANK to this node's rank, 0..127}"
export MASTER_PORT=${MASTER_PORT:-29500}
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
torchrun --nnodes 128 --nproc-per-node 8 --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
  pretrain_gpt.py "${MEGATRON_ARGS[@]}"
