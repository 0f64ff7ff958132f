"""The docs cannot drift from the code.

Reference: every function, view, table and row type of the `outbox` and `inbox` schemas users see
(names without a leading underscore) and every `outbox_ext.*` setting has a page,
docs/reference/<name>.md, whose signature block matches the catalog; no page names an object
that does not exist, and the reference index links every page.

Doc blocks: every ```sql and ```sh block of README.md, docs/ and examples/*/README.md runs against a real cluster, in
the order it appears, in a database of its own per file (with outbox_ext installed, unless the
file's own blocks install it). A block runs as written (psql for SQL, bash for shell, from the
repository's root with PGHOST/PGPORT/PGUSER/PGDATABASE set). Three marks change that:
- ```sql fails 22023: the block must fail, with that SQLSTATE (errors are part of the docs);
- ```sql signature / ```text signature: a reference page's signature, compared, not run;
- `<!-- not run: why -->` on the line before the fence: skipped, and the why must be said.

Links: every relative link in those files leads to a file that exists, and to a heading
of it when it names one.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import TEMPLATE

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
REFERENCE = DOCS / "reference"
RUN_AS = {"sql", "sh", "bash", "shell"}
NOT_RUN = re.compile(r"<!--\s*not run:\s*(.*?)\s*-->")
FENCE = re.compile(r"^(\s*)```(.*)$")


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    info: list[str]
    text: str
    not_run: str | None  # the reason given, when marked not run

    @property
    def lang(self) -> str:
        return self.info[0] if self.info else ""

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def markdown_files() -> list[Path]:
    """README.md, docs/ and the examples' READMEs."""
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md")), *sorted((ROOT / "examples").glob("*/README.md"))]


