"""CUPTI-like records of one replay step, built by hand the way the collector copies them:
triton's eager run and a graph replay (captured with 2 kernels, replayed for a decoy batch and the
real one), plus the NVTX markers nsys would see. GPU times are deliberately late: every kernel ends
after its range closed, as on the GPU without a sync, so only the launch can place it."""

from __future__ import annotations

from dataclasses import dataclass, field

from attndbg.timeline.records import ApiCall, Edge, ExternalId, Kernel, Marker, ProcessRecords, Range

LABEL = "step=0 mode=DECODE bs=3"
PY_THREAD = 4242  # the Python thread's native id (our ranges)
CUPTI_THREAD = 140001  # CUPTI's numbering of the same thread (API calls, markers)
GRAPH_ID = 5


@dataclass
class Builder:
    pid: int = 1000
    records: ProcessRecords = field(init=False)
    clock: int = 1_000_000  # ns
    _open: list[Range] = field(default_factory=list)
    _marker_ids: list[int] = field(default_factory=list)
    _next_range: int = 1
    _next_corr: int = 100

    def __post_init__(self) -> None:
        self.records = ProcessRecords(pid=self.pid, label="attndbg replay")

    def tick(self, ns: int = 1_000) -> int:
        self.clock += ns
        return self.clock

    def push(self, name: str, detail: str) -> int:
        message = f"attndbg/{name} {detail}"
        rid = self._next_range
        self._next_range += 1
        parent = self._open[-1].id if self._open else None
        start = self.tick()
        self._open.append(Range(id=rid, parent=parent, message=message, thread_id=PY_THREAD, start=start, end=0))
        self.records.markers.append(Marker(id=rid + 500, edge=Edge.START, timestamp=start, thread_id=CUPTI_THREAD, name=message, domain="attndbg"))
        self._marker_ids.append(rid + 500)
        return rid

    def pop(self) -> None:
        r = self._open.pop()
        end = self.tick()
        self.records.ranges.append(Range(id=r.id, parent=r.parent, message=r.message, thread_id=r.thread_id, start=r.start, end=end))
        self.records.markers.append(Marker(id=self._marker_ids.pop(), edge=Edge.END, timestamp=end, thread_id=CUPTI_THREAD))

    def call(self, name: str, *, in_range: bool = True) -> ApiCall:
        corr = self._next_corr
        self._next_corr += 1
        start = self.tick(100)
        call = ApiCall(correlation_id=corr, name=name, start=start, end=self.tick(100), thread_id=CUPTI_THREAD)
        self.records.api_calls.append(call)
        if in_range and self._open:
            self.records.external_ids.append(ExternalId(correlation_id=corr, external_id=self._open[-1].id))
        return call

    def kernel(self, call: ApiCall, name: str, *, late_ns: int = 50_000, node: int = 0, stream: int = 7) -> Kernel:
        start = call.end + late_ns + node * 4_000  # runs after the range that launched it closed
        k = Kernel(name=name, correlation_id=call.correlation_id, device=0, stream=stream, start=start, end=start + 3_000,
                   graph_id=GRAPH_ID if node else 0, graph_node_id=node)
        self.records.kernels.append(k)
        return k


def replay_step(pid: int = 1000, step: int = 0) -> ProcessRecords:
    b = Builder(pid=pid)
    label = LABEL.replace("step=0", f"step={step}")
    b.push("step", f"trace=step_{step}.pt {label}")
    b.push("data", label)
    b.kernel(b.call("cudaLaunchKernel_v7000"), "_ZN2at6native18elementwise_kernelILi128ELi2EEEviPf")
    b.pop()
    b.push("backend/triton", label)
    b.push("plan", f"{label} backend=triton variant=eager")
    b.pop()
    b.push("run", f"{label} backend=triton variant=eager")
    b.kernel(b.call("cuLaunchKernelEx"), "_fwd_kernel_stage1")
    b.kernel(b.call("cuLaunchKernelEx"), "_fwd_kernel_stage2")
    b.pop()
    b.push("capture+replay", f"{label} backend=triton variant=graph capture_bs=8 fill=1")
    b.push("capture", label)
    b.call("cuLaunchKernelEx")  # recorded into the graph: no kernel runs now
    b.call("cuLaunchKernelEx")
    b.pop()
    for batch in ("decoy", "real"):
        b.push("replay", f"{label} batch={batch}")
        launch = b.call("cudaGraphLaunch_v10000")
        b.kernel(launch, "_fwd_kernel_stage1", node=1)
        b.kernel(launch, "_fwd_kernel_stage2", node=2)
        b.pop()
    b.pop()
    b.pop()
    b.pop()
    return b.records


def engine_steps(pid: int = 2000) -> ProcessRecords:
    """An engine's process under `record --timeline` (transformers' CUDA graphs): step 0 captures a
    graph for 8 padded tokens (its warm-up forward runs eagerly, then 2 launches are captured),
    steps 1-2 replay it, step 3 runs eagerly (a prefill, no graph for it); between steps the engine
    launches a kernel of its own, outside every range (preparing the next batch)."""
    b = Builder(pid=pid)
    b.records.label = "engine process"

    def words(step: int, mode: str, bs: int, graph: str) -> str:
        return f"engine=transformers step={step} mode={mode} bs={bs} graph={graph}" + ("" if graph == "eager" else " graph_bs=8")

    b.push("engine", words(0, "DECODE", 3, "capture"))
    b.kernel(b.call("cudaLaunchKernel_v7000"), "attention_warmup")
    b.kernel(b.call("cudaLaunchKernel_v7000"), "lm_head_warmup")
    b.call("cudaLaunchKernel_v7000")  # captured: no kernel runs now
    b.call("cudaLaunchKernel_v7000")
    b.pop()
    for step in (1, 2):
        b.kernel(b.call("cudaLaunchKernel_v7000", in_range=False), "fill_static_inputs")
        b.push("engine", words(step, "DECODE", 3, "replay"))
        launch = b.call("cudaGraphLaunch_v10000")
        b.kernel(launch, "attention", node=1)
        b.kernel(launch, "lm_head", node=2)
        b.pop()
    b.push("engine", words(3, "EXTEND", 1, "eager"))
    b.kernel(b.call("cudaLaunchKernel_v7000"), "attention_prefill")
    b.pop()
    return b.records
