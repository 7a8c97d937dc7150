"""XLA:GPU's optimized program for a GPU that is not here: the deviceless compile.

The CUDA PJRT plugin carries XLA's whole GPU compiler. Given a GPU's description
(a `GpuTargetConfigProto`: compute capability, multiprocessors, memory and its
bandwidth) instead of a device, it compiles for it on a host without a GPU or a
driver: the fusions, the products' kernels and the schedule XLA:GPU would run,
short of autotuning (with no device to time on, each product takes the
compiler's default choice of kernel). `compiled_text` runs that compile in a
child process, so neither the plugin nor the flags it is given (`xla_flags`)
reach this process's own backend:

    text = compiled_text("jaxrl_lp.bench.decode:sampler_traced", spec, "h200", plugin)

`build` names a function `(spec: dict, sharding) -> traced` (a `jax.jit(...).trace`
of the program on `jax.ShapeDtypeStruct`s carrying `sharding`, a compile-only
device's); the child lowers and compiles it and prints the optimized HLO text.
`spec` crosses as JSON; a `policy` in it crosses as its name, parsed in the child.

The plugin is not a dependency of the project (it is the GPU install's, ~480 MB):
`plugin_dir` is a folder it was installed into with the running jax's version,

    pip install --no-deps --target DIR jax-cuda12-plugin==$V jax-cuda12-pjrt==$V

(`V=$(python -c 'import jax; print(jax.__version__)')`), named by `--cuda-plugin` or
`JAXRL_LP_CUDA_PLUGIN` (`plugin_from_env`). The targets (`GPU_TARGETS`) give the
compiler the datasheet's numbers; nothing here measures a GPU.

A Mosaic GPU kernel (`plgpu.kernel`: `kernels.fixed_tile`, `kernels.logprob_mgpu`) is
compiled in the same compile, to the end: its module to PTX by LLVM, the PTX to a cubin by
ptxas for `sm_90a`, and its host side JIT-compiled against Mosaic GPU's runtime library
(`libmosaic_gpu_runtime.so`, the plugin's), which the child loads first (without it the
compile stops at "Failed to lookup host symbol"). `mosaic_kernels` reads what ptxas reports
of each kernel (registers, spills, shared memory): what a GPU's own compile would say of
it, on this host. Whether the kernel then runs correctly and fast only a GPU shows.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

__all__ = ["GPU_TARGETS", "PLUGIN_ENV", "compiled_memory", "compiled_text", "mosaic_kernels",
           "plugin_from_env", "target_config"]

PLUGIN_ENV = "JAXRL_LP_CUDA_PLUGIN"

# What XLA:GPU's compiler reads of a GPU (SXM parts, compute capability 9.0): per block and
# per multiprocessor limits, the multiprocessor count, memory size and bandwidth, L2 size.
_HOPPER = dict(threads_per_block_limit=1024, threads_per_warp=32, shared_memory_per_block=49152,
               shared_memory_per_core=233472, threads_per_core_limit=2048, core_count=132,
               fpus_per_core=128, block_dim_limit_x=2147483647, block_dim_limit_y=65535,
               block_dim_limit_z=65535, l2_cache_size=52428800, clock_rate_ghz=1.98,
               shared_memory_per_block_optin=232448, registers_per_core_limit=65536,
               registers_per_block_limit=65536)
GPU_TARGETS = {
    "h100": dict(_HOPPER, memory_bandwidth=3352320000000, device_memory_size=84942979072,
                 name="NVIDIA H100 80GB HBM3"),
    "h200": dict(_HOPPER, memory_bandwidth=4800000000000, device_memory_size=151397597184,
                 name="NVIDIA H200 141GB HBM3e"),
}


def target_config(target: str) -> str:
    """The text-format `GpuTargetConfigProto` of `target` (a key of `GPU_TARGETS`)."""
    if target not in GPU_TARGETS:
        raise ValueError(f"GPU target must be one of {', '.join(GPU_TARGETS)}; got {target!r}")
    info = dict(GPU_TARGETS[target])
    name = info.pop("name")
    fields = "\n".join(f"  {k}: {v}" for k, v in info.items())
    return (f"gpu_device_info {{\n{fields}\n  cuda_compute_capability {{ major: 9 minor: 0 }}\n"
            f'  device_vendor: "NVIDIA Corporation"\n  name: "{name}"\n}}\n'
            f'platform_name: "CUDA"\ndnn_version_info {{ major: 9 minor: 10 }}\n'
            f'device_description_str: "{name}"\n')


def plugin_from_env(explicit: str | None = None) -> str | None:
    """The plugin folder: `explicit`, else `$JAXRL_LP_CUDA_PLUGIN`, else None. A folder
    without `jax_plugins/xla_cuda*` is refused (ValueError naming it)."""
    path = explicit or os.environ.get(PLUGIN_ENV) or None
    if path is None:
        return None
    if not any(Path(path, "jax_plugins").glob("xla_cuda*/xla_cuda_plugin.so")):
        raise ValueError(f"{path}: no jax_plugins/xla_cuda*/xla_cuda_plugin.so there "
                         f"(pip install --no-deps --target {path} jax-cuda12-plugin==V "
                         "jax-cuda12-pjrt==V, V the running jax's version)")
    return path


def _run_child(build: str, spec: dict, target: str, plugin_dir: str, xla_flags: str,
               timeout: float, env: dict | None = None) -> str:
    """The child's standard output (module docstring); RuntimeError with its last lines
    when it fails."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {xla_flags}".strip(), **(env or {}))
    payload = json.dumps({"build": build, "spec": spec, "target": target,
                          "plugin_dir": plugin_dir})
    proc = subprocess.run([sys.executable, "-m", "jaxrl_lp.plan.cuda_aot"], input=payload,
                          capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-6:])
        raise RuntimeError(f"the deviceless compile for {target} failed:\n{tail}")
    return proc.stdout


