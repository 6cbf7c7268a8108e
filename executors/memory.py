"""Peak memory of one rank's training (imports torch lazily).

CUDA: `max_memory_allocated` / `max_memory_reserved`, reset once the model is
built, minus what was allocated before the model (CUDA context excluded).

CPU: torch has no CPU allocator statistics, so the allocations themselves are
recorded: a `torch.profiler` window with `profile_memory=True` spans the model
build and the parity/warm-up steps; every allocation and free in it is an
event with a signed byte count. Their running sum is the bytes of live tensors
created in the window; the peak is its maximum after the model is built and
sharded (the transient full copy every rank builds to draw the seeded weights
is excluded; the shards, gradients, optimizer states, communication buffers and
activations are included). Timed steps run outside the window, unprofiled.

The process-level figure (`reserved`) is the growth of anonymous resident
memory over the same steps: VmHWM (reset through `/proc/self/clear_refs`, Linux
>= 4.0) - RssFile - RssShmem - RssAnon before the model. It adds what the
allocator keeps cached and the runtime's own memory. (glibc's allocator is left
at its defaults: forcing every tensor into its own mapping would make RSS track
live tensors, but every step would then page-fault its activations in again,
which costs more time than the kernels themselves on a small CPU.)
"""

from __future__ import annotations

from pathlib import Path

MARKER = "meshplan::steps"


def status_bytes(*keys: str) -> dict[str, float]:
    """Fields of /proc/self/status in bytes (they are published in kB)."""
    out = {k: 0.0 for k in keys}
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        key = line.split(":", 1)[0]
        if key in out:
            out[key] = float(line.split()[1]) * 1024
    return out


def peak_live_bytes(events, after_ns: int) -> float:
    """Maximum running sum of (start_ns, nbytes) allocation events at or after `after_ns`."""
    live = peak = 0.0
    seen = False
    for start, nbytes in sorted(events):
        live += nbytes
        if start >= after_ns:
            peak = live if not seen else max(peak, live)
            seen = True
    return peak


class MemoryMeter:
    """start() before the model is built, model_built() after it is sharded,
    stop() after the parity and warm-up steps; peak() at the end."""

    def __init__(self, device: str):
        self.device = device
        self.baseline_bytes = 0.0
        self._prof = None
        self._marker = None
        self._peak = self._reserved = 0.0

    def start(self) -> None:
        import torch

        if self.device == "cuda":
            self.baseline_bytes = float(torch.cuda.memory_allocated())
            return
        from torch.profiler import ProfilerActivity, profile

        self.baseline_bytes = status_bytes("RssAnon")["RssAnon"]
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()

    def model_built(self) -> None:
        import torch

        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            return
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass  # the reserved figure then includes the model build
        self._marker = torch.profiler.record_function(MARKER)
        self._marker.__enter__()

    def stop(self) -> None:
        if self.device == "cuda" or self._prof is None:
            return
        self._marker.__exit__(None, None, None)
        self._prof.__exit__(None, None, None)
        raw = self._prof.profiler.kineto_results.events()
        marks = [e.start_ns() for e in raw if e.name() == MARKER]
        mem = [(e.start_ns(), e.nbytes()) for e in raw if e.name() == "[memory]" and str(e.device_type()).endswith("CPU")]
        self._peak = peak_live_bytes(mem, min(marks) if marks else 0)
        s = status_bytes("VmHWM", "RssFile", "RssShmem")
        self._reserved = s["VmHWM"] - s["RssFile"] - s["RssShmem"] - self.baseline_bytes
        self._prof = None

    def abandon(self) -> None:
        """Close an open profiler window without reading it (a failed run)."""
        if self._prof is None:
            return
        try:
            if self._marker is not None:
                self._marker.__exit__(None, None, None)
            self._prof.__exit__(None, None, None)
        except Exception:  # the run already failed; its own error is the one reported
            pass
        self._prof = None

    def peak(self) -> tuple[float, float]:
        """(peak, reserved) bytes of training on this rank."""
        if self.device == "cuda":
            import torch

            return (float(torch.cuda.max_memory_allocated()) - self.baseline_bytes,
                    float(torch.cuda.max_memory_reserved()) - self.baseline_bytes)
        return self._peak, self._reserved
