"""One rank of an auto-parallel plan's run with DTensor, or the one-process reference (imports torch).

    python -m executors.local_run --nproc N -m executors.autoshard_worker --config run.json --out DIR
    python -m executors.autoshard_worker --reference --config run.json --out DIR

Every rank (and the reference) seeds torch with the run's seed and calls the factory on the CPU, so all hold the
same weights; draws the inputs from a generator seeded the same way, so all see the same global batch; and runs
`steps` steps of forward, backward and optimizer on that one batch. A rank then:

1. builds the DeviceMesh (gloo) with the plan's mesh reversed (`executors.autoshard_run.torch_mesh_shape`: the
   plan lists axes innermost first, torch's last dimension varies fastest) and reverses every placement list;
2. replaces each parameter with a DTensor of the plan's placements (`distribute_tensor` of the full seeded
   weight), distributes each input likewise, and hooks every module the plan names in `activations` so that its
   output is redistributed to the plan's placements;
3. runs each step under `implicit_replication` (the models make tensors of their own, e.g. GPT's position ids:
   those count as replicated) and, with `sdpa_math`, the math backend of scaled_dot_product_attention (DTensor has
   no rule for the CPU flash kernel; the math backend is matmul and softmax, which DTensor shards). After the
   backward each gradient is redistributed to its parameter's placements (a replicated weight's gradient arrives
   as a partial sum: this is the plan's gradient reduction), then the optimizer steps on the DTensors;
4. records the full loss per step (`full_tensor()` of a DTensor loss) and each step's wall time (every step
   starts after a barrier), and writes `DIR/rank<r>.json` before it tears down.

What DTensor cannot run on CPU in torch 2.13 ends the rank with status "unsupported" and the operator and
placement named, before a wrong number can be produced:

- a convolution (nn.Conv1d/2d/3d) whose weight or bias is sharded, or whose input is sharded on anything but the
  batch: DTensor's convolution handler runs the local slices as they are, so a sharded weight gives a wrong
  output marked replicated (measured: small_cnn with conv1 out-channel and conv2 in-channel shards lost parity and
  its ranks disagreed), and a channel-sharded input fails on the channel count;
- an operator without a DTensor sharding rule (torch raises NotImplementedError naming it, e.g.
  `aten._scaled_dot_product_flash_attention_for_cpu` when sdpa_math is off).

The error names the innermost module that was running (forward hooks keep the stack).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

from executors.autoshard_run import (
    AutoshardRankResult,
    AutoshardRunConfig,
    ReferenceResult,
    load_factory,
    mesh_coords,
    parse_placement,
    torch_mesh_shape,
)
from executors.lifeline import bind_to_parent
from executors.results import write_json_atomic
from executors.worker import close_group

DTYPES = {"float32": "float32", "float64": "float64", "int64": "int64", "int32": "int32"}
CONV_INPUT_OK = ("replicate", "shard0")
"""Placements (per mesh axis) of a convolution's input that DTensor's CPU convolution computes right: replicated or
sharded on the batch."""


class UnsupportedPlacement(Exception):
    """The plan holds a placement DTensor cannot run here (the message names the op and the placement)."""


def _threads(cfg: AutoshardRunConfig, ranks: int) -> int:
    return cfg.num_threads or max(1, (os.cpu_count() or 1) // ranks)


def build_model(cfg: AutoshardRunConfig):
    """The module, built on the CPU after seeding torch (the same weights in every process)."""
    import torch

    factory = load_factory(cfg.factory, "factory")
    torch.manual_seed(cfg.seed)
    model = factory(**cfg.factory_kwargs)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"factory {cfg.factory!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model.to(torch.float32).train()


def build_inputs(cfg: AutoshardRunConfig) -> list:
    """The global inputs, drawn from a generator seeded with the run's seed (the same in every process)."""
    import torch

    gen = torch.Generator().manual_seed(cfg.seed + 1)
    out = []
    for spec in cfg.inputs:
        dtype = getattr(torch, DTYPES[spec.dtype])
        if spec.high is not None:
            out.append(torch.randint(0, spec.high, tuple(spec.shape), generator=gen, dtype=dtype))
        else:
            out.append(torch.randn(tuple(spec.shape), generator=gen, dtype=dtype))
    return out


def make_optimizer(cfg: AutoshardRunConfig, params):
    import torch

    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.learning_rate)
    return torch.optim.SGD(params, lr=cfg.learning_rate)


def step_context(cfg: AutoshardRunConfig, distributed: bool):
    """The context every forward and backward runs in (module docstring, step 3)."""
    stack = contextlib.ExitStack()
    if cfg.sdpa_math:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        stack.enter_context(sdpa_kernel(SDPBackend.MATH))
    if distributed:
        from torch.distributed.tensor.experimental import implicit_replication

        stack.enter_context(implicit_replication())
    return stack


