# Colossal-AI plan 1: gpt3-175b on 1024x A100-SXM4-80GB (dgx-a100-80gb), dp16 tp8 pp8 z0 mbs1 rc=full; predicted <estimate>
# note: grad_precision fp32: data parallel all-reduce runs in the compute dtype (fp16); half the plan's gradient traffic
import torch
from colossalai.booster import Booster
from colossalai.booster.plugin import HybridParallelPlugin
from colossalai.shardformer import PipelineGradientCheckpointConfig

plugin = HybridParallelPlugin(
    tp_size=8,
    pp_size=8,
    precision='fp16',
    zero_stage=0,
    dp_outside=False,
    microbatch_size=1,
    num_microbatches=96,
    gradient_checkpoint_config=PipelineGradientCheckpointConfig(num_ckpt_layers_per_stage=[12, 12, 12, 12, 12, 12, 12, 12]),
    overlap_communication=True,
    enable_flash_attention=True,
)
booster = Booster(plugin=plugin)
model.gradient_checkpointing_enable()  # full recomputation, before booster.boost
train_dataloader = plugin.prepare_dataloader(dataset, batch_size=96, shuffle=True, drop_last=True)
model, optimizer, _, train_dataloader, _ = booster.boost(model, optimizer, dataloader=train_dataloader)
