"""The code in README.md and DynamicEmb_APIs.md works: every ```python block
runs (one worker process for all of them, each block in a fresh namespace
and an empty working directory: run_blocks.py) unless marked
`<!-- not-run: reason -->`, and then it at least compiles; every ```bash
block names scripts, modules, sub-commands and --flags that exist."""
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from markdown_doc import code_blocks

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "DynamicEmb_APIs.md"]
BLOCKS = [b for doc in DOCS for b in code_blocks(doc.name, doc.read_text())]
PYTHON = [b for b in BLOCKS if b.lang == "python"]
RUNNABLE = [b for b in PYTHON if b.not_run is None]
BASH = [b for b in BLOCKS if b.lang in ("bash", "sh", "shell", "console")]
WORKER_TIMEOUT_S = 240
MAX_NOT_RUN = 6  # exceptions stay few: a block that can run on one CPU process must


# ---- python blocks ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def block_runs(tmp_path_factory):
    """{where: (result, output)} of every runnable block, from one worker run."""
    tmp = tmp_path_factory.mktemp("docblocks")
    (tmp / "blocks.json").write_text(json.dumps([{"where": b.where, "code": b.code} for b in RUNNABLE]))
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    cmd = [sys.executable, str(Path(__file__).with_name("run_blocks.py")), str(tmp / "blocks.json"),
           str(tmp / "results.json")]
    try:
        proc = subprocess.run(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=WORKER_TIMEOUT_S)
        rc, stdout = proc.returncode, proc.stdout
    except subprocess.TimeoutExpired as e:  # the blocks that finished still count
        out = e.stdout or ""
        rc, stdout = f"killed after {WORKER_TIMEOUT_S} s", out.decode() if isinstance(out, bytes) else out
    results = json.loads((tmp / "results.json").read_text()) if (tmp / "results.json").exists() else []
    outputs = dict(re.findall(r"^=== block (\S+) ===\n(.*?)(?=^=== block |\Z)", stdout, re.S | re.M))
    runs = {r["where"]: (r, outputs.get(r["where"], "")) for r in results}
    runs["__worker__"] = (rc, stdout[-4000:])
    return runs


def test_there_is_code_to_run():
    readme = [b for b in RUNNABLE if b.path == "README.md"]
    assert readme, "README.md has no runnable python block (the quick start)"
    assert len(RUNNABLE) >= 8, f"only {len(RUNNABLE)} runnable python blocks"
    not_run = [b.where for b in PYTHON if b.not_run is not None]
    assert len(not_run) <= MAX_NOT_RUN, f"too many not-run python blocks: {not_run}"
    assert all(b.not_run for b in PYTHON if b.not_run is not None), "a not-run marker needs a reason"


@pytest.mark.parametrize("block", RUNNABLE, ids=lambda b: b.where)
def test_python_block_runs(block, block_runs):
    if block.where not in block_runs:
        rc, tail = block_runs["__worker__"]
        pytest.fail(f"{block.where} did not run: the worker exited with {rc} before it\n{tail}")
    result, output = block_runs[block.where]
    assert result["ok"], f"{block.where} failed after {result['seconds']} s:\n{result['error']}\n" \
                         f"--- its output (tail) ---\n{output[-3000:]}"


@pytest.mark.parametrize("block", [b for b in PYTHON if b.not_run is not None], ids=lambda b: b.where)
def test_not_run_python_block_compiles(block):
    compile(block.code, block.where, "exec")


# ---- bash blocks -----------------------------------------------------------------------------


def _dev_commands() -> set:
    """The sub-commands scripts/dev.sh dispatches on (its case labels)."""
    text = (ROOT / "scripts" / "dev.sh").read_text()
    case = text[text.index('case "$cmd" in'):]
    return set(re.findall(r"^\s*(\w+)\)", case, re.M))


