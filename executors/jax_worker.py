"""The JAX run of one plan (`python -m executors.jax_worker --config RUN.json --out RESULT.json`), started by
`executors.jax_run` in a process whose XLA_FLAGS simulate the plan's devices on the CPU
(`--xla_force_host_platform_device_count`); jax is imported here only, when the run starts.

The model is a small decoder-only transformer in plain jax.numpy with the plan model's shapes (hidden,
heads, KV heads, MLP width, gated or not, vocabulary, tied or untied output, the executed layer count):
RMSNorm, causal grouped-query attention, SiLU-gated or GELU MLP, no positional encoding (the causal mask
orders the tokens), float32 throughout. Its parameters and batch are laid out on a
`jax.sharding.Mesh` of the plan's axes (`JaxRunConfig.mesh`, MaxText's names) by `NamedSharding`s:

- the batch dimension over ("data", "fsdp"), the sequence over "context";
- each weight's model dimension (hidden) over "fsdp" (ZeRO-3: parameters, gradients and the
  optimizer states sharded), its head / MLP / vocabulary dimension over "tensor" (Megatron's
  column- and row-parallel split); ZeRO-1 shards the optimizer states over "data";

XLA's SPMD partitioner then inserts the collectives. One step is the plan's micro-batches, each a
micro_batch_size·dp slice of the global batch, the gradients averaged over them.

Steps: `parity_steps` of plain SGD on one batch (the step size chosen from the reference's step-1
gradient so that the loss falls about 1 %), the same steps on one device without any sharding (the
reference), then `warmup_steps` and `timed_steps` of Adam, each timed to `block_until_ready`.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import traceback
from pathlib import Path

from executors.results import write_json_atomic
from executors.jax_run import JaxRunConfig, PARITY_DROP

#: Adam's moment decays and epsilon (PyTorch's defaults).
ADAM_B1, ADAM_B2, ADAM_EPS = 0.9, 0.999, 1e-8
#: Scale of the normal initialisation of every weight matrix (GPT-2's).
INIT_STD = 0.02


def _shapes(cfg: JaxRunConfig) -> dict[str, tuple[tuple[int, ...], tuple[str | None, ...]]]:
    """Every parameter's shape and its logical dims (fsdp: the hidden dim, tensor: the split dim, None)."""
    m = cfg.model
    h, hd = m.hidden_size, m.head_dim or m.hidden_size // m.num_attention_heads
    q, kv, f, v = m.num_attention_heads * hd, m.kv_heads * hd, m.ffn_hidden_size, m.vocab_size
    out: dict[str, tuple[tuple[int, ...], tuple[str | None, ...]]] = {"embed": ((v, h), ("tensor", "fsdp"))}
    for i in range(m.num_layers):
        out |= {f"l{i}.ln1": ((h,), (None,)), f"l{i}.wq": ((h, q), ("fsdp", "tensor")),
                f"l{i}.wk": ((h, kv), ("fsdp", "tensor")), f"l{i}.wv": ((h, kv), ("fsdp", "tensor")),
                f"l{i}.wo": ((q, h), ("tensor", "fsdp")), f"l{i}.ln2": ((h,), (None,)),
                f"l{i}.w1": ((h, f), ("fsdp", "tensor")), f"l{i}.w2": ((f, h), ("tensor", "fsdp"))}
        if m.gated_mlp:
            out[f"l{i}.w3"] = ((h, f), ("fsdp", "tensor"))
    out["ln_f"] = ((h,), (None,))
    if not m.tie_embeddings:
        out["head"] = ((h, v), ("fsdp", "tensor"))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    cfg = JaxRunConfig.model_validate_json(Path(args.config).read_text())
    try:
        result = run(cfg)
    except Exception as exc:  # the parent reports it as crashed, with the tail of the trace
        result = {"status": "error", "error": f"{type(exc).__name__}: {exc}",
                  "trace": traceback.format_exc()[-4000:]}
    write_json_atomic(Path(args.out), json.dumps(result))
    return 0 if result["status"] != "error" else 1


