# Megatron-DeepSpeed plan 1: gpt3-175b on 1024x A100-SXM4-80GB (dgx-a100-80gb), dp16 tp8 pp8 z0 mbs1 rc=full; predicted (as megatron runs it, not deepspeed) <estimate>
# Save `meshplan emit --backend deepspeed` as ds_config.json; add your model-shape, data, tokenizer
# and learning-rate flags, then run torchrun ... pretrain_gpt.py "${MEGATRON_DS_ARGS[@]}" ...
MEGATRON_DS_ARGS=(
  --tensor-model-parallel-size 8
  --pipeline-model-parallel-size 8
  --micro-batch-size 1
  --global-batch-size 1536
  --seq-length 2048
  --zero-stage 0
  --fp16
  --recompute-granularity full
  --recompute-method uniform
  --recompute-num-layers 1
  --deepspeed-activation-checkpointing
  --deepspeed
  --deepspeed_config ds_config.json
)