def compiled_text(build: str, spec: dict, target: str, plugin_dir: str,
                  xla_flags: str = "", timeout: float = 1200) -> str:
    """XLA:GPU's optimized HLO text of `build(spec, sharding)` for `target`, compiled in a
    child process with the plugin in `plugin_dir` and `xla_flags` appended to `XLA_FLAGS`.

    Raises RuntimeError with the child's last lines when it fails.
    """
    return _run_child(build, spec, target, plugin_dir, xla_flags, timeout)


# What ptxas prints of each kernel (`MOSAIC_GPU_DUMP_PTXAS`), in this order.
_PTXAS_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
_PTXAS_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                          r"(\d+) bytes spill loads")
_PTXAS_USED = re.compile(r"Used (\d+) registers(?:, used (\d+) barriers)?(?:, (\d+) bytes smem)?")


def mosaic_kernels(build: str, spec: dict, target: str, plugin_dir: str,
                   timeout: float = 1200) -> list[dict]:
    """What ptxas reports of each Mosaic GPU kernel in `build(spec, sharding)`'s program
    compiled for `target` (module docstring), in compile order: `{"kernel", "arch",
    "registers", "barriers", "static_smem_bytes", "stack_bytes", "spill_store_bytes",
    "spill_load_bytes"}`. A program with no Mosaic GPU kernel gives `[]`. The shared memory
    ptxas counts is the static part only: a Mosaic kernel's scratch and pipeline buffers are
    dynamic shared memory, sized at launch.
    """
    out = _run_child(build, spec, target, plugin_dir, "", timeout,
                     env={"MOSAIC_GPU_DUMP_PTXAS": "1"})
    kernels: list[dict] = []
    for line in out.splitlines():
        if m := _PTXAS_ENTRY.search(line):
            kernels.append({"kernel": m[1].removesuffix("_mosaic_gpu_kernel"), "arch": m[2]})
        elif kernels and (m := _PTXAS_FRAME.search(line)):
            kernels[-1].update(stack_bytes=int(m[1]), spill_store_bytes=int(m[2]),
                               spill_load_bytes=int(m[3]))
        elif kernels and "ptxas" in line and (m := _PTXAS_USED.search(line)):
            kernels[-1].update(registers=int(m[1]), barriers=int(m[2] or 0),
                               static_smem_bytes=int(m[3] or 0))
    return kernels


def compiled_memory(build: str, spec: dict, target: str, plugin_dir: str,
                    xla_flags: str = "", timeout: float = 1200) -> dict:
    """XLA:GPU's buffer plan of `build(spec, sharding)` for `target` (as `compiled_text`):
    `{"temp_bytes", "argument_bytes", "output_bytes", "alias_bytes", "text"}`, the bytes
    from the compiled executable's memory analysis (what the device would allocate beside
    the arguments, no device asked) and `text` its optimized HLO."""
    return json.loads(compiled_text(build, dict(spec, _memory=True), target, plugin_dir,
                                    xla_flags, timeout))


def _child(job: dict) -> None:
    sys.path.insert(0, job["plugin_dir"])  # its `jax_plugins` namespace: found by jax
    runtime = Path(job["plugin_dir"]) / "jax_cuda12_plugin" / "libmosaic_gpu_runtime.so"
    if runtime.is_file():  # the symbols a Mosaic GPU kernel's host code calls (docstring)
        ctypes.CDLL(str(runtime), mode=ctypes.RTLD_GLOBAL)
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    topo = topologies.get_topology_desc("aot", "cuda", topology="1x1x1",
                                        target_config=target_config(job["target"]))
    module, name = job["build"].split(":")
    memory = job["spec"].pop("_memory", False)
    traced = getattr(importlib.import_module(module), name)(
        job["spec"], SingleDeviceSharding(topo.devices[0]))
    compiled = traced.lower().compile()
    if not memory:
        sys.stdout.write(compiled.as_text())
        return
    stats = compiled.memory_analysis()
    json.dump({"temp_bytes": stats.temp_size_in_bytes,
               "argument_bytes": stats.argument_size_in_bytes,
               "output_bytes": stats.output_size_in_bytes,
               "alias_bytes": stats.alias_size_in_bytes, "text": compiled.as_text()}, sys.stdout)


if __name__ == "__main__":
    from jaxrl_lp.numerics.policy import Policy

    job = json.loads(sys.stdin.read())
    if isinstance(job["spec"].get("policy"), str):  # a spec's policy crosses by its name
        job["spec"]["policy"] = Policy.parse(job["spec"]["policy"])
    _child(job)
