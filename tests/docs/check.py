#!/usr/bin/env python3
"""tests/docs/check.py - the documentation checks (tests/run.sh stage `docs`).

usage: tests/docs/check.py [--bin DIR] [--only NAME[,NAME...]] [-v]

  DIR (default target/release, or $CARGO_TARGET_DIR/release) holds nvmeof-gateway,
  nvmeof-control and nvmeofctl, built with
  `cargo build --release -p nvmeof-gateway -p control-plane --bins`.

Checks (each one line PASS/FAIL, the reasons under it; closing line "N passed, N failed"):
  links       every relative link and #anchor in README.md and docs/*.md resolves (GitHub's
              heading anchors)
  toml        every ```toml block in them passes `nvmeof-gateway --check`; a block preceded
              by `<!-- fragment -->` is checked merged into a minimal config (the sections it
              lacks are added), one preceded by `<!-- not-checked: why -->` is skipped. Paths
              of files that --check opens (ceph `conf`, group `tls_*`) are replaced by an
              empty temporary file when they do not exist here.
  config-ref  docs/configuration.md lists every field the gateway's config structs have, and
              none they lack. The structs' field lists come from the binary itself: each
              section is given an unknown key, and serde's error names the expected fields.
  cli         docs/cli.md is what tests/docs/gen-cli.sh prints for these binaries
              (regenerate: tests/docs/gen-cli.sh target/release > docs/cli.md), and every
              `nvmeofctl CMD SUB --opt ...` line in the docs' shell blocks names a real
              subcommand and options its --help lists
  metrics     the metric families a running gateway (memory backend) and a control plane
              (--store memory) export, plus every "nvmeof_..." name literal in the metrics
              source, are each documented in docs/metrics.md, and every metric name
              docs/metrics.md mentions exists
  dashboard   docs/grafana-dashboard.json is valid JSON, a dashboard with panels, and every
              metric name in its queries is exported
"""

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
# Pages a change in progress adds: a link to one of them that does not exist yet is reported,
# not failed. Empty when nothing is in flight.
PENDING: set = set()
VERBOSE = False


def log(msg):
    if VERBOSE:
        print("    " + msg)


# ------------------------------------------------------------------ markdown --
FENCE = re.compile(r"^\s*(```|~~~)")


def split_code(text):
    """Yields (is_code, info, start_line, lines) blocks of a markdown text."""
    blocks, cur, in_code, info, start = [], [], False, "", 1
    for n, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if m and not in_code:
            blocks.append((False, "", start, cur))
            cur, in_code, info, start = [], True, line.strip()[3:].strip(), n + 1
        elif m and in_code:
            blocks.append((True, info, start, cur))
            cur, in_code, info, start = [], False, "", n + 1
        else:
            cur.append(line)
    blocks.append((in_code, info, start, cur))
    return blocks


def github_slug(heading):
    """The anchor GitHub gives a heading: lower case, markup and punctuation dropped,
    spaces to '-'."""
    h = heading.strip().lower()
    h = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", h)  # links: their text
    h = h.replace("`", "")
    h = re.sub(r"[^\w\- ]", "", h)  # keeps letters, digits, _, -, space
    return h.replace(" ", "-")


def anchors_of(path, cache={}):
    if path not in cache:
        seen, out = {}, set()
        for is_code, _, _, lines in split_code(path.read_text()):
            if is_code:
                continue
            for line in lines:
                m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
                if not m:
                    continue
                slug = github_slug(m.group(2))
                n = seen.get(slug, 0)
                seen[slug] = n + 1
                out.add(slug if n == 0 else f"{slug}-{n}")
        cache[path] = out
    return cache[path]


LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|<a\s+href=\"([^\"]+)\"")


