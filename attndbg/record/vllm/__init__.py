"""The vLLM (v1) adapter.

`adapter` wraps every attention metadata builder's `build()` and records a step; `convert` turns
CommonAttentionMetadata into the engine-neutral batch (padding as padding), `fields` is the table of
the common fields recorded verbatim and how each is cut, `plan` reads a builder's output under its
own names, `model` what a builder knows of its layers, `tensors` the `--layers` tensors of
`AttentionImpl.forward`.

`install` and `register` are the package's entry points (vLLM's `vllm.general_plugins` names
`attndbg.record.vllm:register`, `attndbg.record.bootstrap` calls `install`); they import the
adapter only when called.
"""


def install() -> None:
    from attndbg.record.vllm.adapter import install as install_hooks

    install_hooks()


def register() -> None:
    from attndbg.record.vllm.adapter import register as register_plugin

    register_plugin()
