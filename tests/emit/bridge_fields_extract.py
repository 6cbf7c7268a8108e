"""Write tests/emit/data/megatron_bridge_<version>_fields.json: the config paths a Megatron-Bridge release's (or a
main-branch commit's) `ConfigContainer` accepts as Hydra overrides, the form of the model config each recipe
family builds, and the settings of its mixed-precision recipes, read from the source without importing it.

Used for a Megatron-Bridge release that cannot be installed next to this project's interpreter (0.6.0 needs
Python 3.12 and a development megatron-core of Megatron-LM's main branch that no package index carries), so
that tests/emit/test_emit_bridge_fields.py can check every key the emitter writes for that release against
the release's own field names. Run by hand, from two git clones, when the target release changes:

    python tests/emit/bridge_fields_extract.py BRIDGE_GIT REF MEGATRON_LM_GIT > tests/emit/data/...json

REF is a tag (v0.6.0) or a branch (main, recorded with the commit it points at). The Megatron-LM commit is the
one REF pins as its 3rdparty/Megatron-LM submodule. Nothing is
imported or copied from either repository; the files are read with `git show` and parsed with `ast`:

- A section's fields are what `dataclasses.fields()` would list for the class the release's recipes put
  there: the annotated names of the class and of every dataclass among its bases, the bases followed through
  the modules' `from ... import` statements (and package `__init__` re-exports) into either repository.
  Megatron-Bridge's override path (training/utils/omegaconf_utils.py) builds its OmegaConf tree from exactly
  `dataclasses.fields()`, and Hydra refuses a key that is not in the tree ("Could not override ...").
- The nested model config (`model[nested]`, the outer fields, and `model[nested].transformer`, the
  TransformerConfig it holds under `transformer`) is recorded where REF has it: Megatron-Bridge's main branch
  after 0.6.0 builds its Llama recipes' model with `AutoBridge.get_model_config()`, a BridgeGPTModelConfig
  whose dataclass fields are its own GPT fields plus `transformer`, so Hydra takes `model.transformer.<field>`
  there and refuses `model.<field>` for a transformer field.
- A recipe family's model form (`recipe_model_forms`: family directory under megatron/bridge/recipes -> the
  forms its `cfg.model = ...` assignments take) is `nested` for a `....get_model_config()` call, `flat` for a
  `....to_megatron_provider(...)` call or a `...Provider(...)` constructor, else `other` (a helper).
- A mixed-precision recipe's settings are the `MixedPrecisionConfig` class defaults, then the keywords of the
  `MixedPrecisionConfig(...)` call or the settings of the recipe it starts from (`cfg = bf16_mixed()`), then
  each `cfg.<field> = <literal>` statement, for every function decorated `@register`.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys

#: section of the ConfigContainer -> (module, class) of what the release's recipes put there; `model` has one
#: entry per provider class the emitter's plans meet (dense GPT and Llama recipes, MLA for DeepSeek's)
SECTIONS = {
    "model": ("megatron.bridge.models.gpt_provider", "GPTModelProvider"),
    "model[mla]": ("megatron.bridge.models.mla_provider", "MLAModelProvider"),
    "ddp": ("megatron.bridge.training.config", "DistributedDataParallelConfig"),
    "optimizer": ("megatron.bridge.training.config", "OptimizerConfig"),
    "train": ("megatron.bridge.training.config", "TrainingConfig"),
    "dataset": ("megatron.bridge.training.config", "GPTDatasetConfig"),
    "checkpoint": ("megatron.bridge.training.config", "CheckpointConfig"),
    "dist": ("megatron.bridge.training.config", "DistributedInitConfig"),
    "": ("megatron.bridge.training.config", "ConfigContainer"),
}
#: the nested model config of Megatron-Bridge's builder-backed recipes (main after 0.6.0): recorded where REF has it
NESTED_SECTIONS = {
    "model[nested]": ("megatron.bridge.models.gpt.model_config", "BridgeGPTModelConfig"),
    "model[nested].transformer": ("megatron.bridge.models.transformer_config", "TransformerConfig"),
}
MIXED_PRECISION_MODULE = "megatron.bridge.training.mixed_precision"
RECIPES_DIR = "src/megatron/bridge/recipes/"
#: base classes that are not dataclasses and carry no fields
NON_DATACLASS_BASES = {"Generic", "ABC", "Protocol", "object"}


class Source:
    """Python files of the two repositories at fixed revisions."""

    def __init__(self, bridge_git: str, bridge_rev: str, mlm_git: str, mlm_rev: str):
        self.roots = {"megatron.bridge": (bridge_git, bridge_rev, "src/"), "megatron": (mlm_git, mlm_rev, "")}
        self.cache: dict[str, ast.Module | None] = {}
        self.packages: dict[str, bool] = {}  # module -> whether it is a package's __init__

    def module(self, name: str) -> ast.Module | None:
        if name not in self.cache:
            self.packages[name] = False
            git, rev, prefix = self.roots["megatron.bridge" if name.startswith("megatron.bridge") else "megatron"]
            base = prefix + name.replace(".", "/")
            self.cache[name] = None
            for path in (base + ".py", base + "/__init__.py"):
                proc = subprocess.run(["git", "-C", git, "show", f"{rev}:{path}"], capture_output=True, text=True)
                if proc.returncode == 0:
                    self.cache[name] = ast.parse(proc.stdout, path)
                    self.packages[name] = path.endswith("__init__.py")
                    break
        return self.cache[name]

    def paths(self, under: str) -> list[str]:
        """The Megatron-Bridge files under the folder `under`, recursively."""
        git, rev, _ = self.roots["megatron.bridge"]
        proc = subprocess.run(["git", "-C", git, "ls-tree", "-r", "--name-only", rev, under], capture_output=True,
                              text=True, check=True)
        return proc.stdout.split()

    def text(self, path: str) -> str:
        git, rev, _ = self.roots["megatron.bridge"]
        return subprocess.run(["git", "-C", git, "show", f"{rev}:{path}"], capture_output=True, text=True,
                              check=True).stdout

    def find_class(self, module: str, name: str, depth: int = 0) -> tuple[str, ast.ClassDef]:
        """The class `name` as seen from `module`: defined there or imported into it."""
        tree = self.module(module)
        if tree is None or depth > 8:
            raise LookupError(f"{module}.{name} not found")
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return module, node
        for node in tree.body:
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        return self.find_class(self._absolute(module, node), alias.name, depth + 1)
        raise LookupError(f"{module}.{name} not found")


    def _absolute(self, module: str, node: ast.ImportFrom) -> str:
        """The module a `from ... import` names, relative imports (`from ..x import`) resolved."""
        if node.level == 0:
            return node.module
        parts = module.split(".")
        package = parts if self.packages.get(module) else parts[:-1]
        package = package[:len(package) - (node.level - 1)]
        return ".".join(package + ([node.module] if node.module else []))


def _is_dataclass(cls: ast.ClassDef) -> bool:
    for dec in cls.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        if "dataclass" in ast.unparse(target):
            return True
    return False


def _base_name(base: ast.expr) -> str:
    node = base.value if isinstance(base, ast.Subscript) else base  # Mixin[Model] -> Mixin
    return ast.unparse(node).split(".")[-1]


def fields(src: Source, module: str, name: str) -> list[str]:
    """dataclasses.fields() of the class, in no particular order (sorted)."""
    out: set[str] = set()
    module, cls = src.find_class(module, name)
    for base in cls.bases:
        base_name = _base_name(base)
        if base_name in NON_DATACLASS_BASES:
            continue
        out |= set(fields(src, module, base_name))
    if _is_dataclass(cls):
        for node in cls.body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                    and "ClassVar" not in ast.unparse(node.annotation):
                out.add(node.target.id)
    return sorted(out)


def _value(node: ast.expr):
    try:
        return ast.literal_eval(node)
    except ValueError:
        return ast.unparse(node)


def mixed_precision_recipes(src: Source) -> dict[str, dict]:
    tree = src.module(MIXED_PRECISION_MODULE)
    _, cls = src.find_class(MIXED_PRECISION_MODULE, "MixedPrecisionConfig")
    defaults = {n.target.id: _value(n.value) for n in cls.body
                if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.value is not None}
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)
             and any(ast.unparse(d) == "register" for d in n.decorator_list)}
    done: dict[str, dict] = {}

    def settings(name: str) -> dict:
        if name in done:
            return done[name]
        out: dict = {}
        for stmt in funcs[name].body:
            call = stmt.value if isinstance(stmt, (ast.Return, ast.Assign)) else None
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Name):
                if call.func.id == "MixedPrecisionConfig":
                    out = dict(defaults) | {k.arg: _value(k.value) for k in call.keywords}
                elif call.func.id in funcs:
                    out = dict(settings(call.func.id))
            elif isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Attribute):
                out[stmt.targets[0].attr] = _value(stmt.value)
        done[name] = out
        return out

    return {name: settings(name) for name in sorted(funcs)}


def _model_form(call: ast.expr) -> str:
    """nested, flat or other: what a recipe's `cfg.model = <call>` builds (see the module docstring)."""
    if isinstance(call, ast.Call):
        name = ast.unparse(call.func).split(".")[-1]
        if name == "get_model_config":
            return "nested"
        if name == "to_megatron_provider" or name.endswith("Provider"):
            return "flat"
    return "other"


