"""Every figure the README and docs quote is found in the results file it names (issue 46).

A benchmark run (`python -m benchmarks.run NAME [--quick]`) writes `benchmarks/results/NAME[.quick].json`: its
figures, printed table, commit, command and the machine's load. Prose quotes them with a reference right after
the figures it backs:

    the engine decodes 2.41x faster (benchmarks/results/generation.quick.json: throughput.median_ratio)

A reference is `(benchmarks/results/FILE.json: KEY, KEY, ...)`; a KEY is a dotted path into the file's `figures`
(list items by index, `a.{b,c}.d` for several keys at once), or into the record itself for `machine.*`, `seconds`,
`date`, `commit`, `command`. It covers the text from the previous reference of the same block (a paragraph, a
list item, a table row, a heading) or from the block's start. Checked here, with no benchmark run:

1. each KEY exists and its value is quoted in the text it covers: a number equals one of the numbers written
   there within the printed rounding (0.641 matches 0.64 and 64.1%; 287.3 matches 287), a list of numbers each
   of its items, a string appears verbatim;
2. each figure-looking claim of a known pattern is covered by a reference and equals one of its values:
   ratios (`2.34x`, `1.26-1.55x`, `×`), durations (`287 s`, `73 ms`), sizes (`1614 MB`, `2.0 MiB`), rates
   (`tok/s`, `tokens/s`) and before -> after pairs with a decimal or a percentage (`0.22 → 0.38`; whole numbers
   either side of an arrow are indices: `N-1 → 0`). Not claims, so not checked: figures in code
   spans and code blocks (commands, settings), and figures whose clause names them a setting or someone else's
   figure: one of NOT_MEASURED earlier in the same clause (`goal >= 2x`, `the paper reports 1.2-1.3x`, `a time
   budget of 60 s`, `an assumed 10 µs`). Bare numbers and percentages are not claims by this rule (most are settings: `Rt 40%`,
   `12 settings`); they are checked where a reference covers them.
"""

from __future__ import annotations

import functools
import json
import math
import re
import sys
import types
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # benchmarks/ is a folder of the repository, not of the installed package
    sys.path.append(str(REPO))

from benchmarks import run  # noqa: E402

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RECORD_KEYS = ("machine", "seconds", "date", "commit", "command")

REFERENCE = re.compile(r"\(benchmarks/results/([\w.-]+\.json):\s*([^()]*)\)")
NUMBER = re.compile(r"(?<![\w.])[−+-]?\d+(?:\.\d+)?(?:e[−+-]?\d+)?(?!-?[A-Za-wyz])")
"""A number as prose writes a figure: not part of a word or a name (`fp32`, `13B`, `2-core`, `1-minute`)."""
_NUM = r"[−+-]?\d+(?:\.\d+)?"
_RANGE = rf"{_NUM}(?:\s?[-–]\s?{_NUM})?"
CLAIM = re.compile(
    rf"(?<![\w.-])(?:{_RANGE}(?:x|×)(?!\w)"  # ratios (`4 x 8` and `16 × 8` are products, not ratios)
    rf"|{_RANGE}\s?(?:s|ms|µs|min)(?![\w/])"  # durations
    rf"|{_RANGE}\s?(?:KB|kB|KiB|MB|MiB|GB|GiB)(?![\w/])"  # sizes (not `B`: 13B is a model)
    rf"|{_RANGE}\s?(?:tok/s|tokens/s)"  # rates
    rf"|{_NUM}%?\s?(?:→|->)\s?{_NUM}%?)"  # before -> after (of decimals or percentages: `_is_claim`)
)
NOT_MEASURED = re.compile(
    r"paper|published|goal|target|budget|\bcaps? |limit|timeout|guard|default(?! job)|assum|nominal|arithmetic"
    r"|at most|up to"
    r"|e\.g\.|>=|<=|≤|≥"
)
"""Words that mark the figures after them in the same clause (from the last `. `, `;`, `(`, `)`, `|` before the
figure) as settings, goals or figures quoted from elsewhere (the paper)."""


def _blocks(text: str) -> list[tuple[int, str]]:
    """(first line number, text) of each paragraph, list item, table row and heading; code masked out."""
    blocks: list[tuple[int, str]] = []
    current: list[str] = []
    start = 0
    fenced = False

    def close() -> None:
        if current:  # code spans (commands, settings, quoted messages) masked, across lines too
            blocks.append((start, re.sub(r"`[^`]*`", lambda m: " " * len(m.group(0)), " ".join(current))))
            current.clear()

    indented = False  # an indented code block: 4 spaces after a blank line
    previous = ""
    for number, line in enumerate(text.splitlines(), 1):
        indented = line.startswith("    ") and (indented or not previous.strip())
        previous = line
        if line.lstrip().startswith("```"):
            fenced = not fenced
            close()
            continue
        if fenced or indented:
            continue
        stripped = line.strip()
        new_item = re.match(r"([-*]|\d+\.)\s", stripped) or stripped.startswith(("#", "|"))
        if not stripped or new_item:
            close()
        if stripped:
            if not current:
                start = number
            current.append(stripped)
            if stripped.startswith(("#", "|")):
                close()
    close()
    return blocks