def run(cfg: JaxRunConfig) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = jax.devices()
    if len(devices) < cfg.num_devices:
        return {"status": "error", "error": f"{len(devices)} XLA devices, the plan needs {cfg.num_devices}"}
    m, shapes = cfg.model, _shapes(cfg)
    heads, kv_heads = m.num_attention_heads, m.kv_heads
    hd = m.head_dim or m.hidden_size // heads

    def init(seed: int) -> dict:
        keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
        out = {}
        for key, (name, (shape, _)) in zip(keys, shapes.items()):
            out[name] = (jnp.ones(shape, jnp.float32) if len(shape) == 1
                         else INIT_STD * jax.random.normal(key, shape, jnp.float32))
        return out

    def rms(x, w):
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + m.norm_epsilon) * w

    def forward_loss(p, tokens):
        b, s = tokens.shape
        x = p["embed"][tokens]
        mask = jnp.tril(jnp.ones((s, s), dtype=bool))
        for i in range(m.num_layers):
            y = rms(x, p[f"l{i}.ln1"])
            q = (y @ p[f"l{i}.wq"]).reshape(b, s, heads, hd)
            k = (y @ p[f"l{i}.wk"]).reshape(b, s, kv_heads, hd)
            v = (y @ p[f"l{i}.wv"]).reshape(b, s, kv_heads, hd)
            k, v = jnp.repeat(k, heads // kv_heads, axis=2), jnp.repeat(v, heads // kv_heads, axis=2)
            scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
            attn = jax.nn.softmax(jnp.where(mask, scores, -1e30), axis=-1)
            x = x + jnp.einsum("bhqk,bkhd->bqhd", attn, v).reshape(b, s, heads * hd) @ p[f"l{i}.wo"]
            y = rms(x, p[f"l{i}.ln2"])
            inner = (jax.nn.silu(y @ p[f"l{i}.w1"]) * (y @ p[f"l{i}.w3"]) if m.gated_mlp
                     else jax.nn.gelu(y @ p[f"l{i}.w1"]))
            x = x + inner @ p[f"l{i}.w2"]
        x = rms(x, p["ln_f"])
        logits = x @ (p["embed"].T if m.tie_embeddings else p["head"])
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

    def grads_of(p, batch, scale_grads):
        """Mean loss and gradient over the step's micro-batches (each of micro_rows sequences), the gradient times
        `scale_grads` (the test hook; 1 but on the mesh of a fault run)."""
        micro = batch.reshape(cfg.num_microbatches, cfg.micro_rows, batch.shape[1])
        loss, grads = 0.0, jax.tree.map(jnp.zeros_like, p)
        for j in range(cfg.num_microbatches):
            lj, gj = jax.value_and_grad(forward_loss)(p, micro[j])
            loss, grads = loss + lj, jax.tree.map(jnp.add, grads, gj)
        scale = 1.0 / cfg.num_microbatches
        return loss * scale, jax.tree.map(lambda g: g * scale * scale_grads, grads)

    def sgd_step(p, batch, lr, scale_grads=1.0):
        loss, g = grads_of(p, batch, scale_grads)
        return jax.tree.map(lambda w, gw: w - lr * gw, p, g), loss, sum(jnp.sum(x * x) for x in jax.tree.leaves(g))

    def adam_step(p, state, batch, t):
        loss, g = grads_of(p, batch, 1.0)
        mu = jax.tree.map(lambda a, b: ADAM_B1 * a + (1 - ADAM_B1) * b, state[0], g)
        nu = jax.tree.map(lambda a, b: ADAM_B2 * a + (1 - ADAM_B2) * b * b, state[1], g)
        c1, c2 = 1 - ADAM_B1 ** t, 1 - ADAM_B2 ** t
        new = jax.tree.map(lambda w, a, b: w - cfg.learning_rate * (a / c1) / (jnp.sqrt(b / c2) + ADAM_EPS), p, mu, nu)
        return new, (mu, nu), loss

    rng = np.random.default_rng(cfg.seed)
    batch_np = rng.integers(0, m.vocab_size, size=(cfg.global_batch_size, cfg.seq_len), dtype=np.int32)

    # the reference: one device, no sharding
    one = devices[0]
    ref_params = jax.device_put(init(cfg.seed), one)
    ref_batch = jax.device_put(batch_np, one)
    ref_sgd = jax.jit(sgd_step)  # the reference's gradients are never scaled
    ref_losses, lr = [], None
    for _ in range(cfg.parity_steps):
        if lr is None:  # step size from the step-1 gradient: the loss falls by about PARITY_DROP
            _, loss0, gsq = ref_sgd(ref_params, ref_batch, 0.0)
            lr = float(PARITY_DROP * loss0 / max(float(gsq), 1e-30))
        ref_params, loss, _ = ref_sgd(ref_params, ref_batch, lr)
        ref_losses.append(float(loss))
    del ref_params

    # the plan: the mesh and its shardings
    mesh = Mesh(np.array(devices[:cfg.num_devices]).reshape(tuple(cfg.mesh.values())), tuple(cfg.mesh))

    def axis(name: str | None) -> str | None:
        return name if name in cfg.mesh else None

    def spec(dims, optimizer: bool = False):
        out = []
        for d in dims:
            if d == "fsdp" and optimizer and cfg.zero_stage == 1:
                out.append(axis("data"))
            else:
                out.append(axis(d))
        return NamedSharding(mesh, PartitionSpec(*out))

    p_shard = {n: spec(dims) for n, (_, dims) in shapes.items()}
    o_shard = {n: spec(dims, optimizer=True) for n, (_, dims) in shapes.items()}
    batch_axes = tuple(a for a in ("data", "fsdp") if a in cfg.mesh) or None
    b_shard = NamedSharding(mesh, PartitionSpec(batch_axes, axis("context")))
    rep = NamedSharding(mesh, PartitionSpec())
    params = jax.device_put(init(cfg.seed), p_shard)
    batch = jax.device_put(batch_np, b_shard)
    sgd = jax.jit(sgd_step, in_shardings=(p_shard, b_shard, None, None), out_shardings=(p_shard, rep, rep))
    losses = []
    for _ in range(cfg.parity_steps):
        params, loss, _ = sgd(params, batch, lr, cfg.grad_scale)
        losses.append(float(loss))
    state = (jax.device_put(jax.tree.map(jnp.zeros_like, params), o_shard),
             jax.device_put(jax.tree.map(jnp.zeros_like, params), o_shard))
    adam = jax.jit(adam_step, in_shardings=(p_shard, (o_shard, o_shard), b_shard, None),
                   out_shardings=(p_shard, (o_shard, o_shard), rep))
    times = []
    for t in range(1, cfg.warmup_steps + cfg.timed_steps + 1):
        start = time.perf_counter()
        params, state, loss = adam(params, state, batch, float(t))
        jax.block_until_ready((params, state, loss))
        if t > cfg.warmup_steps:
            times.append(time.perf_counter() - start)
        losses.append(float(loss))
    return {"status": "ok", "losses": losses, "reference_losses": ref_losses, "parity_learning_rate": lr,
            "step_times_s": times, "num_devices": cfg.num_devices, "mesh": dict(cfg.mesh),
            "jax_version": jax.__version__}


if __name__ == "__main__":
    raise SystemExit(main())
