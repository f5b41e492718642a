"""The guide cannot rot: every fenced code block in README.md and docs/**/*.md is run or accounted for.

* ```python blocks run as scripts in a subprocess (fresh temporary directory, hard timeout). A block
  that needs 2 processes is a complete Lightning script with `devices=2`: Lightning's launcher
  re-runs the same file for rank 1.
* ```bash / ```sh / ```shell lines, and the `$ ` lines of ```console blocks, are commands. Each must
  be run by a named test: a recipe command by tests/test_recipes.py (its flags must exist in the
  recipe), anything else by an entry of COVERED below, whose test or file is checked to exist.
  EXEMPT lists the few commands the suite deliberately does not run, each with its reason.
* ```text, ```yaml and the other NOT_CODE languages are not code. A fence with no language fails:
  say what it is.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.test_recipes import RUNS

ROOT = Path(__file__).resolve().parents[1]
PYTHON = {"python", "py", "python3", "pycon"}
SHELL = {"bash", "sh", "shell", "zsh", "console", "shell-session"}
NOT_CODE = {"text", "txt", "plaintext", "output", "yaml", "yml", "json", "toml", "ini", "cfg", "csv", "diff",
            "mermaid", "log", "slurm-output"}
BLOCK_TIMEOUT = 300


@dataclass(frozen=True)
class Covered:
    """A shell command the suite runs elsewhere.

    Attributes:
        pattern: regular expression the whole command must match (whitespace collapsed).
        by: ``tests/test_x.py::test_name`` (the test must exist), or a file that runs the command.
        evidence: text that must occur in ``by`` (default: the test's ``def``), so the entry rots loudly.
    """

    pattern: str
    by: str
    evidence: str = ""


COVERED: list[Covered] = [
    Covered(r"bash scripts/test\.sh( .*)?", ".ci/run", "scripts/test.sh"),
    Covered(r"\.venv/bin/python -m pytest( .*)?", "scripts/test.sh", '"$VENV/bin/python" -m pytest'),
    Covered(r"bash scripts/bootstrap\.sh", "scripts/test.sh", "bash scripts/bootstrap.sh"),
    Covered(r"bash scripts/train\.sh( .*)?", "tests/test_docs.py::test_train_script_runs_the_main_job"),
    Covered(r"pip install \.", "tests/test_wheel.py::test_pip_install_then_lsync_train_outside_the_repo"),
    Covered(r"pip install \"\.\[[\w,]+\]\"", "scripts/bootstrap.sh", '-e ".[test,recipes]"'),
    Covered(r"bash scripts/gpu_check\.sh( \[?REPORT_DIR\]?)?",
            "tests/test_gpu_check.py::test_without_cuda_it_says_so_and_exits_2"),
    Covered(r"bash scripts/gpu_check\.sh --download( .*)?",
            "tests/test_gpu_check.py::test_dry_run_from_a_bare_host_installs_from_wheels_runs_the_tier_and_reports"),
    Covered(r"(\.venv/bin/)?python docs/gen_api\.py( --check)?",
            "tests/test_docs.py::test_api_reference_is_up_to_date"),
    Covered(r"lsync-doctor invariance .*",
            "tests/test_invariance.py::test_lsync_doctor_invariance_prints_the_report_and_exits_nonzero_on_a_difference"),
    Covered(r"lsync-ft-run --replicas 2 --min-replicas 2 -- python recipes/fault_tolerant_ddp\.py --kill-at 8",
            "tests/test_recipes.py::test_fault_tolerant_ddp_a_killed_group_recovers_and_both_end_equal"),
    Covered(r"sbatch recipes/launch_slurm_ft\.sbatch python recipes/fault_tolerant_ddp\.py --kill-at 8",
            "tests/test_multinode.py::test_sbatch_ft_recipe_a_group_killed_on_its_node_recovers_from_the_other"),
    Covered(r"lsync-ft-run .*",
            "tests/test_ft.py::test_a_killed_group_is_restarted_healed_from_its_peer_and_the_other_never_stops"),
]

#: command pattern -> why the suite does not run it.
EXEMPT: dict[str, str] = {
    r"\.venv/bin/python bench/bench_core\.py": "a benchmark: minutes of timing loops, results are read by people",
}

# `python recipes/X.py ...`, `.venv/bin/python ...`, `torchrun [--opt[=| ]value ...] recipes/X.py ...`
RECIPE_COMMAND = re.compile(r"(?:(?:\S*/)?python3? |(?:\S*/)?torchrun (?:--?[\w-]+(?:[= ](?!recipes/)[^-\s]\S*)? )*)"
                            r"recipes/(\w+\.py)(.*)")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


_OPEN = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")


def extract_blocks(text: str, path: Path) -> list[Block]:
    """Fenced code blocks of a Markdown text (``` or ~~~, 3+ characters, any indentation, info strings).

    A closing fence is the same character, at least as long as the opening one, alone on its line;
    content lines lose the opening fence's indentation (blocks inside list items). An unclosed fence
    raises ValueError naming its line, instead of silently swallowing the rest of the file.
    """
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = _OPEN.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = m.group("indent"), m.group("fence"), m.group("info").strip()
        lang = re.sub(r"^[{.]+", "", info.split()[0]).rstrip("}").lower() if info else ""
        closing = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not closing.match(lines[j]):
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        if j == len(lines):
            raise ValueError(f"{path}:{i + 1}: fence {fence!r} is never closed")
        blocks.append(Block(path, i + 1, lang, "\n".join(body) + "\n"))
        i = j + 1
    return blocks


def doc_files() -> list[Path]:
    readme = ROOT / "README.md"
    return ([readme] if readme.exists() else []) + sorted((ROOT / "docs").rglob("*.md"))


def all_blocks() -> list[Block]:
    return [b for path in doc_files() for b in extract_blocks(path.read_text(), path)]


def shell_commands(block: Block) -> list[str]:
    """The commands of a shell block: continuations joined, comments and console output dropped."""
    lines = block.code.splitlines()
    if block.lang in ("console", "shell-session"):
        lines = [line[2:] for line in lines if line.startswith("$ ")]
    commands, current = [], ""
    for line in lines:
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        command = _strip_comment(current).strip()
        current = ""
        if command:
            commands.append(" ".join(command.split()))
    return commands


def _strip_comment(line: str) -> str:
    """``line`` without its shell comment (a ``#`` at the start of a word, outside quotes)."""
    return line[: _end_of_words(line)]


def _end_of_words(line: str) -> int:
    """Index where a shell comment starts (a # at a word start, outside quotes), else len(line)."""
    quote = ""
    for k, ch in enumerate(line):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (k == 0 or line[k - 1].isspace()):
            return k
    return len(line)


def coverage_problem(command: str) -> str | None:
    """None when ``command`` is run by a named test (or exempt), else what is wrong."""
    bare = re.sub(r"^(\w+=\S*\s+)+", "", command)  # leading VAR=value assignments
    m = RECIPE_COMMAND.fullmatch(bare)
    if m:
        recipe, rest = m.groups()
        if recipe not in RUNS:
            return f"recipes/{recipe} is not run by tests/test_recipes.py (add it to RUNS)"
        source = (ROOT / "recipes" / recipe).read_text()
        missing = [f for f in re.findall(r"(?<!\S)--[a-z][\w-]*", rest) if f'"{f}"' not in source]
        return f"recipes/{recipe} has no option {', '.join(missing)}" if missing else None
    for entry in COVERED:
        if re.fullmatch(entry.pattern, bare):
            return _evidence_problem(entry)
    if any(re.fullmatch(p, bare) for p in EXEMPT):
        return None
    return ("not run by any test: run it in a test and add a Covered(...) entry to tests/test_docs.py, "
            "or mark the block ```text if it is not meant to be run")


def _evidence_problem(entry: Covered) -> str | None:
    file, _, test = entry.by.partition("::")
    target = ROOT / file
    if not target.is_file():
        return f"covered by {entry.by}, which does not exist"
    evidence = entry.evidence or f"def {test}("
    if evidence not in target.read_text():
        return f"covered by {entry.by}, but {evidence!r} is not in {file}"
    return None


# ------------------------------------------------------------------------------------------- tests

BLOCKS = all_blocks()


def test_every_block_has_a_known_language() -> None:
    unknown = [f"{b.where} ```{b.lang}" for b in BLOCKS if b.lang not in PYTHON | SHELL | NOT_CODE]
    assert not unknown, ("fenced blocks without a known language (use ```python, ```bash, ```console, or "
                         f"```text for anything that is not code): {unknown}")


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang in SHELL], ids=lambda b: b.where)
def test_shell_block_commands_are_run_by_the_suite(block: Block) -> None:
    problems = {c: p for c in shell_commands(block) if (p := coverage_problem(c))}
    assert not problems, f"{block.where}: " + "; ".join(f"`{c}`: {p}" for c, p in problems.items())