def recipe_model_forms(src: Source) -> dict[str, list[str]]:
    """Recipe family (the folder under megatron/bridge/recipes) -> the forms of the model its recipes build."""
    out: dict[str, set[str]] = {}
    for path in src.paths(RECIPES_DIR):
        rel = path[len(RECIPES_DIR):]
        if "/" not in rel or not rel.endswith(".py"):
            continue
        for node in ast.walk(ast.parse(src.text(path), path)):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 \
                    and ast.unparse(node.targets[0]) == "cfg.model":
                out.setdefault(rel.split("/")[0], set()).add(_model_form(node.value))
    return {family: sorted(forms) for family, forms in sorted(out.items())}


def main() -> None:
    bridge_git, ref, mlm_git = sys.argv[1:4]
    commit = subprocess.run(["git", "-C", bridge_git, "rev-parse", f"{ref}^{{commit}}"], capture_output=True,
                            text=True, check=True).stdout.strip()
    is_tag = subprocess.run(["git", "-C", bridge_git, "rev-parse", "--verify", "--quiet", f"refs/tags/{ref}"],
                            capture_output=True).returncode == 0
    tree = subprocess.run(["git", "-C", bridge_git, "ls-tree", commit, "3rdparty/Megatron-LM"], capture_output=True,
                          text=True, check=True).stdout.split()
    mlm_commit = tree[2]
    src = Source(bridge_git, commit, mlm_git, mlm_commit)
    sections = dict(SECTIONS)
    try:  # the nested sections where REF has the nested model config (its TransformerConfig predates it)
        src.find_class(*NESTED_SECTIONS["model[nested]"])
        sections |= NESTED_SECTIONS
    except LookupError:
        pass
    data = {
        "megatron_bridge": {"repo": "NVIDIA-NeMo/Megatron-Bridge", "tag" if is_tag else "branch": ref,
                            "commit": commit},
        "megatron_lm": {"repo": "NVIDIA/Megatron-LM", "commit": mlm_commit,
                        "path": f"3rdparty/Megatron-LM (the submodule the {'tag' if is_tag else 'commit'} pins)"},
        "sections": {section: {"class": f"{module}.{name}", "fields": fields(src, module, name)}
                     for section, (module, name) in sections.items()},
        "recipe_model_forms": recipe_model_forms(src),
        "mixed_precision_recipes": mixed_precision_recipes(src),
    }
    json.dump(data, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