@functools.cache
def _record(name: str) -> dict[str, Any]:
    path = REPO / "benchmarks" / "results" / name
    if not path.is_file():
        raise AssertionError(
            f"no results file {path.relative_to(REPO)}: run its benchmark (benchmarks/run.py)"
        )
    return json.loads(path.read_text())


def _expand(keys: str) -> list[str]:
    """`a.{b,c}.d, e` -> [a.b.d, a.c.d, e]."""
    out = []
    for key in _split(keys):
        match = re.search(r"\{([^}]*)\}", key)
        if match is None:
            out.append(key)
        else:
            head, tail = key[: match.start()], key[match.end() :]
            out += _expand(",".join(head + x + tail for x in match.group(1).split("|")))
    return out


def _split(keys: str) -> list[str]:
    """Split on the commas outside braces, and write the commas inside braces as `|`."""
    parts, depth, current = [], 0, ""
    for char in keys:
        depth += (char == "{") - (char == "}")
        if char == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += "|" if char == "," and depth else char
    return [p for p in [*parts, current.strip()] if p]


def _resolve(record: dict[str, Any], keys: list[str]) -> list[tuple[str, Any]]:
    """(key, figure) of each key; a name holding commas (`weight_sync.plain, 2 replicas.engine.ms`) is the longest
    run of the comma-separated pieces that names a figure. A key naming nothing gives (key, KeyError())."""
    out, i = [], 0
    while i < len(keys):
        for n in range(len(keys) - i, 0, -1):
            key = ", ".join(keys[i : i + n])
            try:
                out.append((key, _lookup(record, key)))
                break
            except KeyError:
                continue
        else:
            n = 1
            out.append((keys[i], KeyError(keys[i])))
        i += n
    return out


def _lookup(record: dict[str, Any], key: str) -> Any:
    """The figure at `key`: in the record's figures, or in the record itself for the run's conditions."""
    return run.figure(record if key.split(".")[0] in RECORD_KEYS else record["figures"], key)


def _numbers(text: str) -> list[tuple[float, float, bool]]:
    """(value, half a unit of its last written digit, followed by %) of each number written in `text`."""
    out = []
    for m in NUMBER.finditer(text):
        written = m.group(0).replace("−", "-")
        mantissa, _, exponent = written.partition("e")
        decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
        half = 0.5 * 10.0 ** (int(exponent or 0) - decimals)
        out.append((float(written), half, text[m.end() : m.end() + 1] == "%"))
    return out


def _quoted(value: float, text: str) -> bool:
    """Whether `text` writes `value` at some number's printed precision (x100 for a percentage)."""
    for written, half, percent in _numbers(text):
        for scale in (100.0, 1.0) if percent else (1.0,):
            if abs(value * scale - written) <= half * (1 + 1e-9) + 1e-12:
                return True
    return False


def _values(value: Any) -> list[Any]:
    if isinstance(value, bool):
        raise TypeError(f"{value!r} is not a figure to quote")
    if isinstance(value, list):
        return [v for item in value for v in _values(item)]
    if isinstance(value, int | float | str):
        return [value]
    raise TypeError(
        f"{type(value).__name__} is not a figure to quote: name a number, a string or a list of them"
    )


def _exempt(block: str, start: int, claim: str) -> bool:
    if re.search("→|->", claim) and not re.search(r"[.%]", claim):
        return True  # whole numbers either side of an arrow are indices (ranks, stages: `N-1 → 0`)
    clause = re.split(r"[;()|\[\]]|\. ", block[:start])[-1].lower()
    return NOT_MEASURED.search(clause) is not None


def _check_block(doc: str, line: int, block: str) -> list[str]:
    problems = []
    spans = []  # (start, end, values) of the text each reference covers
    previous = 0
    for ref in REFERENCE.finditer(block):
        name, keys = ref.group(1), ref.group(2)
        covered = block[previous : ref.start()]
        values: list[Any] = []
        try:
            record = _record(name)
        except AssertionError as exc:
            problems.append(f"{doc}:{line}: {exc}")
            previous = ref.end()
            continue
        for key, figure in _resolve(record, _expand(keys)):
            if isinstance(figure, KeyError):
                problems.append(f"{doc}:{line}: {name} has no figure {key!r}")
                continue
            try:
                found = _values(figure)
            except TypeError as exc:
                problems.append(f"{doc}:{line}: {name}: {key}: {exc}")
                continue
            for value in found:
                ok = value in covered if isinstance(value, str) else _quoted(float(value), covered)
                if not ok:
                    shown = value if isinstance(value, str) else f"{value:.6g}"
                    problems.append(
                        f"{doc}:{line}: {name}: {key} = {shown} is not what the text quotes: {covered!r}"
                    )
            values += [v for v in found if not isinstance(v, str)]
        spans.append((previous, ref.start(), values))
        previous = ref.end()
    for claim in CLAIM.finditer(block):
        if _exempt(block, claim.start(), claim.group(0)):
            continue
        span = next(((s, e, v) for s, e, v in spans if s <= claim.start() < e), None)
        if span is None:
            problems.append(f"{doc}:{line}: {claim.group(0)!r} names no results file: {block[:160]!r}")
            continue
        for number in NUMBER.finditer(claim.group(0)):
            written = claim.group(0)[number.start() : number.end() + 1]  # with its % if it has one
            if not any(_quoted(float(v), written) for v in span[2]):
                problems.append(
                    f"{doc}:{line}: {claim.group(0)!r}: {number.group(0)} is none of its reference's figures: "
                    f"{block[:160]!r}"
                )
    return problems


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_quoted_figure_is_in_the_results_file_it_names(doc: Path) -> None:
    problems = [p for line, block in _blocks(doc.read_text()) for p in _check_block(doc.name, line, block)]
    assert not problems, f"{len(problems)} figure(s) without their source:\n" + "\n".join(problems)