def _python_params() -> list[object]:
    """Python blocks; those that start processes (Lightning devices=N, mp.spawn) carry the slow marker."""
    multi = re.compile(r"devices\s*=\s*[2-9]|mp\.spawn|multiprocessing|init_process_group")
    return [pytest.param(b, id=b.where, marks=[pytest.mark.slow] if multi.search(b.code) else [])
            for b in BLOCKS if b.lang in PYTHON]


@pytest.mark.parametrize("block", _python_params())
@pytest.mark.timeout(BLOCK_TIMEOUT + 30 + 60)  # above the block's own limit
def test_python_block_runs(block: Block, tmp_path: Path) -> None:
    ast.parse(block.code, filename=block.where)  # a syntax error is reported with the doc's name
    script = tmp_path / "block.py"
    script.write_text(block.code)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["timeout", "-k", "5", str(BLOCK_TIMEOUT), sys.executable, str(script)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT + 30)
    assert proc.returncode == 0, (f"{block.where}: exit {proc.returncode}\n--- block\n{block.code}\n--- stdout\n"
                                  f"{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-5000:]}")


def _table(path: Path) -> list[str]:
    """The quick-reference table's rows, with links made relative to the repository root."""
    rows = [line for line in path.read_text().splitlines() if line.startswith("| ")]
    return [re.sub(r"\]\((\.\./)?", "](", row) for row in rows if "what syncs it" in row or "](" in row]


