"""Building, caching and trusting hfquant's native libraries (hfquant.ops.native_build): `HFQUANT_NATIVE`, what the
cache folder's hash covers, which files are compiled, one header for the exported functions, a library planted in
the cache is never loaded, and concurrent first uses build once."""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import run_python

from hfquant.ops import gemv, native, native_build

needs_native = pytest.mark.skipif(
    not gemv.native_int4_works(), reason="native int4 GEMV unavailable here (no compiler or no AVX512-BF16)"
)
CSRC = Path(native_build.__file__).with_name("csrc")


@pytest.mark.parametrize(
    "value,enabled",
    [("0", False), ("false", False), ("No", False), ("OFF", False), ("1", True), ("true", True), ("", True)],
)
def test_hfquant_native_spellings(monkeypatch, value, enabled):
    monkeypatch.setenv("HFQUANT_NATIVE", value)
    assert native_build.native_enabled() is enabled


def test_hfquant_native_other_values_are_refused(monkeypatch):
    monkeypatch.setenv("HFQUANT_NATIVE", "maybe")
    with pytest.raises(ValueError, match="HFQUANT_NATIVE='maybe' is not understood"):
        native_build.native_enabled()


PLANTED = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(SENTINEL, "w"); if (f) { fputs("planted code ran", f); fclose(f); }
}
int hfquant_int4_cpu_abi(void) { return 2; }
int hfquant_int4_cpu_supported(void) { return 1; }
"""


def _plant(tmp_path, cache, mode: int, record: bool, compiler: str):
    """A library with a constructor at the cache path `compiler`'s kernel would be loaded from; returns its sentinel
    file."""
    sentinel = tmp_path / "SENTINEL"
    source = tmp_path / "planted.c"
    source.write_text(PLANTED.replace("SENTINEL", f'"{sentinel}"'))
    env = {**os.environ, "HFQUANT_CACHE": str(cache)}
    folder = Path(
        subprocess.run(
            [
                sys.executable,
                "-c",
                f"from hfquant.ops import native_build; print(native_build.c_library_folder({compiler!r}))",
            ],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        ).stdout.strip()
    )
    folder.mkdir(parents=True)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(folder / "int4_cpu.so"), str(source)], check=True)
    if record:  # even a matching hash record does not make a folder others can write trusted
        (folder / "int4_cpu.so.sha256").write_text(hashlib.sha256((folder / "int4_cpu.so").read_bytes()).hexdigest())
    for path in (folder.parent, folder):
        path.chmod(mode)
    return sentinel


FAKE_COMPILER = """#!/bin/sh
# answers --version (the cache folder's name hashes it); any build command is recorded, then fails
if [ "$1" = "--version" ]; then echo "fake-compiler 1"; exit 0; fi
echo "$@" >> "MARKER"
exit 1
"""


@needs_native
def test_a_library_planted_in_the_cache_is_never_loaded(tmp_path):
    """A planted int4_cpu.so in a folder others may write (0777, with a matching hash record) is not loaded: the
    library is built again (into a private temporary folder) and works."""
    cache = tmp_path / "cache"
    sentinel = _plant(tmp_path, cache, 0o777, True, shutil.which("cc"))
    code = "from hfquant.ops import native; assert native.int4_cpu_library() is not None; print('native ok')"
    result = run_python(code, HFQUANT_CACHE=str(cache), CC="cc")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "native ok" in result.stdout
    assert not sentinel.exists(), "the planted library's constructor ran"


def test_a_library_without_its_hash_record_is_built_again_not_loaded(tmp_path):
    """A planted int4_cpu.so in a private folder (0700) but without a hash record is not loaded: its build starts in
    its place. The compiler is a stand-in that records the command and fails (the test above runs a real rebuild;
    compiling the library again here took 24 s), so no library is had and the kernels fall back to aten."""
    cache, marker = tmp_path / "cache", tmp_path / "MARKER"
    fake = tmp_path / "fake-cc"
    fake.write_text(FAKE_COMPILER.replace("MARKER", str(marker)))
    fake.chmod(0o755)
    sentinel = _plant(tmp_path, cache, 0o700, False, str(fake))
    code = "from hfquant.ops import native; print('library', native.built_library())"
    result = run_python(code, HFQUANT_CACHE=str(cache), CC=str(fake))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "library None" in result.stdout
    assert not sentinel.exists(), "the planted library's constructor ran"
    commands = marker.read_text().splitlines() if marker.is_file() else []
    # the build that replaces it started: the shared library, into the (private) cache folder
    assert len(commands) == 1 and "-shared" in commands[0] and f" -o {cache / 'native'}/" in commands[0], commands


def test_every_file_in_csrc_is_compiled_or_hashed():
    """A C file left out of SOURCES would not be linked; a header left out of HEADERS would not be in the cache key."""
    assert sorted(path.name for path in CSRC.glob("*.c")) == sorted(path.name for path in native_build.SOURCES)
    assert sorted(path.name for path in CSRC.glob("*.h")) == sorted(path.name for path in native_build.HEADERS)
    assert sorted(CSRC.glob("*.cpp")) == [native_build.CPP_SOURCE]
    assert sorted(path.name for path in CSRC.iterdir()) == sorted(
        path.name for path in (*native_build.SOURCES, *native_build.HEADERS, native_build.CPP_SOURCE)
    )


def _prototypes() -> dict[str, int]:
    """The functions `hfquant_kernels.h` declares, with their argument counts (void: 0)."""
    header = (CSRC / "hfquant_kernels.h").read_text()
    found = re.findall(r"^int (hfquant_\w+)\(([^)]*)\);", header, flags=re.MULTILINE)
    return {name: 0 if arguments == "void" else arguments.count(",") + 1 for name, arguments in found}


def test_one_header_declares_every_exported_function():
    """hfquant_kernels.h declares exactly the functions the C files export (each defined in one file), every C file
    and torch_ops.cpp include it and torch_ops.cpp declares none itself, and native.py's ctypes signatures have the
    header's argument counts."""
    prototypes = _prototypes()
    definitions = []
    for source in native_build.SOURCES:
        text = source.read_text()
        assert '#include "hfquant_kernels.h"' in text, source.name
        x86 = text.split("#else")[0]  # the stubs of other machines repeat the signatures
        definitions += re.findall(r"^(?:[A-Z0-9_]+ )?int (hfquant_\w+)\([^;]*?\) ?\{", x86, flags=re.MULTILINE)
    assert sorted(definitions) == sorted(prototypes), (definitions, prototypes)
    cpp = native_build.CPP_SOURCE.read_text()
    assert '#include "hfquant_kernels.h"' in cpp and 'extern "C"' not in cpp
    assert {name: len(argtypes) for name, argtypes in native._SIGNATURES.items()} == {
        name: count for name, count in prototypes.items() if count
    }


