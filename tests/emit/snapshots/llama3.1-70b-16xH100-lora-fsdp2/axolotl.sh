# Axolotl plan 1: llama3.1-70b on 16x H100-SXM5-80GB (dgx-h100), dp16 tp1 pp1 z3 mbs1 rc=full; predicted <estimate>
# note: attention_kernel flash: the plan is timed with the GPU's fastest fused attention (cuDNN on Hopper and Blackwell); the config runs FlashAttention-2 and may run slower than planned
# note: not from the plan: the data set mhenrichsen/alpaca_2k_test (alpaca), learning rate, one epoch and output_dir ./outputs/meshplan are starting values to replace
# run: axolotl train axolotl.yaml  (on each of the 2 nodes, with accelerate's machine rank and main process address; Axolotl 0.9.2)
cat > axolotl.yaml <<'MESHPLAN_EOF'
base_model: meta-llama/Llama-3.1-70B
adapter: lora
lora_r: 16
lora_alpha: 32
lora_dropout: 0.0
lora_target_modules:
- q_proj
- k_proj
- v_proj
- o_proj
lora_mlp_kernel: false
lora_qkv_kernel: false
lora_o_kernel: false
datasets:
- path: mhenrichsen/alpaca_2k_test
  type: alpaca
output_dir: ./outputs/meshplan
sequence_len: 4096
micro_batch_size: 1
gradient_accumulation_steps: 4
num_epochs: 1
learning_rate: 0.0002
optimizer: adamw_torch
bf16: true
fp16: false
gradient_checkpointing: false
flash_attention: true
torch_compile: false
fsdp:
- full_shard
- auto_wrap
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_reshard_after_forward: true
  fsdp_offload_params: false
  fsdp_cpu_ram_efficient_loading: true
  fsdp_state_dict_type: FULL_STATE_DICT
  fsdp_activation_checkpointing: true
MESHPLAN_EOF