def test_guide_and_readme_quick_reference_tables_agree() -> None:
    """docs/README_quickref.md is the README's section; docs/guide.md carries the same table."""
    quickref = _table(ROOT / "docs" / "README_quickref.md")
    assert quickref and quickref == _table(ROOT / "docs" / "guide.md")[: len(quickref)]
    readme = ROOT / "README.md"
    if readme.exists() and "| scenario | what syncs it |" in readme.read_text():  # pasted: keep it in step
        assert _table(readme)[: len(quickref)] == quickref, "README.md's table differs from docs/README_quickref.md"


@pytest.mark.slow
@pytest.mark.timeout(BLOCK_TIMEOUT + 30 + 60)
def test_train_script_runs_the_main_job(tmp_path: Path) -> None:
    """README's `bash scripts/train.sh [overrides]`, as written, shrunk to 1 epoch of 2 batches."""
    run = tmp_path / "run"
    tiny = ["trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1", "callbacks=none",
            "trainer.enable_checkpointing=false", f"hydra.run.dir={run}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["timeout", "-k", "5", str(BLOCK_TIMEOUT), "bash", str(ROOT / "scripts" / "train.sh"), *tiny],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT + 30)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert "lsync-train: root seed" in proc.stdout and (run / "summary.json").exists(), proc.stdout[-3000:]


def test_api_reference_is_up_to_date() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "docs" / "gen_api.py"), "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _outside_code(text: str, path: Path) -> str:
    """``text`` with its fenced blocks blanked, so links and headings inside code are ignored."""
    lines = text.splitlines()
    for block in extract_blocks(text, path):
        n = block.code.count("\n")
        lines[block.line - 1: block.line + n + 1] = [""] * (n + 2)
    return "\n".join(lines)


