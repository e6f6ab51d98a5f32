"""axon's C++ CPU kernels (``axon/csrc/*.cpp``): built on first use, cached, loaded as torch ops.

The sources are compiled with the machine's C++ compiler for this very CPU (``-march=native``)
into ``<cache_root>/kernels/<key>/axon_cpu.so``, where the key hashes the sources, the compiler,
the flags, torch's version and the CPU's feature flags: a second start loads the library in
milliseconds, and a cache copied to another kind of CPU is rebuilt rather than run. The build
writes to a temporary name and renames, so concurrent starts never load a half-written file.

Loading registers ``torch.ops.axon_cpu.*``. ``AXON_CPU_AMX=0`` keeps the linear kernel off the AMX
tiles of CPUs that have them (its AVX-512 path then runs, as on other CPUs). Where no compiler is found or the build fails, the
caller falls back to pure-torch code (``load_cpu_kernels`` returns False and logs why).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sysconfig
import tempfile
import threading

import torch

from axon.startup import startup_phase

logger = logging.getLogger(__name__)

SOURCE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")
LIBRARY_NAME = "axon_cpu.so"
_lock = threading.Lock()
_loaded_path: str | None = None  # the library this process loaded


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _compile_flags() -> list[str]:
    torch_dir = os.path.dirname(torch.__file__)
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        "-O3",
        "-march=native",
        # Fast math vectorizes exp (glibc's vector math); the kernels use no infinities or NaNs.
        # Compile-only: see _link_flags.
        "-ffast-math",
        "-fopenmp",
        "-std=c++20",
        "-fPIC",
        "-w",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-I{os.path.join(torch_dir, 'include')}",
        f"-I{os.path.join(torch_dir, 'include', 'torch', 'csrc', 'api', 'include')}",
    ]


def _link_flags() -> list[str]:
    """No -ffast-math here: linked with it, the compiler adds crtfastmath.o, whose constructor
    sets flush-to-zero and denormals-are-zero for the whole process when the library loads,
    changing the arithmetic of every other library (and of the user's code) in it."""
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    return ["-shared", "-fopenmp", f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}", "-lc10", "-ltorch_cpu"]


def _sources() -> list[str]:
    return sorted(os.path.join(SOURCE_DIR, f) for f in os.listdir(SOURCE_DIR) if f.endswith(".cpp"))


@functools.cache
def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _compiler_version(compiler: str) -> str:
    out = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False)
    return out.stdout.splitlines()[0] if out.stdout else compiler


def _headers() -> list[str]:
    return sorted(os.path.join(SOURCE_DIR, f) for f in os.listdir(SOURCE_DIR) if f.endswith(".h"))


def build_key(compiler: str) -> str:
    h = hashlib.sha256()
    for path in _sources() + _headers():
        with open(path, "rb") as f:
            h.update(os.path.basename(path).encode() + b"\0" + f.read())
    for part in (
        _compiler_version(compiler),
        " ".join(_compile_flags() + _link_flags()),
        torch.__version__,
        _cpu_flags(),
        sysconfig.get_platform(),
    ):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def library_path(cache_root: str) -> str | None:
    """Where the library for this machine lives (built now if missing); None without a compiler."""
    compiler = _compiler()
    if compiler is None:
        return None
    folder = os.path.join(cache_root, "kernels", build_key(compiler))
    path = os.path.join(folder, LIBRARY_NAME)
    if not os.path.isfile(path):
        _build(compiler, folder, path)
    return path


def _build(compiler: str, folder: str, path: str) -> None:
    """Compile each source to an object (in parallel), then link them without fast math."""
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=folder)
    os.close(fd)
    with tempfile.TemporaryDirectory(prefix=".objects-", dir=folder) as objects:
        sources = _sources()
        objs = [os.path.join(objects, os.path.basename(src) + ".o") for src in sources]
        compiles = [[compiler, "-c", src, "-o", obj, *_compile_flags()] for src, obj in zip(sources, objs)]
        link = [compiler, *objs, "-o", tmp, *_link_flags()]
        try:
            with startup_phase("building axon's CPU kernels (once per machine and version)"):
                procs = [(cmd, subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)) for cmd in compiles]
                for cmd, proc in procs:
                    _, stderr = proc.communicate()
                    _check(cmd, proc.returncode, stderr)
                proc = subprocess.run(link, capture_output=True, text=True, check=False)
                _check(link, proc.returncode, proc.stderr)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)


