#!/usr/bin/env python3
"""The commands the docs show, checked against the binary they document.

Run by scripts/test.sh after the cargo tests; runs alone too (no network, a few seconds
once the debug binary is built). Reads README.md, deploy/README.md and docs/*.md.

Fenced blocks of shell (```sh, ```bash, ```shell: every line; ```console: the `$ ` lines):
  - A block that needs a Kubernetes cluster says so in its info string: ```sh cluster
    (kubectl or oc against an API server, kubeadm, helm, `kubelet-ca-agent sync` or
    `publish` with a cluster source). One that needs a node, as root, says ```sh node
    (systemctl, journalctl, curl of a running agent or kubelet, a file outside the agent's
    own paths). A marked block is not run.
  - Every other block is run here when it can be, in a sandbox: a fresh temporary
    directory, /etc/kubernetes and /var/lib/kubelet-ca-agent in the text mapped into it
    (seeded with signers made by openssl, a bundle and state written by `sync`),
    kubelet-ca-agent the debug build, a copy of deploy/ and systemd/ as the working
    directory with a rendered.json beside them, HOME in the sandbox, no kubeconfig. Each
    command must succeed; `inspect` and `drift check` may also exit 1, their verdict.
  - A block that cannot be run (a daemon such as `run`, placeholders such as <tag>, a
    build, the test suite, a program the sandbox does not offer) is parsed only. A marker
    on a block that could be run is an error: the check runs it instead.
In every block, marked or not, and in inline code (`kubelet-ca-agent ...`, `sync --flag`,
a bare `--flag`), each kubelet-ca-agent invocation is checked against the binary's own
--help: the subcommand exists, each flag exists for that subcommand, takes a value when
it is given one and only then, a value is one of the listed possible values (or a
duration, or a source spec), required flags are there and positional arguments are not
too many. KUBELET_CA_AGENT_* names must be the environment names of real flags, scripts
named must exist, cargo flags must be in `cargo <command> --help`, and links to other
files of the repository (with their #anchors) must resolve.

Stated exit codes and defaults, in the docs' prose and in every --help text:
  - Each statement of an exit code ("exits 0", "(exit 2)", "Exits 0 when ..., 1 when ...")
    is matched by a pattern of EXIT_CLAIMS, whose scenario runs the binary in a sandbox as
    above: the code stated must be the code the binary exits with. A statement no pattern
    covers is an error (add a scenario, or to UNCHECKED_EXITS with why it cannot run here).
  - Each default stated beside its flag (`--flag` (default X), `--flag` (X)) and those of
    DEFAULT_CLAIMS must be the [default: ...] of that flag's --help, which the binary prints
    from the value it uses.

The operator docs stand on their own: every doc but the developers' (DEVELOPER_DOCS:
architecture, testing, performance) is an operator doc, and may not cite the contract the
project is built to (SPEC 8c, SPEC section 11, SPEC.md), which an operator does not have.
A metavariable such as `--source SPEC` is not a citation.

Usage: scripts/check-docs.py [--binary PATH] [--verbose] [FILE.md ...]
"""

import argparse
import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKERS = {"cluster", "node"}
SHELL_LANGS = {"sh", "bash", "shell", "console"}
# Docs for the project's developers, which may cite SPEC; every other doc is an operator's.
DEVELOPER_DOCS = {"docs/architecture.md", "docs/testing.md", "docs/performance.md"}
# A citation of the contract: "SPEC 8c", "SPEC section 11", "SPEC.md", "SPEC's".
# (Not a numbered list item after a metavariable at a line's end: "--source SPEC\n2. ...".)
SPEC_CITATION = re.compile(
    r"\bSPEC(?:\.md\b|'s\b|[ \t]+(?:section[ \t]+|§[ \t]*)?\d+[a-z]?"
    r"|[ \t]*\n[ \t]*(?:section\s+)?\d+[a-z]?\b(?!\.\s))")
# Paths of a node that the sandbox provides (everything else absolute is the node's).
MAPPED = ("/etc/kubernetes", "/var/lib/kubelet-ca-agent")
HARMLESS_PATHS = ("/dev/null", "/dev/stdin", "/dev/stdout", "/dev/stderr", "-")
# Flags of other tools that docs name on their own in prose, by file.
FOREIGN_PROSE_FLAGS = {
    "docs/testing.md": {
        "--in-place": "cargo mutants",
        "--timeout": "cargo mutants",
        "--iterate": "cargo mutants",
        "--in-diff": "cargo mutants",
    },
}
# Programs the sandbox runs (besides kubelet-ca-agent and `kubectl kustomize`).
SANDBOX_TOOLS = {
    "cat", "echo", "printf", "mkdir", "grep", "sed", "head", "tail", "ls", "cp", "mv",
    "basename", "dirname", "base64", "wc", "sort", "uniq", "diff", "cmp", "tee", "test",
    "true", "false", "cut", "tr", "touch", "awk", "openssl", "sha256sum", "jq", "[",
}
CLUSTER_TOOLS = {"kubectl", "oc", "kubeadm", "helm"}
NODE_TOOLS = {
    "systemctl", "journalctl", "restorecon", "sysctl", "lsattr", "chattr", "crictl",
    "curl", "wget", "setenforce", "mount", "umount", "reboot", "kubelet",
}
CARGO_BUILTINS = {
    "build", "test", "bench", "run", "install", "check", "clippy", "fmt", "doc", "metadata",
    "tree", "update", "fetch", "clean",
}
SEPARATORS = {"|", "||", "&&", ";", "&", "(", ")", "|&", ";;", "!", "{", "}"}
REDIRECTS = {">", ">>", "<", "<<", "<<<", ">&", "&>", "<&", ">|", "<>", "&>>", "<<-"}
PLACEHOLDER = re.compile(r"<([A-Za-z][\w .'/:-]*?)>")
DURATION = re.compile(r"^(\d+(\.\d+)?\s*[a-zA-Zµ]+\s*)+$")
SOURCE_SCHEMES = ("configmap:", "controllerconfig:", "file:", "dir:")


