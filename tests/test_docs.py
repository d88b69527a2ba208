"""The documentation's examples run as written.

What is executed ("one process" below: a process that runs the page's script as a fresh
``python script.py`` would, forked from the test session's torch-preloaded server —
``launch.run`` —, which saves the ~3 s of CPU a new interpreter spends importing torch):

* ``docs/user_guide.md``: every ```python block that is not a torchrun script, in order,
  in ONE process (the guide promises that its examples run one after the other in one
  process and share names such as ``root``, ``TinyGPT``, ``model``);
* ``docs/user_guide.md``: every torchrun script (a block whose first line is
  ``# <name>.py — run with: torchrun --nproc-per-node N <name>.py ...``), with
  ``my_model.py`` = the guide's block that defines ``class TinyGPT``, on N gloo ranks on
  CPU given the variables torchrun gives them (``launch.Torchrun``, forked as above);
* ``docs/first_day.md``: every ```python block that is not a torchrun script, in order, in
  one process; then its torchrun scripts, in the page's order, in ONE shared directory
  (each step goes on from the previous one's checkpoints), with ``my_model.py`` = the
  page's block that defines ``class ToyModel``, each as above (``test_demo`` runs a
  script under ``python -m torch.distributed.run`` itself);
* ``docs/coming_from_megatron.md``: every ```python block, in order, in one process;
* ``README.md``: every ```python block, in order, in one process (the "Use" example is a
  complete program).

Each process runs a script in which line N is line N of the Markdown file (the text
around the code blocks is blanked out), so a traceback points at the page's line."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import List, Tuple

import pytest

from .helpers import slack
from . import launch
from .launch import Torchrun


ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "user_guide.md"
MEGATRON_PAGE = ROOT / "docs" / "coming_from_megatron.md"
FIRST_DAY = ROOT / "docs" / "first_day.md"
README = ROOT / "README.md"

TORCHRUN_LINE = re.compile(r"# (\w+\.py) — run with: torchrun --nproc-per-node (\d+) ")
# The torchrun scripts the guide has today; more may be added, none may silently vanish.
KNOWN_SCRIPTS = {"ddp_demo.py", "fp_demo.py", "recover_demo.py", "fsdp_demo.py"}
# The first-day page's scripts, in the order a reader runs them.
FIRST_DAY_SCRIPTS = ["save_load.py", "train.py", "resume.py"]


class Block:
    """One fenced code block: its language, its first and last line (1-based), its code and
    the ``## `` section it sits in."""

    def __init__(self, lang: str, start: int, lines: List[str], section: str):
        self.lang, self.start, self.lines, self.section = lang, start, lines, section

    @property
    def code(self) -> str:
        return "".join(self.lines)

    @property
    def torchrun(self) -> Tuple[str, int] | None:
        """``(script name, number of processes)`` for a torchrun script, else ``None``."""
        m = TORCHRUN_LINE.match(self.lines[0]) if self.lines else None
        return (m.group(1), int(m.group(2))) if m else None


def _blocks(path: Path) -> List[Block]:
    blocks, section, current = [], "", None
    for number, line in enumerate(path.read_text().splitlines(keepends=True), start=1):
        if current is None:
            if line.startswith("## "):
                section = line[3:].strip()
            m = re.match(r"```(\w*)\s*$", line)
            if m:
                current = Block(m.group(1), number + 1, [], section)
        elif line.startswith("```"):
            blocks.append(current)
            current = None
        else:
            current.lines.append(line)
    assert current is None, f"{path}: unterminated code block from line {current.start}"
    return blocks


def _script(path: Path, blocks: List[Block]) -> str:
    """The blocks at their own line numbers, every other line of the page left empty."""
    lines = [""] * len(path.read_text().splitlines())
    for block in blocks:
        for i, line in enumerate(block.lines):
            lines[block.start - 1 + i] = line.rstrip("\n")
    return "\n".join(lines) + "\n"


def _env() -> dict:
    # a clean launch: no process-group coordinates inherited from the test runner
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _run_page(page: Path, tmp_path: Path) -> None:
    blocks = [b for b in _blocks(page) if b.lang == "python" and b.torchrun is None]
    assert blocks, f"no Python examples found in {page}"
    script = tmp_path / f"{page.stem}_examples.py"
    script.write_text(_script(page, blocks))
    work = tmp_path / "cwd"
    work.mkdir()
    # line N of the script is line N of the page; run as `python script` would, forked (launch.py)
    proc = launch.run([str(script)], _env(), work, timeout=slack(180))
    assert proc.returncode == 0, (
        f"the Python examples of {page.relative_to(ROOT)} ({script}) exited with {proc.returncode}"
        f"\n--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-10000:]}")


def test_user_guide_examples_run_in_one_process(tmp_path):
    _run_page(GUIDE, tmp_path)


def _guide_scripts():
    return [b for b in _blocks(GUIDE) if b.lang == "python" and b.torchrun is not None]


def test_user_guide_torchrun_scripts_are_found():
    names = {b.torchrun[0] for b in _guide_scripts()}
    assert KNOWN_SCRIPTS <= names, f"torchrun scripts found in the guide: {sorted(names)}"
    assert len(names) == len(_guide_scripts()), "two torchrun scripts of the guide share a name"


def _write_model(page: Path, class_name: str, where: Path) -> None:
    """``my_model.py`` in ``where``: the page's block that defines ``class_name``."""
    pattern = rf"^class {class_name}\b"
    [model] = [b for b in _blocks(page) if b.lang == "python" and re.search(pattern, b.code, re.M)]
    (where / "my_model.py").write_text(model.code)


def _run_script(page: Path, block: Block, where: Path, shared: Path) -> None:
    name, nproc = block.torchrun
    (where / name).write_text(block.code)
    what = f"{name} ({page.relative_to(ROOT)} line {block.start}) under torchrun with {nproc} ranks"
    job = Torchrun([name, str(shared)], nproc, where, [_env()])
    [code] = job.wait(slack(240))
    assert code == 0, f"{what} exited with {code}\n{job.output()[-12000:]}"


@pytest.mark.parametrize("block", _guide_scripts(), ids=lambda b: b.torchrun[0])
def test_user_guide_torchrun_script(block, tmp_path):
    _write_model(GUIDE, "TinyGPT", tmp_path)
    shared = tmp_path / "shared"
    shared.mkdir()
    _run_script(GUIDE, block, tmp_path, shared)


def test_first_day_examples_run_in_one_process(tmp_path):
    _run_page(FIRST_DAY, tmp_path)


def test_first_day_torchrun_scripts_run_in_order(tmp_path):
    scripts = [b for b in _blocks(FIRST_DAY) if b.lang == "python" and b.torchrun is not None]
    assert [b.torchrun[0] for b in scripts] == FIRST_DAY_SCRIPTS
    _write_model(FIRST_DAY, "ToyModel", tmp_path)
    shared = tmp_path / "shared"
    shared.mkdir()
    for block in scripts:                 # one directory: resume.py resumes what train.py saved
        _run_script(FIRST_DAY, block, tmp_path, shared)


def test_coming_from_megatron_examples_run_in_one_process(tmp_path):
    _run_page(MEGATRON_PAGE, tmp_path)


def test_readme_examples_run_as_written(tmp_path):
    assert any(b.section == "Use" for b in _blocks(README) if b.lang == "python"), "README lost its Use example"
    _run_page(README, tmp_path)
