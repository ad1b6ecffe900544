# Build script for mla_attn: one CUDA extension, `mla_attn._C`, holding the sm_90a decode kernels,
# the TORCH_LIBRARY op schemas (csrc/bindings/ops.cpp) and a small pybind11 module (build_info()).
#
# Environment knobs
#   CUDA_HOME                   CUDA toolkit root (default /usr/local/cuda; nvcc >= 12.4 required).
#                               The `nvcc` on PATH is never consulted.
#   CUTLASS_DIR                 CUTLASS checkout to take headers from (its include/ must hold cute/).
#                               Otherwise: third_party/cutlass (scripts/fetch_cutlass.sh clones the
#                               commit pinned in third_party/cutlass.pin there), then the
#                               nvidia-cutlass wheel (cutlass_library/source/include).
#   MAX_JOBS                    parallel compile jobs (honoured by torch's ninja build).
#   NVCC_THREADS                nvcc --threads N (default 2).
#   MLA_ATTN_PTXAS_VERBOSE=1    ptxas -v --warn-on-spills --warn-on-local-memory-usage.
#   MLA_ATTN_DISABLE_FP16=1     drop fp16 instantiation sources, define MLA_ATTN_DISABLE_FP16.
#   MLA_ATTN_DISABLE_BF16=1     same for bf16.
#   MLA_ATTN_RACECHECK=1        define MLA_ATTN_RACECHECK: code that only compute-sanitizer's racecheck
#                               needs (extra barriers; scripts/sanitize.sh refuses racecheck without it).
#                               Not for production builds.
import glob
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.dist import Distribution

ROOT = Path(__file__).resolve().parent
PKG_DIR = ROOT / "python" / "mla_attn"
MIN_NVCC = (12, 4)


def read_cutlass_pin() -> dict:
    """third_party/cutlass.pin: url=, tag= (vX.Y.Z) and commit= of the CUTLASS the kernels target."""
    pin = {}
    for line in (ROOT / "third_party" / "cutlass.pin").read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and not key.startswith("#"):
            pin[key.strip()] = value.strip()
    return pin


CUTLASS_PIN = read_cutlass_pin()
CUTLASS_PIN_VERSION = CUTLASS_PIN["tag"].lstrip("v")


def log(msg: str) -> None:
    print(f"[mla_attn setup] {msg}", flush=True)


def env_flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


# ---------------------------------------------------------------------------------------------
# CUDA toolkit. Resolved before torch.utils.cpp_extension is imported: torch fixes CUDA_HOME at
# import time and would otherwise guess it from the `nvcc` on PATH (a wrapper on some machines).
# ---------------------------------------------------------------------------------------------
def resolve_cuda_home() -> Path:
    cuda_home = Path(os.environ.get("CUDA_HOME") or "/usr/local/cuda")
    nvcc = cuda_home / "bin" / "nvcc"
    if not nvcc.is_file():
        sys.exit(
            f"error: no nvcc at {nvcc}. Set CUDA_HOME to a CUDA toolkit (>= "
            f"{MIN_NVCC[0]}.{MIN_NVCC[1]}) root, e.g. CUDA_HOME=/usr/local/cuda."
        )
    os.environ["CUDA_HOME"] = str(cuda_home)
    return cuda_home


def nvcc_version(cuda_home: Path) -> tuple:
    nvcc = cuda_home / "bin" / "nvcc"
    try:
        out = subprocess.check_output([str(nvcc), "--version"], text=True)
    except (OSError, subprocess.CalledProcessError) as e:
        sys.exit(f"error: `{nvcc} --version` failed: {e}")
    m = re.search(r"release (\d+)\.(\d+)", out)
    if not m:
        sys.exit(f"error: cannot parse the version from `{nvcc} --version`:\n{out}")
    ver = (int(m.group(1)), int(m.group(2)))
    if ver < MIN_NVCC:
        sys.exit(
            f"error: {nvcc} is CUDA {ver[0]}.{ver[1]}; mla_attn needs CUDA >= "
            f"{MIN_NVCC[0]}.{MIN_NVCC[1]} (sm_90a WGMMA/TMA and C++20). Point CUDA_HOME at a newer "
            "toolkit."
        )
    return ver


