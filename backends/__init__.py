"""Kernel-library adapters; installed as attndbg.backends."""