def train(cfg: AutoshardRunConfig, model, inputs, distributed: bool, grad_sync=None, on_error=None):
    """(loss per step, wall time per step) of `cfg.steps` steps on `inputs`."""
    import torch

    opt = make_optimizer(cfg, [p for p in model.parameters() if p.requires_grad])
    losses, times = [], []
    for _ in range(cfg.steps):
        if distributed:
            torch.distributed.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with step_context(cfg, distributed):
            loss = model(*inputs)
            if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
                raise TypeError(f"the module's forward must return a scalar loss (got {type(loss).__name__}"
                                + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "") + ")")
            value = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
            loss.backward()
        if grad_sync is not None:
            grad_sync()
        opt.step()
        losses.append(float(value.detach().reshape(())))
        times.append(time.perf_counter() - t0)
    return losses, times


def run_reference(cfg: AutoshardRunConfig, out: Path) -> None:
    import torch

    torch.set_num_threads(_threads(cfg, 1))
    model = build_model(cfg)
    losses, times = train(cfg, model, build_inputs(cfg), distributed=False)
    numel = sum(p.numel() for p in model.parameters())
    write_json_atomic(out / "reference.json",
                      ReferenceResult(losses=losses, step_times_s=times, param_numel=numel).model_dump_json())


def torch_placements(placements: list[str], field: str) -> list:
    """The plan's placements (innermost axis first) as torch Placements in DeviceMesh order (reversed)."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    out = []
    for text in placements:
        kind, dim = parse_placement(text, field)
        out.append(Shard(dim) if kind == "shard" else Partial() if kind == "partial" else Replicate())
    return list(reversed(out))


def _kinds(placements) -> list[str]:
    """'replicate', 'partial' or 'shard<d>' per mesh dimension of a DTensor's placements."""
    out = []
    for p in placements:
        if p.is_shard():
            out.append(f"shard{p.dim}")
        else:
            out.append("partial" if p.is_partial() else "replicate")
    return out


def _plan_text(placements) -> str:
    """Placements in the plan's order (innermost axis first), as the plan writes them."""
    return "[" + ", ".join(f"Shard({p.dim})" if p.is_shard() else "Partial()" if p.is_partial() else "Replicate()"
                           for p in reversed(list(placements))) + "]"


def distribute_params(model, plan, mesh) -> None:
    """Replace each parameter with a DTensor of its plan placements; UnsupportedPlacement for the placements
    DTensor cannot run (module docstring); RuntimeError when the plan and the module's parameters differ."""
    import torch
    from torch.distributed.tensor import distribute_tensor

    names = {name for name, _ in model.named_parameters()}
    missing = sorted(names - set(plan.params))
    extra = sorted(set(plan.params) - names)
    if missing or extra:
        raise RuntimeError("the plan's parameters differ from the module's: "
                           + (f"no placement for {missing[:5]}" if missing else "")
                           + ("; " if missing and extra else "")
                           + (f"the module has no {extra[:5]}" if extra else ""))
    conv = (torch.nn.modules.conv._ConvNd,)
    for mod_name, module in model.named_modules():
        for pname, param in list(module.named_parameters(recurse=False)):
            fqn = f"{mod_name}.{pname}" if mod_name else pname
            placements = torch_placements(plan.params[fqn], f"plan.params[{fqn!r}]")
            if isinstance(module, conv) and any(p.is_shard() for p in placements):
                raise UnsupportedPlacement(
                    f"parameter {fqn} {plan.params[fqn]}: aten.convolution with a sharded weight or bias is not "
                    f"run by DTensor on CPU (torch {torch.__version__}: its convolution handler computes the local "
                    "slice as if it were the whole weight, a wrong result); convolution parameters must be "
                    "replicated")
            dt = distribute_tensor(param.detach(), mesh, placements)
            module.register_parameter(pname, torch.nn.Parameter(dt, requires_grad=param.requires_grad))