def _check(cmd: list[str], returncode: int, stderr: str) -> None:
    if returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{stderr[-4000:]}")


def load_cpu_kernels(cache_root: str) -> bool:
    """Build (if needed) and load the kernels; True when ``torch.ops.axon_cpu`` is usable."""
    global _loaded_path
    with _lock:
        if _loaded_path is not None:
            return True
        try:
            path = library_path(cache_root)
        except (OSError, RuntimeError) as e:
            logger.warning("axon's CPU kernels could not be built; using pure-torch kernels: %s", e)
            return False
        if path is None:
            logger.warning("no C++ compiler found (g++, c++, clang++ or $CXX); using pure-torch kernels")
            return False
        torch.ops.load_library(path)
        _register_fakes()
        if os.environ.get("AXON_CPU_AMX", "1") == "0":  # the AVX-512 path on an AMX CPU
            torch.ops.axon_cpu.set_linear_amx(False)
        _loaded_path = path
        return True


def cpu_kernels_loaded() -> bool:
    """Whether this process has loaded the kernels (``load_cpu_kernels`` succeeded)."""
    return _loaded_path is not None


def use_cpu_kernels(x: torch.Tensor) -> bool:
    """Whether a layer given ``x`` runs axon's CPU kernel (x on the CPU, the kernels loaded)."""
    return x.device.type == "cpu" and cpu_kernels_loaded()


def _register_fakes() -> None:
    """Shapes of the ops' outputs, for tracing them into compiled graphs."""

    @torch.library.register_fake("axon_cpu::packed_linear")
    def _(x, packed, N, bias, float_out):
        return x.new_empty(*x.shape[:-1], N, dtype=torch.float32 if float_out else x.dtype)

    @torch.library.register_fake("axon_cpu::quant_linear")
    def _(x, codes, kind, scales, mins, group, N, bias, float_out):
        return x.new_empty(*x.shape[:-1], N, dtype=torch.float32 if float_out else x.dtype)

    @torch.library.register_fake("axon_cpu::w8a8_linear")
    def _(x, codes, w_scales, col_sums, N, bias, float_out):
        return x.new_empty(*x.shape[:-1], N, dtype=torch.float32 if float_out else x.dtype)

    @torch.library.register_fake("axon_cpu::fused_moe")
    def _(
        x, router_logits, w13, w2, w13_bias, w2_bias, top_k, renormalize, intermediate, first_expert, *rest
    ):
        return torch.empty_like(x)

    @torch.library.register_fake("axon_cpu::fused_moe_quant")
    def _(x, router_logits, *rest):
        return torch.empty_like(x)

    @torch.library.register_fake("axon_cpu::attention")
    def _(q, k, v, layer, scale):
        return torch.empty_like(q)

    @torch.library.register_fake("axon_cpu::encoder_attention")
    def _(q, k, v, query_start_loc, scale):
        return torch.empty_like(q)

    @torch.library.register_fake("axon_cpu::shm_all_reduce")
    def _(x, handle):
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)

    @torch.library.register_fake("axon_cpu::shm_all_gather")
    def _(x, handle, world):
        return x.new_empty(world, *x.shape)

    @torch.library.register_fake("axon_cpu::rms_norm")
    def _(x, weight, eps):
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)

    @torch.library.register_fake("axon_cpu::add_rms_norm")
    def _(x, residual, weight, eps):
        return torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty(
            x.shape, dtype=x.dtype, device=x.device
        )

    @torch.library.register_fake("axon_cpu::silu_and_mul")
    def _(gate_up):
        return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)

    @torch.library.register_fake("axon_cpu::rotary_neox")
    def _(positions, q, k, cos, sin):
        return q.new_empty(q.shape), k.new_empty(k.shape)

    @torch.library.register_fake("axon_cpu::paged_attention")
    def _(
        q,
        k_cache,
        v_cache,
        block_table,
        query_start_loc,
        seq_lens,
        num_actual_tokens,
        scale,
        window=0,
        sinks=None,
    ):
        return torch.empty_like(q)
