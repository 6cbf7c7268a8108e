"""Property-based fuzzing of every input path: `plan()`, `evaluate()`, the specs, the Hugging Face
config loader, cluster and model files, and the CLI. Wrong types, NaN and infinity, huge and
negative values, unicode, deep nesting and large or odd files: nothing but SpecError escapes,
nothing hangs, no result holds NaN or a negative term, and the CLI never exits 0 on bad input.

Reproducible (derandomize, no example database) and sized to about three thousand cases in about a
minute; `MESHPLAN_FUZZ_SCALE=10` runs every property with ten times the examples.

A property whose inputs may be valid is run through `run_tallied`: it counts, per class of input (a
field, a constraint, a file kind), the examples that got past validation, and fails when a class was
refused wholesale, since then the fuzzing never reached the code behind the validation for that class.
"""

from __future__ import annotations

import functools
import json
import math
import os
import warnings
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cost_models.params import num_params
from planner import ModelSpec, Strategy, evaluate, plan
from planner.cli import main
from planner.errors import SpecError
from planner.specs.files import MAX_DEPTH, MAX_FILE_BYTES
from planner.specs.hf import read_hf_config
from profiles import load_cluster, load_model

SCALE = int(os.environ.get("MESHPLAN_FUZZ_SCALE", "1"))


def fuzz(n: int):
    return settings(max_examples=n * SCALE, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# ---- values ---------------------------------------------------------------------------------
huge_ints = st.one_of(st.integers(-2**70, 2**70), st.sampled_from([0, -1, 2**31, 2**32 + 1, 2**63, 10**18, -2**63]))
odd_floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.5, -0.0, 1e308, -1e-308]))
odd_text = st.one_of(st.text(max_size=20), st.sampled_from(["8", "2048", "nan", "inf", "-1", "ünï©ødé", "", " "]))
scalars = st.one_of(huge_ints, odd_floats, odd_text, st.booleans(), st.none())
weird = st.one_of(scalars, st.lists(scalars, max_size=4), st.dictionaries(st.text(max_size=5), scalars, max_size=3),
                  st.recursive(scalars, lambda x: st.lists(x, max_size=2) | st.dictionaries(st.text(max_size=3), x,
                                                                                             max_size=2), max_leaves=8))


def tallied(fn):
    """Tally a fuzz property's examples per class: the property returns {class: accepted} for the
    classes its input belongs to (accepted: the input got past validation)."""
    @functools.wraps(fn)
    def body(*args, **kwargs):
        for c, accepted in fn(*args, **kwargs).items():
            body.tried[c] += 1
            body.accepted[c] += bool(accepted)
    body.tried, body.accepted = Counter(), Counter()
    return body


def run_tallied(prop, classes, *args, never=(), minimum: int = 1) -> Counter:
    """Run a @given(...)@tallied property (`args`: its arguments hypothesis does not draw: fixtures, the
    class under test); fail unless each of `classes` had at least `minimum` accepted examples, or if one
    of `never` (classes no input of may pass) was not tried or had one accepted."""
    inner = prop.hypothesis.inner_test
    inner.tried.clear()
    inner.accepted.clear()
    prop(*args)
    print(f"{prop.__name__}: accepted/tried per class: "
          + ", ".join(f"{c}: {inner.accepted[c]}/{inner.tried[c]}" for c in sorted(inner.tried, key=str)))
    short = [c for c in classes if inner.accepted[c] < minimum]
    assert not short, (f"{prop.__name__}: classes with fewer than {minimum} accepted examples (refused wholesale): "
                       + ", ".join(f"{c} ({inner.accepted[c]}/{inner.tried[c]})" for c in short))
    passed = [c for c in never if inner.accepted[c] or not inner.tried[c]]
    assert not passed, f"{prop.__name__}: classes that must always be refused were accepted (or not tried): {passed}"
    return inner.accepted


def deep(n: int):
    out: object = 1
    for _ in range(n):
        out = {"a": out}
    return out


def check_estimate(est) -> None:
    """No NaN, infinity or negative term in a result."""
    numbers = [est.step_time_s, est.tokens_per_s, est.tokens_per_s_per_gpu, est.model_tflops_per_gpu,
               est.hardware_tflops_per_gpu, est.mfu, est.peak_memory_bytes, est.memory_capacity_bytes,
               est.bubble_fraction, est.comm_hidden_fraction, *est.memory_bytes.values(), *est.time_s.values()]
    assert all(math.isfinite(x) and x >= 0 for x in numbers), est
    assert est.step_time_s > 0


