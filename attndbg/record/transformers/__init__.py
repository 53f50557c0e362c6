"""The transformers continuous-batching adapter (`generate_batch`): `adapter` wraps
`ModelRunner.compute_batch` and the `sdpa` / `paged|eager` attention functions.

`install` is the package's entry point (`attndbg.record.bootstrap` calls it once transformers'
continuous-batching model runner is imported); it imports the adapter only when called.
"""


def install() -> None:
    from attndbg.record.transformers.adapter import install as install_hooks

    install_hooks()
