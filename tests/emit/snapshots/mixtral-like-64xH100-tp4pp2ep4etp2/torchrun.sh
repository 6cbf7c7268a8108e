#!/usr/bin/env bash
# torchrun for plan 1: mixtral-8x7b-like on 64x H100-SXM5-80GB (dgx-h100), dp8 tp4 pp2 ep4 etp2 sp z1 mbs1 rc=none; predicted <estimate>
# Run this on each of the 8 nodes with NODE_RANK=0..7 and MASTER_ADDR set to node 0's address.
set -euo pipefail
: "${MASTER_ADDR:?set MASTER_ADDR to node 0's hostname or IP}"
: "${NODE_RANK:?set NODE_RANK to this node's rank, 0..7}"
export MASTER_PORT=${MASTER_PORT:-29500}
# export NCCL_SOCKET_IFNAME=...   # the interface that reaches the other nodes (site-specific)
# export NCCL_IB_HCA=...          # InfiniBand adapters to use (site-specific)
export CUDA_DEVICE_MAX_CONNECTIONS=1
MEGATRON_ARGS=(
  --tensor-model-parallel-size 4
  --pipeline-model-parallel-size 2
  --context-parallel-size 1
  --expert-model-parallel-size 4
  --expert-tensor-parallel-size 2
  --sequence-parallel
  --tp-comm-overlap
  --micro-batch-size 1
  --global-batch-size 256
  --seq-length 4096
  --use-distributed-optimizer
  --overlap-grad-reduce
  --overlap-param-gather
  --optimizer adam
  --bf16
  --cross-entropy-loss-fusion
  --num-layers 32
  --hidden-size 4096
  --ffn-hidden-size 14336
  --num-attention-heads 32
  --group-query-attention
  --num-query-groups 8
  --swiglu
  --normalization RMSNorm
  --norm-epsilon 1e-05
  --position-embedding-type rope
  --max-position-embeddings 32768
  --untie-embeddings-and-output-weights
  --disable-bias-linear
  --attention-dropout 0.0
  --hidden-dropout 0.0
  --attention-backend auto
  --num-experts 8
  --moe-router-topk 2
  --moe-ffn-hidden-size 14336
  --moe-grouped-gemm
  --moe-token-dispatcher-type alltoall
  --moe-router-load-balancing-type aux_loss
)
torchrun --nnodes 8 --nproc-per-node 8 --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
  pretrain_gpt.py "${MEGATRON_ARGS[@]}"
