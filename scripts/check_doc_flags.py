#!/usr/bin/env python3
"""Checks that the command lines quoted in README.md and docs/*.md use only flags the programs
accept, so that the documentation cannot silently rot when a flag is renamed or removed.

Usage (what ctest runs, tests/CMakeLists.txt):
  check_doc_flags.py --root REPO --program pipefisher_sim=PATH --program pipefisher_train=PATH ...
                     [--gbench PATH]

Every invocation of one of the project's own programs is checked: in fenced code blocks (with
`\\` line continuations joined, `$ ` prompts, `NAME=path` variables such as the README's
`S=build/release/sim/cli/pipefisher_sim` followed by `$S ...`, env-var prefixes, wrappers such as
mpirun or timeout) and in inline backtick spans. A program is recognised by its name, whatever its
directory (`build/release/`, `./`, none). The flags each accepts come from the program itself:
  - pipefisher_sim / _train / _data (CLI11): their `--help`, and `SUB --help` per subcommand; the
    flags after a subcommand must be that subcommand's;
  - bench programs (every one the CMake files define, built here or not): the "--flag" literals
    of bench/NAME.cpp (their hand-written parsers) plus, for Google Benchmark programs, the
    library's flags from `--help` of the benchmark program given by --gbench (without one, in a
    build without benchmarks, `--benchmark_*` flags are counted as unchecked);
  - scripts/*.sh: the flags of their `case` labels; scripts/*.py, bench/*.py: their argparse
    add_argument flags, per subparser.
Flags named without their program (prose, backtick spans such as `--kfac-policy fill`, comments
of code blocks) must be some program's; a span `SUBCOMMAND --flag` (`calibrate --max-spread`)
that subcommand's. ALLOWED below lists, per file and with the reason, the few flags that are
genuinely not this project's (mpirun's, another repository's, an option kept on a branch).
Each problem is one line `file:line: program: unknown flag --x` (or, for a flag with a fixed set
of values, `file:line: program: --flag v: unknown value (allowed: ...)`); exit status 1 if any.
What cannot be checked in this build is counted and named in the summary line, never silently
passed as checked.
"""
import argparse
import os
import re
import shlex
import subprocess
import sys

# Scripts that hand the rest of their arguments to a program after one of their own flags:
# `scripts/demo.sh --train FLAGS...` runs pipefisher_train with FLAGS.
PASSTHROUGH = {
    "scripts/demo.sh": {"--train": "pipefisher_train", "--sim": "pipefisher_sim"},
}

# Commands that run another command given later on their line; the program is searched for
# after them (their own options are not checked).
WRAPPERS = {
    "mpirun", "mpiexec", "srun", "env", "time", "timeout", "nice", "taskset", "numactl", "sudo",
    "exec", "nsys", "ncu", "compute-sanitizer", "valgrind", "gdb", "perf", "python", "python3",
    "bash", "sh", "do", "then", "else", "xargs", "/usr/bin/time", "!", "for", "while", "if",
}

# Flags the documentation names that are genuinely not this project's current CLI, per file, with
# why. Keep it short: a renamed flag is fixed in the docs, never listed here.
ALLOWED = {
    ("docs/runtime.md", "--oversubscribe"): "Open MPI's mpirun options of the MPI tests",
    ("docs/runtime.md", "--bind-to"): "Open MPI's mpirun options of the MPI tests",
    ("docs/runtime.md", "--allow-run-as-root"): "Open MPI's mpirun options of the MPI tests",
    ("docs/simulator.md", "--n_batches"): "PipeFisher's harness prof_kron.py, another repository",
    ("docs/simulator.md", "--cache-levels"):
        "'Tried and not kept': calibrate's option on branch simfid-models only, not on main",
}

# Fenced blocks in these languages are not shell.
NON_SHELL = {"json", "cpp", "c++", "c", "cmake", "python", "py", "yaml", "csv", "cuda", "diff"}

SEPARATORS = {"|", "||", "&&", ";", "&", "(", ")", "{", "}", "$("}

BINARY_NAME = re.compile(r"^(?:.*/)?((?:pipefisher|bench)_[A-Za-z0-9_]+)$")
SCRIPT_PATH = re.compile(r"^(?:.*/)?((?:scripts|bench)/[A-Za-z0-9_.-]+\.(?:sh|py))$")
LONG_FLAG = re.compile(r"^--[A-Za-z0-9][A-Za-z0-9_.-]*$")
SHORT_FLAG = re.compile(r"^-[A-Za-z]$")
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
PLACEHOLDER = re.compile(r"[$<>{}|\[\]*]|\.\.\.|^[A-Z_]+$|^-")
VARIABLE = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?")


