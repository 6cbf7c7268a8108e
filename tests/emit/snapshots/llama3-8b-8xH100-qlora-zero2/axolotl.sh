# Axolotl plan 1: llama3-8b on 8x H100-SXM5-80GB (dgx-h100), dp8 tp1 pp1 z2 mbs1 rc=full; predicted <estimate>
# note: attention_kernel flash: the plan is timed with the GPU's fastest fused attention (cuDNN on Hopper and Blackwell); the config runs FlashAttention-2 and may run slower than planned
# note: cross_entropy_fusion: the plan is costed with a fused cross-entropy; the Hugging Face model computes PyTorch's cross_entropy over the full logits
# note: adapter_precision fp32: DeepSpeed's 16-bit engine holds the adapters in 16 bits with an fp32 master copy in the optimizer (a few bytes more per adapter weight than planned)
# note: not from the plan: the data set mhenrichsen/alpaca_2k_test (alpaca), learning rate, one epoch and output_dir ./outputs/meshplan are starting values to replace
# run: axolotl train axolotl.yaml  (Axolotl 0.9.2)
cat > axolotl.yaml <<'MESHPLAN_EOF'
base_model: meta-llama/Meta-Llama-3-8B
load_in_4bit: true
adapter: qlora
bnb_config_kwargs:
  bnb_4bit_quant_type: nf4
  bnb_4bit_use_double_quant: true
lora_r: 16
lora_alpha: 32
lora_dropout: 0.0
lora_target_linear: true
lora_mlp_kernel: false
lora_qkv_kernel: false
lora_o_kernel: false
datasets:
- path: mhenrichsen/alpaca_2k_test
  type: alpaca
output_dir: ./outputs/meshplan
sequence_len: 4096
micro_batch_size: 1
gradient_accumulation_steps: 8
num_epochs: 1
learning_rate: 0.0002
optimizer: paged_adamw_32bit
bf16: true
fp16: false
gradient_checkpointing: true
flash_attention: true
torch_compile: false
deepspeed: ds_config.json
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
