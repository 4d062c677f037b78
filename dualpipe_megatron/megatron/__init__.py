"""Megatron-Core adapter: guarded patches of Megatron symbols, CPU compatibility layer."""
