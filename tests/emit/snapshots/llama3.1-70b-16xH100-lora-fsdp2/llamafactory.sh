# LLaMA-Factory plan 1: llama3.1-70b on 16x H100-SXM5-80GB (dgx-h100), dp16 tp1 pp1 z3 mbs1 rc=full; predicted <estimate>
# note: attention_kernel flash: the plan is timed with the GPU's fastest fused attention (cuDNN on Hopper and Blackwell); the config runs FlashAttention-2 and may run slower than planned
# note: not from the plan: the data set alpaca_en_demo (LLaMA-Factory's data/dataset_info.json), learning rate, one epoch and output_dir saves/meshplan are starting values to replace
# run: accelerate launch --config_file accelerate_fsdp2.yaml --machine_rank $NODE_RANK --main_process_ip $MASTER_ADDR -m llamafactory.launcher llamafactory.yaml  (on each of the 2 nodes; LLaMA-Factory 0.9.4)
cat > llamafactory.yaml <<'MESHPLAN_EOF'
model_name_or_path: meta-llama/Llama-3.1-70B
flash_attn: fa2
stage: sft
do_train: true
finetuning_type: lora
lora_rank: 16
lora_alpha: 32
lora_dropout: 0.0
lora_target: q_proj,k_proj,v_proj,o_proj
dataset: alpaca_en_demo
template: llama3
cutoff_len: 4096
output_dir: saves/meshplan
per_device_train_batch_size: 1
gradient_accumulation_steps: 4
learning_rate: 0.0002
num_train_epochs: 1.0
optim: adamw_torch
bf16: true
fp16: false
disable_gradient_checkpointing: true
torch_compile: false
MESHPLAN_EOF
cat > accelerate_fsdp2.yaml <<'MESHPLAN_EOF'
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
mixed_precision: bf16
num_machines: 2
num_processes: 16
machine_rank: 0
main_training_function: main
rdzv_backend: static
same_network: true
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_reshard_after_forward: true
  fsdp_offload_params: false
  fsdp_cpu_ram_efficient_loading: true
  fsdp_state_dict_type: FULL_STATE_DICT
  fsdp_activation_checkpointing: true
MESHPLAN_EOF
