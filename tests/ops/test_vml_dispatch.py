"""`resolve_vml_dispatch`: after it, a process's first multi-threaded VML call gives the bytes of every later call.

Without it, on an Intel Xeon (family 6 model 167, PyTorch 2.13's oneMKL 2024.2) about half of fresh processes
computed their first 3072-value `cos` on two threads differently from the second (9 of 16 with torch alone; with
the call left out, this test failed 3 times in 4 with 6 processes; it runs 8). CPUs where MKL does not race pass
either way."""

from __future__ import annotations

import subprocess
import sys

import hfquant.ops.vml_dispatch

# The module is loaded by its path: `import hfquant` would cost each child about a second, and its imports run VML
# functions of their own
_CHILD = f"""
import importlib.util, torch
spec = importlib.util.spec_from_file_location("vml_dispatch", {hfquant.ops.vml_dispatch.__file__!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
torch.set_num_threads(2)
module.resolve_vml_dispatch()
x = torch.linspace(0, 60, 3072)
first_cos, first_sin = x.cos(), x.sin()
print(int(torch.equal(first_cos, x.cos()) and torch.equal(first_sin, x.sin())))
"""


def test_first_multithreaded_cos_and_sin_equal_later_calls():
    results = [
        subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=300) for _ in range(8)
    ]
    assert all(result.returncode == 0 for result in results), [result.stderr[-2000:] for result in results]
    assert [result.stdout.strip() for result in results] == ["1"] * 8