# ---- specs ---------------------------------------------------------------------------------
SMALL = dict(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=100)


def valid_values(spec, base: dict, extra: dict) -> dict[str, list]:
    """Per field of `spec`: its value in `spec(**base)` and the `extra` ones, each valid alone on `base`."""
    made = spec(**base)
    return {f: [getattr(made, f), *extra.get(f, [])] for f in spec.model_fields}


def value_for(valid: list, odd=weird):
    """One of a field's valid values or an odd one, even odds (so that the field's path past validation is
    reached, and tallied, as well as its refusals; the valid one is the simpler to hypothesis)."""
    return st.booleans().flatmap(lambda is_odd: odd if is_odd else st.sampled_from(valid))


STRATEGY_VALID = valid_values(Strategy, {}, {
    "tp": [2, 8], "pp": [2, 4], "dp": [1, 4], "cp": [2], "ep": [4], "etp": [2], "zero_stage": [1, 2, 3],
    "micro_batch_size": [4], "recompute": ["selective", "full"], "offload_activation_layers": [2],
    "embedding_as_layer": [True], "loss_as_layer": [True], "overlap_grad_reduce": [False],
    "overlap_param_gather": [False], "overlap_p2p_comm": [False], "overlap_moe_comm": [True]})
MODEL_VALID = valid_values(ModelSpec, SMALL, {
    "num_layers": [2, 12], "hidden_size": [128], "num_attention_heads": [2, 8], "num_kv_heads": [1, 2, 4],
    "head_dim": [16, 32], "ffn_hidden_size": [256], "gated_mlp": [True], "vocab_size": [1000],
    "tie_embeddings": [False], "position_embedding": ["learned", "none"], "max_position_embeddings": [4096],
    "rope_theta": [10000.0], "rope_scaling": ["yarn"], "norm": ["layernorm"], "qk_norm": ["per_head", "full"],
    "linear_bias": [True], "qkv_bias": [True], "dropout": [True], "sliding_window": [16], "attention_sinks": [True],
    "num_mtp_layers": [1], "name": ["m"], "source": ["x"]})


@fuzz(16)
@given(data=st.data())
@tallied
def prop_strategy_any_field_value(field, data):
    value = data.draw(value_for(STRATEGY_VALID[field]), label=field)
    try:
        Strategy(**{field: value})
    except SpecError:
        return {field: False}
    return {field: True}


@pytest.mark.parametrize("field", sorted(Strategy.model_fields))
def test_strategy_any_field_value(field):
    run_tallied(prop_strategy_any_field_value, [field], field)


@fuzz(10)
@given(data=st.data())
@tallied
def prop_model_spec_any_field_value(field, data):
    """The field valid or weird, up to two others valid (a combination may still be refused)."""
    value = data.draw(value_for(MODEL_VALID[field]), label=field)
    others = data.draw(st.dictionaries(st.sampled_from(sorted(MODEL_VALID)), st.integers(0, 2**16), max_size=2),
                       label="others")
    changes = {f: MODEL_VALID[f][i % len(MODEL_VALID[f])] for f, i in others.items()} | {field: value}
    try:
        m = ModelSpec(**(SMALL | changes))
    except SpecError:
        return {field: False}
    assert num_params(m) > 0
    return {field: True}


@pytest.mark.parametrize("field", sorted(ModelSpec.model_fields))
def test_model_spec_any_field_value(field):
    run_tallied(prop_model_spec_any_field_value, [field], field)


# ---- plan and evaluate ------------------------------------------------------------------------
heads = st.sampled_from([1, 2, 4, 8])
models = st.builds(lambda L, a, d, f, v, g, tie: dict(num_layers=L, hidden_size=a * d, num_attention_heads=a,
                                                   ffn_hidden_size=f, vocab_size=v, gated_mlp=g, tie_embeddings=tie),
                   st.integers(1, 12), heads, st.sampled_from([16, 32, 64]), st.integers(1, 512), st.integers(1, 5000),
                   st.booleans(), st.booleans())
