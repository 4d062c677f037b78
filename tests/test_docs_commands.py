"""README.md and docs/*.md point at real things: links, anchors, paths, commands and their flags.

Cheap by design (no process, no Megatron import): links and anchors are resolved against the
files' headings; ``make`` targets against the Makefile; our CLIs' subcommands and options through
their own ``make_parser()``; script options against the option strings written in the script
(``scripts/pretrain_gpt.py`` and the launch templates also take ours and Megatron's, read as
text from ``training_hooks.py`` and Megatron's ``arguments.py``); names imported from
``dualpipe_megatron`` in Python examples against the module's top-level definitions. Whether a
command *works* is the business of the tests of each tool; here we catch what a rename or a
moved section silently breaks.
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib
import importlib.util
import re
import shlex
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOC_IDS = [str(p.relative_to(ROOT)) for p in DOCS]

FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
CODE_SPAN = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
REPO_PATH = re.compile(r"(?<![\w./$-])((?:scripts|tests|bench|docs|patches|dualpipe_megatron)/[\w./*-]*[\w*/])")
GENERATED = ("bench/results/", "outputs/")
OUR_FLAG = re.compile(r"--(?:no-)?dualpipe-[a-z0-9-]+|--pipeline-schedule\b|--eplb-[a-z0-9-]+")
FLAG = re.compile(r"^(--?[A-Za-z][\w-]*)")
PYTHONS = {"python", "python3", ".venv/bin/python", "$(PY)"}
SEPARATORS = {"&&", "||", ";", "|"}


# ---------------------------------------------------------------- reading the documents

@functools.cache
def text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def prose(path: Path) -> str:
    """The document without fenced blocks (links and headings live here)."""
    return FENCE.sub("", text(path))


def fenced(path: Path, langs: tuple[str, ...]) -> list[str]:
    return [m.group(2) for m in FENCE.finditer(text(path)) if m.group(1) in langs]


def code_spans(path: Path) -> list[str]:
    return [m.group(1).replace("\\|", "|") for m in CODE_SPAN.finditer(prose(path))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@functools.cache
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    for m in HEADING.finditer(prose(path)):
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


# ---------------------------------------------------------------- what the repository defines

@functools.cache
def make_targets() -> frozenset[str]:
    return frozenset(re.findall(r"^([\w-]+)[ \t]*:(?!=)", text(ROOT / "Makefile"), re.M))


def option_literals(path: Path) -> set[str]:
    """Option strings written in a script: quoted in Python, bare words in shell."""
    source = path.read_text(encoding="utf-8")
    if path.suffix == ".py":
        return set(re.findall(r"""["'](--?[A-Za-z][\w-]*)["']""", source))
    return set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", source))


@functools.cache
def our_flags() -> frozenset[str]:
    """Options ``training_hooks.add_arguments`` and EPLB's ``add_arguments`` define (read from
    their sources)."""
    trees = [ast.parse(text(ROOT / "dualpipe_megatron" / path))
             for path in ("megatron/training_hooks.py", "eplb/training.py")]
    return frozenset(
        arg.value for tree in trees for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument"
        for arg in node.args if isinstance(arg, ast.Constant) and str(arg.value).startswith("--"))


@functools.cache
def pretrain_flags() -> frozenset[str]:
    """What a Megatron pretraining script accepts, read as text (building Megatron's parser
    costs an import of megatron.training): ours, every quoted option in megatron, and the
    options Megatron generates from its config dataclasses' fields (`--name`, `--no-name`,
    `--disable-name`; taken from every class-level annotation, so a superset)."""
    spec = importlib.util.find_spec("megatron")
    flags = set(our_flags())
    for location in (spec.submodule_search_locations or []) if spec else []:
        for path in Path(location).rglob("*.py"):
            source = path.read_text(encoding="utf-8", errors="replace")
            flags |= set(re.findall(r"""["'](--[\w-]+)["']""", source))
            for field in re.findall(r"^    ([a-z]\w*)[ \t]*:[ \t]*[^=\s]", source, re.M):
                name = field.replace("_", "-")
                flags |= {f"--{name}", f"--no-{name}", f"--disable-{name}"}
    if len(flags) == len(our_flags()):
        pytest.skip("megatron-core is not installed here")
    return frozenset(flags)


@functools.cache
def cli_parser(module: str) -> argparse.ArgumentParser | None:
    """``make_parser()`` of ``dualpipe_megatron.<x>.cli`` where the tool has one."""
    if not (ROOT / Path(*module.split("."))).joinpath("cli.py").exists():
        return None
    return importlib.import_module(f"{module}.cli").make_parser()


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse keeps no public list of subcommands
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def module_exists(module: str) -> bool:
    base = ROOT / Path(*module.split("."))
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


@functools.cache
def top_level_names(module: str) -> frozenset[str]:
    base = ROOT / Path(*module.split("."))
    path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
    names = set()
    for node in ast.parse(text(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    if base.is_dir():  # a submodule is importable from its package
        names |= {p.stem for p in base.glob("*.py")} | {p.name for p in base.iterdir() if p.is_dir()}
    return frozenset(names)


# ---------------------------------------------------------------- commands in the documents

def commands(path: Path) -> list[list[str]]:
    """Shell commands: each line of bash/sh/empty-language blocks, and code spans that start
    like a command. Placeholders (`[--x]`, `...`) are kept; the checks ignore them."""
    blocks = fenced(path, ("bash", "sh", "shell", ""))
    lines = [ln for block in blocks for ln in block.replace("\\\n", " ").splitlines()]
    lines += [span for span in code_spans(path) if looks_like_command(span.split()[0:2])]
    out = []
    for line in lines:
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:
            continue
        current: list[str] = []
        for token in tokens + [";"]:
            if token in SEPARATORS:
                if current:
                    out.append(current)
                current = []
            else:
                current.append(token)
    return [cmd for cmd in out if looks_like_command(strip_env(cmd)[:2])]


def strip_env(cmd: list[str]) -> list[str]:
    i = 0
    while i < len(cmd) and re.match(r"^[A-Z_][A-Z0-9_]*=", cmd[i]):
        i += 1
    return cmd[i:]


def looks_like_command(head: list[str]) -> bool:
    head = strip_env(head) if head else head
    if not head:
        return False
    first = head[0]
    return (first in PYTHONS | {"make", "torchrun", "bash", "sbatch", "dualpipe-schedules"}
            or (first.startswith(("scripts/", "bench/")) and first.endswith((".py", ".sh", ".sbatch"))))


def flags_of(args: list[str]) -> list[str]:
    out = []
    for token in args:
        m = FLAG.match(token.strip("[]()"))
        if m and m.group(1) not in ("-", "--"):
            out.append(m.group(1))
    return out


def is_placeholder(token: str) -> bool:
    return token == "..." or token.strip("[]").isupper() or token.startswith(("[", "<"))


def check_script(script: str, args: list[str], problems: list[str], line: str) -> None:
    if script in ("pretrain_gpt.py", "pretrain_hybrid.py"):  # Megatron-LM's own scripts, named bare in the docs
        allowed = pretrain_flags()
    else:
        path = ROOT / script
        if not path.exists():
            problems.append(f"{line}: {script} does not exist")
            return
        allowed = option_literals(path) | {"-h", "--help"}
        if path.name in ("pretrain_gpt.py", "launch_torchrun.sh", "launch_slurm.sbatch"):
            allowed |= pretrain_flags()
    problems += [f"{line}: {script} has no option {flag}" for flag in flags_of(args) if flag not in allowed]


def check_module(module: str, args: list[str], problems: list[str], line: str) -> None:
    if not module.startswith("dualpipe_megatron"):
        return
    if not (module_exists(module) or module_exists(module + ".__main__")):
        problems.append(f"{line}: no module {module}")
        return
    if module == "dualpipe_megatron.launch":
        script = next((a for a in args if not a.startswith("-")), None)
        if script and not is_placeholder(script):
            check_script(script, args[args.index(script) + 1:], problems, line)
        return
    parser = cli_parser(module)
    if parser is None:
        path = ROOT / Path(*module.split(".")).with_suffix(".py")
        allowed = option_literals(path) | {"-h", "--help"} if path.exists() else set()
        problems += [f"{line}: {module} has no option {flag}" for flag in flags_of(args) if flag not in allowed]
        return
    subs = subparsers(parser)
    positional = [a for a in args if not a.startswith(("-", "["))]
    if subs and positional:
        if positional[0] not in subs:
            problems.append(f"{line}: {module} has no subcommand {positional[0]!r} (has {sorted(subs)})")
            return
        parser = subs[positional[0]]
    known = set(parser._option_string_actions)
    problems += [f"{line}: {module} {positional[:1]} has no option {flag}"
                 for flag in flags_of(args) if flag not in known]


def check_command(cmd: list[str], problems: list[str]) -> None:
    line = " ".join(cmd)
    cmd = strip_env(cmd)
    head, args = cmd[0], cmd[1:]
    if head == "make":
        problems += [f"{line}: no make target {t!r}" for t in args if not t.startswith("-") and t not in make_targets()]
    elif head == "dualpipe-schedules":
        check_module("dualpipe_megatron.schedules", args, problems, line)
    elif head in PYTHONS or head == "torchrun":
        i = 0
        while i < len(args) and args[i] != "-m" and not args[i].endswith(".py"):
            i += 1
        if i == len(args):
            return
        if args[i] == "-m" and i + 1 < len(args):
            check_module(args[i + 1], args[i + 2:], problems, line)
        elif args[i].endswith(".py"):
            check_script(args[i], args[i + 1:], problems, line)
    elif head in ("bash", "sbatch"):
        rest = [a for a in args if not a.startswith("-")]
        if rest:
            check_script(rest[0], args[args.index(rest[0]) + 1:], problems, line)
    else:
        check_script(head, args, problems, line)


# ---------------------------------------------------------------- the checks

@pytest.mark.parametrize("doc", DOCS, ids=DOC_IDS)
def test_relative_links_and_anchors_resolve(doc: Path) -> None:
    problems = []
    for target in LINK.findall(prose(doc)):
        if re.match(r"^[a-z]+:", target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            problems.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{target}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=DOC_IDS)
def test_repository_paths_exist(doc: Path) -> None:
    problems = []
    for path in sorted(set(REPO_PATH.findall(text(doc)))):
        if path.startswith(GENERATED) or "{" in path:
            continue
        if not (list(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()):
            problems.append(path)
    assert not problems, f"paths named in {doc.name} that do not exist: {problems}"


@pytest.mark.parametrize("doc", DOCS, ids=DOC_IDS)
def test_commands_name_real_targets_subcommands_and_options(doc: Path) -> None:
    problems: list[str] = []
    for cmd in commands(doc):
        check_command(cmd, problems)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=DOC_IDS)
def test_dualpipe_flags_named_exist(doc: Path) -> None:
    unknown = sorted(set(OUR_FLAG.findall(text(doc))) - our_flags())
    assert not unknown, f"{doc.name} names options training_hooks does not define: {unknown}"


@pytest.mark.parametrize("doc", DOCS, ids=DOC_IDS)
def test_python_examples_import_real_names(doc: Path) -> None:
    problems = []
    for block in fenced(doc, ("python",)):
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dualpipe_megatron"):
                if not module_exists(node.module):
                    problems.append(f"no module {node.module}")
                    continue
                problems += [f"{node.module} has no {a.name}" for a in node.names
                             if a.name not in top_level_names(node.module)]
    assert not problems, "\n".join(problems)


def test_readme_flag_table_lists_every_option() -> None:
    """The README's flag table is the user's first stop: every option we add must be in it."""
    table = "\n".join(ln for ln in prose(ROOT / "README.md").splitlines() if ln.startswith("| `--"))
    missing = sorted(f for f in our_flags() if f"`{f}" not in table)
    assert not missing, f"README flag table lacks {missing}"


def test_code_tables_name_files_that_exist() -> None:
    """Rows like "| `dir/` | `a.py` (...), `b.py` |": every file named exists in that folder."""
    problems = []
    for doc in DOCS:
        for row in re.findall(r"^\| `([\w/]+/)` \|(.*)$", prose(doc), re.M):
            folder = ROOT / row[0]
            for name in re.findall(r"`([\w.-]+\.(?:py|sh|sbatch|patch))`", row[1]):
                if not folder.is_dir() or not list(folder.rglob(name)):
                    problems.append(f"{doc.name}: {row[0]}{name}")
    assert not problems, f"files named in code tables that do not exist: {problems}"