class Program:
    """The flags a program accepts: its own, and per subcommand; for a flag with a fixed set of
    values (CLI11's `TEXT:{gpipe,1f1b,...}`), those values."""

    def __init__(self, flags, subcommands=None, choices=None):
        self.flags = set(flags)
        self.subcommands = subcommands or {}
        self.choices = choices or {}


def require_built(path):
    # Never check less than asked: a program to ask that is not built is an error, not a skip.
    if not os.access(path, os.X_OK):
        sys.exit(f"check_doc_flags: {path} is not built (build it, or the whole project, first)")


def help_text(path, args):
    require_built(path)
    result = subprocess.run([path, *args, "--help"], capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        sys.exit(f"check_doc_flags: '{path} {' '.join(args)} --help' exited {result.returncode}")
    return result.stdout


def cli11_sections(text):
    """The option names, their fixed values and the subcommand names of one CLI11 --help page."""
    flags, choices, subcommands, section = set(), {}, [], None
    for line in text.splitlines():
        if re.match(r"^\S.*:$", line):
            section = line[:-1]
            continue
        if not line.startswith("  ") or line.startswith("   "):
            continue  # a wrapped description, not an entry
        fields = line.split()
        names = fields[0]
        if section == "Options":
            flags.update(n for n in names.split(",") if n.startswith("-"))
            values = re.match(r"^[A-Z]+:\{([^}]*)\}", fields[1]) if len(fields) > 1 else None
            if values:
                choices.update((n, set(values.group(1).split(","))) for n in names.split(","))
        elif section == "Subcommands":
            subcommands.append(names)
    return flags, choices, subcommands


def cli11_program(path):
    flags, choices, subcommand_names = cli11_sections(help_text(path, []))
    subcommands = {}
    for name in subcommand_names:
        sub_flags, sub_choices, _ = cli11_sections(help_text(path, [name]))
        subcommands[name] = Program(sub_flags, choices=sub_choices)
    return Program(flags, subcommands, choices)


def gbench_flags(path):
    """Google Benchmark's own flags, from `--help` of any program linked with it."""
    require_built(path)
    text = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=60).stdout
    return set(re.findall(r"\[(--[A-Za-z0-9_]+)", text))


def source_literal_flags(source):
    # "--flag" or "--flag=" as a whole string literal: what the hand-written parsers compare.
    return set(re.findall(r'"(--?[A-Za-z][A-Za-z0-9_-]*)=?"', source))


def bench_program(source_path, gbench):
    with open(source_path, encoding="utf-8") as f:
        source = f.read()
    flags = source_literal_flags(source)
    if "benchmark::Initialize" in source or "BENCHMARK_MAIN" in source:
        flags |= gbench if gbench is not None else set()
    return Program(flags)


def shell_script_flags(source):
    flags = set()
    for line in source.splitlines():
        # case labels: `  --seconds) ...`, `  -h|--help) ...`
        label = re.match(r"^\s*((?:-[A-Za-z0-9-]+\s*\|\s*)*-[A-Za-z0-9-]+)\)", line)
        if label:
            flags.update(part.strip() for part in label.group(1).split("|"))
    return flags


def python_script_program(source):
    """argparse flags, per subparser: `fit = sub.add_parser("fit")` then `fit.add_argument(...)`."""
    subparsers = dict(re.findall(r"(\w+)\s*=\s*\w+\.add_parser\(\s*[\"']([\w-]+)[\"']", source))
    flags = {"-h", "--help"}
    subcommands = {name: Program({"-h", "--help"}) for name in subparsers.values()}
    for call in re.finditer(r"(\w+)\.add_argument\(([^)]*)", source):
        names = re.findall(r"[\"'](--?[A-Za-z][A-Za-z0-9_-]*)[\"']", call.group(2))
        if call.group(1) in subparsers:
            subcommands[subparsers[call.group(1)]].flags.update(names)
        else:
            flags.update(names)
    return Program(flags, subcommands)