constraint_values = st.one_of(st.integers(-2, 70), st.lists(st.integers(1, 16), max_size=40), st.sampled_from(
    ["auto", "full", "selective", "none", None, True, 2.5, "x", [2] * 200]))
#: A value each constraint field allows on most of the questions below (mixed into the odd ones).
CONSTRAINT_VALID = {"tp": [1, [1, 2]], "pp": [1, [1, 2]], "cp": [1], "dp": ["auto", 1], "vpp": [1],
                    "micro_batch_size": [1, [1, 2]], "zero_stage": [0, 1, [1, 3]], "recompute": ["none", "full"],
                    "recompute_num_layers": [1, None], "sequence_parallel": [False], "ep": [1], "stage_layers": [None]}
CONSTRAINED = sorted(CONSTRAINT_VALID)
constraints = st.dictionaries(st.sampled_from([*CONSTRAINED, "bogus"]), constraint_values, max_size=2)


@fuzz(4)
@given(model=models, num_gpus=st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 64]), gbs=st.integers(1, 300),
       seq=st.sampled_from([1, 7, 128, 1000, 4096]), others=constraints, top_k=st.integers(1, 4), data=st.data())
@tallied
def prop_plan_small_inputs(key, model, num_gpus, gbs, seq, others, top_k, data):
    """`key` constrained (valid or odd), with up to two other constraints; tallied by `key`."""
    cons = others | {key: data.draw(value_for(CONSTRAINT_VALID.get(key, [1]), constraint_values), label=key)}
    try:
        result = plan(model, "dgx-h100", num_gpus, gbs, seq, constraints=cons, top_k=top_k)
    except SpecError:
        return {key: False}
    for p in result.plans + result.closest:
        check_estimate(p.estimate)
    return {key: True}


@pytest.mark.parametrize("key", CONSTRAINED)
def test_plan_small_inputs(key):
    run_tallied(prop_plan_small_inputs, [key], key)


def test_plan_unknown_constraint_always_refused():
    run_tallied(prop_plan_small_inputs, [], "bogus", never=["bogus"])


@fuzz(300)
@given(num_gpus=scalars, gbs=scalars, seq=scalars, precision=st.one_of(st.sampled_from(["bf16", "fp8", "int4"]),
                                                                          scalars), top_k=scalars)
def test_plan_any_scalar_arguments(num_gpus, gbs, seq, precision, top_k):
    """Bad scalars are refused before any search (a search on 2^63 GPUs or a batch of 10^18 would hang)."""
    ok = all(isinstance(v, int) and not isinstance(v, bool) for v in (num_gpus, gbs, seq, top_k)) and \
        precision in ("bf16", "fp8") and 1 <= num_gpus <= 64 and 1 <= gbs <= 4096 and 1 <= seq <= 8192
    if not ok:
        with pytest.raises(SpecError):
            plan(SMALL, "dgx-h100", num_gpus, gbs, seq, precision=precision, top_k=top_k,
                 constraints={"pp": 1, "tp": 1} if isinstance(num_gpus, int) and num_gpus > 4096 else None)
        return


strategy_values = {
    "dp": st.one_of(st.just("auto"), st.integers(-1, 20)), "tp": st.integers(0, 20), "pp": st.integers(0, 20),
    "cp": st.integers(0, 8), "vpp": st.integers(0, 6), "zero_stage": st.integers(-1, 4),
    "micro_batch_size": st.integers(0, 300), "sequence_parallel": st.booleans(),
    "recompute": st.sampled_from(["none", "selective", "full", "half"]), "recompute_num_layers": st.integers(0, 20),
    "num_layers_in_first_stage": st.integers(0, 10),
    "stage_layers": value_for([[2, 2], [1, 3]], st.lists(st.one_of(st.integers(-1, 10), st.just(2**70)), max_size=6)),
    "offload_optimizer": st.booleans(), "ep": st.integers(0, 4)}
STRATEGY_KEYS = sorted(strategy_values)
#: What a field needs beside it to be a Strategy at all (vpp > 1 needs pp > 1, ...): its tallied examples
#: set these too, unless the other drawn fields replace them.
STRATEGY_NEEDS = {"vpp": {"pp": 2}, "num_layers_in_first_stage": {"pp": 2}, "stage_layers": {"pp": 2},
                  "sequence_parallel": {"tp": 2}, "recompute_num_layers": {"recompute": "full"},
                  "offload_optimizer": {"zero_stage": 1}}


