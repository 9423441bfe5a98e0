"""Building, caching and trust-checking hfquant's two native libraries: `int4_cpu.so` (the C kernels of `csrc/`, called
through ctypes by `hfquant.ops.native`) and `torch_ops.so` (the same kernels with `csrc/torch_ops.cpp`, PyTorch
dispatcher operators loaded by `hfquant.ops.torch_ops`). This module compiles and returns file paths; loading them
is the callers' job.

The sources ship inside the package. On first use they are compiled with the system C compiler (`$CC`, else `cc`;
`-O3 -fopenmp`) into `<cache>/native/<hash>/int4_cpu.so`, where `<cache>` is `$HFQUANT_CACHE` or `~/.cache/hfquant`
and the hash covers the sources, the headers, the flags and the compiler's version line. `torch_ops.so` is built from
the same C sources (compiled to objects with the same flags) and `csrc/torch_ops.cpp` by the C++ compiler (`$CXX`,
else `c++`; C++20, against the headers and libraries of the installed torch), into a folder whose hash also covers the
C++ source and flags, both compilers' version lines and torch's version: the library is tied to the torch it was built
against, so a different torch build gets another hash, so another build. A library is written under a temporary name
and renamed, so concurrent first uses do not see half a file, and built under an advisory lock of its folder
(`.build.lock`, `fcntl.flock`), so that they wait for one build instead of each compiling (pytest-xdist's workers on an
empty cache each spent about a minute of CPU on the same build).

Loading a library runs its code, so a cached one is used only when it is ours and private: the folders from
`<cache>/native` down and the file are owned by this user and writable by nobody else, and the file's sha256 equals
the one recorded beside it (`<name>.sha256`) when it was built. A cache that fails this is never loaded from: the
library is built into a private temporary folder for this process instead (logged at WARNING level).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from hfquant.core import paths

try:
    import fcntl
except ImportError:  # not POSIX: no build lock (the rename still keeps a half-written library out of sight)
    fcntl = None

__all__ = [
    "SOURCES",
    "HEADERS",
    "CPP_SOURCE",
    "FLAGS",
    "native_enabled",
    "c_compiler",
    "cpp_compiler",
    "source_digest",
    "c_library_folder",
    "torch_ops_folder",
    "build_c_library",
    "build_torch_ops",
    "cached_library",
    "run_compiler",
]

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(
    _CSRC / name
    for name in (
        "int4_cpu.c",
        "int4_intdot_cpu.c",
        "int8_cpu.c",
        "rtn_cpu.c",
        "bf16_cpu.c",
        "blocks_cpu.c",
        "blocks_quant_cpu.c",
        "iq4_search_cpu.c",
        "fold_chunk_cpu.c",
        "sinq_cpu.c",
        "isa_cpu.c",
        "norm_cpu.c",
        "attention_cpu.c",
        "decode_rows_cpu.c",
    )
)
"""The C sources, compiled into one library (`int4_cpu.so`, and with `CPP_SOURCE` into `torch_ops.so`)."""
HEADERS = (
    _CSRC / "bf16_bits.h",
    _CSRC / "hfquant_kernels.h",
    _CSRC / "blocks_body.h",
    _CSRC / "blocks_r8_body.h",
    _CSRC / "blocks_r8k_body.h",
    _CSRC / "hq3r_body.h",
    _CSRC / "iq4_search_body.h",
    _CSRC / "swiglu_body.h",
)
"""Headers the C and C++ sources include: part of what a built library is cached under."""
CPP_SOURCE = _CSRC / "torch_ops.cpp"
FLAGS = ("-O3", "-shared", "-fPIC", "-fopenmp", "-std=gnu11")
_LIBRARIES = ("-lm",)
_CPP_FLAGS = ("-O2", "-shared", "-fPIC", "-std=c++20", "-fopenmp", "-w")

_OFF = ("0", "false", "no", "off")
_ON = ("", "1", "true", "yes", "on")


def native_enabled() -> bool:
    """Whether `HFQUANT_NATIVE` allows the native kernels (unset: yes).

    Raises:
        ValueError: a value that is neither one of 0/false/no/off nor one of 1/true/yes/on (any case), naming it.
    """
    value = os.environ.get("HFQUANT_NATIVE", "")
    if value.strip().lower() in _OFF:
        return False
    if value.strip().lower() in _ON:
        return True
    raise ValueError(
        f"HFQUANT_NATIVE={value!r} is not understood; use one of {list(_OFF)} to turn hfquant's native kernels off, "
        f"or one of {list(_ON[1:])} (or leave it unset) to use them"
    )


def c_compiler() -> str | None:
    """The C compiler's path: `$CC`, else `cc`, found on PATH; None without one."""
    return shutil.which(os.environ.get("CC") or "cc")