def test_relative_links_and_anchors_resolve() -> None:
    problems = []
    for path in doc_files():
        text = _outside_code(path.read_text(), path)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            file, _, anchor = target.partition("#")
            base = ROOT if path.name == "README_quickref.md" else path.parent  # written to be pasted into README.md
            dest = (base / file).resolve() if file else path
            if not dest.exists():
                problems.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", _outside_code(dest.read_text(), dest), flags=re.M)
                if anchor not in {_slug(h) for h in headings}:
                    problems.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
    assert not problems, "broken links:\n" + "\n".join(problems)


@pytest.mark.timeout(240)
def test_docs_site_builds_strictly(tmp_path: Path) -> None:
    """The site (mkdocs.yml: docs/ and the API reference rendered from the docstrings) builds with warnings as
    errors: a broken anchor, a page left out of the nav, a docstring mkdocstrings cannot render fails here."""
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=200, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    reference = (tmp_path / "site" / "reference" / "index.html").read_text()
    assert "guard_timeout" in reference and "check_world_size_invariance" in reference  # from the docstrings
    assert ":class:" not in reference  # Sphinx roles shown as code (docs/hooks.py)


# ---------------------------------------------------------------- the extractor itself (no processes)


def test_extractor_handles_what_readmes_contain(tmp_path: Path) -> None:
    text = "\n".join([
        "# t", "```python", "print(1)", "```",
        "- item", "  ~~~bash title=x", "  bash scripts/test.sh \\", "    -k docs  # comment", "  ~~~",
        "````text", "```python", "not code", "```", "````",
        "```{.console}", "$ bash scripts/test.sh", "output line", "```",
        "```", "unlabelled", "```",
    ])
    blocks = extract_blocks(text, tmp_path / "x.md")
    assert [(b.lang, b.line) for b in blocks] == [("python", 2), ("bash", 6), ("text", 10), ("console", 15),
                                                   ("", 19)]
    assert blocks[0].code == "print(1)\n"
    assert shell_commands(blocks[1]) == ["bash scripts/test.sh -k docs"]
    assert blocks[2].code == "```python\nnot code\n```\n"
    assert shell_commands(blocks[3]) == ["bash scripts/test.sh"]
    with pytest.raises(ValueError, match=r"x.md:1: fence '```' is never closed"):
        extract_blocks("```python\nprint(1)\n", tmp_path / "x.md")


def test_coverage_rules() -> None:
    assert coverage_problem("python recipes/ddp_basics.py --max-steps 3") is None
    assert coverage_problem("torchrun --standalone --nproc_per_node=2 recipes/local_sgd.py --k 2") is None
    assert coverage_problem("OMP_NUM_THREADS=1 python recipes/ddp_basics.py") is None
    assert coverage_problem("torchrun --nnodes 2 --node_rank=0 --master_addr=10.0.0.1 --nproc_per_node 8 "
                            "recipes/ddp_basics.py --accelerator gpu --devices 8 --num-nodes 2") is None
    assert "no option --nope" in (coverage_problem("python recipes/ddp_basics.py --nope 1") or "")
    assert "not run by tests/test_recipes.py" in (coverage_problem("python recipes/unknown.py") or "")
    assert "not run by any test" in (coverage_problem("rm -rf /") or "")
    assert coverage_problem("bash scripts/test.sh -k docs") is None
    assert _strip_comment("echo '# not a comment' # a comment").strip() == "echo '# not a comment'"
