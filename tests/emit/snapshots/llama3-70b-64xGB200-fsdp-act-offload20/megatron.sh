# Megatron-LM plan 1: llama3-70b on 64x GB200-NVL72-GPU (gb200-nvl72), dp64 tp1 pp1 z3 mbs1 rc=none act-offload20; predicted <estimate>
# Add your data, tokenizer, learning-rate and checkpoint flags, then run
#   torchrun ... pretrain_gpt.py "${MEGATRON_ARGS[@]}" ...
MEGATRON_ARGS=(
  --tensor-model-parallel-size 1
  --pipeline-model-parallel-size 1
  --context-parallel-size 1
  --micro-batch-size 1
  --global-batch-size 128
  --seq-length 8192
  --cpu-offloading-num-layers 20
  --use-distributed-optimizer
  --use-megatron-fsdp
  --data-parallel-sharding-strategy optim_grads_params
  --no-gradient-accumulation-fusion
  --ckpt-format fsdp_dtensor
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