def test_the_library_cache_key_covers_the_included_headers(tmp_path, monkeypatch):
    """A changed header builds a new library: its bytes are part of the cache folder's hash (C and C++ builds) and
    of the source digest kernel timings are recorded under."""
    compiler = shutil.which("cc") or pytest.skip("no C compiler")
    cpp_compiler = shutil.which("c++")
    for index, header in enumerate(native_build.HEADERS):
        before = native_build.c_library_folder(compiler)
        before_cpp = cpp_compiler and native_build.torch_ops_folder(compiler, cpp_compiler)
        changed = tmp_path / header.name
        changed.write_bytes(header.read_bytes() + b"\n/* changed */\n")
        headers = list(native_build.HEADERS)
        headers[index] = changed
        with monkeypatch.context() as patch:
            patch.setattr(native_build, "HEADERS", tuple(headers))
            assert native_build.c_library_folder(compiler) != before
            if cpp_compiler:
                assert native_build.torch_ops_folder(compiler, cpp_compiler) != before_cpp
    digest = native_build.source_digest()
    copy = tmp_path / "csrc"
    shutil.copytree(CSRC, copy)
    (copy / "hfquant_kernels.h").write_bytes((CSRC / "hfquant_kernels.h").read_bytes() + b"\n")
    monkeypatch.setattr(native_build, "_CSRC", copy)
    assert native_build.source_digest() != digest


def test_concurrent_first_uses_build_the_library_once(tmp_path):
    """Four threads asking for one uncached library at once: one builds it, the others wait on the folder's build
    lock and load that build (pytest-xdist's workers on an empty cache each compiled it before the lock)."""
    folder = tmp_path / "native" / "digest"
    builds = []
    started = threading.Barrier(4)

    def build(output: Path, scratch: Path) -> None:
        builds.append(output)
        time.sleep(0.3)  # long enough that the other threads arrive while this build runs
        output.write_bytes(b"\x7fELF stand-in")

    def first_use() -> Path:
        started.wait()
        return native_build.cached_library(folder, "stand-in.so", build)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        libraries = list(pool.map(lambda _: first_use(), range(4)))
    assert len(builds) == 1, builds
    assert libraries == [folder / "stand-in.so"] * 4
    assert (folder / "stand-in.so").read_bytes() == b"\x7fELF stand-in"
