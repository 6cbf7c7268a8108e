"""The Megatron executor's configs: the emitted split reaches megatron-core, and the one-GPU
parity reference drops it (issue 7). Configs only: building GPTModel needs CUDA."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

from executors.megatron_worker import _resolve, reference_engine_config  # noqa: E402
from executors.validate import engine_config  # noqa: E402
from planner import evaluate  # noqa: E402
from planner.api import make_inputs  # noqa: E402
from planner.specs import Strategy  # noqa: E402

QUESTION = ("llama3-8b", "dgx-h100", 32, 128, 4096)


def _transformer_config(kw: dict):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(**_resolve(kw["transformer"]))


@pytest.mark.parametrize("strategy", [
    Strategy(tp=2, pp=4, vpp=2, stage_layers=[6, 10, 12, 4]),
    Strategy(tp=2, pp=2, embedding_as_layer=True, loss_as_layer=True),  # (32 + 2) / 2 layers a stage
    Strategy(tp=2, pp=4, num_layers_in_first_stage=6, num_layers_in_last_stage=6),
], ids=lambda s: s.split_label())
def test_megatron_engine_config_carries_the_split_and_its_reference_drops_it(strategy):
    model, cluster, train = make_inputs(*QUESTION, "bf16")
    st = strategy.resolve(QUESTION[2])
    est = evaluate(*QUESTION, strategy=st)
    kw, why_not = engine_config("megatron", model, cluster, train, QUESTION[2], st, est)
    assert kw is not None, why_not
    full = _transformer_config(kw)
    assert (full.pipeline_model_parallel_layout is not None) == (st.stage_layers is not None)
    assert full.account_for_embedding_in_pipeline_split == st.embedding_as_layer
    assert full.num_layers_in_first_pipeline_stage == st.num_layers_in_first_stage
    ref = _transformer_config(reference_engine_config(kw))
    assert ref.pipeline_model_parallel_size == 1 and ref.virtual_pipeline_model_parallel_size is None
    assert ref.pipeline_model_parallel_layout is None and not ref.account_for_embedding_in_pipeline_split
    assert ref.num_layers_in_first_pipeline_stage is None and ref.num_layers == model.num_layers
