#!/usr/bin/env python3
"""Generate the values table of a chart's README.md from its values.yaml comments.

usage: helm/gen-values-table.py [--check] [CHART_DIR]   (default helm/nvmeof-gateway)

Every key of values.yaml carries a "# -- description" comment block right above it
(continuation lines are plain "# ..." lines). Each leaf (a scalar, a list, or an empty map)
becomes one row: key path, type (from values.schema.json), default (as written in
values.yaml) and description. The table replaces what lies between the markers
<!-- values-table:start --> and <!-- values-table:end --> in README.md.

--check writes nothing: exit 1 if README.md's table differs from the generated one (stale)
or if a key has no description or no schema entry; exit 0 otherwise.
Standard library only.
"""
import json
import re
import sys
from pathlib import Path

START = "<!-- values-table:start -->"
END = "<!-- values-table:end -->"
KEY_LINE = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z0-9_.-]+):(?P<rest>.*)$")
DOC_START = re.compile(r"^ *# -- ?(?P<text>.*)$")
DOC_MORE = re.compile(r"^ *#(?: (?P<text>.*))?$")


class ValuesError(Exception):
    pass


def parse_values(text):
    """[(path, default_text, description, is_leaf)] in file order."""
    rows = []
    stack = []  # [(indent, key)]
    doc = None  # description lines being collected
    lines = text.splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            doc = None
            continue
        m = DOC_START.match(line)
        if m:
            doc = [m.group("text").strip()]
            continue
        if doc is not None and DOC_MORE.match(line):
            doc.append((DOC_MORE.match(line).group("text") or "").strip())
            continue
        if line.lstrip().startswith("#"):
            doc = None  # a plain comment (file header): not a description
            continue
        m = KEY_LINE.match(line)
        if not m:
            if line.lstrip().startswith("- "):
                continue  # an item of a block list: part of the key above
            raise ValuesError(f"values.yaml:{number}: cannot read {line!r}")
        indent = len(m.group("indent"))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, m.group("key")))
        path = ".".join(k for _, k in stack)
        rest = strip_comment(m.group("rest")).strip()
        if not doc:
            raise ValuesError(f"values.yaml:{number}: {path} has no '# --' description above it")
        rows.append({"path": path, "default": rest, "description": " ".join(doc), "line": number})
        doc = None
    # A key whose value is on the following lines (a map or a block list) is a section
    # unless nothing nested follows it.
    for i, row in enumerate(rows):
        nested = i + 1 < len(rows) and rows[i + 1]["path"].startswith(row["path"] + ".")
        row["leaf"] = not nested
        if row["leaf"] and row["default"] == "":
            row["default"] = block_value(lines, row["line"])
    return rows


def strip_comment(text):
    """The value part of `key: value  # comment` (quotes respected)."""
    out, quote = [], None
    for i, c in enumerate(text):
        if quote:
            if c == quote:
                quote = None
        elif c in "\"'":
            quote = c
        elif c == "#" and (i == 0 or text[i - 1] == " "):
            break
        out.append(c)
    return "".join(out)


def block_value(lines, number):
    """A block list under a key, as a flow list: ["a", "b"]."""
    items = []
    for line in lines[number:]:
        s = line.strip()
        if s.startswith("- "):
            items.append(s[2:])
        else:
            break
    return "[" + ", ".join(items) + "]" if items else ""


def schema_type(schema, path, default):
    node = schema
    for key in path.split("."):
        props = node.get("properties", {})
        if key in props:
            node = props[key]
        elif isinstance(node.get("additionalProperties"), dict):
            node = node["additionalProperties"]
        elif node.get("type") == "object" and "properties" not in node and "additionalProperties" not in node:
            return literal_type(default)  # inside a Kubernetes object the schema passes through
        else:
            return None
    t = node.get("type", "any")
    t = "/".join(t) if isinstance(t, list) else t
    if "enum" in node:
        t += " (" + ", ".join(json.dumps(v) for v in node["enum"]) + ")"
    return t


def literal_type(text):
    if text in ("true", "false"):
        return "boolean"
    if re.fullmatch(r"-?[0-9]+", text):
        return "integer"
    if text.startswith("["):
        return "array"
    if text.startswith("{"):
        return "object"
    return "string"


def cell(text):
    return text.replace("|", "\\|")


def table(chart):
    rows = parse_values((chart / "values.yaml").read_text())
    schema = json.loads((chart / "values.schema.json").read_text())
    out = ["| Key | Type | Default | Description |", "|-----|------|---------|-------------|"]
    for row in rows:
        if not row["leaf"]:
            continue
        t = schema_type(schema, row["path"], row["default"])
        if t is None:
            raise ValuesError(f"values.yaml:{row['line']}: {row['path']} is not in values.schema.json")
        default = row["default"] or '""'
        out.append(f"| `{row['path']}` | {cell(t)} | `{cell(default)}` | {cell(row['description'])} |")
    return "\n".join(out) + "\n"


def splice(readme, generated):
    if START not in readme or END not in readme:
        raise ValuesError(f"README.md lacks the markers {START} ... {END}")
    head, rest = readme.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{generated}{END}{tail}"


def main(argv):
    check = "--check" in argv
    args = [a for a in argv if a != "--check"]
    chart = Path(args[0]) if args else Path(__file__).resolve().parent / "nvmeof-gateway"
    readme_path = chart / "README.md"
    try:
        readme = readme_path.read_text()
        new = splice(readme, table(chart))
    except (ValuesError, OSError) as e:
        print(f"gen-values-table: {e}", file=sys.stderr)
        return 1
    if check:
        if new != readme:
            print(f"gen-values-table: {readme_path} values table is stale: run helm/gen-values-table.py",
                  file=sys.stderr)
            return 1
        return 0
    if new != readme:
        readme_path.write_text(new)
        print(f"gen-values-table: {readme_path} updated")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