# ------------------------------------------------------------------------------------------------ the rules
def test_a_reference_checks_its_figures_and_an_unreferenced_claim_fails(monkeypatch) -> None:
    record = {
        "figures": {
            "a": {"ratio": 2.3449, "ms": 73.04, "acc": [0.22, 0.384]},
            "choice": "fold",
            "sync": {
                "plain, 2 replicas": {"ms": 1.12},
                "cap 1.2x": {"s": 0.7},
            },  # names as the benchmark prints them
        },
        "machine": {"load_before": [3.45, 2.0, 1.0]},
    }
    monkeypatch.setattr(sys.modules[__name__], "_record", lambda name: record)

    def problems(text: str) -> str:
        return "\n".join(p for line, block in _blocks(text) for p in _check_block("doc.md", line, block))

    def ref(keys: str) -> str:
        return f"(benchmarks/results/x.json: {keys})"

    assert (
        problems(f"It is 2.34x faster, 73 ms a step, accuracy 0.22 → 0.38 {ref('a.{ratio,ms,acc}')}.") == ""
    )
    assert problems(f"accuracy 22% → 38.4% {ref('a.acc')}, fold {ref('choice')}") == ""
    assert "is not what the text quotes" in problems(f"2.35x {ref('a.ratio')}")
    assert "names no results file" in problems("It is 2.34x faster.")
    assert "names no results file" in problems("- accuracy 0.22 -> 0.38 in 200 iterations")
    assert "none of its reference" in problems(f"2.34x and 5 s {ref('a.ratio')}")
    assert "no figure" in problems(f"2.34x {ref('a.speedup')}")
    assert (
        problems(f"1.1 ms {ref('sync.plain, 2 replicas.ms')}, 0.7 s and 73 ms {ref('sync.cap 1.2x.s, a.ms')}")
        == ""
    )
    assert problems(f"at a load of 3.45 {ref('machine.load_before.0')}") == ""
    assert "is not what the text quotes" in problems(
        f"on 2 cores for 1 minute {ref('machine.load_before.0')}"
    )
    # settings, goals and the paper's figures are not claims; code is not prose; ranks are not before / after
    assert problems("goal >= 2x; the paper's 1.2-1.3x; a time budget of 60 s; `--time-budget 60 s`") == ""
    assert problems("```\n287 s\n```\n\n    287 s\n\nflows N-1 → 0") == ""


def test_percentages_and_rounding() -> None:
    assert _quoted(0.641, "64.1%") and _quoted(0.641, "0.64") and _quoted(287.3, "287 s")
    assert _quoted(4.8e-7, "4.8e-7") and not _quoted(4.8e-7, "4.7e-7")
    assert not _quoted(0.641, "64.2%") and not _quoted(287.6, "287 s")
    assert _expand("a.{b,c}.d, e") == ["a.b.d", "a.c.d", "e"]


def test_the_runner_writes_the_figures_beside_the_table(tmp_path, monkeypatch, capsys) -> None:
    fake = types.ModuleType("benchmarks.bench_fake")

    def bench(quick: bool = False) -> dict[str, Any]:
        print("speedup 2.00x")
        return {"speedup": 2.0 if quick else 3.0}

    fake.run = bench  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "benchmarks.bench_fake", fake)
    run.run_one("fake", True, tmp_path)
    written = json.loads((tmp_path / "fake.quick.json").read_text())
    assert written["figures"] == {"speedup": 2.0} and written["output"] == ["speedup 2.00x"]
    assert written["quick"] and written["command"].endswith("benchmarks.run fake --quick")
    assert len(written["machine"]["load_before"]) == 3
    fake.run = lambda quick=False: {"speedup": 2.5}  # type: ignore[attr-defined]
    run.run_one("fake", True, tmp_path)
    assert "speedup: 2 -> 2.5" in capsys.readouterr().out  # the figures that moved since the file's last run
    assert math.isclose(
        run.figure(json.loads((tmp_path / "fake.quick.json").read_text())["figures"], "speedup"), 2.5
    )