# ---------------------------------------------------------------------------------------------
# CUTLASS headers: $CUTLASS_DIR, then the pinned checkout in third_party/cutlass, then the
# nvidia-cutlass wheel (located with importlib, not imported).
# ---------------------------------------------------------------------------------------------
def _include_of(root: Path):
    for cand in (root / "include", root):
        if (cand / "cute").is_dir() and (cand / "cutlass" / "version.h").is_file():
            return cand
    return None


def find_cutlass():
    tried = []
    env_dir = os.environ.get("CUTLASS_DIR")
    if env_dir:
        inc = _include_of(Path(env_dir).expanduser().resolve())
        tried.append(f"  1. $CUTLASS_DIR={env_dir}: " + ("ok" if inc else "no include/cute there"))
        if inc:
            return inc, "CUTLASS_DIR"
        log(f"WARNING: $CUTLASS_DIR={env_dir} holds no include/cute; trying the next source")
    else:
        tried.append("  1. $CUTLASS_DIR: not set")

    pinned = ROOT / "third_party" / "cutlass"
    if (pinned / "include" / "cute").is_dir():
        check_pinned_commit(pinned)
        return pinned / "include", f"third_party/cutlass@{CUTLASS_PIN['tag']}"
    tried.append(f"  2. {pinned}: not fetched (scripts/fetch_cutlass.sh)")

    spec = importlib.util.find_spec("cutlass_library")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            inc = Path(loc) / "source" / "include"
            if (inc / "cute").is_dir():
                return inc, "nvidia-cutlass wheel"
        tried.append("  3. nvidia-cutlass wheel: cutlass_library found but has no source/include/cute")
    else:
        tried.append(f"  3. nvidia-cutlass wheel: not installed (pip install nvidia-cutlass=={CUTLASS_PIN_VERSION}.0)")
    sys.exit("error: CUTLASS headers not found. Looked in, in order:\n" + "\n".join(tried))


