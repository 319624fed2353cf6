"""Write each role's README from its meta/argument_specs.yml, the one place its variables are documented.

A role without a README gets a generated one. A role whose README is written by hand keeps its prose:
the generated part lives between the two markers below and is replaced there. Rerun after editing an
argument spec; tests/ansible/test_role_readmes.py fails while a README is out of date.

Usage: python tools/role_readmes.py [--check] [ROLE ...]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
ROLES = ROOT / "roles"
COLLECTION = "specops.drafter"
BEGIN = "<!-- BEGIN generated from meta/argument_specs.yml by tools/role_readmes.py: do not edit -->"
END = "<!-- END generated from meta/argument_specs.yml -->"
# Ansible's documentation markup (C(x), O(x), V(x), M(x), I(x), B(x), RV(x)) rendered as Markdown.
MARKUP = re.compile(r"\b(C|O|V|M|I|B|RV)\(([^()]*)\)")


def markdown(text: str) -> str:
    def render(match: re.Match) -> str:
        kind, value = match.groups()
        if kind == "I":
            return f"*{value}*"
        if kind == "B":
            return f"**{value}**"
        return f"`{value}`"

    return MARKUP.sub(render, " ".join(str(text).split()))


def paragraphs(value) -> list[str]:
    items = value if isinstance(value, list) else [value] if value else []
    return [markdown(item) for item in items]


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def default_text(option: dict) -> str:
    if "default" not in option:
        return "(required)" if option.get("required") else ""
    value = option["default"]
    shown = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    shown = shown.removesuffix("\n...").removesuffix("...").strip()
    return f"`{shown}`" if shown != "" else '`""`'


def type_text(option: dict) -> str:
    kind = option.get("type", "str")
    if kind == "list" and option.get("elements"):
        kind = f"list of {option['elements']}"
    if option.get("choices"):
        kind += ": " + ", ".join(f"`{c}`" for c in option["choices"])
    return kind


def entry_point(name: str, spec: dict) -> list[str]:
    tasks_from = "" if name == "main" else f" (`tasks_from: {name}`)"
    lines = [f"### `{name}`{tasks_from}", ""]
    if spec.get("short_description"):
        lines += [markdown(spec["short_description"]) + ".", ""]
    for text in paragraphs(spec.get("description")):
        lines += [text, ""]
    options = spec.get("options") or {}
    if options:
        lines += ["| variable | type | default | description |", "| --- | --- | --- | --- |"]
        for option_name, option in options.items():
            text = " ".join(paragraphs(option.get("description")))
            columns = [f"`{option_name}`", type_text(option), default_text(option), text]
            lines.append("| " + " | ".join(cell(column) for column in columns) + " |")
        lines.append("")
    else:
        lines += ["No variables of its own.", ""]
    return lines


def generated(role: str, specs: dict) -> str:
    lines = [
        BEGIN,
        "## Variables",
        "",
        f"`ansible-doc -t role {COLLECTION}.{role}` shows the same. Every variable is validated against",
        "`meta/argument_specs.yml` when the role runs; "
        + (
            "defaults live in `defaults/main.yml`."
            if (ROLES / role / "defaults" / "main.yml").is_file()
            else "the role has no defaults of its own: the playbook applies the ones shown."
        ),
        "",
    ]
    for name, spec in specs.items():
        lines += entry_point(name, spec)
    lines += [END]
    return "\n".join(lines) + "\n"


def whole(role: str, specs: dict) -> str:
    main = specs.get("main", next(iter(specs.values())))
    lines = [f"# {COLLECTION}.{role}", ""]
    if main.get("short_description"):
        lines += [markdown(main["short_description"]) + ".", ""]
    lines += [
        "## Use",
        "",
        "```yaml",
        f"- name: Run {role}",
        "  ansible.builtin.include_role:",
        f"    name: {COLLECTION}.{role}",
        "```",
        "",
        "",
    ]
    return "\n".join(lines) + generated(role, specs)


def render(role_dir: Path) -> str:
    role = role_dir.name
    specs = yaml.safe_load((role_dir / "meta" / "argument_specs.yml").read_text())["argument_specs"]
    readme = role_dir / "README.md"
    current = readme.read_text() if readme.is_file() else ""
    if BEGIN in current and END in current:
        head, rest = current.split(BEGIN, 1)
        tail = rest.split(END, 1)[1].lstrip("\n")
        if head.startswith(f"# {COLLECTION}.{role}\n") and not tail:
            return whole(role, specs)
        return head + generated(role, specs) + (("\n" + tail) if tail else "")
    if current:
        return current.rstrip("\n") + "\n\n" + generated(role, specs)
    return whole(role, specs)


def roles(names: list[str]) -> list[Path]:
    found = sorted(p for p in ROLES.iterdir() if (p / "meta" / "argument_specs.yml").is_file())
    return [p for p in found if not names or p.name in names]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; fail if a README is out of date")
    parser.add_argument("roles", nargs="*", help="only these roles (default: every role)")
    args = parser.parse_args()
    stale = []
    for role_dir in roles(args.roles):
        readme = role_dir / "README.md"
        wanted = render(role_dir)
        if (readme.read_text() if readme.is_file() else None) == wanted:
            continue
        stale.append(role_dir.name)
        if not args.check:
            readme.write_text(wanted)
            print(f"wrote {readme.relative_to(ROOT)}")
    if args.check and stale:
        print(f"out of date: {', '.join(stale)}: run python tools/role_readmes.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
