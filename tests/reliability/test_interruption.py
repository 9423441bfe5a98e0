"""Interruptions and faults while `hfquant convert` writes: killed (SIGKILL, SIGINT) at seeded random points, the
disk filling up, two converts racing for one DST. Each must leave DST as it was (absent, or the previous complete
version, byte for byte) or complete, leave no temporary folder after SIGINT or an error, and a rerun must succeed.

The kill points are exact: a driver process imports hfquant once and runs one clean convert (so that every import
and first-use setup is done before it forks), then forks one child per trial; the child runs
`hfquant.commands.cli.main(["convert", ...])` with every file-writing operation wrapped (safetensors `save_file`, `open` for
writing, `shutil.copyfile`, `shutil.rmtree`, `os.replace`, `os.rename`, `tempfile.mkdtemp`, and `hfquant.checkpoint.publish`'
creation of the temporary folder and its two publishing renames), and sends itself the signal just before or just
after the n-th of them. A clean run logs the sequence; the points are drawn from it with a
fixed seed. `test_real_signals_from_outside` also interrupts the real command from another process.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hfquant.verification import verify

SEED = 20251121
POINTS_PER_SIGNAL = 3  # random points per signal and scenario in the writing phase
ARGS_NEW = ["--bits", "4", "--group-size", "32", "--max-shard-size", "40KB", "--no-progress"]
ARGS_OLD = ["--bits", "8", "--max-shard-size", "60KB", "--no-progress"]
DRIVER_TIMEOUT = 240

DRIVER = r'''
import builtins, contextlib, errno, hashlib, io, json, os, shutil, signal, sys, tempfile, time, traceback
from pathlib import Path

import hfquant.commands.cli
import hfquant.conversion.convert  # noqa: F401  (everything convert needs is imported before forking)
import hfquant.checkpoint.publish
import safetensors.torch
import transformers  # noqa: F401
from safetensors import SafetensorError

SIGNALS = {"KILL": signal.SIGKILL, "INT": signal.SIGINT}
SRC = DST = None


def snapshot(folder):
    if not folder.exists():
        return None
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def siblings():
    return sorted(p.name for p in DST.parent.iterdir())


def act(action, name, args):
    kind = action["kind"]
    if kind == "signal":
        os.kill(os.getpid(), SIGNALS[action["signal"]])
    elif kind == "enospc":  # what a full disk does: a partial file, then the error of the writer
        target = args[1] if name in ("save_file", "copyfile") else args[0]
        if name == "save_file":
            Path(target).write_bytes(b"\0" * 1000)
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(target))
    elif kind == "barrier":
        Path(action["ready"]).touch()
        deadline = time.monotonic() + 60
        while not Path(action["go"]).exists():
            if time.monotonic() > deadline:
                os._exit(99)
            time.sleep(0.005)


def install(action, log):
    count = [0]
    fired = [False]

    def wrap(owner, attr, name, applies=lambda *a, **k: True):
        original = getattr(owner, attr)

        def wrapper(*args, **kwargs):
            if not applies(*args, **kwargs):
                return original(*args, **kwargs)
            count[0] += 1
            number = count[0]
            log.append(name)
            hit = action is not None and not fired[0] and number == action["op"]
            if hit and action["when"] == "before":
                fired[0] = True
                act(action, name, args)
            result = original(*args, **kwargs)
            if hit and action["when"] == "after":
                fired[0] = True
                act(action, name, args)
            return result

        setattr(owner, attr, wrapper)

    def writing(file, mode="r", *args, **kwargs):
        return isinstance(mode, str) and any(c in mode for c in "wax+")

    wrap(safetensors.torch, "save_file", "save_file")
    wrap(shutil, "copyfile", "copyfile")
    wrap(shutil, "rmtree", "rmtree")
    wrap(os, "replace", "replace")
    wrap(os, "rename", "rename")
    wrap(tempfile, "mkdtemp", "mkdtemp")
    wrap(hfquant.checkpoint.publish, "_create_unique", "tmpdir")  # mkdir of .DST.tmp-*
    wrap(hfquant.checkpoint.publish, "rename_noreplace", "publish")  # .DST.tmp-* -> an absent DST
    wrap(hfquant.checkpoint.publish, "exchange", "exchange")  # .DST.tmp-* <-> an existing DST
    wrap(builtins, "open", "open", writing)
    io.open = builtins.open


def start(args, action, tag):
    """Fork a child running `hfquant convert SRC DST *args` with `action` at its op; returns (pid, log, stderr)."""
    log_path = DST.parent.parent / f"log-{tag}.json"
    err_path = DST.parent.parent / f"err-{tag}.txt"
    pid = os.fork()
    if pid == 0:
        code = 1
        log = []
        try:
            out = os.open(os.devnull, os.O_WRONLY)
            err = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(out, 1)
            os.dup2(err, 2)
            install(action, log)
            try:
                code = hfquant.commands.cli.main(["convert", SRC, str(DST), *args])
            except SystemExit as exit:
                code = exit.code if isinstance(exit.code, int) else 1
            except KeyboardInterrupt:
                traceback.print_exc()
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGINT)
            except BaseException:
                traceback.print_exc()  # what an uncaught exception does to a real process: traceback, exit 1
                code = 1
        finally:
            log_path.write_text(json.dumps(log))
            sys.stderr.flush()
            os._exit(code)
    return pid, log_path, err_path


def finish(pid, log_path, err_path):
    _, status = os.waitpid(pid, 0)
    rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    log = json.loads(log_path.read_text()) if log_path.exists() else None
    stderr = err_path.read_text(errors="replace")[-3000:] if err_path.exists() else ""
    return {"rc": rc, "log": log, "stderr": stderr}


def run(args, action=None, tag="run"):
    return finish(*start(args, action, tag))


def restore(state):
    if DST.exists():
        shutil.rmtree(DST)
    if state == "previous":
        shutil.copytree(DST.parent.parent / "previous", DST)


def serve(steps):
    results = {}
    for step in steps:
        kind = step["kind"]
        if kind == "prepare":  # a clean run whose output is kept as a reference (and as "previous" if asked)
            restore(step.get("state", "absent"))
            result = run(step["args"], tag=step["name"])
            result["snapshot"] = snapshot(DST)
            if step.get("keep_as_previous"):
                shutil.copytree(DST, DST.parent.parent / "previous")
            results[step["name"]] = result
        elif kind == "trial":  # restore the state, interrupt a run, look, then rerun
            restore(step["state"])
            before, listing = snapshot(DST), siblings()
            result = run(step["args"], step["action"], tag=step["name"])
            result.update(before=before, after=snapshot(DST), siblings_before=listing, siblings_after=siblings())
            if step.get("rerun_args"):
                rerun = run(step["rerun_args"], tag=step["name"] + "-rerun")
                result.update(rerun_rc=rerun["rc"], rerun_stderr=rerun["stderr"], rerun_snapshot=snapshot(DST))
            for name in siblings():  # leftovers were recorded: clear them for the next trial
                if name != DST.name:
                    shutil.rmtree(DST.parent / name, ignore_errors=True)
            results[step["name"]] = result
        elif kind == "race":  # two runs held at a barrier, released together or one after the other
            restore(step["state"])
            listing = siblings()
            flags = DST.parent.parent
            for name in ("ready-a", "ready-b", "go-a", "go-b"):
                (flags / name).unlink(missing_ok=True)
            children = {}
            for who in ("a", "b"):
                action = {"kind": "barrier", "op": step["op"], "when": "before", "ready": str(flags / f"ready-{who}"),
                          "go": str(flags / f"go-{who}")}
                children[who] = start(step["args"], action, f"{step['name']}-{who}")
            deadline = time.monotonic() + 120
            while not all((flags / f"ready-{who}").exists() for who in "ab") and time.monotonic() < deadline:
                time.sleep(0.005)
            outcome = {}
            (flags / "go-a").touch()
            if step["order"] == "together":
                (flags / "go-b").touch()
            outcome["a"] = finish(*children["a"])
            (flags / "go-b").touch()
            outcome["b"] = finish(*children["b"])
            outcome.update(after=snapshot(DST), siblings_before=listing, siblings_after=siblings())
            results[step["name"]] = outcome
    return results


def warm_up(args):
    """One clean convert here, unwrapped, before the first fork: what a first convert imports and sets up (the model
    classes transformers imports lazily, the card's template, scipy; 2 CPU s of a forked child's 2.1) is then
    inherited by every child, whose convert is left with its own work (0.2 CPU s of the tiny model)."""
    scratch = DST.parent.parent / "warm-up"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = hfquant.commands.cli.main(["convert", SRC, str(scratch), *args])
    shutil.rmtree(scratch, ignore_errors=True)
    assert code == 0, code


# One request per line on stdin: {"src", "dst", "steps"}; one line of results per request on stdout.
warm = False
for line in sys.stdin:
    request = json.loads(line)
    SRC, DST = request["src"], Path(request["dst"])
    DST.parent.mkdir(parents=True, exist_ok=True)
    if not warm:
        warm_up(request["steps"][0]["args"])
        warm = True
    print(json.dumps(serve(request["steps"])), flush=True)
'''


@pytest.fixture(scope="module")
def source(float_checkpoint) -> Path:
    return float_checkpoint("llama")


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """Where every driver request writes: out/dst, the backup of the previous version, logs of the children."""
    return tmp_path_factory.mktemp("work")


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    """The driver process (hfquant imported once), serving requests until the module's tests are done."""
    path = tmp_path_factory.mktemp("driver") / "driver.py"
    path.write_text(DRIVER)
    process = subprocess.Popen(
        [sys.executable, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"},
    )
    yield process
    process.stdin.close()
    try:
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
        process.stderr.close()
        process.stdout.close()


def _drive(driver, tmp: Path, source: Path, steps: list[dict]) -> dict:
    """Run `steps` in the driver with DST = tmp/out/dst; returns the results by step name."""
    request = {"src": str(source), "dst": str(tmp / "out" / "dst"), "steps": steps}
    driver.stdin.write(json.dumps(request) + "\n")
    driver.stdin.flush()
    line = driver.stdout.readline()  # bounded: every child waits for its barrier at most 60 s, the driver's runs end
    assert line, f"driver died: {driver.stderr.read()[-3000:]}"
    return json.loads(line)


PUBLISHING = ("publish", "exchange")


def _phases(log: list[str]) -> tuple[list[int], list[int]]:
    """(writing ops, publishing ops), 1-based, of a clean run's log: writing starts after the temporary folder is made
    ("tmpdir"); publishing is the rename into an absent DST or the swap with an existing one, and what follows it (the
    removal of the replaced version)."""
    first = log.index("tmpdir")
    start = next(i for i, name in enumerate(log) if name in PUBLISHING)
    return list(range(first + 2, start + 1)), list(range(start + 1, len(log) + 1))


def _trial(name, state, action) -> dict:
    """One interrupted run; after a SIGKILL (leftovers possible) a rerun with --overwrite follows."""
    rerun = ARGS_NEW + ["--overwrite"] if action.get("signal") == "KILL" else None
    return {
        "kind": "trial",
        "name": name,
        "state": state,
        "args": ARGS_NEW + ["--overwrite"] * (state == "previous"),
        "action": action,
        "rerun_args": rerun,
    }


@pytest.fixture(scope="module")
def logs(driver, work, source) -> dict:
    """The op sequences of a clean run into an absent DST and over an existing one, and the reference snapshots."""
    tmp = work
    steps = [
        {"kind": "prepare", "name": "previous", "args": ARGS_OLD, "keep_as_previous": True},
        {"kind": "prepare", "name": "new", "args": ARGS_NEW},
        {"kind": "prepare", "name": "over", "state": "previous", "args": ARGS_NEW + ["--overwrite"]},
    ]
    results = _drive(driver, tmp, source, steps)
    for _name, result in results.items():
        assert result["rc"] == 0, result["stderr"]
    assert verify(tmp / "out" / "dst").problems == []
    assert results["over"]["snapshot"] == results["new"]["snapshot"]
    assert results["previous"]["snapshot"] != results["new"]["snapshot"]
    return results


def _plan(logs: dict) -> list[dict]:
    """Seeded random points in the writing phase of both scenarios, and every point of publishing."""
    rng = random.Random(SEED)
    steps = []
    for state, log in (("absent", logs["new"]["log"]), ("previous", logs["over"]["log"])):
        writing, publishing = _phases(log)
        points = [(op, when) for op in writing for when in ("before", "after")] + [(writing[0] - 1, "before")]
        for sig in ("KILL", "INT"):
            for op, when in rng.sample(points, POINTS_PER_SIGNAL):
                steps.append(
                    _trial(
                        f"{state}-{sig}-{when}-{op}", state, {"kind": "signal", "signal": sig, "op": op, "when": when}
                    )
                )
        for op in publishing:
            for when in ("before", "after"):
                for sig in ("KILL", "INT"):
                    steps.append(
                        _trial(
                            f"{state}-{sig}-{when}-{op}",
                            state,
                            {"kind": "signal", "signal": sig, "op": op, "when": when},
                        )
                    )
    return steps


@pytest.fixture(scope="module")
def trials(driver, work, source, logs) -> dict:
    return _drive(driver, work, source, _plan(logs))


def _hidden_leftovers(result: dict) -> list[str]:
    return sorted(set(result["siblings_after"]) - set(result["siblings_before"]) - {"dst"})


def _check_trial(name: str, result: dict, logs: dict) -> None:
    new, previous = logs["new"]["snapshot"], logs["previous"]["snapshot"]
    signal_name = name.split("-")[1]
    assert result["rc"] != 0 or result["after"] == new, f"{name}: rc 0 without a complete DST"
    expected = (result["before"], new)
    assert result["before"] in (None, previous)
    assert result["after"] in expected, f"{name}: DST is neither as it was nor the complete new version"
    leftovers = _hidden_leftovers(result)
    if signal_name == "INT":
        assert result["rc"] in (0, 130), f"{name}: rc {result['rc']}: {result['stderr']}"
        assert leftovers == [], f"{name}: left {leftovers} after SIGINT: {result['stderr']}"
        if result["rc"] == 130:
            assert "interrupted" in result["stderr"]
    else:
        assert result["rc"] in (0, -signal.SIGKILL)
        assert all(n.startswith(".dst.") for n in leftovers), leftovers  # hidden, named after DST
    if "rerun_rc" in result:
        assert result["rerun_rc"] == 0, f"{name}: rerun failed: {result['rerun_stderr']}"
        assert result["rerun_snapshot"] == new


def test_killed_at_random_points_dst_is_as_it_was_and_a_rerun_succeeds(trials, logs):
    names = list(trials)
    assert len(names) >= 4 * POINTS_PER_SIGNAL
    for name in names:
        _check_trial(name, trials[name], logs)
    # every trial was really interrupted before the end, or (publish points) right at it
    assert sum(trials[n]["rc"] != 0 for n in names) >= 4 * POINTS_PER_SIGNAL
    assert any(trials[n]["after"] is None for n in names if n.startswith("absent"))
    _, publishing = _phases(logs["over"]["log"])
    for name in names:
        if name.startswith("previous"):  # until the swap DST keeps the previous version; from then on, the new one
            state, sig, when, op = name.split("-")
            # Ctrl-C during publish_folder (as the swap is called) is held back until the swap is done
            at_swap = int(op) == publishing[0] and (when == "after" or sig == "INT")
            swapped = int(op) > publishing[0] or at_swap
            assert trials[name]["after"] == logs["new" if swapped else "previous"]["snapshot"], name


# -- the moments that were once windows (convert made the folder outside its try; overwrote by two renames) ----------


@pytest.fixture(scope="module")
def windows(driver, work, source, logs) -> dict:
    new, over = logs["new"]["log"], logs["over"]["log"]
    tmpdir = new.index("tmpdir") + 1
    swap = over.index("exchange") + 1
    steps = [
        _trial("absent-INT-after-tmp", "absent", {"kind": "signal", "signal": "INT", "op": tmpdir, "when": "after"}),
        _trial("absent-INT-before-tmp", "absent", {"kind": "signal", "signal": "INT", "op": tmpdir, "when": "before"}),
        _trial(
            "previous-KILL-after-swap", "previous", {"kind": "signal", "signal": "KILL", "op": swap, "when": "after"}
        ),
        _trial(
            "previous-INT-after-swap", "previous", {"kind": "signal", "signal": "INT", "op": swap, "when": "after"}
        ),
        _trial(
            "previous-INT-before-swap", "previous", {"kind": "signal", "signal": "INT", "op": swap, "when": "before"}
        ),
    ]
    return _drive(driver, work, source, steps)


@pytest.mark.parametrize("name", ["absent-INT-after-tmp", "absent-INT-before-tmp"])
def test_sigint_as_the_temporary_folder_is_created_leaves_nothing(windows, logs, name):
    result = windows[name]
    _check_trial(name, result, logs)
    assert result["rc"] == 130 and result["after"] is None


@pytest.mark.parametrize("name", ["previous-KILL-after-swap", "previous-INT-after-swap", "previous-INT-before-swap"])
def test_interrupted_at_the_swap_over_an_existing_dst(windows, logs, name):
    """Ctrl-C at the swap is delivered after it (DST is the new version, the old one is deleted, exit 130); SIGKILL
    right after it leaves the new DST and the old version in a hidden .dst.tmp-* folder."""
    result = windows[name]
    _check_trial(name, result, logs)
    assert result["after"] == logs["new"]["snapshot"]
    assert result["rc"] == (-signal.SIGKILL if "KILL" in name else 130)


# -- a full disk ----------------------------------------------------------------------------------------------------


def _enospc_steps(logs: dict) -> list[dict]:
    log = logs["over"]["log"]
    writing, _ = _phases(log)
    shard = next(op for op in writing if log[op - 1] == "save_file" and op > writing[0])  # the second shard or so
    text = next(op for op in writing if log[op - 1] == "open")
    copy = next((op for op in writing if log[op - 1] == "copyfile"), text)
    steps = []
    for what, op in (("shard", shard), ("json", text), ("copy", copy)):
        steps.append(_trial(f"previous-ENOSPC-{what}", "previous", {"kind": "enospc", "op": op, "when": "before"}))
    return steps


@pytest.fixture(scope="module")
def full_disk(driver, work, source, logs) -> dict:
    return _drive(driver, work, source, _enospc_steps(logs))


def _check_full_disk(result: dict, logs: dict) -> None:
    assert result["rc"] == 1, result["stderr"]
    assert result["after"] == logs["previous"]["snapshot"]
    assert _hidden_leftovers(result) == []
    assert "No space left on device" in result["stderr"]
    assert result["stderr"].startswith("hfquant: error:"), result["stderr"]
    assert "Traceback" not in result["stderr"]


@pytest.mark.parametrize("what", ["shard", "json", "copy"])
def test_full_disk_keeps_dst_and_says_so(full_disk, logs, what):
    """A shard (safetensors raises its own SafetensorError), config.json / index / card, or a copied tokenizer file."""
    _check_full_disk(full_disk[f"previous-ENOSPC-{what}"], logs)


# -- two converts into one DST --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def races(driver, work, source, logs) -> dict:
    log = logs["new"]["log"]
    writing, publishing = _phases(log)
    steps = [
        # both pass every check, then publish at the same moment
        {
            "kind": "race",
            "name": "together",
            "state": "absent",
            "args": ARGS_NEW,
            "op": publishing[0],
            "order": "together",
        },
        # the second reaches publishing after the first has finished
        {
            "kind": "race",
            "name": "staggered",
            "state": "absent",
            "args": ARGS_NEW,
            "op": writing[-1],
            "order": "staggered",
        },
    ]
    return _drive(driver, work, source, steps)


def _check_race(result: dict, logs: dict) -> None:
    codes = sorted([result["a"]["rc"], result["b"]["rc"]])
    assert codes == [0, 1], (result["a"]["stderr"], result["b"]["stderr"])
    loser = result["a"] if result["a"]["rc"] else result["b"]
    assert result["after"] == logs["new"]["snapshot"]
    assert _hidden_leftovers(result) == []
    message = loser["stderr"]
    assert message.startswith("hfquant: error:") and "dst" in message
    assert "exists" in message or "another" in message, message


def test_second_convert_into_a_finished_dst_fails_clearly(races, logs):
    _check_race(races["staggered"], logs)


def test_two_converts_publishing_at_once_one_wins_the_other_fails_clearly(races, logs):
    _check_race(races["together"], logs)


def test_two_converts_publishing_at_once_leave_one_complete_dst(races, logs):
    result = races["together"]
    assert sorted([result["a"]["rc"], result["b"]["rc"]]) == [0, 1]
    assert result["after"] == logs["new"]["snapshot"]
    assert _hidden_leftovers(result) == []


# -- Ctrl-C from a terminal -----------------------------------------------------------------------------------------


def test_ctrl_c_from_a_terminal_with_a_worker(tmp_path, source):
    """The real command with `--workers 1`, over a previous version of DST, gets SIGINT on its whole process group
    (what Ctrl-C in a terminal does) at a seeded random moment after its temporary folder appears: the worker and the
    command stop, DST keeps the previous version byte for byte, nothing is left beside it, exit status 130."""
    from hfquant import HfQuantConfig
    from hfquant.conversion.convert import convert

    dst = tmp_path / "out" / "dst"
    convert(source, dst, HfQuantConfig(bits=8), max_shard_size="60KB", progress=False)
    before = _snapshot(dst)
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hfquant.commands.cli",
            "convert",
            str(source),
            str(dst),
            *ARGS_NEW,
            "--workers",
            "1",
            "--overwrite",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "TQDM_DISABLE": "1"},
    )
    try:
        deadline = time.monotonic() + 120
        while not any(p.name.startswith(".dst.tmp-") for p in dst.parent.iterdir()):
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "convert never started writing"
            time.sleep(0.002)
        time.sleep(random.Random(SEED).uniform(0.0, 0.3))  # the worker is starting or quantizing
        os.killpg(process.pid, signal.SIGINT)
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    assert process.returncode == 130, stderr[-2000:]
    # the worker, interrupted too, may print its own KeyboardInterrupt first; the command's last word is this line
    assert stderr.strip().splitlines()[-1].startswith("hfquant: interrupted"), stderr[-2000:]
    assert _snapshot(dst) == before
    assert [p.name for p in dst.parent.iterdir()] == ["dst"]


