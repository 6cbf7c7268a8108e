"""Property-based fuzzing of every input path: `plan()`, `evaluate()`, the specs, the Hugging Face
config loader, cluster and model files, and the CLI. Wrong types, NaN and infinity, huge and
negative values, unicode, deep nesting and large or odd files: nothing but SpecError escapes,
nothing hangs, no result holds NaN or a negative term, and the CLI never exits 0 on bad input.

Reproducible (derandomize, no example database) and sized to about three thousand cases in about a
minute; `MESHPLAN_FUZZ_SCALE=10` runs every property with ten times the examples.
"""

from __future__ import annotations

import json
import math
import os
import warnings

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


@fuzz(400)
@given(field=st.sampled_from(sorted(Strategy.model_fields)), value=weird)
def test_strategy_any_field_value(field, value):
    try:
        Strategy(**{field: value})
    except SpecError:
        pass


@fuzz(400)
@given(changes=st.dictionaries(st.sampled_from(sorted(ModelSpec.model_fields)), weird, min_size=1, max_size=3))
def test_model_spec_any_field_value(changes):
    try:
        m = ModelSpec(**(SMALL | changes))
    except SpecError:
        return
    assert num_params(m) > 0


# ---- plan and evaluate ------------------------------------------------------------------------
heads = st.sampled_from([1, 2, 4, 8])
models = st.builds(lambda L, a, d, f, v, g, tie: dict(num_layers=L, hidden_size=a * d, num_attention_heads=a,
                                                   ffn_hidden_size=f, vocab_size=v, gated_mlp=g, tie_embeddings=tie),
                   st.integers(1, 12), heads, st.sampled_from([16, 32, 64]), st.integers(1, 512), st.integers(1, 5000),
                   st.booleans(), st.booleans())
constraint_values = st.one_of(st.integers(-2, 70), st.lists(st.integers(1, 16), max_size=40), st.sampled_from(
    ["auto", "full", "selective", "none", None, True, 2.5, "x", [2] * 200]))
constraints = st.dictionaries(st.sampled_from(["tp", "pp", "cp", "dp", "vpp", "micro_batch_size", "zero_stage",
                                               "recompute", "recompute_num_layers", "sequence_parallel", "ep",
                                               "stage_layers", "bogus"]), constraint_values, max_size=3)


@fuzz(40)
@given(model=models, num_gpus=st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 64]), gbs=st.integers(1, 300),
       seq=st.sampled_from([1, 7, 128, 1000, 4096]), cons=constraints, top_k=st.integers(1, 4))
def test_plan_small_inputs(model, num_gpus, gbs, seq, cons, top_k):
    try:
        result = plan(model, "dgx-h100", num_gpus, gbs, seq, constraints=cons, top_k=top_k)
    except SpecError:
        return
    for p in result.plans + result.closest:
        check_estimate(p.estimate)


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


strategies = st.fixed_dictionaries({}, optional={
    "dp": st.one_of(st.just("auto"), st.integers(-1, 20)), "tp": st.integers(0, 20), "pp": st.integers(0, 20),
    "cp": st.integers(0, 8), "vpp": st.integers(0, 6), "zero_stage": st.integers(-1, 4),
    "micro_batch_size": st.integers(0, 300), "sequence_parallel": st.booleans(),
    "recompute": st.sampled_from(["none", "selective", "full", "half"]), "recompute_num_layers": st.integers(0, 20),
    "num_layers_in_first_stage": st.integers(0, 10),
    "stage_layers": st.lists(st.one_of(st.integers(-1, 10), st.just(2**70)), max_size=6),
    "offload_optimizer": st.booleans(), "ep": st.integers(0, 4)})


@fuzz(200)
@given(model=models, num_gpus=st.sampled_from([1, 2, 4, 6, 8, 16]), gbs=st.integers(1, 256),
       seq=st.sampled_from([64, 1000, 2048]), strategy=strategies)
def test_evaluate_any_strategy(model, num_gpus, gbs, seq, strategy):
    """A valid input with any strategy gives an Estimate (fits=False and reasons when it breaks a rule)."""
    try:
        est = evaluate(model, "dgx-h100", num_gpus, gbs, seq, strategy=strategy)
    except SpecError:
        return
    check_estimate(est)
    assert est.fits == (not est.reasons)
    if not est.valid:
        assert not est.fits and est.reasons


# ---- Hugging Face configs --------------------------------------------------------------------
LLAMA_HF = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 2048,
            "tie_word_embeddings": False, "attention_dropout": 0.0, "sliding_window": None}
HF_KEYS = sorted(LLAMA_HF) + ["head_dim", "mlp_bias", "attention_bias", "text_config", "layer_types", "num_experts",
                              "_name_or_path", "use_sliding_window", "n_layer"]
MODEL_TYPES = st.sampled_from(["llama", "mistral", "qwen2", "qwen2_moe", "deepseek_v3", "gemma3", "gpt2", "gpt_oss",
                               "mixtral", "llama4", "unknown_family", "jamba"])


@fuzz(500)
@given(changes=st.dictionaries(st.sampled_from(HF_KEYS), weird, max_size=3), model_type=MODEL_TYPES)
def test_hf_config_any_values(changes, model_type):
    try:
        m = read_hf_config(LLAMA_HF | {"model_type": model_type} | changes)
    except SpecError:
        return
    assert num_params(m) > 0


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


@fuzz(500)
@given(path=st.sampled_from(CLUSTER_PATHS), value=weird)
def test_cluster_any_values(path, value):
    try:
        c = load_cluster(with_value(CLUSTER, path, value))
    except SpecError:
        return
    for x in (c.gpu.memory_bytes, c.gpu.hbm_bw_bytes_per_s, c.intra_node.bw_bytes_per_s, c.inter_node.bw_bytes_per_s,
              *c.gpu.peak_flop_per_s.values()):
        assert math.isfinite(x) and x > 0


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
                     b"num_layers: !!python/object:os.system x\n", b"[" * 5000, b"{" * 100 + b"}" * 100]))


_FILES = iter(range(10**9))


@fuzz(300)
@given(data=file_bytes, suffix=st.sampled_from([".yaml", ".json"]), kind=st.sampled_from(["model", "cluster"]))
def test_any_file_contents(tmp_path_factory, data, suffix, kind):
    path = tmp_path_factory.getbasetemp() / f"fuzz-file-{next(_FILES)}{suffix}"
    path.write_bytes(data)
    try:
        (load_model if kind == "model" else load_cluster)(str(path))
    except SpecError:
        pass


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


@fuzz(25)
@given(extra=st.lists(st.sampled_from(["--tp", "--pp", "--vpp", "--cp", "--mbs", "--zero", "--dp",
                                       "--stage-layers", "--recompute-num-layers"]), min_size=1, max_size=3,
                      unique=True),
       values=st.lists(st.sampled_from(["0", "-3", "3", "2", "64", "2,2", "99999999999"]), min_size=3, max_size=3))
def test_cli_evaluate_strategy_values(capsys, extra, values):
    args = ["evaluate"] + [x for kv in GOOD.items() for x in kv]
    for opt, v in zip(extra, values):
        args += [opt, v]
    code, err = run(capsys, args)
    assert code in (0, 1, 2), (args, code, err)
    assert "Traceback" not in err
    if code == 2:
        assert len(err.strip().splitlines()) == 1, (args, err)
