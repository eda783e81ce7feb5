"""Who holds a ZeRO-3 trial's GPU memory: live tensors and allocator blocks at a GRPO step's points.

Why: docs/gpu-validation.md (second lease, row Z) left open which buffer holds a Qwen2.5-7B shape's
second 14 GiB under ZeRO-3 with optimizer+params offload (16.5-17.6 GiB during the first generation,
31.0 GiB from the first step on): DeepSpeed's (prefetched or persistent parameters, its buffers),
TRL's gathering for generation, or torch's caching allocator keeping freed blocks reserved. One GPU
run of this probe answers it: each snapshot has torch's allocated / reserved counters and the
device's used memory, the live storages on the device (parameters, grads, ZeRO partitions, others
with what refers to them, DeepSpeed's status) and the allocator's blocks by the code that made them.

Use: this folder on PYTHONPATH (Python imports ``sitecustomize`` at start-up) and an output folder
in AUTOTUNE_TENSOR_PROBE; without that variable it does nothing at all::

    PYTHONPATH=scripts/gpu_probe:$PYTHONPATH AUTOTUNE_TENSOR_PROBE=/tmp/probe python -m autotune search ...

(``PARTS=zero3probe scripts/gpu_checks.sh`` runs row Z so.) An import hook patches
``trl.trainer.grpo_trainer`` as it is imported, so only the trial worker is touched, before it
builds its model. On CUDA it records allocations' Python stacks (a history of segment events only).
``probe-<pid>.jsonl`` gets one line per snapshot: train begin; entry, inside TRL's gather
(``unwrap_model_for_generation``) and exit of the first three ``GRPOTrainer._generate`` calls; the
end of steps 1-3, with ``memory_summary()`` in ``summary-<pid>-stepN.txt`` (a search ends a trial
by SIGTERM, which skips atexit's ``summary-<pid>.txt``). On a CPU it lists tensors over 1 MiB: a
smoke test. Its own errors become ``probe_error`` lines; it never breaks the trial.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import functools
import gc
import importlib.machinery
import importlib.util
import json
import os
import sys
import time
import types
from pathlib import Path
from typing import Any

OUT = os.environ.get("AUTOTUNE_TENSOR_PROBE")
TARGET = "trl.trainer.grpo_trainer"
CALLS, STEPS = 3, (1, 2, 3)  # generations and step ends snapshotted
LIBS = ("deepspeed/", "trl/", "peft/", "accelerate/", "transformers/", "autotune/")
SKIP = ["alloc", "free_requested", "free_completed", "snapshot"]  # the history: segment events only
GIB = 2**30
_state: dict[str, Any] = {"cuda": False, "names": None, "trainer": None, "calls": collections.Counter()}


def _write(record: dict[str, Any]) -> None:
    if not OUT:
        return
    try:
        Path(OUT).mkdir(parents=True, exist_ok=True)
        with Path(OUT, f"probe-{os.getpid()}.jsonl").open("a") as f:
            f.write(json.dumps(record, default=str) + "\n")
    except Exception as exc:  # noqa: BLE001 - the probe must never break the trial
        print(f"tensor probe: cannot write: {exc}", file=sys.stderr)


def _guarded(point: str, fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - a probe_error line instead of a broken trial
        _write({"point": point, "pid": os.getpid(), "probe_error": f"{type(exc).__name__}: {exc}"})
        return None


def _gib(n: float) -> float:
    return round(n / GIB, 4)


def _memory() -> dict[str, Any]:
    import torch

    if not _state["cuda"]:
        import resource

        return {
            "device": "cpu",
            "max_rss_gib": _gib(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10),
        }
    free, total = torch.cuda.mem_get_info()
    out = {"device": torch.cuda.get_device_name(), "device_used_gib": _gib(total - free)}
    for name in ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved"):
        out[name.replace("memory_", "") + "_gib"] = _gib(getattr(torch.cuda, name)())
    return out


def _tensors(trainer: Any, owners: bool) -> dict[str, Any]:
    """The live tensors gc sees on the device, by storage (ZeRO-3 makes many views of one buffer)."""
    import torch

    if _state["names"] is None and trainer is not None:  # the parameter objects stay; their data changes
        _state["names"] = {id(p): n for n, p in trainer.model.named_parameters()}
    names, device = _state["names"] or {}, "cuda" if _state["cuda"] else "cpu"
    params, others = [], []
    for obj in gc.get_objects():
        with contextlib.suppress(Exception):
            if isinstance(obj, torch.Tensor):
                (params if isinstance(obj, torch.nn.Parameter) else others).append(obj)
    found = [(p, "parameter", names.get(id(p))) for p in params]  # first: a storage they use is theirs
    for p in params:  # grads and ZeRO partitions gc may not list (no Python object yet)
        for attr, kind in (("grad", "grad"), ("ds_tensor", "ds_partition")):
            if isinstance(t := getattr(p, attr, None), torch.Tensor):
                found.append((t, kind, f"{names.get(id(p), '?')}.{attr}"))
    found += [(t, "other", None) for t in others]
    seen: set[int] = set()
    rows: dict[int, dict[str, Any]] = {}
    for t, kind, name in found:
        with contextlib.suppress(Exception):
            if id(t) in seen or t.device.type != device:
                continue
            seen.add(id(t))
            storage = t.untyped_storage()
            if storage.nbytes() <= (0 if _state["cuda"] else 2**20):
                continue
            row = rows.setdefault(storage.data_ptr(), {"size": storage.nbytes(), "t": t, "views": 0})
            row["views"] += 1
            row.setdefault("kinds", {})[kind] = None
            if name and len(row.setdefault("names", [])) < 3:
                row["names"].append(name)
            if hasattr(t, "ds_id") and "ds" not in row:
                status = getattr(t, "ds_status", None)
                row["ds"] = [t.ds_id, getattr(status, "name", status), getattr(t, "ds_numel", None)]
    del found, params, others
    groups: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0])
    for row in rows.values():
        row["kinds"] = "+".join(row["kinds"])
        ds = "ds" if "ds" in row or "ds_partition" in row["kinds"] else "plain"
        group = groups[f"{row['kinds']} {str(row['t'].dtype).replace('torch.', '')} {ds}"]
        group[0], group[1] = group[0] + 1, group[1] + row["size"]
    largest = []
    for i, row in enumerate(sorted(rows.values(), key=lambda r: -r["size"])[:15]):
        t = row.pop("t")
        row.update(gib=_gib(row.pop("size")), shape=list(t.shape), dtype=str(t.dtype), cls=type(t).__name__)
        if owners and i < 5 and "parameter" not in row["kinds"]:  # what keeps the largest others alive
            row["owners"] = _owners(t, {id(rows), id(largest)})
        largest.append(row)
    return {
        "groups": {k: [v[0], _gib(v[1])] for k, v in sorted(groups.items(), key=lambda kv: -kv[1][1])},
        "total_gib": _gib(sum(v[1] for v in groups.values())),
        "largest": largest,
    }


def _owners(t: Any, mine: set[int]) -> list[str]:
    """A tensor's referrers: an object's type, or the key a dict keeps it under."""
    out = []
    for ref in gc.get_referrers(t):
        if id(ref) in mine or isinstance(ref, types.FrameType):
            continue
        label = type(ref).__name__
        for key, value in ref.items() if isinstance(ref, dict) else ():  # a loop: a comprehension
            if value is t:  # would hold t in a cell, one more referrer
                label = f"dict[{key!r}]"
                break
        out.append(label)
    return out[:4]


def _where(frames: list[dict[str, Any]] | None) -> str:
    """An allocation's innermost frame in a library (and the innermost TRL frame above it)."""
    lib = via = fallback = None
    for f in frames or []:
        path = f.get("filename", "")
        short = next((path[i + 1 :] for p in (*LIBS, "torch/") if (i := path.rfind("/" + p)) >= 0), None)
        if short is None:
            continue
        label = f"{short}:{f.get('line')}:{f.get('name')}"
        if short.startswith("torch/"):
            fallback = fallback or label
        elif lib is None:
            lib = label
        elif via is None and short.startswith("trl/") and not lib.startswith("trl/"):
            via = label
    if lib is None:
        return fallback or "<no python stack>"
    return f"{lib} < {via}" if via else lib