def kubectl_kustomize_works():
    """kubectl 1.21+ embeds kustomize v4+ (components, `images:` on a remote base); an older
    or missing kubectl leaves `kubectl kustomize` blocks parsed only."""
    try:
        out = subprocess.run(["kubectl", "version", "--client"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return re.search(r"Kustomize Version: v([4-9]|[1-9][0-9])", out.stdout) is not None


KUSTOMIZE_OK = kubectl_kustomize_works()


class Failure:
    def __init__(self):
        self.errors = []
        self.unknown_flags = []

    def error(self, where, message):
        self.errors.append(f"{where}: {message}")


# --- the binary's command line, from its --help ---------------------------------------


class Command:
    """One command of the binary as its --help describes it."""

    def __init__(self, path, text):
        self.path = path
        self.options = {}  # long name -> Option
        self.shorts = {}  # short letter -> Option
        self.positionals = 0
        self.subcommands = {}
        self.subcommand_names = []
        self.required = []
        self.text = text
        self._parse(text)

    def _parse(self, text):
        section = None
        current = None
        blocks = []
        for line in text.splitlines():
            if re.match(r"^[A-Z][\w ]*:\s*$", line):
                section = line.strip().rstrip(":")
                current = None
                continue
            usage = re.match(r"^Usage: (.*)", line)
            if usage:
                # Flags outside brackets in the usage line are required.
                outside = re.sub(r"\[[^\]]*\]", "", usage.group(1))
                self.required = re.findall(r"--([a-z0-9][a-z0-9-]*)", outside)
                continue
            if section == "Commands":
                m = re.match(r"^  ([a-z][\w-]*)(\s|$)", line)
                if m:
                    self.subcommand_names.append(m.group(1))
            elif section == "Arguments":
                if re.match(r"^  \S", line):
                    self.positionals += 1
            elif section is not None:  # Options, and headings of option groups (Logging)
                m = re.match(
                    r"^\s{2,}(?:-(?P<short>\w), )?--(?P<long>[a-z0-9][a-z0-9-]*)(?: <(?P<value>[^>]+)>)?",
                    line,
                )
                if m:
                    current = {"m": m, "text": [line[m.end():]]}
                    blocks.append(current)
                elif current is not None:
                    current["text"].append(line)
        for block in blocks:
            m = block["m"]
            text = " ".join(t.strip() for t in block["text"])
            possible = None
            pv = re.search(r"\[possible values: ([^\]]+)\]", text)
            if pv:
                possible = [v.strip() for v in pv.group(1).split(",")]
            elif "Possible values:" in text:
                after = "\n".join(block["text"]).split("Possible values:", 1)[1]
                possible = re.findall(r"^\s+- ([^:\s]+)", after, re.M)
            env = re.search(r"\[env: (\w+)=", text)
            default = re.search(r"\[default: ([^\]]+)\]", text)
            opt = {
                "name": m.group("long"),
                "value": m.group("value"),
                "possible": possible,
                "env": env.group(1) if env else None,
                "default": default.group(1).strip() if default else None,
            }
            self.options[opt["name"]] = opt
            if m.group("short"):
                self.shorts[m.group("short")] = opt

    def name(self):
        return " ".join(("kubelet-ca-agent",) + self.path)


def load_interface(binary):
    def help_of(path):
        out = subprocess.run(
            [binary, *path, "--help"], capture_output=True, text=True, timeout=30,
            env=clean_env(),
        )
        if out.returncode != 0:
            sys.exit(f"check-docs: {binary} {' '.join(path)} --help failed: {out.stderr}")
        return out.stdout

    def build(path):
        cmd = Command(path, help_of(path))
        for sub in cmd.subcommand_names:
            if sub == "help":
                continue
            cmd.subcommands[sub] = build(path + (sub,))
        return cmd

    return build(())


def all_commands(cmd):
    yield cmd
    for sub in cmd.subcommands.values():
        yield from all_commands(sub)


def clean_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBELET_CA_AGENT_")}
    env.pop("RUST_LOG", None)
    return env


# --- checking one invocation ----------------------------------------------------------


def is_placeholder(word):
    return (
        "PLACEHOLDER_" in word
        or "$" in word
        or "`" in word
        or re.fullmatch(r"[A-Z][A-Z0-9_/\[\]|.-]*", word) is not None
        or word in ("...", "…")
    )


def check_value(opt, value, where, fail, synopsis):
    if is_placeholder(value):
        return
    values = value.split("|") if synopsis else [value]
    for v in values:
        if opt["possible"] is not None:
            if v not in opt["possible"]:
                fail.error(
                    where,
                    f"--{opt['name']} {v}: not one of {', '.join(opt['possible'])}",
                )
        elif opt["value"] == "DURATION":
            if not DURATION.match(v):
                fail.error(where, f"--{opt['name']} {v}: not a duration such as 90s, 15m, 36h, 30d")
        elif opt["name"] == "source":
            for spec in v.split(","):
                if spec and not spec.startswith(SOURCE_SCHEMES) and not is_placeholder(spec):
                    fail.error(
                        where,
                        f"--source {spec}: not a source spec ({', '.join(SOURCE_SCHEMES)}...)",
                    )


def check_invocation(root, args, where, fail, synopsis=False, env_names=()):
    """Checks the words after `kubelet-ca-agent`; returns the command reached and the
    options given ({name: value or True})."""
    node = root
    given = {}
    positionals = 0
    chose_sub = False
    wants_help = False
    i = 0
    while i < len(args):
        word = args[i]
        if synopsis:
            word = word.strip("[]").rstrip(".").rstrip("]")
            if word in ("", "|"):
                i += 1
                continue
        if word == "--":
            positionals += len(args) - i - 1
            break
        if word.startswith("--") and len(word) > 2:
            name, eq, value = word[2:].partition("=")
            opt = node.options.get(name)
            if opt is None:
                if PLACEHOLDER.search(name) or "PLACEHOLDER_" in name:
                    i += 1
                    continue
                fail.error(where, f"{node.name()}: no flag --{name} (not in `{node.name()} --help`)")
                fail.unknown_flags.append((node.name(), f"--{name}", where))
                i += 1
                continue
            if name in ("help", "version"):
                wants_help = True
            if opt["value"]:
                if eq:
                    given[name] = value
                elif i + 1 < len(args) and not (
                    args[i + 1].startswith("-") and args[i + 1] != "-" and not synopsis
                ):
                    value = args[i + 1]
                    if synopsis:
                        value = value.strip("[]").rstrip(".").rstrip("]")
                    given[name] = value
                    i += 1
                else:
                    fail.error(where, f"{node.name()}: --{name} takes a value ({opt['value']})")
                    i += 1
                    continue
                check_value(opt, given[name], where, fail, synopsis)
            else:
                if eq:
                    fail.error(where, f"{node.name()}: --{name} takes no value (given {value!r})")
                given[name] = True
            i += 1
            continue
        if word.startswith("-") and word != "-" and len(word) >= 2 and not synopsis:
            letter, rest = word[1], word[2:]
            opt = node.shorts.get(letter)
            if opt is None:
                fail.error(where, f"{node.name()}: no flag -{letter}")
                fail.unknown_flags.append((node.name(), f"-{letter}", where))
            elif opt["value"]:
                if not rest:
                    if i + 1 < len(args):
                        rest = args[i + 1]
                        i += 1
                    else:
                        fail.error(where, f"{node.name()}: -{letter} takes a value")
                given[opt["name"]] = rest
                check_value(opt, rest, where, fail, synopsis)
            else:
                if opt["name"] in ("help", "version"):
                    wants_help = True
                given[opt["name"]] = True
            i += 1
            continue
        # A word: a subcommand, or a positional argument.
        if node.subcommand_names and not chose_sub:
            if word in node.subcommands:
                node = node.subcommands[word]
                i += 1
                continue
            if word == "help":
                return node, given, True
            if is_placeholder(word) or PLACEHOLDER.fullmatch(word):
                return None, given, True
            fail.error(where, f"{node.name()}: no command {word!r} (has {', '.join(node.subcommand_names)})")
            return None, given, True
        chose_sub = True
        positionals += 1
        if not synopsis and positionals > node.positionals:
            fail.error(where, f"{node.name()}: unexpected argument {word!r}")
        i += 1
    if not synopsis and not wants_help:
        if node.subcommand_names and node is not root:
            fail.error(where, f"{node.name()}: needs a command ({', '.join(node.subcommand_names)})")
        for req in node.required:
            env = node.options.get(req, {}).get("env")
            if req not in given and env not in env_names:
                fail.error(where, f"{node.name()}: --{req} is required")
    return node, given, wants_help


# --- shell text -----------------------------------------------------------------------


def logical_lines(text, first_line):
    """(line number, text, heredoc bodies) of each logical line: continuations joined,
    heredoc bodies taken out."""
    lines = text.split("\n")
    out = []
    i = 0
    while i < len(lines):
        start = i
        line = lines[i]
        while line.endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line[:-1] + " " + lines[i].strip()
        bodies = []
        for m in re.finditer(r"<<-?\s*(['\"]?)(\w+)\1", line):
            body = []
            while i + 1 < len(lines) and lines[i + 1].strip() != m.group(2):
                i += 1
                body.append(lines[i])
            i += 1  # the delimiter
            bodies.append("\n".join(body))
        out.append((first_line + start, line, bodies))
        i += 1
    return out


def tokenize(line):
    lex = shlex.shlex(line, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    lex.commenters = "#"
    try:
        return list(lex)
    except ValueError:
        return None


def simple_commands(line):
    """Each simple command of a line: (words, redirect targets, env assignments)."""
    tokens = tokenize(line)
    if tokens is None:
        return None
    commands = []
    words, targets, assigns = [], [], {}
    i = 0
    while i < len(tokens):
        t = tokens[i]
        if t in SEPARATORS or t == "$":
            if words or assigns:
                commands.append((words, targets, assigns))
            words, targets, assigns = [], [], {}
        elif t in REDIRECTS:
            if words and re.fullmatch(r"\d", words[-1]):
                words.pop()
            if i + 1 < len(tokens) and tokens[i + 1] not in SEPARATORS:
                if t not in ("<<", "<<-"):
                    targets.append(tokens[i + 1])
                i += 1
        elif not words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", t):
            k, _, v = t.partition("=")
            assigns[k] = v
        else:
            if t.endswith("$") and len(t) > 1:  # `../$(...)`: the rest is a substitution
                t = t[:-1]
                words.append(t)
                commands.append((words, targets, assigns))
                words, targets, assigns = [], [], {}
            else:
                words.append(t)
        i += 1
    if words or assigns:
        commands.append((words, targets, assigns))
    # `sudo`, `env`, `exec`, `nice -n N`, `timeout N`: the command is what follows.
    result = []
    for words, targets, assigns in commands:
        while words:
            if words[0] in ("sudo", "exec", "env", "time", "command"):
                words = words[1:]
            elif words[0] == "nice":
                words = words[3:] if len(words) > 2 and words[1] == "-n" else words[1:]
            elif words[0] == "timeout" and len(words) > 1:
                words = words[2:]
            elif re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
                k, _, v = words[0].partition("=")
                assigns[k] = v
                words = words[1:]
            else:
                break
        result.append((words, targets, assigns))
        # `kubectl exec POD -- CMD`: CMD is a command of its own.
        if words and words[0] in ("kubectl", "oc") and "--" in words:
            rest = words[words.index("--") + 1:]
            if rest:
                result.append((rest, [], {}))
    return result


def is_agent(word):
    return os.path.basename(word) == "kubelet-ca-agent"


def note_path(path, block):
    """An absolute path the sandbox does not provide is the node's; one under /tmp is the
    workstation's, outside the sandbox all the same."""
    if not path.startswith("/") or path in HARMLESS_PATHS:
        return
    if any(path == m or path.startswith(m + "/") for m in MAPPED):
        return
    if path == "/tmp" or path.startswith("/tmp/"):
        block.unrunnable.append("/tmp")
    else:
        block.needs.add("node")


class Block:
    def __init__(self, doc, line, lang, markers, text, indent):
        self.doc, self.line, self.lang, self.markers = doc, line, lang, markers
        self.text, self.indent = text, indent
        self.needs = set()  # "cluster", "node"
        self.unrunnable = []  # why it cannot be run here
        self.script = []  # the lines to run, for console blocks the commands only


def examine_block(block, root, fail, cargo_flags):
    """Checks the block's invocations, and notes what it needs and why it cannot run."""
    text = block.text
    if block.lang == "console":
        commands = []
        lines = text.split("\n")
        i = 0
        while i < len(lines):
            if lines[i].startswith("$ "):
                cmd = lines[i][2:]
                start = i
                while cmd.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    cmd += "\n" + lines[i]
                commands.append((start, cmd))
            i += 1
        block.script = [c for _, c in commands]
        units = []
        for start, cmd in commands:
            for ln, line, bodies in logical_lines(cmd, block.line + 1 + start):
                units.append((ln, line, bodies))
    else:
        block.script = [text]
        units = logical_lines(text, block.line + 1)
    if PLACEHOLDER.search(re.sub(r"<<-?\s*['\"]?\w+['\"]?", "", "\n".join(u[1] for u in units))):
        block.unrunnable.append("placeholders")
    for ln, line, bodies in units:
        where = f"{block.doc}:{ln}"
        if re.search(r"\[--[a-z]", line):
            block.unrunnable.append("a synopsis")
        marked = PLACEHOLDER.sub(lambda m: "PLACEHOLDER_" + re.sub(r"\W", "_", m.group(1)), line)
        commands = simple_commands(marked)
        if commands is None:
            fail.error(where, f"cannot parse as shell: {line.strip()}")
            continue
        for words, targets, assigns in commands:
            for k in assigns:
                check_env_name(k, root, where, fail)
            for t in targets:
                note_path(t, block)
            if not words:
                continue
            prog, args = words[0], words[1:]
            if is_agent(prog):
                node, given, helped = check_invocation(root, args, where, fail, env_names=assigns)
                if node is None or helped:
                    continue
                sub = node.path[:1]
                sources = given.get("source") or assigns.get("KUBELET_CA_AGENT_SOURCE")
                if sub in (("run",), ("sync",)) and not sources:
                    sources = node.options["source"]["default"] or ""
                cluster_source = bool(sources) and any(
                    s.startswith(("configmap:", "controllerconfig:")) for s in str(sources).split(",")
                )
                if sub in (("run",), ("publish",)) and "once" not in given:
                    # A daemon is never run here: parsed only, whatever it reads.
                    block.unrunnable.append("a daemon")
                    continue
                if sub in (("publish",), ("rollout",)) or cluster_source or "kubeconfig" in given:
                    block.needs.add("cluster")
                for a in args:
                    for piece in re.split(r"[=,]|(?<=:)(?=/)", a):
                        note_path(piece, block)
                continue
            if prog in CLUSTER_TOOLS:
                if prog == "kubectl" and args[:1] == ["kustomize"]:
                    if not KUSTOMIZE_OK:
                        block.unrunnable.append("no kubectl with kustomize v4+ here")
                    continue
                block.needs.add("cluster")
                if prog == "kubeadm":
                    block.needs.add("node")
                continue
            if prog in NODE_TOOLS:
                block.needs.add("node")
                continue
            if prog == "openssl" and args[:1] == ["s_client"]:
                block.needs.add("node")
                continue
            if prog == "cargo":
                check_cargo(args, where, fail, cargo_flags)
                block.unrunnable.append("cargo")
                continue
            if "scripts/" in prog:
                path = os.path.normpath(os.path.join(ROOT, prog))
                if not (os.path.isfile(path) and os.access(path, os.X_OK)):
                    fail.error(where, f"{prog}: no such executable script in the repository")
                block.unrunnable.append(prog)
                continue
            if prog == "install" or prog in SANDBOX_TOOLS:
                for a in args:
                    note_path(a, block)
                if prog == "install":
                    block.unrunnable.append("install")
                continue
            block.unrunnable.append(prog)


def check_cargo(args, where, fail, cache):
    if not args or args[0].startswith("+") or args[0] not in CARGO_BUILTINS:
        return
    sub = args[0]
    if sub not in cache:
        out = subprocess.run(["cargo", sub, "--help"], capture_output=True, text=True)
        cache[sub] = set(re.findall(r"(?<![\w-])--([a-z][a-z0-9-]*)", out.stdout))
    for a in args[1:]:
        m = re.match(r"^--([a-z][a-z0-9-]*)", a)
        if m and m.group(1) not in cache[sub]:
            fail.error(where, f"cargo {sub}: no flag --{m.group(1)} (not in `cargo {sub} --help`)")


def check_env_name(name, root, where, fail):
    if not name.startswith("KUBELET_CA_AGENT_"):
        return
    envs = {o["env"] for c in all_commands(root) for o in c.options.values() if o["env"]}
    if name not in envs:
        fail.error(where, f"{name}: no flag has this environment name")


# --- markdown -------------------------------------------------------------------------


FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*(.*)$")


def parse_markdown(doc, text):
    """Fenced blocks, and the prose (outside them) as (line number, text) paragraphs."""
    blocks, prose = [], []
    lines = text.split("\n")
    i = 0
    para, para_start = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        # CommonMark: the info string of a backtick fence holds no backtick, so a line that
        # starts with an inline span of backticks (```` ```sh ````) opens no block.
        if m and m.group(2)[0] == "`" and "`" in m.group(3):
            m = None
        if m:
            if para:
                prose.append((para_start, "\n".join(para)))
                para = []
            indent, fence, info = len(m.group(1)), m.group(2), m.group(3).strip()
            body = []
            j = i + 1
            while j < len(lines):
                close = re.match(r"^\s*(`{3,}|~{3,})\s*$", lines[j])
                if close and close.group(1)[0] == fence[0] and len(close.group(1)) >= len(fence):
                    break
                body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j].lstrip())
                j += 1
            words = info.split()
            lang = words[0] if words else ""
            blocks.append(Block(doc, i + 1, lang, words[1:], "\n".join(body), indent))
            i = j + 1
            continue
        if lines[i].strip():
            if not para:
                para_start = i + 1
            para.append(lines[i])
        elif para:
            prose.append((para_start, "\n".join(para)))
            para = []
        i += 1
    if para:
        prose.append((para_start, "\n".join(para)))
    return blocks, prose


def anchors_of(path):
    """GitHub's anchors of a markdown file's headings."""
    result = set()
    in_fence = False
    for line in open(path, encoding="utf-8"):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        m = None if in_fence else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            title = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1)).lower()
            slug = re.sub(r"[^\w\- ]", "", title).replace(" ", "-")
            n, base = 1, slug
            while slug in result:
                slug = f"{base}-{n}"
                n += 1
            result.add(slug)
    return result


