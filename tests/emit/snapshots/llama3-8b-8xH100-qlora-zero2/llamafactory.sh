# LLaMA-Factory plan 1: llama3-8b on 8x H100-SXM5-80GB (dgx-h100), dp8 tp1 pp1 z2 mbs1 rc=full; predicted <estimate>
# note: attention_kernel flash: the plan is timed with the GPU's fastest fused attention (cuDNN on Hopper and Blackwell); the config runs FlashAttention-2 and may run slower than planned
# note: cross_entropy_fusion: the plan is costed with a fused cross-entropy; the Hugging Face model computes PyTorch's cross_entropy over the full logits
# note: adapter_precision fp32: DeepSpeed's 16-bit engine holds the adapters in 16 bits with an fp32 master copy in the optimizer (a few bytes more per adapter weight than planned)
# note: LLaMA-Factory 0.9.4 checks for deepspeed <= 0.16.9 when it starts a DeepSpeed run; DISABLE_VERSION_CHECK=1 skips that check for a newer DeepSpeed
# note: not from the plan: the data set alpaca_en_demo (LLaMA-Factory's data/dataset_info.json), learning rate, one epoch and output_dir saves/meshplan are starting values to replace
# run: FORCE_TORCHRUN=1 llamafactory-cli train llamafactory.yaml  (LLaMA-Factory 0.9.4)
cat > llamafactory.yaml <<'MESHPLAN_EOF'
model_name_or_path: meta-llama/Meta-Llama-3-8B
quantization_bit: 4
quantization_method: bnb
quantization_type: nf4
double_quantization: true
flash_attn: fa2
stage: sft
do_train: true
finetuning_type: lora
lora_rank: 16
lora_alpha: 32
lora_dropout: 0.0
lora_target: all
deepspeed: ds_config.json
dataset: alpaca_en_demo
template: llama3
cutoff_len: 4096
output_dir: saves/meshplan
per_device_train_batch_size: 1
gradient_accumulation_steps: 8
learning_rate: 0.0002
num_train_epochs: 1.0
optim: paged_adamw_32bit
bf16: true
fp16: false
disable_gradient_checkpointing: false
torch_compile: false
MESHPLAN_EOF
cat > ds_config.json <<'MESHPLAN_EOF'
{
  "train_batch_size": "auto",
  "train_micro_batch_size_per_gpu": 1,
  "gradient_accumulation_steps": 8,
  "steps_per_print": 10,
  "gradient_clipping": 1.0,
  "bf16": {
    "enabled": true
  },
  "communication_data_type": "fp32",
  "data_types": {
    "grad_accum_dtype": "fp32"
  },
  "zero_optimization": {
    "stage": 2,
    "overlap_comm": true,
    "contiguous_gradients": true,
    "reduce_bucket_size": 16777216,
    "reduce_scatter": true,
    "allgather_bucket_size": 16777216
  }
}
MESHPLAN_EOF