def _module_source(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, f"module {module} is not importable"
    if spec.submodule_search_locations:  # a package: python -m runs its __main__
        main = Path(spec.origin).with_name("__main__.py")
        assert main.exists(), f"package {module} has no __main__ to run with -m"
        return main
    return Path(spec.origin)


def _check_flags(source: Path, args: list, what: str) -> list:
    """Each --flag appears as a string literal in the program's source (or in
    a private helper module beside it, e.g. benchmark/_common.py)."""
    helpers = sorted(source.parent.glob("_*.py")) if ROOT in source.parents else []
    text = source.read_text() + "".join(p.read_text() for p in helpers if p != source)
    flags = [a.split("=", 1)[0] for a in args if a.startswith("--") and len(a) > 2]
    return [f"{what}: {f} is not an option of {source.name}" for f in flags
            if not re.search(rf"[\"']{re.escape(f)}[\"']", text)]


def _check_paths(args: list, what: str) -> list:
    return [f"{what}: {a} does not exist" for a in args
            if (a.endswith((".py", ".sh")) or a.startswith(("tests/", "scripts/"))) and not (ROOT / a).exists()]


def _check_python(args: list, what: str) -> list:
    """args after `python`: [-m module | script.py] [args]."""
    while args and args[0].startswith("-") and args[0] != "-m":
        args = args[1:]  # interpreter options (-u, -X ...)
    if not args:
        return []
    if args[0] == "-m":
        module, rest = args[1], args[2:]
        if module == "pytest":
            return _check_paths(rest, what)
        try:
            source = _module_source(module)
        except AssertionError as e:
            return [f"{what}: {e}"]
        return _check_paths(rest, what) + _check_flags(source, rest, what)
    script, rest = args[0], args[1:]
    if not (ROOT / script).exists():
        return [f"{what}: {script} does not exist"]
    if script == "setup.py":
        return []
    return _check_paths(rest, what) + _check_flags(ROOT / script, rest, what)


def _check_command(words: list, what: str) -> list:
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        words = words[1:]  # VAR=value prefixes
    if not words:
        return []
    cmd, args = words[0], words[1:]
    if cmd == "bash" and args and args[0].endswith("dev.sh"):
        if not (ROOT / args[0]).exists():
            return [f"{what}: {args[0]} does not exist"]
        sub, rest = (args[1], args[2:]) if len(args) > 1 else ("example", [])
        if sub not in _dev_commands():
            return [f"{what}: scripts/dev.sh has no sub-command {sub!r} (it has {sorted(_dev_commands())})"]
        if sub == "example":
            return _check_python(["example.py"] + rest, what)
        if sub == "bench":
            return _check_python([f"benchmark/bench_{rest[0]}.py"] + rest[1:], what)
        if sub == "python":
            return _check_python(rest, what)
        return _check_paths(rest, what)  # test: pytest's own options
    if cmd == "bash":
        return _check_paths(args[:1], what)
    if re.match(r"^(\S*/)?python(3(\.\d+)?)?$", cmd):
        return _check_python(args, what)
    if cmd == "torchrun":
        i = 0
        while i < len(args) and args[i].startswith("-"):
            i += 1 if "=" in args[i] or i + 1 >= len(args) or args[i + 1].startswith("-") else 2
        problems = _check_flags(_module_source("torch.distributed.run"), args[:i], what)
        return problems + (_check_python(args[i:], what) if i < len(args) else [f"{what}: torchrun runs nothing"])
    if "/" in cmd and not (ROOT / cmd).exists():
        return [f"{what}: {cmd} does not exist"]
    return []


def _commands(code: str):
    """(line, words) of each simple command of a bash block."""
    logical, start, buf = [], None, ""
    for i, line in enumerate(code.splitlines(), 1):
        start = start or i
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        logical.append((start, buf + line))
        start, buf = None, ""
    for line_no, line in logical:
        words = shlex.split(line.lstrip("$ "), comments=True)
        cmd = []
        for w in words + [";"]:
            if w in (";", "&&", "||", "|"):
                if cmd:
                    yield line_no, cmd
                cmd = []
            else:
                cmd.append(w)


@pytest.mark.parametrize("block", BASH, ids=lambda b: b.where)
def test_bash_block_names_what_exists(block):
    problems, built = [], False
    for line_no, words in _commands(block.code):
        # A program under build/ (git-ignored) is made by a build script run earlier in the same block.
        if built and words[0].startswith("build/"):
            continue
        built = built or any(w.endswith("build.sh") for w in words)
        problems += _check_command(words, f"{block.path}:{block.line + line_no}")
    assert not problems, "\n".join(problems)
