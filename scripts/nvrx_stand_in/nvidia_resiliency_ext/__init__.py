"""A stand-in for nvidia-resiliency-ext, for the Bridge tier only (scripts/setup_bridge.sh).

Megatron-Bridge 0.6.2 imports ``nvidia_resiliency_ext.inprocess`` unconditionally. The package
index here has nvidia-resiliency-ext 0.4.1 at most, and megatron-core 0.19.2 fails to import
beside it (its ``nvrx.py`` reads ``__version__``, which 0.4.1 lacks). This stand-in offers only
what an import needs; version 0.0.0 keeps megatron-core's NVRx async checkpointing off.
"""

__version__ = "0.0.0"
