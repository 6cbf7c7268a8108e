#!/usr/bin/env bash
# torchrun for plan 1: deepseek-v3-like on 256x H100-SXM5-80GB (dgx-h100), dp32 tp1 pp8 ep8 z1 mbs1 rc=full first=7 last=6; predicted <estimate>
# Run this on each of the 32 nodes with NODE_RANK=0..31 and MASTER_ADDR set to node 0's address.
set -euo pipefail
: "${MASTER_ADDR:?set MASTER_ADDR to node 0's hostname or IP}"
: "${NODE_RANK:?set NODE_RANK to this node's rank, 0..31}"
export MASTER_PORT=${MASTER_PORT:-29500}
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
torchrun --nnodes 32 --nproc-per-node 8 --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
  pretrain_gpt.py "${MEGATRON_ARGS[@]}"