@fuzz(14)
@given(model=models, num_gpus=st.sampled_from([1, 2, 4, 6, 8, 16]), gbs=st.integers(1, 256),
       seq=st.sampled_from([64, 1000, 2048]), data=st.data())
@tallied
def prop_evaluate_any_strategy(key, model, num_gpus, gbs, seq, data):
    """A valid input with any strategy gives an Estimate (fits=False and reasons when it breaks a rule).
    `key` is set (with what it needs beside it), up to two other fields too; tallied by `key`."""
    others = data.draw(st.fixed_dictionaries({}, optional=strategy_values).filter(lambda d: len(d) <= 2),
                       label="others")
    strategy = STRATEGY_NEEDS.get(key, {}) | others | {key: data.draw(strategy_values[key], label=key)}
    try:
        est = evaluate(model, "dgx-h100", num_gpus, gbs, seq, strategy=strategy)
    except SpecError:
        return {key: False}
    check_estimate(est)
    assert est.fits == (not est.reasons)
    if not est.valid:
        assert not est.fits and est.reasons
    return {key: True}


@pytest.mark.parametrize("key", STRATEGY_KEYS)
def test_evaluate_any_strategy(key):
    run_tallied(prop_evaluate_any_strategy, [key], key)


# ---- Hugging Face configs --------------------------------------------------------------------
LLAMA_HF = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 2048,
            "tie_word_embeddings": False, "attention_dropout": 0.0, "sliding_window": None}
HF_KEYS = sorted(LLAMA_HF) + ["head_dim", "mlp_bias", "attention_bias", "text_config", "layer_types", "num_experts",
                              "_name_or_path", "use_sliding_window", "n_layer"]
MODEL_TYPE_NAMES = ["llama", "mistral", "qwen2", "qwen2_moe", "deepseek_v3", "gemma3", "gpt2", "gpt_oss", "mixtral",
                    "llama4", "unknown_family", "jamba"]
#: The base config of a family that reads fields under names of its own (GPT-2's n_layer, n_embd, ...) instead of
#: LLAMA_HF's (which its reader would refuse as fields it does not read).
HF_FAMILY_BASE = {"gpt2": {"n_layer": 4, "n_embd": 64, "n_head": 4, "n_positions": 2048, "vocab_size": 100}}
#: Families the planner refuses whatever the fields (a hybrid of attention and state-space layers).
HYBRID = ["jamba"]



@fuzz(40)
@given(changes=st.dictionaries(st.sampled_from(HF_KEYS), weird, max_size=3))
@tallied
def prop_hf_config_any_values(model_type, changes):
    """Tallied by model_type ('replaced' where the changes replace it)."""
    cls = model_type if "model_type" not in changes else "replaced"
    try:
        m = read_hf_config(HF_FAMILY_BASE.get(model_type, LLAMA_HF) | {"model_type": model_type} | changes)
    except SpecError:
        return {cls: False}
    assert num_params(m) > 0
    return {cls: True}


@pytest.mark.parametrize("model_type", MODEL_TYPE_NAMES)
def test_hf_config_any_values(model_type):
    hybrid = model_type in HYBRID
    run_tallied(prop_hf_config_any_values, [] if hybrid else [model_type], model_type,
                never=[model_type] if hybrid else [])


@fuzz(150)
@given(key=st.sampled_from(["num_hidden_layers", "hidden_size", "intermediate_size", "attention_dropout",
                            "vocab_size", "max_position_embeddings"]),
       value=st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e400, 4.5, "64", True, [64], {"a": 1}]))
def test_hf_json_file_nan_infinity_wrong_types(tmp_path_factory, key, value):
    path = tmp_path_factory.mktemp("hf") / "config.json"
    path.write_text(json.dumps(LLAMA_HF | {key: value}))
    with pytest.raises(SpecError):
        read_hf_config(str(path))


# ---- cluster and model files ------------------------------------------------------------------
CLUSTER = {"name": "fz", "gpu": {"name": "g", "memory_gib": 80, "peak_tflops": {"bf16": 989, "fp8": 1979},
                                "hbm_bw_gb_per_s": 3350},
           "gpus_per_node": 8, "intra_node": {"name": "nvl", "bw_gb_per_s": 450, "latency_us": 3},
           "inter_node": {"name": "ib", "bw_gb_per_s": 50, "latency_us": 6}}
