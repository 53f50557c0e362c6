"""SGLang's part in the flight recorder: the pointer audit of the attention metadata its CUDA graphs
read, and the acceptance rate of its speculative verify steps (`--when 'accept<X'`).

Pointer audit (record/pointer_audit.py), per backend instance and graph (batch size, forward mode):
- SGL-new: `init_forward_metadata_out_graph(fb, in_capture=True)` runs before each capture; with
  `in_capture=False` and a replay view (`num_padding`) before each replay. The backend's
  `forward_metadata` after the call is what the graph reads;
- SGL-classic: `init_forward_metadata_capture_cuda_graph(bs, num_tokens, req_pool_indices,
  seq_lens, encoder_lens, forward_mode, ...)` at capture and
  `init_forward_metadata_replay_cuda_graph(bs, req_pool_indices, seq_lens, seq_lens_sum,
  encoder_lens, forward_mode, ...)` before each replay.

Acceptance: SGL-new `EAGLEWorkerV2.verify(batch)` returns a GenerationBatchResult whose
`accept_lens` [bs] count each request's accepted tokens *with* the bonus token (eagle_worker_v2:
"accept_lens includes the bonus token"), out of `speculative_num_draft_tokens - 1` drafts each;
SGL-classic `EAGLEWorker.verify` returns `(logits, EagleVerifyOutput, ...)` whose
`accept_length_per_req_cpu` count accepted drafts without it, out of `draft_token_num - 1`. The
rate is judged on the flight thread once the host copy of `accept_lens` landed (no device sync).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from attndbg.record.host_copy import HostCopy
from attndbg.record.pointer_audit import PointerAudit, report_moved
from attndbg.record.session import current_session
from attndbg.record.triggers import Trigger, TriggerKind, acceptance

AUDIT = PointerAudit()
_FORWARD_MODE_ARG = 5  # position of forward_mode in both classic capture and replay signatures (after self)


def _mode_name(mode: Any) -> str:
    return str(getattr(mode, "name", mode))


def _graph_key(backend: Any, bs: Any, mode: Any) -> tuple[int, int, str]:
    return (id(backend), int(bs), _mode_name(mode))


def audit_out_graph(backend: Any, forward_batch: Any, *, in_capture: bool) -> None:
    """SGL-new: after `init_forward_metadata_out_graph` ran for a capture or a replay view."""
    session = current_session()
    if session is None or not session.enabled:
        return
    with session.guard("sglang pointer audit"):
        key = _graph_key(backend, forward_batch.batch_size, forward_batch.forward_mode)
        if in_capture:
            AUDIT.captured(key, getattr(backend, "forward_metadata", None))
        elif hasattr(forward_batch, "num_padding"):
            _replayed(session, backend, key)


def _replayed(session: Any, backend: Any, key: tuple[int, int, str]) -> None:
    moved = AUDIT.replayed(key, getattr(backend, "forward_metadata", None))
    next_step = (session.last_step if session.last_step is not None else -1) + 1  # the replay's step, numbered next
    report_moved(session, moved, step=next_step, what=f"sglang {type(backend).__name__}.forward_metadata")


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], name: str, position: int) -> Any:
    return kwargs[name] if name in kwargs else args[position] if len(args) > position else None


def wrap_capture_metadata(original: Callable) -> Callable:
    """SGL-classic `init_forward_metadata_capture_cuda_graph`: remember what the graph reads."""

    @functools.wraps(original)
    def init_forward_metadata_capture_cuda_graph(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        session = current_session()
        if session is not None and session.enabled:
            with session.guard("sglang pointer audit"):
                key = _graph_key(self, _arg(args, kwargs, "bs", 0), _arg(args, kwargs, "forward_mode", _FORWARD_MODE_ARG))
                AUDIT.captured(key, getattr(self, "forward_metadata", None))
        return result

    return init_forward_metadata_capture_cuda_graph


def audit_classic_replay(backend: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """SGL-classic: after `init_forward_metadata_replay_cuda_graph(bs, ..., forward_mode, ...)`."""
    session = current_session()
    if session is None or not session.enabled:
        return
    with session.guard("sglang pointer audit"):
        _replayed(session, backend, _graph_key(backend, _arg(args, kwargs, "bs", 0), _arg(args, kwargs, "forward_mode", _FORWARD_MODE_ARG)))


def acceptance_of(worker: Any, result: Any) -> tuple[Tensor | list[int], int, int] | None:
    """(per-request accepted drafts or accept_lens, drafts per request, bonus tokens counted in
    each) from a verify call's result; None when the result carries none."""
    accept_lens = getattr(result, "accept_lens", None)
    drafts = getattr(worker, "speculative_num_draft_tokens", None)
    if isinstance(accept_lens, Tensor) and isinstance(drafts, int):
        return accept_lens, drafts - 1, 1  # SGL-new: the bonus token included
    for part in result if isinstance(result, tuple) else ():
        per_req = getattr(part, "accept_length_per_req_cpu", None)
        spec = getattr(getattr(part, "draft_input", None), "draft_token_num", None) or getattr(worker, "speculative_num_draft_tokens", None)
        if per_req is not None and isinstance(spec, int):
            return list(per_req), spec - 1, 0  # SGL-classic: accepted drafts only
    return None


def wrap_verify(original: Callable) -> Callable:
    """`EAGLEWorkerV2.verify` / `EAGLEWorker.verify`: judge the step's acceptance rate (`--when accept<X`)."""

    @functools.wraps(original)
    def verify(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        session = current_session()
        flight = session.flight if session is not None and session.enabled else None
        if flight is None or flight.when.accept_below is None:
            return result
        with session.guard("sglang verify acceptance"):
            found = acceptance_of(self, result)
            if found is not None:
                accepted, drafts, bonus = found
                copy = HostCopy({"accepted": accepted if isinstance(accepted, Tensor) else torch.tensor(accepted)})
                flight.check(copy, functools.partial(_judge, step=session.last_step, drafts=drafts, bonus=bonus, below=flight.when.accept_below))
        return result

    return verify


def _judge(host: dict[str, Any], *, step: int | None, drafts: int, bonus: int, below: float) -> Trigger | None:
    per_request = (host["accepted"].to(torch.int64).reshape(-1) - bonus).clamp(min=0)
    rate = acceptance(int(per_request.sum()), drafts * per_request.numel())
    if rate is None or rate >= below:
        return None
    return Trigger(
        kind=TriggerKind.ACCEPT,
        step=step,
        message=f"verify accepted {int(per_request.sum())} of {drafts * per_request.numel()} draft tokens ({rate:.3f} < {below})",
    )


def install_verify_hooks() -> None:
    """Wrap the EAGLE workers' verify where this SGLang has them (each found by feature)."""
    import importlib

    from attndbg.record import hooks

    for module_name, class_name in (("sglang.srt.speculative.eagle_worker_v2", "EAGLEWorkerV2"), ("sglang.srt.speculative.eagle_worker", "EAGLEWorker")):
        try:
            worker = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            continue
        hooks.patch(worker, "verify", wrap_verify)