def cpp_compiler() -> str | None:
    """The C++ compiler's path: `$CXX`, else `c++`, found on PATH; None without one."""
    return shutil.which(os.environ.get("CXX") or "c++")


def source_digest() -> str:
    """12 hex digits of the sha256 of every kernel source (`csrc/`: the C sources, their headers and the C++
    operators of `torch_ops`): kernel timings recorded for other sources are stale."""
    sources = sorted(_CSRC.iterdir())
    return hashlib.sha256(b"".join(source.read_bytes() for source in sources)).hexdigest()[:12]


def _version_line(compiler: str) -> str:
    """The first line of `compiler --version` ("" when it prints nothing)."""
    output = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    return (output.splitlines() or [""])[0]


def c_library_folder(compiler: str) -> Path:
    """`<cache>/native/<hash of sources, headers, flags and compiler version>`: where `int4_cpu.so` is cached."""
    sources = b"".join(source.read_bytes() for source in SOURCES + HEADERS)
    flags = " ".join(FLAGS + _LIBRARIES).encode()
    digest = hashlib.sha256(sources + flags + _version_line(compiler).encode()).hexdigest()[:16]
    return paths.cache_dir() / "native" / digest


def torch_ops_folder(c_compiler: str, cpp_compiler: str) -> Path:
    """`<cache>/native/<hash>`: where `torch_ops.so` is cached; the hash covers the C and C++ sources and headers, the
    flags, both compilers' version lines and the torch version (the library links against torch)."""
    versions = [_version_line(compiler) for compiler in (c_compiler, cpp_compiler)]
    parts = [source.read_bytes() for source in (*SOURCES, *HEADERS, CPP_SOURCE)]
    parts += [" ".join(FLAGS + _CPP_FLAGS).encode(), "\n".join(versions).encode()]
    parts += [f"torch {torch.__version__} {torch.version.git_version}".encode()]
    digest = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    return paths.cache_dir() / "native" / digest


def _private(path: Path) -> bool:
    """Owned by this user and writable by no one else (not a symlink)."""
    info = path.lstat()
    return (
        not stat.S_ISLNK(info.st_mode)
        and info.st_uid == os.getuid()
        and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    )


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _trusted(library: Path) -> bool:
    """Whether the cached `library` may be loaded: it, its hash record and its folders from `native/` down are ours
    and private, and its sha256 is the recorded one."""
    record = library.with_name(library.name + ".sha256")
    try:
        private = all(_private(p) for p in (library.parent.parent, library.parent, library, record))
        return private and record.read_text().strip() == _sha256(library)
    except OSError:
        return False


def _compile(folder: Path, name: str, build: Callable[[Path, Path], None]) -> Path:
    """Build `folder/name` under a temporary name (`build(output, scratch folder)` runs the compiler), record its
    sha256, rename into place; returns the library."""
    library = folder / name
    handle, partial = tempfile.mkstemp(prefix=f".{library.stem}-", suffix=".so", dir=folder)
    os.close(handle)
    try:
        with tempfile.TemporaryDirectory(dir=folder) as scratch:
            build(Path(partial), Path(scratch))
        os.chmod(partial, 0o700)
        record = folder / f"{name}.sha256"
        record_partial = folder / f".{name}.sha256.{os.getpid()}"
        record_partial.write_text(_sha256(Path(partial)) + "\n")
        os.chmod(record_partial, 0o600)
        os.replace(record_partial, record)
        os.replace(partial, library)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return library