def check_pinned_commit(checkout: Path) -> None:
    """Warns when third_party/cutlass is a git checkout of another commit than the pin."""
    try:
        head = subprocess.check_output(["git", "-C", str(checkout), "rev-parse", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        log(f"WARNING: {checkout} is not a git checkout; cannot check it against the pinned commit")
        return
    if head != CUTLASS_PIN["commit"]:
        log(f"WARNING: {checkout} is at {head}, the pin is {CUTLASS_PIN['tag']} ({CUTLASS_PIN['commit']})")


def cutlass_version(inc: Path) -> str:
    text = (inc / "cutlass" / "version.h").read_text()
    parts = [re.search(rf"#define\s+CUTLASS_{k}\s+(\d+)", text) for k in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(p.group(1) if p else "?" for p in parts)


def find_torch_cuda_include():
    """<site-packages>/nvidia/cu13/include of the CUDA 13 torch wheels (cusparse.h, cublas_v2.h, ...),
    needed by torch's CUDA headers when the system toolkit lacks the math libraries."""
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        inc = Path(loc) / "cu13" / "include"
        if (inc / "cusparse.h").is_file():
            return inc
    return None


# ---------------------------------------------------------------------------------------------
# The C++ runtime. The extension must use the libstdc++ that torch runs on, never a private static
# copy: a second copy's iostreams and locale facets mix with the process's (they share data symbols
# but not code), so the first TORCH_CHECK message that formats a number crashed with SIGSEGV instead
# of raising. Toolchains installed without a shared libstdc++ (or with -static-libstdc++ in their
# specs) link that copy into every shared object: a build that carries one is linked again against
# the libstdc++.so.6 this process (torch) loaded, and refused if that does not remove it.
# ---------------------------------------------------------------------------------------------
def defines_cxx_runtime(shared_object: str):
    """Whether `shared_object` carries its own C++ runtime (defines __cxa_throw); None if unknown."""
    try:
        out = subprocess.check_output(["nm", "-D", "--defined-only", shared_object], text=True,
                                      stderr=subprocess.DEVNULL)
    except (OSError, subprocess.CalledProcessError):
        log(f"WARNING: nm could not read {shared_object}; its C++ runtime is not checked")
        return None
    return any(line.split()[-1] == "__cxa_throw" for line in out.splitlines() if line.strip())


def loaded_libstdcxx():
    """The libstdc++.so.6 this process (which imported torch) runs on, or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libstdc++.so" in line}
    except OSError:
        return None
    return sorted(paths)[0] if paths else None


def with_shared_cxx_runtime(base: type) -> type:
    """torch's BuildExtension (a parameter: torch is imported only once CUDA_HOME is set), relinking a
    build that carries its own libstdc++ against torch's."""
    class BuildExtensionSharedCxxRuntime(base):
        def build_extensions(self):
            super().build_extensions()
            for ext in self.extensions:
                path = self.get_ext_fullpath(ext.name)
                if not defines_cxx_runtime(path):
                    continue
                shared = loaded_libstdcxx()
                if shared is None:
                    sys.exit(f"error: {path} carries its own copy of libstdc++ (the compiler links it "
                             "statically) and torch's shared libstdc++ was not found to link instead")
                log(f"{path} carries its own copy of libstdc++: linking it again against {shared} (torch's)")
                ext.extra_link_args = list(ext.extra_link_args or []) + [shared]
                self.force = True  # the objects are up to date: only the link runs again
                self.build_extension(ext)
                if defines_cxx_runtime(path):
                    sys.exit(f"error: {path} still carries its own copy of libstdc++; its error paths would "
                             "crash instead of raising. Build with a compiler that has a shared libstdc++ (CXX=...).")

    return BuildExtensionSharedCxxRuntime


# ---------------------------------------------------------------------------------------------
# Generated build config (gitignored), read by mla_attn at runtime and by the tests.
# ---------------------------------------------------------------------------------------------
def write_build_config(fields: dict) -> None:
    text = "# Generated by setup.py -- do not edit (gitignored).\n"
    text += "".join(f"{name} = {value!r}\n" for name, value in fields.items())
    PKG_DIR.mkdir(parents=True, exist_ok=True)
    path = PKG_DIR / "_build_config.py"
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


# ---------------------------------------------------------------------------------------------
# The extension: toolchain, sources, flags.
# ---------------------------------------------------------------------------------------------
def kernel_sources(dtypes: list) -> list:
    """The .cpp bindings and every .cu below the kernel folders, relative to ROOT, without the
    instantiation files of a left-out dtype (they are named after it: instantiations/fp16_fp8kv.cu)."""
    kernel_dirs = ["common", "mla_decode", "mla_prefill", "merge", "kv_cache", "sparse"]
    left_out = [d for d in ("bf16", "fp16") if d not in dtypes]
    cuda_sources = sorted(s for d in kernel_dirs
                          for s in glob.glob(str(ROOT / "csrc" / d / "**" / "*.cu"), recursive=True))
    cuda_sources = [s for s in cuda_sources if not any(d in Path(s).stem for d in left_out)]
    sources = sorted(glob.glob(str(ROOT / "csrc" / "bindings" / "*.cpp"))) + cuda_sources
    return [os.path.relpath(s, ROOT) for s in sources]


def extension_setup() -> dict:
    """setup()'s arguments for the extension, after looking up CUDA, CUTLASS and torch (and writing
    _build_config.py)."""
    cuda_home = resolve_cuda_home()
    nvcc_ver = nvcc_version(cuda_home)
    cutlass_inc, cutlass_source = find_cutlass()
    cutlass_ver = cutlass_version(cutlass_inc)
    torch_cuda_inc = find_torch_cuda_include()
    log(f"CUDA_HOME={cuda_home} (nvcc {nvcc_ver[0]}.{nvcc_ver[1]})")
    log(f"CUTLASS {cutlass_ver} headers from {cutlass_source}: {cutlass_inc}")
    if cutlass_ver != CUTLASS_PIN_VERSION:
        log(f"WARNING: CUTLASS {cutlass_ver} found, the kernels are developed against {CUTLASS_PIN_VERSION}")
    log(f"torch wheel CUDA headers: {torch_cuda_inc or 'none'}")

    # Imported only now: torch reads CUDA_HOME at import time.
    import torch
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    dtypes = [d for d in ("bf16", "fp16") if not env_flag(f"MLA_ATTN_DISABLE_{d.upper()}")]
    if not dtypes:
        sys.exit("error: MLA_ATTN_DISABLE_BF16 and MLA_ATTN_DISABLE_FP16 together leave nothing to build")
    sources = kernel_sources(dtypes)
    log(f"sources ({len(sources)}): {' '.join(sources)}")

    feature_macros = [f"-DMLA_ATTN_DISABLE_{d.upper()}" for d in ("bf16", "fp16") if d not in dtypes]
    racecheck = env_flag("MLA_ATTN_RACECHECK")
    if racecheck:
        feature_macros.append("-DMLA_ATTN_RACECHECK")
        log("MLA_ATTN_RACECHECK=1: building the racecheck-only barriers (for compute-sanitizer, not production)")
    nvcc_ver_text = f"{nvcc_ver[0]}.{nvcc_ver[1]}"
    info_macros = [
        f"-DMLA_ATTN_CUTLASS_SOURCE=\"{cutlass_source}\"",
        f"-DMLA_ATTN_NVCC_VERSION=\"{nvcc_ver_text}\"",
        f"-DMLA_ATTN_TORCH_VERSION=\"{torch.__version__}\"",
        '-DMLA_ATTN_ARCH="sm_90a"',
    ]

    nvcc_flags = [
        "-gencode=arch=compute_90a,code=sm_90a",
        "-std=c++20",
        "-O3",
        "-DNDEBUG",
        "--use_fast_math",
        "-lineinfo",
        "--expt-relaxed-constexpr",
        "--expt-extended-lambda",
        "-DCUTLASS_ENABLE_GDC_FOR_SM90",  # CUTLASS's PDL helpers compile to nothing without it
        # torch adds these to every CUDAExtension; CuTe/CUTLASS need the half/bf16 operators.
        "-U__CUDA_NO_HALF_OPERATORS__",
        "-U__CUDA_NO_HALF_CONVERSIONS__",
        "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
        "-U__CUDA_NO_HALF2_OPERATORS__",
        "--threads",
        os.environ.get("NVCC_THREADS", "2"),
    ] + feature_macros
    if env_flag("MLA_ATTN_PTXAS_VERBOSE"):
        nvcc_flags.append("-Xptxas=-v,--warn-on-spills,--warn-on-local-memory-usage")

    cxx_flags = ["-O3", "-std=c++20", "-DNDEBUG"] + feature_macros + info_macros

    include_dirs = [str(ROOT / "csrc"), str(cutlass_inc)]
    if torch_cuda_inc is not None:
        # -isystem: searched after CUDA_HOME/include, so it only fills in the headers the toolkit lacks.
        nvcc_flags += ["-isystem", str(torch_cuda_inc)]
        cxx_flags += ["-isystem", str(torch_cuda_inc)]

    write_build_config(dict(
        ARCH="sm_90a",
        CUTLASS_VERSION=cutlass_ver,
        CUTLASS_SOURCE=cutlass_source,
        CUTLASS_INCLUDE=str(cutlass_inc),
        NVCC_VERSION=nvcc_ver_text,
        CUDA_HOME=str(cuda_home),
        TORCH_VERSION=torch.__version__,
        DTYPES=tuple(dtypes),
        PTXAS_VERBOSE=env_flag("MLA_ATTN_PTXAS_VERBOSE"),
        RACECHECK=racecheck,
    ))
    return dict(
        ext_modules=[
            CUDAExtension(
                name="mla_attn._C",
                sources=sources,
                include_dirs=include_dirs,
                extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
                py_limited_api=False,
            )
        ],
        cmdclass={"build_ext": with_shared_cxx_runtime(BuildExtension).with_options(use_ninja=True)},
    )


class ExtensionOnDemand(Distribution):
    """Commands that only package the sources need no toolchain: `sdist` (MANIFEST.in lists its files)
    and `egg_info` (what a build frontend runs first, to ask for build requirements). A call with any
    other command gets the extension before its commands run, decided from the parsed commands
    (`setup.py sdist bdist_wheel` builds it)."""

    def run_commands(self):
        if not set(self.commands) <= {"sdist", "egg_info"}:
            extension = extension_setup()
            self.ext_modules = extension["ext_modules"]
            self.cmdclass.update(extension["cmdclass"])
        super().run_commands()


setup(
    distclass=ExtensionOnDemand,
    package_dir={"": "python"},
    packages=["mla_attn"],
    zip_safe=False,
)