CLUSTER_PATHS = [("gpus_per_node",), ("gpu", "memory_gib"), ("gpu", "peak_tflops", "bf16"), ("gpu", "peak_tflops"),
                 ("gpu", "hbm_bw_gb_per_s"), ("gpu", "gemm_efficiency"), ("intra_node", "bw_gb_per_s"),
                 ("inter_node", "latency_us"), ("inter_node", "efficiency"), ("comm_overlap",), ("max_gpus",),
                 ("nvlink_domain_size",), ("gpu",), ("intra_node",), ("name",), ("host",), ("gpu", "name")]


def with_value(base: dict, path: tuple, value) -> dict:
    out = json.loads(json.dumps(base))
    node = out
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return out


#: Valid values per path, mixed into the weird ones (each path is tallied).
CLUSTER_VALID = {("gpus_per_node",): [4, 8, 72], ("gpu", "memory_gib"): [40, 192], ("gpu", "peak_tflops", "bf16"): [312],
                 ("gpu", "peak_tflops"): [{"bf16": 312, "fp16": 312}], ("gpu", "hbm_bw_gb_per_s"): [1555],
                 ("gpu", "gemm_efficiency"): [0.6], ("intra_node", "bw_gb_per_s"): [300],
                 ("inter_node", "latency_us"): [0, 10], ("inter_node", "efficiency"): [0.7], ("comm_overlap",): [0.5],
                 ("max_gpus",): [64], ("nvlink_domain_size",): [8, 72], ("gpu",): ["h100-sxm", "a100-80gb"],
                 ("intra_node",): [{"name": "pcie", "bw_gb_per_s": 25, "latency_us": 5}], ("name",): ["x", "ünï"],
                 ("host",): [{"memory_gib": 1024, "memory_bw_gb_per_s": 400}], ("gpu", "name"): ["G"]}


@fuzz(30)
@given(data=st.data())
@tallied
def prop_cluster_any_values(path, data):
    """Tallied by path."""
    value = data.draw(value_for(CLUSTER_VALID[path]), label="value")
    try:
        c = load_cluster(with_value(CLUSTER, path, value))
    except SpecError:
        return {path: False}
    for x in (c.gpu.memory_bytes, c.gpu.hbm_bw_bytes_per_s, c.intra_node.bw_bytes_per_s, c.inter_node.bw_bytes_per_s,
              *c.gpu.peak_flop_per_s.values()):
        assert math.isfinite(x) and x > 0
    return {path: True}


@pytest.mark.parametrize("path", CLUSTER_PATHS, ids=".".join)
def test_cluster_any_values(path):
    run_tallied(prop_cluster_any_values, [path], path)


@fuzz(120)
@given(path=st.sampled_from([("gpu", "peak_tflops", "bf16"), ("gpu", "memory_gib"), ("gpu", "hbm_bw_gb_per_s"),
                             ("intra_node", "bw_gb_per_s"), ("inter_node", "bw_gb_per_s")]),
       value=st.sampled_from([-989, 0, float("inf"), float("nan"), 1e308, "989", True]))
def test_cluster_negative_or_infinite_hardware_refused(path, value):
    """A negative peak gave a negative MFU; an infinite memory or bandwidth made everything fit."""
    with pytest.raises(SpecError):
        load_cluster(with_value(CLUSTER, path, value))


file_bytes = st.one_of(
    st.binary(max_size=200),
    st.text(max_size=200).map(lambda t: t.encode("utf-8")),
    st.text(max_size=50).map(lambda t: t.encode("utf-16")),
    st.sampled_from([b"", b"\xff\xfe\x00", b"num_layers: .nan\n", b"- 1\n- 2\n", b"a: &a [1]\nb: *a\n",
                     b"num_layers: !!python/object:os.system x\n", b"[" * 5000, b"{" * 100 + b"}" * 100]),
    # valid files of each kind (JSON is YAML too): a model, a Hugging Face config, a cluster
    st.sampled_from([json.dumps(SMALL).encode(), json.dumps(LLAMA_HF).encode(), json.dumps(CLUSTER).encode()]))


_FILES = iter(range(10**9))


