"""Small synth shapes shared by the detector tests: quick under the Triton interpreter."""

SMALL = ("heads=2:1", "head_dim=32")
# Per preset: overrides that keep the interpreter quick but keep what the preset is about.
SWEEP_SHAPES = {
    "decode-gqa": ("kv_lens=5,70", "shared_prefix=0"),
    "decode-mha": ("heads=1:1", "kv_lens=3,40"),
    "decode-paged": ("kv_lens=5,33", "shared_prefix=16"),
    "decode-long": ("kv_lens=1,1100",),
    "mla-decode": ("heads=2", "kv_lora_rank=64", "rope_dim=32", "kv_lens=1,40"),
    "window-decode": ("kv_lens=10,100",),
    "softcap": ("kv_lens=7,150",),
    "verify": ("prefix_lens=20,75",),
    "verify-chain": ("prefix_lens=31,64",),
    "sinks-decode": ("kv_lens=1,40",),
    "fp8-scaled": ("kv_lens=9,70",),
}


def kv_dtype_word(preset: str, dtype: str) -> str:
    """The sweep's KV dtype: the run's, unless the preset is about its own (fp8-scaled's fp8 cache)."""
    from attndbg.trace import synth

    return f"kv_dtype={synth.PRESETS[preset].get('kv_dtype', dtype)}"
