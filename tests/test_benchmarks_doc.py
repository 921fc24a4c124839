"""perf/BENCHMARKS.md: every table names the JSON in perf/results/ it came from, and that
file says when, where, what ran and at which git revision (perf/runinfo.py's fields)."""
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIELDS = ("date", "host", "command", "git_revision")


def _sections(text: str) -> list[tuple[str, list[str]]]:
    out: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if re.match(r"^#{1,3} ", line):
            out.append((line, []))
        elif out:
            out[-1][1].append(line)
    return out


def _has_table(lines: list[str]) -> bool:
    """A markdown table, or a fenced block without a language (a printed table)."""
    return any(line.startswith("|") for line in lines) or any(line.strip() == "```" for line in lines)


def test_every_table_names_its_results_json():
    text = (ROOT / "perf" / "BENCHMARKS.md").read_text()
    tables = [(title, lines) for title, lines in _sections(text) if _has_table(lines)]
    assert len(tables) >= 8, [t for t, _ in tables]
    for title, lines in tables:
        refs = re.findall(r"perf/results/[\w.-]+\.json", "\n".join(lines))
        assert refs, f"{title}: a table without a perf/results/*.json"
        for ref in refs:
            path = ROOT / ref
            assert path.is_file(), f"{title}: {ref} does not exist"
            doc = json.loads(path.read_text())
            missing = [f for f in FIELDS if not (isinstance(doc.get(f), str) and doc[f].strip())]
            assert not missing, f"{ref}: no {missing}"
            assert re.match(r"^[0-9a-f]{40}", doc["git_revision"]), (ref, doc["git_revision"])
            assert doc["date"][:4].isdigit(), (ref, doc["date"])