def declared_targets(root):
    """Executables the project's CMake files define (built or not in this configuration)."""
    names = set()
    for directory, subdirectories, files in os.walk(root):
        # Not into build trees, virtual environments or .git.
        subdirectories[:] = [d for d in subdirectories if d != "build" and not d.startswith(".")]
        for name in files:
            if name == "CMakeLists.txt" or name.endswith(".cmake"):
                with open(os.path.join(directory, name), encoding="utf-8") as f:
                    text = f.read()
                names.update(re.findall(r"add_executable\(\s*([A-Za-z0-9_]+)", text))
                names.update(re.findall(r"pf_add_benchmark\(\s*NAME\s+([A-Za-z0-9_]+)", text))
    return names


class Catalog:
    def __init__(self, root, binaries, gbench):
        self.root = root
        self.programs = {}
        self.declared = declared_targets(root)
        self.all_flags = None
        gbench_set = gbench_flags(gbench) if gbench else None
        for name, path in binaries.items():
            self.programs[name] = cli11_program(path)
        # Google Benchmark's flags, where this build has no benchmark program to ask.
        self.unchecked_prefix = "--benchmark_" if gbench_set is None else None
        for name in sorted(n for n in self.declared if n.startswith("bench_")):
            source = os.path.join(root, "bench", name + ".cpp")
            if os.path.exists(source):
                self.programs[name] = bench_program(source, gbench_set)

    def every_flag(self):
        if self.all_flags is None:
            for folder in ("scripts", "bench"):
                for name in os.listdir(os.path.join(self.root, folder)):
                    if name.endswith((".sh", ".py")):
                        self.script(f"{folder}/{name}")
            self.all_flags = set()
            for program in self.programs.values():
                self.all_flags |= program.flags
                for subcommand in program.subcommands.values():
                    self.all_flags |= subcommand.flags
        return self.all_flags

    def script(self, relative):
        if relative not in self.programs:
            path = os.path.join(self.root, relative)
            if not os.path.exists(path):
                return None
            with open(path, encoding="utf-8") as f:
                source = f.read()
            if relative.endswith(".sh"):
                self.programs[relative] = Program(shell_script_flags(source))
            else:
                self.programs[relative] = python_script_program(source)
        return self.programs[relative]