def _allocator() -> dict[str, Any]:
    """torch's caching allocator: segments, blocks by who allocated them, segments' growth."""
    import torch

    snap = torch.cuda.memory._snapshot()
    segments = snap["segments"]
    active, inactive, events, grown, reserved, in_use = (collections.Counter() for _ in range(6))
    for seg in segments:  # the caching allocator reuses a freed block only on its own stream
        reserved[str(seg.get("stream"))] += seg["total_size"]
        in_use[str(seg.get("stream"))] += seg["active_size"]
    for block in (b for seg in segments for b in seg["blocks"]):
        (inactive if block["state"] == "inactive" else active)[_where(block.get("frames"))] += block["size"]
    for entry in (e for trace in snap.get("device_traces", []) for e in trace):
        events[entry["action"]] += entry["size"]
        if entry["action"] in ("segment_alloc", "segment_map"):
            grown[f"stream {entry.get('stream')}: {_where(entry.get('frames'))}"] += entry["size"]
    total, used = sum(s["total_size"] for s in segments), sum(s["active_size"] for s in segments)
    top = lambda counter, n: [[k, _gib(v)] for k, v in counter.most_common(n)]  # noqa: E731
    return {
        "segments": len(segments),
        "segments_gib": _gib(total),
        "active_gib": _gib(used),
        "inactive_gib": _gib(total - used),
        "largest_segment_gib": _gib(max((s["total_size"] for s in segments), default=0)),
        "active_by_frame": top(active, 15),
        "inactive_by_last_alloc": top(inactive, 5),
        "segment_events_gib": {k: _gib(v) for k, v in events.items()},
        "segments_grown_by": top(grown, 10),
        "segments_by_stream_gib": {k: [_gib(v), _gib(in_use[k])] for k, v in reserved.items()},
    }


