#!/usr/bin/env bash
# torchrun for plan 1: llama3-70b on 64x H100-SXM5-80GB (dgx-h100), dp2 tp4 pp4 cp2 vpp5 sp z1 mbs1 rc=none; predicted <estimate>
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
  --pipeline-model-parallel-size 4
  --num-virtual-stages-per-pipeline-rank 5
  --context-parallel-size 2
  --sequence-parallel
  --tp-comm-overlap
  --micro-batch-size 1
  --global-batch-size 128
  --seq-length 8192
  --use-distributed-optimizer
  --overlap-grad-reduce
  --overlap-param-gather
  --optimizer adam
  --bf16
  --cross-entropy-loss-fusion
  --num-layers 80
  --hidden-size 8192
  --ffn-hidden-size 28672
  --num-attention-heads 64
  --group-query-attention
  --num-query-groups 8
  --swiglu
  --normalization RMSNorm
  --norm-epsilon 1e-05
  --position-embedding-type rope
  --max-position-embeddings 8192
  --rotary-base 500000
  --untie-embeddings-and-output-weights
  --disable-bias-linear
  --attention-dropout 0.0
  --hidden-dropout 0.0
  --attention-backend auto
)
torchrun --nnodes 8 --nproc-per-node 8 --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
  pretrain_gpt.py "${MEGATRON_ARGS[@]}"