def logical_lines(path):
    """(line number, text, kind) of every candidate of a Markdown file: kind "command" for a line
    of a fenced shell block (continuations joined), "comment" for the `# ...` comment of one,
    "inline" for a backtick span of prose, "prose" for a line's text outside its spans."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    fence, language, pending, pending_line = None, "", "", 0
    paragraph, paragraph_line = [], 0
    for number, line in enumerate(lines, start=1):
        stripped = line.strip()
        opener = re.match(r"^(`{3,}|~{3,})\s*([A-Za-z0-9+_-]*)", stripped)
        if fence is None and opener:
            fence, language = opener.group(1), opener.group(2).lower()
            continue
        if fence is not None:
            if stripped.startswith(fence) and stripped.strip(fence[0]) == "":
                if pending:
                    yield pending_line, pending, "command"
                fence, pending = None, ""
                continue
            if language in NON_SHELL:
                continue
            comment = re.search(r"(?:^|\s)#(.*)$", line)
            if comment:
                yield number, comment.group(1), "comment"
            text = re.sub(r"^\s*[$>] ", "", line) if not pending else line
            if not pending:
                pending_line = number
            if text.rstrip().endswith("\\"):
                pending += text.rstrip()[:-1] + " "
                continue
            yield pending_line, pending + text, "command"
            pending = ""
            continue
        # Prose: a span may run over lines of its paragraph (`pipefisher_sim search --model X
        # --gpus N`), so spans are found in the paragraph, at the line where they start.
        if not paragraph:
            paragraph_line = number
        paragraph.append(line)
        if stripped == "" or number == len(lines) or re.match(r"^\s*(```|~~~)", lines[number]):
            yield from prose_spans(paragraph_line, "\n".join(paragraph))
            paragraph = []


def prose_spans(first_line, text):
    """The backtick spans of a paragraph ("inline"), then each line's text outside them ("prose":
    a flag named without backticks must exist too)."""
    spans = r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)"
    for span in re.finditer(spans, text, re.DOTALL):
        number = first_line + text.count("\n", 0, span.start())
        yield number, span.group(2).replace("\n", " "), "inline"
    outside = re.sub(spans, lambda m: "\n" * m.group(0).count("\n"), text, flags=re.DOTALL)
    for offset, line in enumerate(outside.split("\n")):
        if "--" in line:
            yield first_line + offset, line, "prose"


def tokens_of(text):
    try:
        lexer = shlex.shlex(text, posix=True, punctuation_chars=False)
        lexer.whitespace_split = True
        lexer.commenters = "#"
        return list(lexer)
    except ValueError:  # an unbalanced quote in prose: split on blanks
        return text.split("#")[0].split()


def segments(tokens):
    current = []
    for token in tokens:
        if token in SEPARATORS:
            yield current
            current = []
        elif token.endswith(";") and token != ";":
            current.append(token.rstrip(";"))
            yield current
            current = []
        else:
            current.append(token)
    yield current


def expand(token, variables):
    return VARIABLE.sub(lambda m: variables.get(m.group(1), m.group(0)), token)


def identify(token, variables):
    """The program name a command-position token runs, or None."""
    resolved = expand(token, variables)
    # `bench_model_$b` (an A/B pair of builds of one program): the program is bench_model.
    resolved = re.sub(r"_?\$\{?[A-Za-z_][A-Za-z0-9_]*\}?$", "", resolved)
    binary = BINARY_NAME.match(resolved)
    if binary:
        return binary.group(1)
    script = SCRIPT_PATH.match(resolved)
    if script:
        return script.group(1)
    return None


def flag_of(token):
    token = token.strip("[]")
    token = token.split("=", 1)[0].rstrip(",.)")
    if LONG_FLAG.match(token) or SHORT_FLAG.match(token):
        return token
    return None


class Checker:
    def __init__(self, catalog, verbose):
        self.catalog = catalog
        self.verbose = verbose
        self.problems = []
        self.checked = 0
        self.skipped = {}
        self.allowed_used = set()

    def report(self, where, program, flag):
        prefix = self.catalog.unchecked_prefix
        if prefix and flag.startswith(prefix):
            self.skipped[prefix + "*"] = self.skipped.get(prefix + "*", 0) + 1
            return
        key = (where.rsplit(":", 1)[0], flag)
        if key in ALLOWED:
            self.allowed_used.add(key)
            return
        self.problems.append(f"{where}: {program}: unknown flag {flag}")

    def lookup(self, name):
        if name in self.catalog.programs:
            return self.catalog.programs[name]
        if name.endswith((".sh", ".py")):
            return self.catalog.script(name)
        return None

    def check_arguments(self, where, name, arguments, inline=False):
        program = self.lookup(name)
        if program is None:
            if inline and not arguments:
                return  # a name in prose (`pipefisher_formula_refresh_steps`, a JSON field)
            if name in self.catalog.declared or name.endswith((".sh", ".py")):
                # A target with no flags to read here (an MPI test, a fuzz harness) or another
                # project's script (PipeFisher's prof_kron.py): counted as unchecked.
                self.skipped[name] = self.skipped.get(name, 0) + 1
            else:
                self.problems.append(f"{where}: {name}: unknown program")
            return
        self.checked += 1
        if self.verbose:
            print(f"{where}: {name}: {' '.join(arguments)}")
        accepted, choices, label = program.flags, program.choices, name
        subcommand_seen = False
        previous_was_flag = False
        for index, token in enumerate(arguments):
            if token == "--":
                return
            flag = flag_of(token)
            if flag is None:
                if (not subcommand_seen and token in program.subcommands
                        and not previous_was_flag):
                    subcommand = program.subcommands[token]
                    accepted, choices = subcommand.flags, subcommand.choices
                    label = f"{name} {token}"
                    subcommand_seen = True
                previous_was_flag = False
                continue
            previous_was_flag = "=" not in token
            if flag not in accepted:
                self.report(where, label, flag)
            elif flag in choices:
                value = token.split("=", 1)[1] if "=" in token else (
                    arguments[index + 1] if index + 1 < len(arguments) else None)
                # A placeholder (`X`, `MODE`, `none|host`, `{on,off}`, `$P`, `...`) is no value.
                if (value is not None and not PLACEHOLDER.search(value)
                        and value not in choices[flag]):
                    self.problems.append(f"{where}: {label}: {flag} {value}: unknown value "
                                         f"(allowed: {', '.join(sorted(choices[flag]))})")
            passthrough = PASSTHROUGH.get(name, {}).get(flag)
            if passthrough:
                self.check_arguments(where, passthrough, arguments[index + 1:])
                return

    def check_line(self, where, text, variables, inline):
        """Checks the invocations of one line; returns whether it had any."""
        found = False
        tokens = tokens_of(text)
        for segment in segments(tokens):
            # Record `NAME=value` lines (no command): the README's `S=.../pipefisher_sim`.
            if segment and all(ASSIGNMENT.match(t) for t in segment):
                if not inline:
                    for token in segment:
                        key, value = token.split("=", 1)
                        variables[key] = expand(value, variables)
                continue
            position = 0
            while position < len(segment) and ASSIGNMENT.match(segment[position]):
                position += 1
            if position >= len(segment):
                continue
            start = None
            if identify(segment[position], variables):
                start = position
            elif os.path.basename(segment[position]) in WRAPPERS:
                for later in range(position + 1, len(segment)):
                    if identify(segment[later], variables):
                        start = later
                        break
            if start is None:
                continue
            name = identify(segment[start], variables)
            self.check_arguments(where, name, segment[start + 1:], inline)
            found = True
        return found

    def check_prose_flags(self, where, text, label, accepted):
        """Flags named without their program, each must be in `accepted`; `--kfac-*` needs one
        flag with that prefix."""
        for word in re.findall(r"(?<![\w-])--[A-Za-z0-9][A-Za-z0-9_.-]*\*?", text):
            self.checked += 1
            if word.endswith("*"):
                if not any(flag.startswith(word[:-1]) for flag in accepted):
                    self.report(where, label, word)
            elif word.rstrip(".") not in accepted:
                self.report(where, label, word.rstrip("."))

    def check_comment(self, where, text):
        """A `# ...` comment of a code block, or prose outside backticks: every flag it names is
        some program's."""
        self.check_prose_flags(where, text, "any program", self.catalog.every_flag())

    def check_span(self, where, text):
        """A prose span without a program: `--flag value` (some program's flag) or
        `SUBCOMMAND --flag` (that subcommand's, e.g. `calibrate --max-spread`); a span starting
        with another word is another tool's (`cmake --build`, `ctest --test-dir`)."""
        words = text.split()
        if not words:
            return
        if words[0].startswith("--"):
            self.check_prose_flags(where, text, "any program", self.catalog.every_flag())
            return
        owners = [(name, program.subcommands[words[0]])
                  for name, program in sorted(self.catalog.programs.items())
                  if words[0] in program.subcommands]
        if owners:
            accepted = set().union(*(sub.flags for _, sub in owners))
            label = " or ".join(f"{name} {words[0]}" for name, _ in owners)
            self.check_prose_flags(where, " ".join(words[1:]), label, accepted)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", required=True, help="the repository")
    parser.add_argument("--program", action="append", default=[], metavar="NAME=PATH",
                        help="a CLI11 program of this build")
    parser.add_argument("--gbench", help="any Google Benchmark program, for the library's flags")
    parser.add_argument("--verbose", action="store_true", help="print every invocation checked")
    parser.add_argument("files", nargs="*", help="Markdown files (default: README.md, docs/*.md)")
    args = parser.parse_args()

    root = os.path.abspath(args.root)
    binaries = dict(item.split("=", 1) for item in args.program)
    catalog = Catalog(root, binaries, args.gbench)
    docs = sorted(f for f in os.listdir(os.path.join(root, "docs")) if f.endswith(".md"))
    files = args.files or ["README.md"] + [os.path.join("docs", f) for f in docs]

    checker = Checker(catalog, args.verbose)
    for relative in files:
        variables = {}
        for number, text, kind in logical_lines(os.path.join(root, relative)):
            where = f"{relative}:{number}"
            if kind in ("comment", "prose"):
                checker.check_comment(where, text)
            elif not checker.check_line(where, text, variables, kind == "inline"):
                if kind == "inline":
                    checker.check_span(where, text)

    if not args.files:
        # An entry nothing needs any more goes, so that the list cannot grow stale.
        for file, flag in sorted(set(ALLOWED) - checker.allowed_used):
            checker.problems.append(f"{file}: ALLOWED lists {flag}, which it no longer names")
    for problem in checker.problems:
        print(problem)
    skipped = ", ".join(f"{n} ({c})" for n, c in sorted(checker.skipped.items()))
    print(f"check_doc_flags: {checker.checked} command lines checked in {len(files)} files, "
          f"{len(checker.problems)} problems" + (f"; unchecked in this build: {skipped}"
                                                   if skipped else ""))
    return 1 if checker.problems else 0


if __name__ == "__main__":
    sys.exit(main())
