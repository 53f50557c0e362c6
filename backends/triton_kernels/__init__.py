"""Our Triton attention kernels (SGLang Triton-backend semantics)."""
