"""Native kernels as torch ops: the bottom floor of the package.

`kernels/cpu/`: C sources (csrc/), their build into an on-disk cache (build.py), the loaded libraries and which ops
this process can run (library.py), and the ops themselves, registered with torch.library in the `tgi_vlm`
namespace with their bounds checks (ops.py). Nothing here imports `models/`, `layers/` or `generation/`: layers
import the kernels, and `tgi_vlm.config.KernelSettings` says which of them run.
"""