@fuzz(300)
@given(data=file_bytes, suffix=st.sampled_from([".yaml", ".json"]), kind=st.sampled_from(["model", "cluster"]))
@tallied
def prop_any_file_contents(tmp_path_factory, data, suffix, kind):
    """Tallied by kind and suffix (a model .json file is a Hugging Face config)."""
    path = tmp_path_factory.getbasetemp() / f"fuzz-file-{next(_FILES)}{suffix}"
    path.write_bytes(data)
    try:
        (load_model if kind == "model" else load_cluster)(str(path))
    except SpecError:
        return {(kind, suffix): False}
    return {(kind, suffix): True}


def test_any_file_contents(tmp_path_factory):
    run_tallied(prop_any_file_contents, [(k, x) for k in ("model", "cluster") for x in (".yaml", ".json")],
                tmp_path_factory)


def billion_laughs(levels: int = 9) -> str:
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "\n".join(lines) + f"\nnum_layers: *a{levels - 1}\n"


@pytest.mark.parametrize("kind", ["model", "cluster"])
def test_yaml_alias_bomb_refused(tmp_path, kind):
    path = tmp_path / "bomb.yaml"
    path.write_text(billion_laughs())
    with pytest.raises(SpecError, match="expands to more than"):
        (load_model if kind == "model" else load_cluster)(str(path))


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 3000, 100_000], ids=["just-over", "3000", "100000"])
def test_deep_yaml_refused(tmp_path, depth):
    path = tmp_path / "deep.yaml"
    path.write_text("a: " + "[" * depth + "]" * depth + "\n")
    with pytest.raises(SpecError, match="nests deeper"):
        load_model(str(path))