class ModuleTracker:
    """The stack of modules running (forward pre- and post-hooks), so that an error names where it happened; the
    convolution input check; and the activation placements of the plan (the output of each named module is
    redistributed to them)."""

    def __init__(self, model, plan, mesh):
        import torch

        self.stack: list[str] = []
        self.mesh = mesh
        modules = dict(model.named_modules())
        unknown = sorted(set(plan.activations) - set(modules))
        if unknown:
            raise RuntimeError(f"plan.activations names modules the module does not have: {unknown[:5]}")
        conv = (torch.nn.modules.conv._ConvNd,)
        for name, module in modules.items():
            target = (torch_placements(plan.activations[name], f"plan.activations[{name!r}]")
                      if name in plan.activations else None)
            module.register_forward_pre_hook(self._enter(name, isinstance(module, conv)))
            module.register_forward_hook(self._leave(name, target), always_call=True)

    def where(self) -> str:
        return f"in module {self.stack[-1] or '(root)'!r}" if self.stack else "outside any module's forward"

    def _enter(self, name: str, is_conv: bool):
        def hook(module, args):
            self.stack.append(name)
            if is_conv and args and hasattr(args[0], "placements"):
                kinds = _kinds(args[0].placements)
                if any(k not in CONV_INPUT_OK for k in kinds):
                    raise UnsupportedPlacement(
                        f"module {name!r} ({type(module).__name__}): aten.convolution input placed "
                        f"{_plan_text(args[0].placements)} is not run by DTensor on CPU (only replicated or "
                        "batch-sharded (Shard(0)) inputs: its handler convolves the local channel or spatial "
                        "slice without exchanging data)")
        return hook

    def _leave(self, name: str, target):
        def hook(module, args, output):
            if self.stack and self.stack[-1] == name:
                self.stack.pop()
            if target is None:
                return None
            if not hasattr(output, "redistribute"):
                raise RuntimeError(f"plan.activations[{name!r}]: the module's output is a "
                                   f"{type(output).__name__}, not a DTensor")
            if list(output.placements) == target:
                return None
            try:
                return output.redistribute(self.mesh, target)
            except Exception as exc:  # named by the plan's field: the redistribution is the plan's
                raise UnsupportedPlacement(
                    f"plan.activations[{name!r}]: DTensor cannot redistribute {_plan_text(output.placements)} to "
                    f"{_plan_text(target)} ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
                ) from exc
        return hook


def grad_sync(model) -> None:
    """Each gradient to its parameter's placements (a replicated weight's gradient arrives as Partial: the
    all-reduce of data parallelism happens here)."""
    for p in model.parameters():
        if p.grad is not None and list(p.grad.placements) != list(p.placements):
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)


def _is_unsupported(exc: BaseException) -> bool:
    return isinstance(exc, UnsupportedPlacement) or (
        isinstance(exc, NotImplementedError) and "sharding strategy" in str(exc))


def run_rank(cfg: AutoshardRunConfig, out: Path) -> int:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    (out / f"rank{rank}.pid").write_text(str(os.getpid()))
    plan = cfg.plan
    if world != plan.num_gpus:
        raise SystemExit(f"WORLD_SIZE ({world}) must equal the plan's num_gpus ({plan.num_gpus})")
    torch.set_num_threads(_threads(cfg, int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))))
    dist.init_process_group("gloo", timeout=timedelta(seconds=cfg.timeout_s))
    result = AutoshardRankResult(rank=rank, status="ok")
    tracker = None
    exit_code = 0
    try:
        mesh = init_device_mesh("cpu", torch_mesh_shape(plan.mesh_shape))
        result.coords = list(reversed([int(c) for c in mesh.get_coordinate()]))
        if result.coords != mesh_coords(rank, plan.mesh_shape):  # the convention the plan's placements assume
            raise RuntimeError(f"rank {rank} sits at {result.coords} on the DeviceMesh, not at "
                               f"{mesh_coords(rank, plan.mesh_shape)} (innermost axis first)")
        model = build_model(cfg)
        distribute_params(model, plan, mesh)
        result.local_param_numel = sum(p.to_local().numel() for p in model.parameters())
        tracker = ModuleTracker(model, plan, mesh)
        inputs = [distribute_tensor(t, mesh, torch_placements(pl, f"plan.inputs[{i}]"))
                  for i, (t, pl) in enumerate(zip(build_inputs(cfg), plan.inputs))]
        result.losses, result.step_times_s = train(cfg, model, inputs, distributed=True,
                                                   grad_sync=lambda: grad_sync(model))
    except Exception as exc:  # reported in the rank's JSON, then through the exit code
        where = tracker.where() if tracker is not None and tracker.stack else ""
        result.status = "unsupported" if _is_unsupported(exc) else "error"
        message = str(exc).splitlines()[0] if str(exc) else ""
        result.error = f"{type(exc).__name__}: {message}" + (f" ({where})" if where else "")
        traceback.print_exc(file=sys.stderr)
        exit_code = 1
    finally:
        write_json_atomic(out / f"rank{rank}.json", result.model_dump_json())
    return close_group(exit_code)


def main(argv: list[str] | None = None) -> int:
    bind_to_parent()  # started by meshplan's launcher: die with it
    parser = argparse.ArgumentParser(prog="python -m executors.autoshard_worker", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, type=Path, help="AutoshardRunConfig JSON")
    parser.add_argument("--out", required=True, type=Path, help="folder for rank<r>.json / reference.json")
    parser.add_argument("--reference", action="store_true", help="run the one-process reference")
    args = parser.parse_args(argv)
    cfg = AutoshardRunConfig.model_validate_json(args.config.read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    if args.reference:
        run_reference(cfg, args.out)
        return 0
    return run_rank(cfg, args.out)


if __name__ == "__main__":
    sys.exit(main())
