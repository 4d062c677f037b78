# Sourced by scripts/setup_te.sh, setup_bridge.sh and tier.sh: the two variables Transformer Engine needs
# to load in .venv-te. Its loader looks for cuDNN and NVRTC only under its own venv's nvidia/ (or
# CUDA_HOME, searched recursively), and its extension links cuBLAS and NCCL, which live in
# .venv's nvidia/ (torch's CUDA wheels). Needs MAIN_VENV set.
nvidia_root=$("$MAIN_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/nvidia
export CUDA_HOME=$nvidia_root
export LD_LIBRARY_PATH=$nvidia_root/cu13/lib:$nvidia_root/cudnn/lib:$nvidia_root/nccl/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
unset nvidia_root