def check_links():
    errors = []
    for doc in DOC_FILES:
        for is_code, _, start, lines in split_code(doc.read_text()):
            if is_code:
                continue
            for i, line in enumerate(lines):
                line = re.sub(r"`[^`]*`", "", line)  # inline code is not a link
                for m in LINK.finditer(line):
                    target = m.group(1) or m.group(2)
                    where = f"{doc.relative_to(ROOT)}:{start + i}"
                    if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, mailto: ...
                        continue
                    path_part, _, anchor = target.partition("#")
                    dest = (doc.parent / path_part).resolve() if path_part else doc
                    if not dest.exists():
                        rel = os.path.relpath(dest, ROOT)
                        if rel in PENDING:
                            print(f"    note: {where}: {target}: not there yet (tests/docs/check.py PENDING)")
                        else:
                            errors.append(f"{where}: {target}: no such file")
                        continue
                    if anchor:
                        if dest.suffix != ".md":
                            errors.append(f"{where}: {target}: anchor into a non-markdown file")
                        elif anchor not in anchors_of(dest):
                            errors.append(f"{where}: {target}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
    return errors


# ---------------------------------------------------------------------- toml --
MINIMAL = {
    "gateway": '[gateway]\nname = "docs-check"\n',
    "listener": '[[listener]]\ntransport = "tcp"\naddress = "127.0.0.1"\nport = 4420\n',
}
CHECKED_PATHS = re.compile(r'^(\s*(?:conf|tls_ca|tls_cert|tls_key)\s*=\s*")(/[^"]*)(")', re.M)


def toml_blocks():
    """(where, text, mode) for each ```toml block; mode: 'full', 'fragment' or 'skip'."""
    for doc in DOC_FILES:
        prev_text = []
        for is_code, info, start, lines in split_code(doc.read_text()):
            if not is_code:
                prev_text = lines
                continue
            if info.split()[:1] != ["toml"]:
                continue
            marker = ""
            for line in reversed(prev_text):
                if line.strip():
                    marker = line.strip()
                    break
            mode = "full"
            if marker.startswith("<!-- fragment"):
                mode = "fragment"
            elif marker.startswith("<!-- not-checked"):
                mode = "skip"
            yield f"{doc.relative_to(ROOT)}:{start}", "\n".join(lines) + "\n", mode


def check_toml(gateway, tmp):
    errors, count = [], 0
    empty = tmp / "empty-file"
    empty.write_text("")

    def existing(m):
        return m.group(0) if Path(m.group(2)).exists() else f"{m.group(1)}{empty}{m.group(3)}"

    for where, text, mode in toml_blocks():
        if mode == "skip":
            log(f"{where}: not checked (marked)")
            continue
        count += 1
        if mode == "fragment":
            for section, header in (("gateway", r"^\[gateway\]"), ("listener", r"^\[\[listener\]\]")):
                if not re.search(header, text, re.M):
                    text = text + "\n" + MINIMAL[section]
        text = CHECKED_PATHS.sub(existing, text)
        f = tmp / "example.toml"
        f.write_text(text)
        r = subprocess.run([str(gateway), "--config", str(f), "--check"],
                           capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            errors.append(f"{where} ({mode}): {(r.stderr or r.stdout).strip()}")
        else:
            log(f"{where} ({mode}): configuration OK")
    if count == 0:
        errors.append("no ```toml example found")
    return errors


# ---------------------------------------------------------------- config-ref --
# section id -> (TOML that puts an unknown key into that section, the heading in
# docs/configuration.md whose tables list its fields)
SECTIONS = {
    "top level": ("__docs_probe = 1\n", "Top level"),
    "gateway": ("[gateway]\n__docs_probe = 1\n", "`[gateway]`"),
    "listener": ("[[listener]]\n__docs_probe = 1\n", "`[[listener]]`"),
    "subsystem": ("[[subsystem]]\n__docs_probe = 1\n", "`[[subsystem]]`"),
    "host entry": ('[[subsystem]]\nnqn = "nqn.x:y"\nhosts = [{ __docs_probe = 1 }]\n', "Host entries"),
    "namespace": ("[[subsystem]]\n[[subsystem.namespace]]\n__docs_probe = 1\n", "`[[subsystem.namespace]]`"),
    "ceph": ("[ceph]\n__docs_probe = 1\n", "`[ceph]`"),
    "group": ("[group]\n__docs_probe = 1\n", "`[group]`"),
}


def code_fields(gateway, tmp, probe):
    f = tmp / "probe.toml"
    f.write_text(probe)
    r = subprocess.run([str(gateway), "--config", str(f), "--check"],
                       capture_output=True, text=True, timeout=30)
    out = r.stderr + r.stdout
    m = re.search(r"unknown field `__docs_probe`, (expected one of (.*)|expected `([^`]*)`|there are no fields)", out)
    if not m:
        raise RuntimeError(f"no field list in the answer to {probe!r}: {out.strip()}")
    if m.group(3):
        return {m.group(3)}
    return set(re.findall(r"`([^`]+)`", m.group(2) or ""))


def doc_fields():
    """heading -> the `field` names in the first column of its tables."""
    out, heading = {}, None
    for is_code, _, _, lines in split_code((ROOT / "docs/configuration.md").read_text()):
        if is_code:
            continue
        for line in lines:
            m = re.match(r"^#{2,3}\s+(.*?)\s*$", line)
            if m:
                heading = m.group(1)
                out.setdefault(heading, set())
                continue
            m = re.match(r"^\|\s*`([A-Za-z0-9_]+)`\s*\|", line)
            if m and heading is not None:
                out[heading].add(m.group(1))
    return out


def check_config_ref(gateway, tmp):
    errors = []
    docs = doc_fields()
    for name, (probe, heading) in SECTIONS.items():
        have = code_fields(gateway, tmp, probe)
        listed = docs.get(heading)
        if listed is None:
            errors.append(f"docs/configuration.md has no heading '{heading}' (section {name})")
            continue
        for f in sorted(have - listed):
            errors.append(f"{name}: field `{f}` is in the code but not in docs/configuration.md under '{heading}'")
        for f in sorted(listed - have):
            errors.append(f"{name}: field `{f}` is in docs/configuration.md under '{heading}' but the code has no such field")
        log(f"{name}: {len(have)} fields: {', '.join(sorted(have))}")
    return errors


# ----------------------------------------------------------------------- cli --
def cli_helps():
    """'nvmeofctl CMD SUB' (and 'nvmeofctl') -> its --help text, from docs/cli.md."""
    helps, heading = {}, None
    for is_code, _, _, lines in split_code((ROOT / "docs/cli.md").read_text()):
        if is_code and heading:
            helps[heading] = "\n".join(lines)
        elif not is_code:
            for line in lines:
                m = re.match(r"^#{2,4}\s+(nvmeofctl.*?)\s*$", line)
                if m:
                    heading = m.group(1)
    return helps


def check_cli_examples():
    """Every nvmeofctl command line in the docs' shell blocks names a real subcommand and
    only options its --help (or nvmeofctl's global help) lists."""
    import shlex
    helps = cli_helps()
    glob = helps.get("nvmeofctl", "")
    errors, count = [], 0
    for doc in DOC_FILES:
        if doc.name == "cli.md":
            continue
        for is_code, info, start, lines in split_code(doc.read_text()):
            if not is_code or info.split()[:1] not in (["sh"], ["bash"], ["console"]):
                continue
            text = "\n".join(lines).replace("\\\n", " ")
            for line in text.splitlines():
                if line.lstrip().startswith("#"):
                    continue
                for part in re.split(r"[|;]|&&", line):
                    m = re.search(r"(?:^|[\s/])nvmeofctl\s+(.*)", part)
                    if not m:
                        continue
                    try:
                        words = shlex.split(m.group(1), comments=True)
                    except ValueError:
                        continue
                    opts, pos, i = [], [], 0
                    while i < len(words):
                        w = words[i]
                        if w == "-":  # standard input as a file argument
                            pass
                        elif w.startswith("-"):
                            opts.append(w.split("=")[0])
                            # global options with a value (the value is not a subcommand)
                            if not pos and w in ("-s", "--server", "-o", "--output", "--tls-ca", "--tls-cert", "--tls-key", "--tls-server-name"):
                                i += 1
                        elif len(pos) < 2:
                            pos.append(w)
                        i += 1
                    if len(pos) < 2 or "|" in pos[0] or pos[0].startswith("$"):
                        continue  # not a full command (prose, a placeholder)
                    count += 1
                    where = f"{doc.relative_to(ROOT)}:{start}"
                    key = f"nvmeofctl {pos[0]} {pos[1]}"
                    if key not in helps:
                        errors.append(f"{where}: `{key}` is not a nvmeofctl command (docs/cli.md)")
                        continue
                    for o in opts:
                        if o in ("-h", "--help"):
                            continue
                        if not re.search(r"(^|[\s,])" + re.escape(o) + r"([\s,=<]|$)", helps[key] + "\n" + glob, re.M):
                            errors.append(f"{where}: `{key}` has no option {o}")
    if count == 0:
        errors.append("no nvmeofctl command found in the docs' shell blocks")
    log(f"{count} nvmeofctl command lines checked")
    return errors


def check_cli(bindir):
    r = subprocess.run(["bash", str(ROOT / "tests/docs/gen-cli.sh"), str(bindir)],
                       capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        return [f"tests/docs/gen-cli.sh failed: {r.stderr.strip()}"]
    have = (ROOT / "docs/cli.md").read_text()
    if have == r.stdout:
        return check_cli_examples()
    import difflib
    diff = list(difflib.unified_diff(have.splitlines(), r.stdout.splitlines(),
                                     "docs/cli.md", "generated", lineterm="", n=1))
    return ["docs/cli.md differs from the binaries' --help (regenerate: "
            "tests/docs/gen-cli.sh target/release > docs/cli.md):"] + diff[:40]


# ------------------------------------------------------------------- metrics --
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(url, deadline):
    last = None
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                return r.read().decode()
        except OSError as e:
            last = e
            time.sleep(0.1)
    raise RuntimeError(f"{url}: no answer ({last})")


def families(text):
    """name -> type, from the exposition's # TYPE lines."""
    return {m.group(1): m.group(2) for m in re.finditer(r"^# TYPE (\S+) (\S+)$", text, re.M)}


def exported_metrics(bindir, tmp):
    """Families from a real scrape of a gateway and a control plane, plus the name literals
    in the metrics source (for families rendered only in some states)."""
    gw_port, gw_metrics, cp_port, cp_metrics = free_port(), free_port(), free_port(), free_port()
    conf = tmp / "metrics-gw.toml"
    conf.write_text(f"""[gateway]
name = "docs-check"
metrics_listen = "127.0.0.1:{gw_metrics}"
[[listener]]
transport = "tcp"
address = "127.0.0.1"
port = {gw_port}
[[subsystem]]
nqn = "nqn.2016-06.io.example:docs-check"
allow_any_host = true
[[subsystem.namespace]]
nsid = 1
backend = "memory"
size = "16MiB"
""")
    procs, found = [], {}
    try:
        env = dict(os.environ, RUST_LOG="warn")
        procs.append(subprocess.Popen([str(bindir / "nvmeof-gateway"), "--config", str(conf)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env))
        procs.append(subprocess.Popen([str(bindir / "nvmeof-control"), "--store", "memory",
                                       "--listen", f"127.0.0.1:{cp_port}",
                                       "--metrics-listen", f"127.0.0.1:{cp_metrics}"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env))
        deadline = time.time() + 20
        for port in (gw_metrics, cp_metrics):
            found.update(families(scrape(f"http://127.0.0.1:{port}/metrics", deadline)))
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    scraped = set(found)
    literal = set()
    for d in ("gateway/src", "control-plane/src", "rdma-transport/src", "rbd-backend/src", "metrics-exposition/src"):
        for f in (ROOT / d).rglob("*.rs"):
            if "test" in f.name:
                continue
            text = f.read_text()
            # Family::new(out, "name", "kind", ...): the name and kind, wherever the call wraps
            for m in re.finditer(r'Family::new\(\s*[^,]+,\s*"(nvmeof_[a-z0-9_]*)",\s*"(\w+)"', text):
                literal.add(m.group(1))
                found.setdefault(m.group(1), m.group(2))
            # in the metrics modules, every "nvmeof_..." literal is a metric name (tables of
            # counters rendered in a loop)
            if f.name == "metrics.rs" or f.parent.name == "metrics":
                for m in re.finditer(r'"(nvmeof_[a-z0-9_]+)"', text):
                    literal.add(m.group(1))
                    found.setdefault(m.group(1), "untyped")
    log(f"scraped {len(scraped)} families; {len(literal)} in the source; {len(literal - scraped)} only in the source: {sorted(literal - scraped)}")
    return found


def metric_names_in(text, known):
    """Metric names in a text: nvmeof_* tokens, histogram series suffixes mapped to the
    family name."""
    names = set()
    for tok in re.findall(r"\bnvmeof_[a-z0-9_]+", text):
        for suffix in ("_bucket", "_sum", "_count"):
            if tok.endswith(suffix) and tok[: -len(suffix)] in known and known[tok[: -len(suffix)]] == "histogram":
                tok = tok[: -len(suffix)]
        names.add(tok)
    return names


def check_metrics(known):
    errors = []
    text = (ROOT / "docs/metrics.md").read_text()
    documented = set(re.findall(r"^\|\s*`(nvmeof_[a-z0-9_]+)`", text, re.M))
    for name in sorted(set(known) - documented):
        errors.append(f"metric {name} ({known[name]}) is exported but has no row in docs/metrics.md")
    for name in sorted(metric_names_in(text, known) - set(known)):
        errors.append(f"docs/metrics.md names {name}, which nothing exports")
    return errors


def check_dashboard(known):
    path = ROOT / "docs/grafana-dashboard.json"
    try:
        dash = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return [f"{path.relative_to(ROOT)}: not valid JSON: {e}"]
    errors, exprs = [], []

    def walk(node):
        if isinstance(node, dict):
            for k, v in node.items():
                if k in ("expr", "query") and isinstance(v, str):
                    exprs.append(v)
                else:
                    walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    panels = dash.get("panels") if isinstance(dash, dict) else None
    if not panels or not isinstance(panels, list):
        return ["docs/grafana-dashboard.json has no panels"]
    if not dash.get("title") or not isinstance(dash.get("schemaVersion"), int):
        errors.append("docs/grafana-dashboard.json: a dashboard needs a title and an integer schemaVersion")
    walk(dash)
    if not exprs:
        errors.append("docs/grafana-dashboard.json has no queries")
    for e in exprs:
        for name in sorted(metric_names_in(e, known) - set(known)):
            errors.append(f"dashboard query names {name}, which nothing exports: {e}")
    log(f"dashboard: {len(panels)} panels, {len(exprs)} queries")
    return errors


# ---------------------------------------------------------------------- main --
def main():
    global VERBOSE
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    if not target.is_absolute():
        target = ROOT / target
    ap.add_argument("--bin", type=Path, default=target / "release")
    ap.add_argument("--only", default="")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    VERBOSE = args.verbose
    bindir = args.bin.resolve()
    gateway = bindir / "nvmeof-gateway"
    only = set(filter(None, args.only.split(",")))
    missing = [b for b in ("nvmeof-gateway", "nvmeof-control", "nvmeofctl") if not (bindir / b).is_file()]

    passed = failed = 0
    known = {}
    with tempfile.TemporaryDirectory(prefix="docs-check-") as t:
        tmp = Path(t)
        checks = [
            ("links", lambda: check_links(), False),
            ("toml", lambda: check_toml(gateway, tmp), True),
            ("config-ref", lambda: check_config_ref(gateway, tmp), True),
            ("cli", lambda: check_cli(bindir), True),
            ("metrics", lambda: check_metrics(known), True),
            ("dashboard", lambda: check_dashboard(known), True),
        ]
        for name, run, needs_bins in checks:
            if only and name not in only:
                continue
            t0 = time.time()
            try:
                if needs_bins and missing:
                    errors = [f"no {', '.join(missing)} in {bindir} (cargo build --release -p nvmeof-gateway -p control-plane --bins)"]
                elif name in ("metrics", "dashboard") and not known:
                    known.update(exported_metrics(bindir, tmp))
                    errors = run()
                else:
                    errors = run()
            except Exception as e:  # a check that cannot run fails, with the reason
                errors = [f"{type(e).__name__}: {e}"]
            status = "PASS" if not errors else "FAIL"
            print(f"{status} {name} ({time.time() - t0:.1f}s)")
            for e in errors:
                print(f"    {e}")
            if errors:
                failed += 1
            else:
                passed += 1
    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