def _snapshot(folder: Path) -> dict | None:
    import hashlib

    if not folder.exists():
        return None
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


# -- the real example model (slow) ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_real_model_interrupted_over_a_verified_previous_version(tmp_path):
    """SmolLM2-135M: convert at 8 bits, record sha256 sums and verify; then convert at 4 bits over it, interrupted by
    SIGINT and by SIGKILL at seeded moments of its writing: every time DST still verifies with the same sums (the same
    bytes); a final rerun at 4 bits completes and verifies."""
    from benchmarks.example_model import build_example_model
    from hfquant.checkpoint.checksums import write_checksums

    source = build_example_model()
    dst = tmp_path / "out" / "dst"
    rng = random.Random(SEED)

    def command(*args: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "hfquant.commands.cli", "convert", str(source), str(dst), "--no-progress", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    first = command("--bits", "8", "--max-shard-size", "50MB")
    staged = _wait_for_staging(dst, first)
    _, stderr = first.communicate(timeout=600)
    # the signal lands while the 4-bit run writes, however fast the machine is at the moment: a quarter of the 8-bit
    # run's own time from its staging folder to its end (a quarter of its whole time let a run that met a quieter
    # machine than the 8-bit one finish first, under load: exit -2, SIGINT after the command had returned)
    window = 0.25 * (time.monotonic() - staged)
    assert first.returncode == 0, stderr[-2000:]
    write_checksums(dst)
    assert verify(dst).ok
    before = _snapshot(dst)
    for sig in (signal.SIGINT, signal.SIGKILL):
        process = command("--bits", "4", "--max-shard-size", "50MB", "--overwrite")
        try:
            _wait_for_staging(dst, process, must_run=True)
            time.sleep(rng.uniform(0.0, window))
            assert process.poll() is None, "the conversion ended before the signal: the test's window is too wide"
            os.killpg(process.pid, sig)
            _, stderr = process.communicate(timeout=300)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.communicate()
        assert process.returncode == (130 if sig == signal.SIGINT else -signal.SIGKILL), stderr[-2000:]
        assert _snapshot(dst) == before
        result = verify(dst)
        assert result.ok and result.checksums == len(json.loads((dst / "hfquant.sha256.json").read_text())["files"])
        leftovers = [p.name for p in dst.parent.iterdir() if p.name != "dst"]
        assert leftovers == [] if sig == signal.SIGINT else all(n.startswith(".dst.") for n in leftovers)
    rerun = command("--bits", "4", "--max-shard-size", "50MB", "--overwrite")
    _, stderr = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, stderr[-2000:]
    assert verify(dst).ok and json.loads((dst / "config.json").read_text())["quantization_config"]["bits"] == 4


def _wait_for_staging(dst: Path, process: subprocess.Popen, must_run: bool = False) -> float:
    """The moment a `.dst.tmp-` staging folder beside `dst` is seen (or `process` ended, unless `must_run`)."""
    deadline = time.monotonic() + 300
    while not (dst.parent.exists() and any(p.name.startswith(f".{dst.name}.tmp-") for p in dst.parent.iterdir())):
        if process.poll() is not None:
            assert not must_run, process.communicate()
            break
        assert time.monotonic() < deadline
        time.sleep(0.005)
    return time.monotonic()
