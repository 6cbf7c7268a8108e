"""The emitter contract, its registry, and the facts every emitter derives from a plan.

An emitter turns one `Plan` into what a framework needs to run it: command-line
flags, a config file, a plugin constructor, a launch script. Framework names
(flags, config keys) live only in each backend module's mapping table; this
module speaks the planner's vocabulary (dp, tp, pp, cp, ep, etp, vpp, zero_stage).

Contract of an `Emitter` (checked for every registered emitter by
tests/emit/test_contract.py):

- `data(plan, options)` returns the structured form (JSON-serialisable: dicts,
  lists, str, int, float, bool, None); `render(plan, options)` returns the text
  a user pastes (a shell block, JSON, TOML or Python). Both describe the same
  settings and are deterministic: the same plan gives byte-identical output.
- Neither mutates the plan, prints, reads or writes files, or imports the
  framework it targets (the tests do that, to check the output).
- A strategy the framework cannot run as planned raises `NotExpressibleError`
  whose message starts "not expressible in <framework>: " and names the field,
  the rule and the value. An emitter never silently drops or changes a knob
  that changes memory or speed; it either maps it or refuses.
- Text from the user (model, cluster and GPU names, the entry point, any path)
  reaches the output only through `planner.emit.quoting`: quoted as data for
  the output's language, escaped into a one-line comment, or checked against
  a pattern where it is used as a name; never written as code.
- An emitter whose output runs plans of more than one framework as costed (a fine-tuning toolkit under
  DeepSpeed or FSDP2) names the others in `also_runs`; `runs` is the one a search for it is costed as.
- An emitter whose text form cannot carry part of a plan that its `data` form
  carries (DeepSpeed's bare JSON has no tp key) has `omissions(plan, options)`,
  one reason per dropped part; `meshplan emit` prints them on stderr and exits
  2 unless `--allow-partial`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, field_validator

from cost_models.layout import ParallelLayout
from planner.emit.quoting import NAME_PATTERN, SHELL_IDENTIFIER, check_name, clip, one_line, shell_command, shell_word
from planner.errors import SpecError, short_repr, unknown_name_message
from planner.specs import Plan, Strategy
from planner.specs.strategy import RANK_ORDERS


class NotExpressibleError(SpecError):
    """The plan's strategy cannot be run as planned by this framework."""

    def __init__(self, framework: str, reason: str) -> None:
        super().__init__(f"not expressible in {framework}: {reason}")
        self.framework = framework
        self.reason = reason


LaunchTarget = Literal["megatron", "deepspeed", "colossalai", "torchtitan"]
#: Megatron-Bridge versions the megatron-bridge emitter writes overrides for: `--bridge-version` name -> the
#: release (or main-branch commit) its field names and rules were checked against. The first is the default, the
#: newest release; `main` is Megatron-Bridge's main branch at a pinned commit after 0.6.0, whose Llama recipes
#: nest the model's transformer fields (planner.emit.megatron_bridge)
BRIDGE_VERSIONS = {"0.6": "0.6.0", "0.3": "0.3.1", "main": "main@067f987df"}
DEFAULT_BRIDGE_VERSION = next(iter(BRIDGE_VERSIONS))
#: a Hugging Face model id (`org/name`) or a local model folder, as the fine-tuning toolkits' configs name the model:
#: letters, digits, `_`, `.`, `-` in `/`-separated parts, optionally absolute or `./`-relative; every part starts with
#: a letter, digit or `_` (so no `..` part, and no leading `-` that would read as an option)
HF_MODEL_PATTERN = r"^(/|\./)?[A-Za-z0-9_][A-Za-z0-9_.-]*(/[A-Za-z0-9_][A-Za-z0-9_.-]*)*$"


