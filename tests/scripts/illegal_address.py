"""Make the GPU's MMU fault on purpose: a kernel that stores to an address nothing mapped.

The driver logs an application Xid for it (31, "GPU memory page fault"; 13 on some GPUs) and
the CUDA context is lost; the GPU itself is fine. Run as a process of its own (its context is
poisoned): exits 0 when the launch failed with CUDA_ERROR_ILLEGAL_ADDRESS (700), else 1.
Only libcuda, through ctypes: no toolkit, no torch.
"""

from __future__ import annotations

import ctypes
import sys

PTX = b"""
.version 6.0
.target sm_50
.address_size 64
.visible .entry poke(.param .u64 where) {
    .reg .u64 %rd<2>;
    .reg .u32 %r<2>;
    ld.param.u64 %rd1, [where];
    mov.u32 %r1, 1;
    st.global.u32 [%rd1], %r1;
    ret;
}
"""


def main() -> int:
    cuda = ctypes.CDLL("libcuda.so.1")

    def check(name: str, status: int) -> None:
        if status != 0:
            raise SystemExit(f"{name} failed: CUDA error {status}")

    device, context = ctypes.c_int(), ctypes.c_void_p()
    module, function = ctypes.c_void_p(), ctypes.c_void_p()
    check("cuInit", cuda.cuInit(0))
    check("cuDeviceGet", cuda.cuDeviceGet(ctypes.byref(device), 0))
    check("cuDevicePrimaryCtxRetain", cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device))
    check("cuCtxSetCurrent", cuda.cuCtxSetCurrent(context))
    check("cuModuleLoadData", cuda.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(PTX)))
    check("cuModuleGetFunction", cuda.cuModuleGetFunction(ctypes.byref(function), module, b"poke"))
    where = ctypes.c_uint64(0xDEAD_0000_0000)  # far above anything mapped
    args = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.byref(where), ctypes.c_void_p))
    check("cuLaunchKernel", cuda.cuLaunchKernel(function, 1, 1, 1, 1, 1, 1, 0, None, args, None))
    status = cuda.cuCtxSynchronize()
    print(f"cuCtxSynchronize: CUDA error {status}", flush=True)
    return 0 if status == 700 else 1


if __name__ == "__main__":
    sys.exit(main())