def snapshot(point: str, call: int, trainer: Any = None, owners: bool = False) -> None:
    """One JSON line: memory counters, live tensors and (CUDA) the allocator, each part guarded."""
    start, state = time.perf_counter(), getattr(trainer, "state", None)
    record = {"point": point, "call": call, "step": getattr(state, "global_step", None)}
    record.update(rank=int(os.environ.get("RANK", 0)), pid=os.getpid(), time=round(time.time(), 2))
    record["memory"] = _guarded(point, _memory)
    record["tensors"] = _guarded(point, _tensors, trainer, owners)
    if _state["cuda"]:
        record["allocator"] = _guarded(point, _allocator)
    record["probe_s"] = round(time.perf_counter() - start, 2)
    _write(record)


def _summary(suffix: str) -> None:
    import torch

    Path(str(OUT), f"summary-{os.getpid()}{suffix}.txt").write_text(torch.cuda.memory_summary())


def _start_recording() -> None:
    """Stacks for every allocation from before the model exists."""
    import torch

    if not torch.cuda.is_available():
        return
    _state["cuda"] = True
    torch.cuda.init()  # the allocator must exist for the recording to reach it
    record = functools.partial(torch.cuda.memory._record_memory_history, context="all", stacks="python")
    try:
        record(max_entries=100_000, skip_actions=SKIP)
    except Exception:  # noqa: BLE001 - an older torch: every event kept, so only the newest 10,000
        record(max_entries=10_000)
    atexit.register(_guarded, "exit", _summary, "")


def _patch(module: types.ModuleType) -> None:
    """Snapshots around GRPOTrainer._generate, inside TRL's gather, and a callback for the steps."""
    from transformers import TrainerCallback

    cls, calls = module.GRPOTrainer, _state["calls"]
    init, generate, unwrap = cls.__init__, cls._generate, module.unwrap_model_for_generation

    class ProbeCallback(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            _guarded("train_begin", snapshot, "train_begin", 0, _state["trainer"])

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step in STEPS:
                _guarded("step_end", snapshot, "step_end", state.global_step, _state["trainer"], True)
                if _state["cuda"]:
                    _guarded("step_end", _summary, f"-step{state.global_step}")

    @functools.wraps(init)
    def probed_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        _state["trainer"] = self
        # first: a step's snapshot comes before autotune's metrics line, which lets the controller
        # end a measured trial
        _guarded("init", self.callback_handler.callbacks.insert, 0, ProbeCallback())

    @functools.wraps(generate)
    def probed_generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls["generate"] += 1
        n = calls["generate"]
        if n <= CALLS:
            _guarded("generate_enter", snapshot, "generate_enter", n, self)
        result = generate(self, *args, **kwargs)
        if n <= CALLS:
            _guarded("generate_exit", snapshot, "generate_exit", n, self)
        return result

    @contextlib.contextmanager
    @functools.wraps(unwrap)
    def probed_unwrap(*args: Any, **kwargs: Any) -> Any:
        with unwrap(*args, **kwargs) as model:
            calls["gathered"] += 1
            if calls["gathered"] <= CALLS:
                _guarded("gathered", snapshot, "gathered", calls["gathered"], _state["trainer"])
            yield model

    cls.__init__, cls._generate = probed_init, probed_generate
    module.unwrap_model_for_generation = probed_unwrap  # the trainer looks it up at each call


class _Hook:
    """A meta path finder: the real finders find TARGET; its set-up runs around the module's code."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != TARGET:
            return None
        sys.meta_path.remove(self)  # once, and the lookups below do not come back here
        try:
            finders = (f for f in sys.meta_path if hasattr(f, "find_spec"))
            spec = next((s for f in finders if (s := f.find_spec(name, path, target)) is not None), None)
            run = spec.loader.exec_module
        except Exception:  # noqa: BLE001 - the import goes on as if the probe were not there
            return None

        def exec_module(module: types.ModuleType) -> None:
            _guarded("start", _start_recording)
            run(module)
            _guarded("patch", _patch, module)

        spec.loader.exec_module = exec_module
        return spec


def _chain() -> None:
    """Run the sitecustomize this one shadows, if there is one (a distribution's, say)."""
    here = Path(__file__).resolve().parent
    rest = [p for p in sys.path if Path(p or ".").resolve() != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


with contextlib.suppress(Exception):
    _chain()
if OUT:
    if TARGET in sys.modules:  # imported before this module ran (by hand, in a live process)
        _guarded("patch", _patch, sys.modules[TARGET])
    else:
        sys.meta_path.insert(0, _Hook())
