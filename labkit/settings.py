"""The quick setting: small sizes so every notebook runs in minutes on 2 CPU cores.

`LABKIT_QUICK=1` forces it, `LABKIT_QUICK=0` asks for the full setting (meant for a
GPU node). Unset, the lab is quick unless a GPU is present.
"""
import os


def quick() -> bool:
    value = os.environ.get("LABKIT_QUICK")
    if value is not None:
        return value.strip().lower() not in ("0", "false", "no", "off", "")
    return not _gpu_present()


def _gpu_present() -> bool:
    # NVML-based count: does not initialise CUDA, so a later fork stays safe.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch

    return torch.cuda.is_available()