def test_deep_json_and_dicts_refused(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(SpecError, match="nests deeper"):
        read_hf_config(str(path))
    with pytest.raises(SpecError, match="nests deeper"):
        read_hf_config(LLAMA_HF | {"rope_scaling": deep(10_000)})
    with pytest.raises(SpecError):
        load_cluster(CLUSTER | {"host": deep(10_000)})


@pytest.mark.parametrize("name", ["/dev/zero", "/dev/urandom", "/dev/null"])
def test_device_files_refused_before_reading(name):
    """/dev/zero as a model file exhausted memory: a file that is not a regular file is never read."""
    with pytest.raises(SpecError, match="not a regular file"):
        load_model(name)
    with pytest.raises(SpecError, match="not a regular file"):
        read_hf_config(name)


def test_huge_directory_binary_utf16_files_refused(tmp_path):
    big = tmp_path / "big.yaml"
    with open(big, "wb") as fh:
        fh.truncate(MAX_FILE_BYTES + 1)  # sparse: large on paper, nothing to read
    with pytest.raises(SpecError, match="at most"):
        load_model(str(big))
    with pytest.raises(SpecError, match="is a directory"):
        load_model(str(tmp_path) + os.sep)
    with pytest.raises(SpecError, match="is a directory"):
        read_hf_config(tmp_path)
    (tmp_path / "bin.yaml").write_bytes(bytes(range(256)))
    with pytest.raises(SpecError, match="not UTF-8"):
        load_model(str(tmp_path / "bin.yaml"))
    (tmp_path / "u16.json").write_text(json.dumps(LLAMA_HF), encoding="utf-16")
    with pytest.raises(SpecError, match="not UTF-8"):
        read_hf_config(str(tmp_path / "u16.json"))


# ---- bounded enumerations ---------------------------------------------------------------------
def test_unbounded_sizes_refused_before_search():
    with pytest.raises(SpecError, match="global_batch_size"):
        plan("llama3-8b", "dgx-h100", 8, 10**18, 4096)
    with pytest.raises(SpecError, match="num_gpus"):
        plan("llama3-8b", "dgx-h100", 2**63, 64, 4096)
    with pytest.raises(SpecError, match="num_layers"):
        plan(SMALL | {"num_layers": 10**6}, "dgx-h100", 8, 64, 1024)
    with pytest.raises(SpecError, match="top_k"):
        plan(SMALL, "dgx-h100", 8, 64, 1024, top_k=10**9)


def test_largest_sizes_allowed_still_finish():
    """The bounds themselves: the enumerations over them end (divisors from prime factors)."""
    r = plan(SMALL, "dgx-h100", 2**32, 2**32, 1024, constraints={"tp": 1, "cp": 1, "pp": 1}, top_k=1)
    assert r.stats.num_candidates > 0
    r = plan(SMALL | {"num_layers": 10_000}, "dgx-h100", 64, 64, 512, top_k=1)
    assert r.stats.num_candidates > 0


def test_repeated_constraint_values_deduplicated_and_bounded():
    once = plan(SMALL, "dgx-h100", 8, 64, 1024, constraints={"pp": [2]}, top_k=1)
    many = plan(SMALL, "dgx-h100", 8, 64, 1024, constraints={"pp": [2] * 100_000}, top_k=1)
    assert many.stats.num_candidates == once.stats.num_candidates
    with pytest.raises(SpecError, match="at most"):
        plan(SMALL, "dgx-h100", 8, 64, 1024, constraints={"pp": list(range(1, 10_000))})


# ---- the CLI ---------------------------------------------------------------------------------
GOOD = {"--model": "llama3-8b", "--cluster": "dgx-h100", "--gpus": "8", "--global-batch-size": "64",
        "--seq-len": "4096"}
bad_option_values = st.one_of(
    st.sampled_from(["0", "-1", "x", "1.5", "nan", "inf", str(2**63), str(10**18), "", "ünï", "/dev/zero", "/"]),
    st.text(max_size=10).filter(lambda t: not t.strip().isdigit()))


#: evaluate's strategy options, each with a value it takes alone for GOOD's question.
OPTION_VALID = {"--tp": ["1", "2", "8"], "--pp": ["1", "2"], "--vpp": ["1"], "--cp": ["1", "2"], "--mbs": ["1", "2"],
                "--zero": ["0", "1", "3"], "--dp": ["8"], "--stage-layers": ["32"], "--recompute-num-layers": ["1"]}
#: What an option needs beside it (--recompute-num-layers: full recompute).
OPTION_NEEDS = {"--recompute-num-layers": ["--recompute", "full"]}
STRATEGY_OPTIONS = sorted(OPTION_VALID)


def run(capsys, args: list[str]) -> tuple[int, str]:
    code = main(args)
    _, err = capsys.readouterr()
    return code, err


@fuzz(40)
@given(option=st.sampled_from(["--model", "--cluster", "--gpus", "--global-batch-size", "--seq-len", "--precision",
                               "--top", "--optimizer", "--grad-precision", "--moe-load-imbalance", "-C"]),
       value=bad_option_values, command=st.sampled_from(["plan", "evaluate"]))
def test_cli_bad_value_exits_2_with_one_line(capsys, option, value, command):
    if command == "evaluate" and option in ("--top", "-C"):
        option = "--tp"
    if option == "-C":
        value = f"tp={value}" if value else "tp"
    if option == "--moe-load-imbalance" and value == "1.5":  # a valid imbalance
        value = "0.5"
    args = [command]
    for k, v in (GOOD | {option: value}).items():
        args += [k, v]
    code, err = run(capsys, args)
    assert code == 2, (args, code, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), (args, err)


@fuzz(3)
@given(others=st.lists(st.sampled_from(STRATEGY_OPTIONS), max_size=2, unique=True),
       values=st.lists(st.sampled_from(["0", "-3", "3", "2", "64", "2,2", "99999999999"]), min_size=3, max_size=3),
       data=st.data())
@tallied
def prop_cli_evaluate_strategy_values(capsys, option, others, values, data):
    """`option` set (a value it takes for llama3-8b on 8 GPUs, or an odd one), up to two others; tallied by
    `option` (accepted: exit 0 or 1, an estimate printed)."""
    args = ["evaluate"] + [x for kv in GOOD.items() for x in kv]
    for opt, v in zip([o for o in others if o != option], values):
        args += [opt, v]
    args += OPTION_NEEDS.get(option, [])
    args += [option, data.draw(value_for(OPTION_VALID[option], st.sampled_from(values)), label=option)]
    code, err = run(capsys, args)
    assert code in (0, 1, 2), (args, code, err)
    assert "Traceback" not in err
    if code == 2:
        assert len(err.strip().splitlines()) == 1, (args, err)
    return {option: code != 2}


@pytest.mark.parametrize("option", STRATEGY_OPTIONS)
def test_cli_evaluate_strategy_values(capsys, option):
    run_tallied(prop_cli_evaluate_strategy_values, [option], capsys, option)