def blocks_of(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown file, with their info strings and not-run marks."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith("```"):
            body.append(lines[i][len(m.group(1)):] if lines[i].startswith(m.group(1)) else lines[i])
            i += 1
        prev = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        mark = NOT_RUN.search(prev)
        blocks.append(Block(path, start + 1, m.group(2).split(), "\n".join(body) + "\n",
                            mark.group(1) if mark else None))
        i += 1
    return blocks


def normalized(signature: str) -> str:
    """One line, single spaces, no space inside parentheses: pages may wrap long signatures."""
    s = re.sub(r"\s+", " ", signature).strip()
    return re.sub(r"\(\s+", "(", re.sub(r"\s+\)", ")", s))


# ---------------------------------------------------------------- the reference against the catalog

def catalog_signatures(conn) -> dict[str, set[str]]:
    """What each reference page must state, by object name, from the catalog."""
    sigs: dict[str, set[str]] = {}
    for name, sig in conn.execute("""
            SELECT n.nspname || '.' || p.proname,
                   n.nspname || '.' || p.proname || '(' || pg_get_function_arguments(p.oid) || ') RETURNS '
                   || pg_get_function_result(p.oid)
              FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
             WHERE n.nspname IN ('outbox', 'inbox') AND p.proname NOT LIKE '\\_%'"""):
        sigs.setdefault(name, set()).add(normalized(sig))
    for name, sig in conn.execute("""
            SELECT n.nspname || '.' || c.relname,
                   CASE c.relkind WHEN 'v' THEN 'VIEW ' WHEN 'c' THEN 'TYPE ' ELSE 'TABLE ' END
                   || n.nspname || '.' || c.relname
                   || '(' || string_agg(a.attname || ' ' || format_type(a.atttypid, a.atttypmod), ', '
                                        ORDER BY a.attnum) || ')'
              FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
              JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
             WHERE n.nspname IN ('outbox', 'inbox') AND c.relkind IN ('r', 'p', 'v', 'c')
               AND NOT c.relispartition AND c.relname NOT LIKE '\\_%'
             GROUP BY n.nspname, c.relname, c.relkind"""):
        sigs[name] = {normalized(sig)}
    for name, vartype, unit, boot_val, context in conn.execute(
            "SELECT name, vartype, unit, boot_val, context FROM pg_settings WHERE name LIKE 'outbox\\_ext.%'"):
        unit = f" UNIT {unit}" if unit else ""
        boot = boot_val if vartype != "string" else "'" + (boot_val or "") + "'"
        sigs[name] = {normalized(f"{name} {vartype}{unit} DEFAULT {boot} CONTEXT {context}")}
    return sigs


def page_signatures(page: Path) -> set[str]:
    found = set()
    for block in blocks_of(page):
        if block.info[1:2] == ["signature"]:
            found |= {normalized(s) for s in re.split(r"\n\s*\n", block.text) if s.strip()}
    return found


def test_every_object_has_a_reference_page_that_matches_the_catalog(cluster, dbname):
    with cluster.connect(dbname) as conn:
        want = catalog_signatures(conn)
    pages = {p.stem: p for p in REFERENCE.glob("*.md") if p.name != "README.md"}
    missing = sorted(set(want) - set(pages))
    stale = sorted(set(pages) - set(want))
    assert not missing, f"objects without a page in docs/reference: {missing}"
    assert not stale, f"pages in docs/reference for objects that do not exist: {stale}"
    wrong = {name: (sorted(want[name]), sorted(page_signatures(pages[name])))
             for name in want if page_signatures(pages[name]) != want[name]}
    assert not wrong, "signatures that differ from the catalog (catalog, page):\n" + "\n".join(
        f"{name}:\n  catalog: {c}\n  page:    {p}" for name, (c, p) in wrong.items())


def test_the_reference_index_links_every_page():
    index = (REFERENCE / "README.md").read_text()
    unlinked = [p.name for p in REFERENCE.glob("*.md") if p.name != "README.md" and f"({p.name})" not in index]
    assert not unlinked, f"docs/reference/README.md does not link {unlinked}"


# ---------------------------------------------------------------- links

LINK = re.compile(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)")


def anchors_of(path: Path) -> set[str]:
    """The anchors a code host makes of a file's headings: lower case, punctuation dropped,
    spaces as hyphens."""
    heads = [line.lstrip("#").strip() for line in path.read_text().splitlines() if re.match(r"#{1,6} ", line)]
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_lead_to_files_and_headings(path):
    broken = []
    for target, anchor in LINK.findall(path.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # a web address
        file = (path.parent / target) if target else path
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in anchors_of(file):
            broken.append(f"{target}#{anchor}")
    assert not broken, f"{path.relative_to(ROOT)} links to files or headings that do not exist: {broken}"


# ---------------------------------------------------------------- every block runs

def runnable(block: Block) -> bool:
    return block.lang in RUN_AS and "signature" not in block.info[1:] and block.not_run is None


def installs_itself(blocks: list[Block]) -> bool:
    return any(b.lang == "sql" and runnable(b) and re.search(r"CREATE EXTENSION (IF NOT EXISTS )?outbox_ext", b.text)
               for b in blocks)


def run_block(block: Block, env: dict[str, str]) -> subprocess.CompletedProcess:
    if block.lang == "sql":
        cmd = ["psql", "-X", "-v", "ON_ERROR_STOP=1", "-v", "VERBOSITY=verbose", "-f", "-"]
    else:
        cmd = ["bash", "-euo", "pipefail", "-s"]
    return subprocess.run(cmd, input=block.text, env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def check_outcome(block: Block, done: subprocess.CompletedProcess) -> None:
    said = f"{block.where} ({' '.join(block.info)}):\n{block.text}\n--- output\n{done.stdout}{done.stderr}"
    if "fails" in block.info[1:]:
        state = block.info[block.info.index("fails") + 1:][:1]
        assert done.returncode != 0, f"a block marked `fails` succeeded: {said}"
        assert not state or f"ERROR:  {state[0]}:" in done.stderr, f"expected SQLSTATE {state[0]}: {said}"
    else:
        assert done.returncode == 0, f"a block failed: {said}"


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_block_runs(cluster, path):
    blocks = blocks_of(path)
    for block in blocks:
        if block.not_run is not None:
            assert block.not_run, f"{block.where}: a block not run must say why"
    todo = [b for b in blocks if runnable(b)]
    if not todo:
        pytest.skip("no block to run")
    db = "doc_" + re.sub(r"\W", "_", str(path.relative_to(ROOT)).lower())[:50]
    with cluster.connect() as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {db}" + ("" if installs_itself(blocks) else f" TEMPLATE {TEMPLATE}"))
    env = {**os.environ, "PGHOST": "127.0.0.1", "PGPORT": str(cluster.port), "PGUSER": "postgres",
           "PGDATABASE": db, "PATH": f"{cluster.bindir}:{os.environ['PATH']}"}
    try:
        for block in todo:
            check_outcome(block, run_block(block, env))
    finally:
        with cluster.connect() as conn:
            conn.execute(f"DROP DATABASE {db} WITH (FORCE)")


# ---------------------------------------------------------------- the front door and the history

def test_the_readme_stays_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move details into docs/"


def test_the_changelog_has_an_entry_per_version():
    from support.versions import NEW, RELEASED
    changelog = (ROOT / "CHANGELOG.md").read_text()
    missing = [v for v in [*RELEASED, NEW] if not re.search(rf"^## {re.escape(v)} ", changelog, re.M)]
    assert not missing, f"CHANGELOG.md has no entry for {missing}"