def run_compiler(command: list[str]) -> None:
    """Run one compiler command (5 minutes at most); raises subprocess.CalledProcessError with its output."""
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=300)


def cached_library(folder: Path, name: str, build: Callable[[Path, Path], None]) -> Path:
    """The library `name` to load: the cached one in `folder` when it is trusted (`_trusted`), else built again
    (`_compile`) into the cache, or, when the cache folders are not ours and private, into a private temporary folder
    of this process.

    Raises:
        OSError / subprocess.CalledProcessError / subprocess.TimeoutExpired: the build failed.
    """
    library = folder / name
    if library.exists() and _trusted(library):
        return library
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        usable = _private(folder.parent) and _private(folder)
    except OSError:
        usable = False
    if not usable:
        folder = Path(tempfile.mkdtemp(prefix="hfquant-native-"))  # 0700, removed with the process's temp files
        logger.warning(
            "hfquant: the native kernel cache %s is not private to this user (owner or permissions); building into "
            "%s instead",
            library.parent,
            folder,
        )
        return _compile(folder, name, build)
    with _build_lock(folder):
        if library.exists() and _trusted(library):
            return library  # built by another process while this one waited
        if library.exists():
            logger.warning(
                "hfquant: %s does not match its recorded sha256 or is not private; building it again", library
            )
        return _compile(folder, name, build)


@contextlib.contextmanager
def _build_lock(folder: Path):
    """An exclusive advisory lock (`fcntl.flock`) on `folder/.build.lock` for the block: one process (or thread)
    builds into a cache folder at a time, the others wait and then find its library. Released when the block ends or
    the process dies. No lock where `fcntl` is missing."""
    if fcntl is None:
        yield
        return
    handle = os.open(folder / ".build.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        os.close(handle)  # closing the descriptor releases the lock


def build_c_library(compiler: str) -> Path:
    """`int4_cpu.so`, the C sources in one library for ctypes, built by `compiler` or taken from the cache.

    Raises:
        OSError / subprocess.CalledProcessError / subprocess.TimeoutExpired: the build failed.
    """

    def build(output: Path, scratch: Path) -> None:
        run_compiler([compiler, *FLAGS, "-o", str(output), *map(str, SOURCES), *_LIBRARIES])

    return cached_library(c_library_folder(compiler), "int4_cpu.so", build)


def build_torch_ops(c_compiler: str, cpp_compiler: str) -> Path:
    """`torch_ops.so`: the C sources compiled to objects by `c_compiler` (`FLAGS` without `-shared`), linked with
    `CPP_SOURCE` by `cpp_compiler` against the installed torch; built or taken from the cache.

    Raises:
        OSError / subprocess.CalledProcessError / subprocess.TimeoutExpired: the build failed.
    """
    torch_folder = Path(torch.__file__).parent

    def build(output: Path, scratch: Path) -> None:
        objects = []
        for source in SOURCES:
            obj = scratch / (source.stem + ".o")
            flags = [flag for flag in FLAGS if flag != "-shared"]
            run_compiler([c_compiler, *flags, "-c", str(source), "-o", str(obj)])
            objects.append(str(obj))
        run_compiler(
            [
                cpp_compiler,
                *_CPP_FLAGS,
                f"-I{torch_folder / 'include'}",
                str(CPP_SOURCE),
                *objects,
                f"-L{torch_folder / 'lib'}",
                "-ltorch",
                "-ltorch_cpu",
                "-lc10",
                f"-Wl,-rpath,{torch_folder / 'lib'}",
                "-lm",
                "-o",
                str(output),
            ]
        )

    return cached_library(torch_ops_folder(c_compiler, cpp_compiler), "torch_ops.so", build)