def check_prose(doc, prose, root, fail):
    union = {}
    for c in all_commands(root):
        for name, opt in c.options.items():
            union.setdefault(name, []).append(opt)
    subs = set(root.subcommands)
    for start, text in prose:
        for m in re.finditer(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", text, re.S):
            where = f"{doc}:{start + text.count(chr(10), 0, m.start())}"
            span = re.sub(r"\s*\n\s*", " ", m.group(2)).strip()
            words = span.split()
            if not words:
                continue
            if words[0].startswith("--"):
                flag = re.match(r"--([a-z0-9][a-z0-9-]*)", words[0])
                if not flag:
                    continue
                name = flag.group(1)
                if name not in union:
                    foreign = FOREIGN_PROSE_FLAGS.get(doc, {})
                    if f"--{name}" in foreign:
                        continue
                    fail.error(where, f"--{name}: no kubelet-ca-agent command has this flag")
                    fail.unknown_flags.append(("kubelet-ca-agent (any command)", f"--{name}", where))
                    continue
                value = words[0].partition("=")[2] or " ".join(words[1:])
                if value and union[name][0]["value"] and not PLACEHOLDER.search(value):
                    probe = Failure()
                    ok = False
                    for opt in union[name]:
                        probe.errors = []
                        check_value(opt, value, where, probe, True)
                        ok = ok or not probe.errors
                    if not ok:
                        fail.errors.extend(probe.errors)
                continue
            marked = PLACEHOLDER.sub(lambda p: "PLACEHOLDER_" + re.sub(r"\W", "_", p.group(1)), span)
            if words[0] in subs and "--" in span:
                check_invocation(root, marked.split(), where, fail, synopsis=True)
                continue
            if is_agent(words[0]):
                check_invocation(root, marked.split()[1:], where, fail, synopsis=True)
                continue
            if words[0] in ("kubectl", "oc") or "|" in span:
                commands = simple_commands(marked) or []
                for cmd_words, _, assigns in commands:
                    if cmd_words and is_agent(cmd_words[0]):
                        check_invocation(root, cmd_words[1:], where, fail, synopsis=True)
        # Links to files of the repository, and their anchors.
        for m in re.finditer(r"\]\(([^)\s]+)\)", text):
            target = m.group(1)
            if re.match(r"^[a-z]+:", target):
                continue
            where = f"{doc}:{start + text.count(chr(10), 0, m.start())}"
            file, _, anchor = target.partition("#")
            path = os.path.normpath(os.path.join(ROOT, os.path.dirname(doc), file)) if file else os.path.join(ROOT, doc)
            if not os.path.exists(path):
                fail.error(where, f"link to {target}: no such file")
            elif anchor and path.endswith(".md") and anchor not in anchors_of(path):
                fail.error(where, f"link to {target}: no heading with that anchor")


def check_no_spec(doc, text, fail):
    """An operator doc cites no SPEC: it says what it means itself."""
    for m in SPEC_CITATION.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        fail.error(f"{doc}:{line}", f"cites {m.group(0)!r}: an operator doc stands on its own "
                                    "(say what it means, or link an operator doc)")


# --- stated exit codes and defaults -----------------------------------------------------

# Where a text states an exit code: "exit 2", "exits 0", "(exit 1)", "exit code 2".
EXIT_SITE = re.compile(r"\b[Ee]xit(?:s|ed)?(?: code)?:?\s*\(?(?:with\s+)?(?P<code>[0-2])\b")
# ... and a code later in the sentence: "Exits as the sync would (2 for ...)", "exits 0 when
# ..., 1 when ...".
EXIT_LATER = re.compile(r"\b[Ee]xit(?:s|ed)?\b[^.]{0,120}?[(,;] ?(?P<code>[0-2]) (?:for|when|on)\b")
# Each scenario: a script run in a fresh sandbox (as the docs' blocks are: $SB is its root,
# the bundle and state dir are in the environment, dir:$SIGNERS are three valid signers),
# whose exit code is the binary's; and the patterns (over the docs' prose and the --help
# texts, whitespace collapsed) whose group `code` states it.
SIGNERS = "dir:$SB/etc/kubernetes/signers"
FREE_PORT = "$(python3 -c 'import socket; s=socket.socket(); s.bind((\"127.0.0.1\", 0)); print(s.getsockname()[1])')"
# An agent running on this sandbox's bundle and state dir (for the lock), its pid in $AGENT.
AGENT = (f"kubelet-ca-agent run --source {SIGNERS} --listen 127.0.0.1:{FREE_PORT} --insecure-metrics 2>/dev/null & AGENT=$!\n"
         "for _ in $(seq 100); do [ -s \"$KUBELET_CA_AGENT_STATE_DIR/agent.lock\" ] && break; sleep 0.1; done; sleep 0.3\n")
EXIT_CLAIMS = {
    "sync writes": (
        f"kubelet-ca-agent sync --source {SIGNERS}",
        [r"`sync`: (?P<code>\d) written or already in sync",
         r"`sync` exits (?P<code>\d) when the file was written or already in sync",
         r"Exits (?P<code>\d) when the file was written or was already in sync"],
    ),
    "sync with an unreadable source": (
        f"kubelet-ca-agent sync --source file:$SB/no-such-source.pem",
        [r"`sync`: 0 written or already in sync; (?P<code>\d) a source unreadable",
         r"in sync, (?P<code>\d) on a runtime failure",
         r"(?P<code>\d) when a source is unreadable or rejected",
         r"the error line of `sync`, which then exits (?P<code>\d)",
         r"`sync` is one-shot: it exits (?P<code>\d) with one line"],
    ),
    "sync with a usage error": (
        "kubelet-ca-agent sync --source no-such-scheme:x",
        [r"(?P<code>\d) a usage or configuration error, with nothing written",
         r"(?P<code>\d) on a usage error",
         r"`UsageError` \(exit (?P<code>\d)\)",
         r"already refused as a usage error \(exit (?P<code>\d)\)"],
    ),
    "sync into a missing directory": (
        f"kubelet-ca-agent sync --source {SIGNERS} --bundle $SB/no-such-dir/kubelet-ca.crt",
        [r"does not exist is refused \(exit (?P<code>\d)\) by `sync`",
         r"a missing directory, a bundle a running agent manages: exit (?P<code>\d) without --dry-run"],
    ),
    "sync --dry-run into a missing directory": (
        f"kubelet-ca-agent sync --dry-run --source {SIGNERS} --bundle $SB/no-such-dir/kubelet-ca.crt",
        [r"`sync --dry-run` prints its plan and exits (?P<code>\d)",
         r"`sync --dry-run` prints its plan, exits (?P<code>\d)",
         r"With --dry-run: exits (?P<code>\d) having written nothing",
         r"write nothing, and exit (?P<code>\d)\.",
         r"write nothing\. Exits as the sync would[^(]*\((?P<code>\d) for a missing directory"],
    ),
    "sync beside a running agent": (
        AGENT + f"kubelet-ca-agent sync --source {SIGNERS}; s=$?; kill $AGENT; wait $AGENT; exit $s",
        [r"refuses that bundle \(exit (?P<code>\d)\)",
         r"`sync` refuses its bundle \(exit (?P<code>\d)\)"],
    ),
    "a second run with the same state dir": (
        AGENT + f"kubelet-ca-agent run --source {SIGNERS} --listen 127.0.0.1:{FREE_PORT} --insecure-metrics; s=$?; kill $AGENT; wait $AGENT; exit $s",
        [r"a second `run` with the same `--state-dir` exits (?P<code>\d)"],
    ),
    "run on a port in use": (
        f"P={FREE_PORT}\npython3 -c \"import socket, time; s=socket.socket(); s.bind(('127.0.0.1', $P)); s.listen(); time.sleep(30)\" & L=$!; sleep 0.5\n"
        f"timeout 20 kubelet-ca-agent run --source {SIGNERS} --listen 127.0.0.1:$P --insecure-metrics; s=$?; kill $L; exit $s",
        [r"A port already in use is not a usage error: it exits (?P<code>\d)"],
    ),
    "run stopped by SIGTERM": (
        AGENT + "kill -TERM $AGENT; wait $AGENT",
        [r"SIGTERM or SIGINT finishes a write in progress, then exits (?P<code>\d)"],
    ),
    "run with --insecure-metrics off loopback": (
        f"kubelet-ca-agent run --source {SIGNERS} --listen 192.0.2.1:9745 --insecure-metrics",
        [r"refused off loopback, exit (?P<code>\d)",
         r"Anything else is refused at start with exit (?P<code>\d)",
         r"flags that do not hold together \(exit (?P<code>\d)\)",
         r"flags that do not hold together are refused \(exit (?P<code>\d)\)"],
    ),
    "an --exec-on-change program that does not exist": (
        f"kubelet-ca-agent sync --source {SIGNERS} --exec-on-change $SB/no-such-program",
        [r"sync and run refuse to start \(exit (?P<code>\d)\)",
         r"what is wrong\.|Otherwise they exit (?P<code>\d), naming the program"],
    ),
    "--manage at the --bundle path": (
        f"kubelet-ca-agent sync --source {SIGNERS} --manage $KUBELET_CA_AGENT_BUNDLE={SIGNERS}",
        [r"two `--manage` at one path, exits (?P<code>\d)"],
    ),
    "a registry spec of the wrong form": (
        f"kubelet-ca-agent sync --source {SIGNERS} --manage-registries $SB/certs.d=file:$SB/x.pem",
        [r"`file:`\) exits (?P<code>\d), naming the form to use"],
    ),
    "inspect of a valid bundle": (
        "kubelet-ca-agent inspect $KUBELET_CA_AGENT_BUNDLE",
        [r"`inspect`: (?P<code>\d) all certificates valid",
         r"Exits (?P<code>\d) when every certificate is valid",
         r"inspect /etc/kubernetes/kubelet-ca\.crt # exit (?P<code>\d)",
         r"/kubelet-ca-agent inspect`: exit (?P<code>\d), the bundle is there"],
    ),
    "inspect of a certificate that expires within --warn-within": (
        "kubelet-ca-agent inspect $KUBELET_CA_AGENT_BUNDLE --warn-within 400d",
        [r"all certificates valid; (?P<code>\d) one is expired, not yet valid, expires within",
         r"(?P<code>\d) when one is expired, not yet valid, expires within",
         r"expires within this duration as a problem \(exit (?P<code>\d)\)",
         r"Exit (?P<code>\d) with a certificate marked `EXPIRED`",
         r"Exit (?P<code>\d) with nothing `valid`"],
    ),
    "inspect of a file that does not exist": (
        "kubelet-ca-agent inspect $SB/no-such-bundle.crt",
        [r"(?P<code>\d) the input is unreadable or holds no certificate",
         r"(?P<code>\d) when the input is unreadable",
         r"or exit (?P<code>\d) \(no file, or no certificate in it\)"],
    ),
    "inspect of input without a certificate": (
        "echo no-certificate-here | kubelet-ca-agent inspect -",
        [r"(?P<code>\d) the input is unreadable or holds no certificate",
         r"(?P<code>\d) when the input is unreadable or holds no certificate"],
    ),
    "drift check with no drift": (
        "echo '{\"ignition\": {\"version\": \"3.4.0\"}, \"storage\": {\"files\": [{\"path\": \"/etc/kubernetes/kubelet-ca.crt\", \"contents\": {\"source\": \"data:,\"}}]}}' >$SB/clean.json\n"
        "kubelet-ca-agent drift check --rendered $SB/clean.json --root $SB",
        [r"`drift check`: (?P<code>\d) no drift",
         r"Exit codes: (?P<code>\d) no file drifted",
         r"Exits (?P<code>\d) when no file drifted"],
    ),
    "drift check of a drifted file": (
        "kubelet-ca-agent drift check --rendered rendered.json --root $SB",
        [r"`drift check`: 0 no drift, (?P<code>\d) a file drifted",
         r"(?P<code>\d) at least one did",
         r"no file drifted, (?P<code>\d) when one did"],
    ),
    "drift check of an invalid document": (
        "echo '{' >$SB/bad.json; kubelet-ca-agent drift check --rendered $SB/bad.json --root $SB",
        [r"1 a file drifted, (?P<code>\d) the document is unreadable or invalid",
         r"(?P<code>\d) when the document is unreadable or invalid \(the message"],
    ),
    "drift strip": (
        "kubelet-ca-agent drift strip --rendered rendered.json >/dev/null",
        [r"the other `drift` commands: (?P<code>\d), or 2",
         r"Every other byte of the document is printed as it was\. Exits (?P<code>\d), or 2"],
    ),
    "drift strip of an invalid document": (
        "echo '{' >$SB/bad.json; kubelet-ca-agent drift strip --rendered $SB/bad.json",
        [r"the other `drift` commands: 0, or (?P<code>\d)",
         r"printed as it was\. Exits 0, or (?P<code>\d) when the document",
         r"refuses the same invalid ones \(exit (?P<code>\d)\)"],
    ),
    "drift exclusions": (
        "kubelet-ca-agent drift exclusions",
        [r"current content \(json\)\. Exits (?P<code>\d), or 2"],
    ),
    "drift exclusions with an unreadable managed-files.json": (
        "echo '{' >$KUBELET_CA_AGENT_STATE_DIR/managed-files.json; kubelet-ca-agent drift exclusions",
        [r"Exits 0, or (?P<code>\d) when managed-files\.json cannot be read",
         r"cannot be read or does not parse is an error \(exit (?P<code>\d)\)"],
    ),
    "rollout with a context the kubeconfig does not have": (
        "printf 'apiVersion: v1\\nkind: Config\\nclusters:\\n- name: c\\n  cluster: {server: \"https://127.0.0.1:1\"}\\n"
        "users:\\n- name: u\\n  user: {token: t}\\ncontexts:\\n- name: x\\n  context: {cluster: c, user: u}\\n"
        "current-context: x\\n' >$SB/kubeconfig; kubelet-ca-agent rollout status --kubeconfig $SB/kubeconfig --context nope",
        [r"A context, cluster or user that the kubeconfig does not have is a usage error \(exit (?P<code>\d)\)"],
    ),
}
# Exit codes stated for what the sandbox cannot run, and why.
UNCHECKED_EXITS = [
    (r"`--once` publishes and exits \(0 published[^)]*\)", "publish needs a cluster"),
    (r"Publish once and exit|exit 0 \(applied, or already published\), 1 \(a source or the API server failed[^)]*\)?(, or 2[^.]*)?",
     "publish needs a cluster"),
    (r"is left as it was while the others are written, and the run exits 1",
     "a --manage file that cannot be used: a file the sandbox cannot make unwritable as root"),
    (r"a refused or unwritable registry is left as it was and the run exits 1",
     "an unwritable registry directory: the sandbox runs as root"),
    (r"exits? 0 the moment every counted node"
     r"|On `--timeout` \(default: none\) it exits 1"
     r"|ends \(exit 0\) the moment the last node's report"
     r"|on `--timeout` it ends with exit 1"
     r"|`kubelet-ca-agent rollout wait --for sources --timeout 10m` exits 0"
     r"|Exits 0 when every counted node is current, 1 when one is not, 2 on a usage error"
     r"|Exits 0 when the condition holds, 1 on --timeout"
     r"|\(exit 1, naming the laggards\)"
     r"|whole fingerprint\), is a usage error \(exit 2\)",
     "rollout reads Nodes: tests/rollout.rs and tests/rotation_procedures.rs check its exit "
     "codes against a real API server"),
    (r"rollout status` exits 0|rollout status exits 0|rollout wait --for add=FP exits 0"
     r"|the clock stops when it exits 0",
     "the rollout benchmark's own figures (docs/performance.md): benches/rollout.rs runs "
     "rollout against a real API server"),
]


def prose_texts(docs, root):
    """(where, text) of each prose paragraph of the docs and each --help text, whitespace
    collapsed."""
    texts = []
    for doc in docs:
        _, prose = parse_markdown(doc, open(os.path.join(ROOT, doc), encoding="utf-8").read())
        texts += [(f"{doc}:{start}", re.sub(r"\s+", " ", text)) for start, text in prose]
        blocks, _ = parse_markdown(doc, open(os.path.join(ROOT, doc), encoding="utf-8").read())
        # Comments in shell blocks state exit codes too (`inspect ... # exit 0`).
        texts += [(f"{doc}:{b.line}", re.sub(r"\s+", " ", b.text)) for b in blocks
                  if b.lang in SHELL_LANGS]
    for c in all_commands(root):
        texts.append((f"`{c.name()} --help`", re.sub(r"\s+", " ", c.text)))
    return texts


def run_scenario(script, binary, base):
    sb, work, bindir = make_sandbox(binary, base)
    env = sandbox_env(sb, bindir)
    try:
        out = subprocess.run(["bash", "-c", f"SB={shlex.quote(sb)}\nSIGNERS={shlex.quote(sb)}/etc/kubernetes/signers\n{script}"],
                             cwd=work, env=env, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return None, "timed out after 60 s"
    return out.returncode, out.stderr.strip().splitlines()[-1:] or [""]


def check_exit_codes(texts, binary, base, fail, verbose):
    actual = {}
    for name, (script, _) in EXIT_CLAIMS.items():
        code, last = run_scenario(script, binary, base)
        actual[name] = code
        if verbose:
            print(f"exit code of {name}: {code} ({last[0][:100] if last else ''})")
        if code not in (0, 1, 2):
            fail.error("check-docs", f"scenario {name!r} exited {code}: {last}")
    checked = 0
    for where, text in texts:
        covered = []
        for name, (_, patterns) in EXIT_CLAIMS.items():
            for pattern in patterns:
                for m in re.finditer(pattern, text):
                    if m.group("code") is None:
                        continue
                    covered.append(m.span())
                    checked += 1
                    stated = int(m.group("code"))
                    if stated != actual[name]:
                        fail.error(where, f"says {m.group(0)!r}: exit {stated}, but the binary exits "
                                          f"{actual[name]} for {name}")
        for pattern, _why in UNCHECKED_EXITS:
            covered += [m.span() for m in re.finditer(pattern, text)]
        for m in list(EXIT_SITE.finditer(text)) + list(EXIT_LATER.finditer(text)):
            at = m.start("code")
            if not any(a <= at < b for a, b in covered):
                context = text[max(0, m.start() - 60):m.end() + 30]
                fail.error(where, f"states exit {m.group('code')} in {context!r}, which no "
                                  "scenario of check-docs checks (add it to EXIT_CLAIMS, or to "
                                  "UNCHECKED_EXITS with why)")
    return checked


# Defaults stated away from their flag: (pattern with group `value`, the flag).
DEFAULT_CLAIMS = [
    (r"Default state dir: `(?P<value>[^`]+)`", "state-dir"),
    (r"The default source is OpenShift's \(`(?P<value>[^`]+)`\)", "source"),
    (r"`publish`\*\* runs on the cluster side.*?\(default `(?P<value>[^`]+)`\)", "source"),
    (r"\(default `(?P<value>[^`]+)`\) lists", "state-dir", "managed-files.json"),
]
# A default stated beside its flag: `--flag` (default X), `--flag` (X), `--flag` ... (default X).
BESIDE = re.compile(r"`--(?P<flag>[a-z0-9-]+)`(?P<between>[^.;`()]{0,40}?)\((?P<default>default:? )?`?(?P<value>[^`)\s,;]+)`?\)")


def check_defaults(texts, root, fail):
    defaults = {}
    for c in all_commands(root):
        for name, opt in c.options.items():
            if opt["default"] is not None:
                defaults.setdefault(name, set()).add(opt["default"])
    checked = 0
    for where, text in texts:
        for m in BESIDE.finditer(text):
            flag, value = m.group("flag"), m.group("value")
            if not m.group("default") and m.group("between").strip():
                continue  # "(X)" only right after the flag: elsewhere it is not a default
            if flag not in defaults or not re.match(r"^[\w./:-]+$", value) or value in ("the",):
                continue
            checked += 1
            if value not in defaults[flag]:
                fail.error(where, f"says the default of --{flag} is {value}; --help says "
                                  f"{' or '.join(sorted(defaults[flag]))}")
        for claim in DEFAULT_CLAIMS:
            pattern, flag = claim[0], claim[1]
            for m in re.finditer(pattern, text):
                value = m.group("value")
                if len(claim) > 2:
                    value = value.rsplit("/", 1)[0] if value.endswith(claim[2]) else value
                checked += 1
                if value not in defaults.get(flag, ()):
                    fail.error(where, f"says the default of --{flag} is {value}; --help says "
                                      f"{' or '.join(sorted(defaults.get(flag, ['none'])))}")
    return checked


# --- the sandbox ----------------------------------------------------------------------


def make_sandbox(binary, base):
    sb = tempfile.mkdtemp(prefix="sandbox-", dir=base)
    etc = os.path.join(sb, "etc/kubernetes")
    state = os.path.join(sb, "var/lib/kubelet-ca-agent")
    signers = os.path.join(etc, "signers")
    os.makedirs(signers)
    os.makedirs(state)
    os.makedirs(os.path.join(sb, "home"))
    work = os.path.join(sb, "work/kubelet-ca-agent")
    os.makedirs(work)
    for d in ("deploy", "systemd"):
        shutil.copytree(os.path.join(ROOT, d), os.path.join(work, d))
    shutil.copy(os.path.join(ROOT, "Containerfile"), work)
    bundle = os.path.join(etc, "kubelet-ca.crt")
    sync = [binary, "sync", "--source", f"dir:{signers}", "--bundle", bundle, "--state-dir", state]
    for i, name in enumerate(("kube-apiserver-to-kubelet-signer", "kube-csr-signer", "kube-csr-signer-2")):
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
             "-nodes", "-days", "365", "-subj", f"/CN={name}", "-keyout", "/dev/null",
             "-out", os.path.join(signers, f"{name}.crt"),
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign"],
            check=True, capture_output=True,
        )
        if i >= 1:  # two bundles: one in history
            subprocess.run(sync, check=True, capture_output=True, env=clean_env())
    with open(os.path.join(work, "rendered.json"), "w") as f:
        json.dump({"ignition": {"version": "3.4.0"}, "storage": {"files": [
            {"path": "/etc/kubernetes/kubelet-ca.crt", "contents": {"source": "data:,"}},
            {"path": "/etc/hostname", "mode": 420, "contents": {"source": "data:,node-1%0A"}},
        ]}}, f)
    bindir = os.path.join(sb, "bin")
    os.makedirs(bindir)
    wrapper = os.path.join(bindir, "kubelet-ca-agent")
    # `inspect` without a path reads the default bundle path, which the sandbox maps too.
    with open(wrapper, "w") as f:
        f.write(f"""#!/usr/bin/env bash
if [ "${{1-}}" = inspect ]; then
  path=0 skip=0
  for a in "${{@:2}}"; do
    if [ $skip = 1 ]; then skip=0; continue; fi
    case $a in
      -) path=1;;
      -o|--output|--warn-within|--log-format|--log-level) skip=1;;
      -*) ;;
      *) path=1;;
    esac
  done
  [ $path = 1 ] || set -- "$@" {shlex.quote(bundle)}
fi
exec {shlex.quote(binary)} "$@"
""")
    os.chmod(wrapper, 0o755)
    return sb, work, bindir


def map_paths(text, sb):
    for m in MAPPED:
        text = re.sub(r"(?<![\w./-])" + re.escape(m) + r"(?=/|\b|$)", sb + m, text)
    return text


def sandbox_env(sb, bindir):
    env = clean_env()
    for k in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"):
        env.pop(k, None)
    env.update({
        "PATH": bindir + ":" + os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.path.join(sb, "home"),
        "KUBECONFIG": os.path.join(sb, "no-kubeconfig"),
        "KUBELET_CA_AGENT_BUNDLE": sb + "/etc/kubernetes/kubelet-ca.crt",
        "KUBELET_CA_AGENT_STATE_DIR": sb + "/var/lib/kubelet-ca-agent",
        "LC_ALL": "C",
    })
    return env


def run_block(block, binary, base, verbose):
    sb, work, bindir = make_sandbox(binary, base)
    body = "\n".join(map_paths(s, sb) for s in block.script)
    script = f"""set -E -o pipefail
__doc_err() {{
  local s=$?
  case "$BASH_COMMAND" in
    *kubelet-ca-agent\\ inspect*|*kubelet-ca-agent\\ drift\\ check*) [ "$s" = 1 ] && return 0;;
  esac
  printf 'exit %s: %s\\n' "$s" "$BASH_COMMAND" >&2
  exit 97
}}
trap __doc_err ERR
{body}
"""
    env = sandbox_env(sb, bindir)
    try:
        out = subprocess.run(["bash", "-c", script], cwd=work, env=env, capture_output=True,
                             text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return False, "timed out after 120 s"
    if verbose:
        sys.stdout.write(out.stdout)
    if out.returncode != 0:
        tail = (out.stdout + out.stderr).strip().splitlines()[-12:]
        return False, "\n    ".join(tail)
    return True, ""


# --- main -----------------------------------------------------------------------------


def find_binary():
    """The debug binary, built if needed, where cargo says it is."""
    out = subprocess.run(
        ["cargo", "build", "--locked", "--bin", "kubelet-ca-agent",
         "--message-format=json-render-diagnostics"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )
    if out.returncode != 0:
        sys.exit("check-docs: cargo build failed")
    exe = None
    for line in out.stdout.splitlines():
        m = json.loads(line)
        if (m.get("reason") == "compiler-artifact" and m["target"]["name"] == "kubelet-ca-agent"
                and m.get("executable")):
            exe = m["executable"]
    if not exe:
        sys.exit("check-docs: cargo build reported no kubelet-ca-agent executable")
    return exe


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--binary", help="the kubelet-ca-agent to check against (default: build it)")
    ap.add_argument("--verbose", action="store_true", help="print every block's verdict and output")
    ap.add_argument("docs", nargs="*", help="markdown files (default: README.md, deploy/README.md, docs/*.md)")
    opts = ap.parse_args()
    binary = os.path.abspath(opts.binary) if opts.binary else find_binary()
    if shutil.which("openssl") is None:
        sys.exit("check-docs: openssl is needed to seed the sandbox")
    root = load_interface(binary)
    docs = opts.docs or (["README.md", "deploy/README.md"]
                         + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs/*.md"))))
    fail = Failure()
    cargo_flags = {}
    counts = {"ran": 0, "parsed": 0, "marked": 0}
    base = tempfile.mkdtemp(prefix="check-docs-")
    try:
        for doc in docs:
            text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
            if os.path.normpath(doc) not in DEVELOPER_DOCS:
                check_no_spec(doc, text, fail)
            for m in re.finditer(r"KUBELET_CA_AGENT_[A-Z0-9_]+", text):
                check_env_name(m.group(0), root, f"{doc}:{text.count(chr(10), 0, m.start()) + 1}", fail)
            blocks, prose = parse_markdown(doc, text)
            check_prose(doc, prose, root, fail)
            for block in blocks:
                where = f"{doc}:{block.line}"
                unknown = [w for w in block.markers if w not in MARKERS]
                if block.lang not in SHELL_LANGS:
                    if not block.lang:
                        # Synopses and sample output: the lines that are invocations.
                        for k, line in enumerate(block.text.split("\n")):
                            line = line[2:] if line.startswith("$ ") else line
                            if line.startswith("kubelet-ca-agent "):
                                marked = PLACEHOLDER.sub(lambda p: "PLACEHOLDER_" + re.sub(r"\W", "_", p.group(1)), line)
                                check_invocation(root, marked.split()[1:], f"{doc}:{block.line + 1 + k}", fail, synopsis=True)
                    continue
                if unknown:
                    fail.error(where, f"unknown marker {' '.join(unknown)} (markers: {', '.join(sorted(MARKERS))})")
                examine_block(block, root, fail, cargo_flags)
                markers = set(block.markers)
                if "cluster" in block.needs and "cluster" not in markers:
                    fail.error(where, f"needs a cluster: mark it ```{block.lang} cluster")
                elif "node" in block.needs and not markers & MARKERS:
                    fail.error(where, f"needs a node: mark it ```{block.lang} node")
                runnable = not block.needs and not block.unrunnable
                if markers & MARKERS:
                    counts["marked"] += 1
                    if runnable:
                        fail.error(where, f"marked {' '.join(sorted(markers))}, but it needs neither: the check can run it, drop the marker")
                    verdict = f"{' '.join(sorted(markers & MARKERS))}: parsed"
                elif not runnable:
                    counts["parsed"] += 1
                    verdict = f"parsed ({', '.join(sorted(set(block.unrunnable)))})"
                else:
                    ok, why = run_block(block, binary, base, opts.verbose)
                    counts["ran"] += 1
                    verdict = "ran" if ok else "FAILED"
                    if not ok:
                        fail.error(where, f"the block failed in the sandbox:\n    {why}")
                if opts.verbose or verdict == "FAILED":
                    print(f"{where} ```{block.lang}: {verdict}")
        texts = prose_texts(docs, root)
        exits_checked = check_exit_codes(texts, binary, base, fail, opts.verbose)
        defaults_checked = check_defaults(texts, root, fail)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"check-docs: {exits_checked} statements of an exit code checked against the binary "
          f"({len(EXIT_CLAIMS)} scenarios), {defaults_checked} statements of a default against --help")
    print(f"check-docs: {len(docs)} files; shell blocks: {counts['ran']} run in the sandbox, "
          f"{counts['parsed']} parsed, {counts['marked']} marked cluster/node (parsed)")
    if fail.unknown_flags:
        print("flags the docs name that the binary does not have:")
        for cmd, flag, where in fail.unknown_flags:
            print(f"  {flag} for {cmd} ({where})")
    if not KUSTOMIZE_OK:
        print("note: no kubectl with kustomize v4+ here: `kubectl kustomize` blocks were parsed, not run")
    if fail.errors:
        for e in fail.errors:
            print(f"error: {e}")
        print(f"check-docs: {len(fail.errors)} problems")
        return 1
    print("check-docs: every command shown runs or parses, and every flag exists")
    return 0


if __name__ == "__main__":
    sys.exit(main())