def check_bridge_version(option: str, value: str) -> str:
    """`value` if it names a Megatron-Bridge release the emitter writes for; else a one-line SpecError that
    names the option (`--bridge-version` on the command line, `bridge_version` in Python) and the choices."""
    if value not in BRIDGE_VERSIONS:
        choices = ", ".join(f"{name} ({release})" for name, release in BRIDGE_VERSIONS.items())
        raise SpecError(f"{option} must be one of {choices} (got {short_repr(value)})")
    return value


class EmitOptions(BaseModel):
    """Choices that are not part of the plan: what the launch scripts run, and where."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    launch_for: LaunchTarget = Field(
        "megatron", description="Framework the torchrun/slurm launch scripts start: megatron, deepspeed, colossalai or torchtitan."
    )
    script: str | None = Field(
        None,
        description="Training entry point the launch scripts run; default: pretrain_gpt.py (Megatron-LM, "
        "Megatron-DeepSpeed), train.py (Colossal-AI), -m torchtitan.train (torchtitan).",
    )
    master_port: int = Field(29500, ge=1, le=65535, description="Rendezvous TCP port on the first node.")
    job_name: str = Field("meshplan", pattern=rf"^{NAME_PATTERN}$", description="Slurm job name.")
    bridge_version: str = Field(
        DEFAULT_BRIDGE_VERSION,
        description="Megatron-Bridge release the megatron-bridge overrides are written for: "
        + ", ".join(f"{name} ({release})" for name, release in BRIDGE_VERSIONS.items())
        + f"; default {DEFAULT_BRIDGE_VERSION}.",
    )

    hf_model: str | None = Field(
        None, max_length=200, pattern=HF_MODEL_PATTERN,
        description="The model the fine-tuning configs (axolotl, llamafactory) load: a Hugging Face id or a local "
        "model folder of the plan's model shape; default: the id of the plan's model preset (planner.emit.finetune"
        ".HF_MODELS), refused for a model without one.",
    )

    @field_validator("script")
    @classmethod
    def _script_splits(cls, value: str | None) -> str | None:
        """The entry point is split into words as a shell splits it (quotes balanced, printable, not empty)."""
        if value is not None:
            shell_command("script", value)
        return value

    @field_validator("bridge_version")
    @classmethod
    def _known_bridge_version(cls, value: str) -> str:
        return check_bridge_version("bridge_version", value)


@runtime_checkable
class Emitter(Protocol):
    """One backend. See the module docstring for the contract."""

    name: str
    """Registry key and `meshplan emit --backend` choice, e.g. `megatron`."""
    framework: str
    """Human name used in messages, e.g. `Megatron-LM`."""
    runs: str | None
    """The `TrainSpec.framework` whose costs and rules describe how the output runs (None: a launch script,
    whose is `EmitOptions.launch_for`)."""
    syntax: str
    """What `render` returns: shell, json, toml or python."""

    def data(self, plan: Plan, options: EmitOptions) -> Any: ...

    def render(self, plan: Plan, options: EmitOptions) -> str: ...


class Registry:
    """Named emitters; refuses duplicate names and lists the choices on a miss."""

    def __init__(self) -> None:
        self._emitters: dict[str, Emitter] = {}

    def register(self, emitter: Emitter) -> Emitter:
        if not isinstance(emitter, Emitter):
            raise TypeError(f"{emitter!r} does not implement the Emitter protocol")
        if emitter.name in self._emitters:
            raise ValueError(f"an emitter named {emitter.name!r} is already registered")
        self._emitters[emitter.name] = emitter
        return emitter

    def get(self, name: str) -> Emitter:
        try:
            return self._emitters[name]
        except KeyError:
            raise SpecError(unknown_name_message("emit backend", name, list(self._emitters))) from None

    def names(self) -> list[str]:
        return list(self._emitters)


REGISTRY = Registry()


# ---- facts derived from a plan ------------------------------------------------
@dataclass(frozen=True)
class PlanFacts:
    """Numbers every emitter needs, derived once from a plan (counts, not bytes).

    The stage split and the micro-batch count come from the plan's `ParallelLayout`
    (cost_models.layout), the same object the cost model and the search use."""

    plan: Plan
    strategy: Strategy
    dp: int
    num_microbatches: int
    num_nodes: int
    gpus_per_node: int
    layout: ParallelLayout

    @property
    def model(self):
        return self.plan.model

    @property
    def train(self):
        return self.plan.train

    @property
    def uneven(self) -> bool:
        """The first/last-stage layer counts are set (Megatron's uneven split)."""
        s = self.strategy
        return s.num_layers_in_first_stage is not None or s.num_layers_in_last_stage is not None

    @property
    def even_split(self) -> bool:
        """The layers split evenly over the pp·vpp virtual stages: no first/last counts, no
        explicit `stage_layers`, no embedding or loss counted as a layer."""
        return not self.strategy.split_label()

    def split_fields(self) -> str:
        """The Strategy fields that make the split non-even, with their values (for messages)."""
        s = self.strategy
        if s.stage_layers is not None:
            return f"stage_layers {s.stage_layers}"
        if self.uneven:
            return f"num_layers_in_first_stage {s.num_layers_in_first_stage}, num_layers_in_last_stage " \
                   f"{s.num_layers_in_last_stage}"
        return " and ".join(n for n in ("embedding_as_layer", "loss_as_layer") if getattr(s, n))

    def layers_per_stage(self) -> list[int]:
        """Transformer layers on each pipeline rank, first to last (`ParallelLayout.layers_per_stage`)."""
        return self.layout.layers_per_stage()

    def layers_per_chunk(self) -> list[int]:
        """Layers of each virtual pipeline stage in schedule order: stage c·pp + r lives on rank r
        (`ParallelLayout.layers_per_chunk`)."""
        return self.layout.layers_per_chunk()

    def local_batch_size(self) -> int:
        """Sequences each data-parallel rank processes per optimizer step: its micro-batches."""
        return self.num_microbatches * self.strategy.micro_batch_size


def facts(plan: Plan) -> PlanFacts:
    """Resolve the plan's strategy and derive the shared numbers (no checks)."""
    strategy = plan.strategy.resolve(plan.num_gpus) if plan.strategy.dp == "auto" else plan.strategy
    layout = ParallelLayout.of_strategy(strategy, plan.model.num_layers)
    per_node = min(plan.cluster.gpus_per_node, plan.num_gpus)
    return PlanFacts(
        plan=plan,
        strategy=strategy,
        dp=int(strategy.dp),
        num_microbatches=int(layout.num_microbatches(plan.train.global_batch_size, strategy.micro_batch_size)[0]),
        num_nodes=-(-plan.num_gpus // per_node),
        gpus_per_node=per_node,
        layout=layout,
    )


#: The emitters whose framework takes a rank order other than Megatron's default (`Strategy.rank_order`).
RANK_ORDER_FRAMEWORKS = ("Megatron-LM", "Megatron-Bridge")


#: Frameworks whose emitters write hybrid Mamba-Transformer stacks (planner.emit.megatron: pretrain_mamba.py).
HYBRID_FRAMEWORKS = frozenset({"Megatron-LM"})


#: Frameworks whose emitters write megatron-core's CUDA graph settings (TrainSpec.cuda_graph_impl, cuda_graph_scope).
GRAPH_FRAMEWORKS = ("Megatron-LM", "Megatron-Bridge")


#: Frameworks whose emitted output trains LoRA / QLoRA adapters (TrainSpec.finetune lora or qlora): the fine-tuning
#: toolkits, and DeepSpeed's bare JSON, which configures the engine around whatever model code (peft's included)
#: the user's script builds. Every other output trains every parameter of a freshly built model.
ADAPTER_FRAMEWORKS = frozenset({"Axolotl", "LLaMA-Factory", "DeepSpeed"})


def check_plan(plan: Plan, framework: str) -> PlanFacts:
    """Rules every framework needs and some accept silently, then the facts.

    Megatron-core, for one, builds its configs for a tp that does not divide the
    KV heads, a pp·vpp that does not divide the layers, or an ep on a dense
    model, and fails (or trains something else) only at run time. A plan that
    breaks one of these is refused for every backend.
    """
    f = facts(plan)
    s, m, t, lay = f.strategy, plan.model, plan.train, f.layout

    def refuse(reason: str) -> None:
        raise NotExpressibleError(framework, reason)

    if getattr(t, "adapters", False) and framework not in ADAPTER_FRAMEWORKS:
        refuse(f"finetune {t.finetune!r} (adapters over a frozen base); {framework}'s output trains every parameter: "
               "emit axolotl or llamafactory")
    if int(lay.num_gpus[0]) != plan.num_gpus:
        refuse(f"dp·tp·cp·pp ({f.dp}·{s.tp}·{s.cp}·{s.pp}) must equal num_gpus ({plan.num_gpus})")
    if not lay.batch_ok(t.global_batch_size, s.micro_batch_size)[0]:
        refuse(f"micro_batch_size·dp ({s.micro_batch_size}·{f.dp}) must divide global_batch_size ({t.global_batch_size})")
    if m.num_attention_heads % s.tp:
        refuse(f"tp ({s.tp}) must divide num_attention_heads ({m.num_attention_heads})")
    if m.kv_heads % s.tp:
        refuse(f"tp ({s.tp}) must divide num_kv_heads ({m.kv_heads})")
    if t.cuda_graph_impl != "none" and framework not in GRAPH_FRAMEWORKS:
        refuse(f"cuda_graph_impl {t.cuda_graph_impl!r} (scope {t.cuda_graph_scope or []}); {framework} is not emitted "
               "with megatron-core's CUDA graphs: emit megatron or megatron-bridge")
    if m.is_hybrid:
        if framework not in HYBRID_FRAMEWORKS:
            refuse(f"model {one_line(clip(m.name))} is a hybrid Mamba-Transformer stack (hybrid_override_pattern); "
                   f"{framework} is not emitted for Mamba/hybrid layers here: emit megatron (Megatron-LM's "
                   "pretrain_mamba.py)")
        if "M" in m.hybrid_override_pattern and (m.mamba_heads % s.tp or m.mamba_num_groups % s.tp):
            refuse(f"tp ({s.tp}) must divide the Mamba heads ({m.mamba_heads}) and mamba_num_groups "
                   f"({m.mamba_num_groups})")
    if not lay.split_ok()[0]:
        refuse(lay.split_message())
    if not m.is_moe and (s.ep > 1 or s.etp > 1):
        refuse(f"ep ({s.ep}) and etp ({s.etp}) must be 1: model {one_line(clip(m.name))} is dense (ModelSpec has no experts)")
    if m.is_moe:
        if m.num_experts % s.ep:
            refuse(f"ep ({s.ep}) must divide num_experts ({m.num_experts})")
        dense_ranks = s.tp * s.cp * f.dp
        if dense_ranks % (s.ep * s.etp):
            # Expert layers regroup the ranks of one pipeline stage: ep·etp·(expert dp) = tp·cp·dp.
            refuse(f"ep·etp ({s.ep}·{s.etp}) must divide tp·cp·dp ({s.tp}·{s.cp}·{f.dp} = {dense_ranks}), the ranks "
                   "of one pipeline stage that expert layers regroup")
    if s.cp > 1 and t.seq_len % (2 * s.cp):
        refuse(f"seq_len ({t.seq_len}) must be divisible by 2·cp ({2 * s.cp}) for load-balanced context parallelism")
    if s.sequence_parallel and (t.seq_len // s.cp) % s.tp:
        refuse(f"with sequence_parallel, seq_len/cp ({t.seq_len // s.cp}) must be divisible by tp ({s.tp})")
    if not lay.megatron_schedule_ok(f.num_microbatches)[0]:
        refuse(f"with vpp > 1, num_microbatches ({f.num_microbatches}) must be a multiple of pp ({s.pp})")
    largest_chunk = max(f.layers_per_chunk())
    if s.recompute_num_layers is not None and s.recompute_num_layers > largest_chunk:
        refuse(f"recompute_num_layers ({s.recompute_num_layers}) must not exceed the layers of the largest pipeline "
               f"chunk ({largest_chunk})")
    if m.position_embedding == "learned" and t.seq_len > m.max_position_embeddings:
        refuse(f"seq_len ({t.seq_len}) exceeds the learned position table (max_position_embeddings "
               f"{m.max_position_embeddings})")
    if s.rank_order != RANK_ORDERS[0]:
        if framework not in RANK_ORDER_FRAMEWORKS:
            refuse(f"rank_order {s.rank_order!r}: {framework} lays ranks out {RANK_ORDERS[0]} only (its process-group "
                   "mesh takes no other order); Megatron-LM and Megatron-Bridge take this one "
                   "(--use-tp-pp-dp-mapping)")
        if s.cp > 1 or s.zero_stage == 3:
            refuse(f"rank_order {s.rank_order!r} with cp {s.cp} and zero_stage {s.zero_stage}: the order is costed "
                   "with cp 1 only, and Megatron-FSDP (zero_stage 3) does not take --use-tp-pp-dp-mapping")
    return f


def runs_framework(backend: str, options: EmitOptions | None = None) -> str:
    """The framework (`TrainSpec.framework`, whose costs and rules `plan --framework` applies) that runs what
    `backend` emits: its emitter's `runs`, or for a launch script (`runs` None) `options.launch_for`."""
    return REGISTRY.get(backend).runs or (options or EmitOptions()).launch_for


def accepted_frameworks(backend: str, options: EmitOptions | None = None) -> tuple[str, ...]:
    """Every framework whose costed plans `backend`'s output runs as costed: `runs_framework` first, then the
    emitter's `also_runs` (the fine-tuning toolkits run a plan of framework deepspeed or torchtitan alike)."""
    return (runs_framework(backend, options),) + tuple(getattr(REGISTRY.get(backend), "also_runs", ()))


def costed_elsewhere(plan: Plan, runs: str) -> str | None:
    """Why the plan's prediction is not for the framework `runs` when it was costed for another (else None)."""
    costed = plan.train.framework
    if costed == runs:
        return None
    return (f"plan {plan.rank} was costed and ranked as {costed} runs it, not {runs}: its predicted step time and "
            f"memory are {costed}'s (`meshplan plan --framework {runs}` costs and ranks the plans as {runs} runs them)")


def describe(plan: Plan, runs: str | None = None) -> str:
    """The text of one comment line naming the plan: model, GPUs, cluster and strategy, and its prediction, said
    to be another framework's when it was costed for one other than `runs`, the framework the output is for.
    The names are cut to `quoting.NAME_MAX_CHARS`, not escaped: it goes into output through `quoting.comment`."""
    est = plan.estimate
    costed = "" if runs is None or plan.train.framework == runs else f" (as {plan.train.framework} runs it, not {runs})"
    return (f"plan {plan.rank}: {clip(plan.model.name)} on {plan.num_gpus}x {clip(plan.cluster.gpu.name)} "
            f"({clip(plan.cluster.name)}), "
            f"{facts(plan).strategy.short()}; predicted{costed} {est.step_time_s:.3g} s/step, {100 * est.mfu:.1f}% MFU, "
            f"{est.peak_memory_bytes / 2**30:.1f} GiB peak per GPU")


def shell_array(name: str, args: list[str]) -> str:
    """A bash array literal, one flag (with its value) per line, every word quoted (`quoting.shell_word`)."""
    lines: list[str] = []
    for arg in args:
        if arg.startswith("-") and not _is_number(arg) or not lines:
            lines.append(shell_word(arg))
        else:
            lines[-1] += " " + shell_word(arg)
    body = "".join(f"  {line}\n" for line in lines)
    return f"{check_name('array name', name, SHELL_IDENTIFIER)}=(\n{body})\n"


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
