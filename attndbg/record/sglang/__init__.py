"""The SGLang adapter (0.5.23; 0.5.3's capture/replay API by feature).

`adapter` places the hooks and records a step; the step's parts are read by `batch` (ForwardBatch,
req_to_token rows), `spec` (EagleVerifyInput: tree and mask), `graph` (CUDA-graph padding), `plan`
(each attention backend's metadata), `model` (layer shapes) and `layers` (`--layers` tensors);
`fields` is the table of every engine field the detectors read.

`install` and `register` are the package's entry points (SGLang's `sglang.srt.plugins` names
`attndbg.record.sglang:register`, `attndbg.record.bootstrap` calls `install`); they import the
adapter only when called, so naming the package costs nothing in an engine process.
"""


def install() -> None:
    from attndbg.record.sglang.adapter import install as install_hooks

    install_hooks()


def register() -> None:
    from attndbg.record.sglang.adapter import register as register_plugin

    register_plugin()
