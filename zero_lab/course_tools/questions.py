"""The interview question bank (lesson 08, and the answers other lessons write the same way): its
index, docs/questions.md, and `zero-lab ask`.

Hand-written. Each answer in solutions/08_interview/08_interview.ipynb is a markdown cell whose
first line is `### <id> · <question>` and whose cell metadata carries the tag `seed:<id>` (a
question of ../shared/reference/seed-questions.md) or `q:<id>` (one beyond the seeds); the code
cells that back the answer carry the same tag. The `## ` heading above an answer is its section.
Other lessons' answers written the same way (lesson 11's failures, by symptom) join the bank; their
other tagged cells (code cells backing a seed question, without a heading) are not answers: skipped.

    questions = collect(read_bank())       # [Question(id, kind, question, answer, section, cells)]
    print(ask(["stage", "3", "bandwidth"]))  # best matches with their short answers
"""

from __future__ import annotations

import json
import math
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from zero_lab.course_tools.export import REPO

LESSON = "08_interview"
INDEX = "docs/questions.md"
TAG = re.compile(r"(seed|q):(\S+)")
HEADING = re.compile(r"###\s+(\S+)\s+·\s+(.+)")
SEED_ROW = re.compile(r"^\|\s*(\d{3}-[\w.]+)\s*\|", re.MULTILINE)


@dataclass
class Question:
    id: str
    kind: str  # "seed" or "q"
    question: str
    answer: str  # the markdown below the heading
    section: str
    cells: int  # code cells that back the answer (run them to see the numbers)
    lesson: str = LESSON

    @property
    def tag(self) -> str:
        return f"{self.kind}:{self.id}"

    @property
    def short_answer(self) -> str:
        return self.answer.split("\n\n", 1)[0].replace("\n", " ").strip()


def bank_path(repo: Path = REPO) -> Path:
    """The source notebook if this is the repository, else the learner edition."""
    source = repo / "solutions" / LESSON / f"{LESSON}.ipynb"
    return source if source.is_file() else repo / "course" / LESSON / f"{LESSON}.ipynb"


def _tag(cell) -> tuple[str, str] | None:
    for tag in cell.metadata.get("tags", []):
        if match := TAG.fullmatch(tag):
            return match[1], match[2]
    return None


def read_cells(path: Path) -> SimpleNamespace:
    """The notebook's cells (cell_type, metadata, source), read as plain JSON: importing nbformat
    takes seconds, and `zero-lab ask` answers in less."""
    cells = json.loads(path.read_text())["cells"]
    return SimpleNamespace(cells=[SimpleNamespace(cell_type=cell["cell_type"], metadata=cell.get("metadata", {}),
                                                  source="".join(cell["source"])) for cell in cells])


def collect(nb, lesson: str = LESSON) -> list[Question]:
    """Every tagged answer of the notebook, in notebook order (lesson 08 tags answers only)."""
    questions: dict[str, Question] = {}
    section = ""
    for index, cell in enumerate(nb.cells):
        tag = _tag(cell)
        if cell.cell_type == "markdown" and cell.source.startswith("## "):
            section = cell.source.splitlines()[0][3:].strip()
        if tag is None:
            continue
        kind, qid = tag
        if lesson != LESSON and not (qid in questions or HEADING.fullmatch(cell.source.partition("\n")[0].strip())):
            continue  # a tagged cell that is not an answer
        if cell.cell_type == "code":
            if qid not in questions:
                raise ValueError(f"{LESSON}, cell {index}: tag {kind}:{qid} on a code cell before its question")
            questions[qid].cells += 1
            continue
        heading, _, answer = cell.source.partition("\n")
        match = HEADING.fullmatch(heading.strip())
        if not match or match[1] != qid:
            raise ValueError(f"{LESSON}, cell {index}: a cell tagged {kind}:{qid} starts with "
                             f"'### {qid} · <question>', not {heading!r}")
        if qid in questions:
            raise ValueError(f"{LESSON}, cell {index}: question {qid} is answered twice")
        questions[qid] = Question(qid, kind, match[2].strip(), answer.strip(), section, 0, lesson)
    return list(questions.values())


def read_bank(repo: Path = REPO) -> list[Question]:
    """Lesson 08's answers, then the other lessons' (sources in the repository, else the learner edition)."""
    folder = "solutions" if (repo / "solutions").is_dir() else "course"
    others = sorted(p for p in (repo / folder).glob("[0-9][0-9]_*/[0-9][0-9]_*.ipynb")
                    if p.stem == p.parent.name and p.stem != LESSON)
    bank = collect(read_cells(bank_path(repo)))
    for path in others:
        bank += collect(read_cells(path), path.stem)
    return bank


def seed_ids(seed_questions: Path) -> list[str]:
    """The ids of ../shared/reference/seed-questions.md (rows `| 000-I1 | ... |`)."""
    return SEED_ROW.findall(seed_questions.read_text())


def index_markdown(questions: list[Question]) -> str:
    lines = [
        "# Interview questions: index",
        "",
        "Generated by `zero-lab build` from the lessons' notebooks in `solutions/`; do not edit. Every question",
        "is answered in lesson 08 (open your copy with `zero-lab start 08`), or in the lesson its section",
        "names (`zero-lab start NN`). Find an answer by its section (lesson 08's contents cell links to each)",
        "and its heading, which starts with its id (`000-I1 ·`); its cells carry the tag `seed:<id>` or",
        "`q:<id>`. ▶ marks answers backed by runnable cells, *cited* the answers that are history or",
        "citations. Ids `000-…` to `004-…` are the questions learners arrive with; the others are asked in",
        "interviews beyond them. From a terminal: `zero-lab ask WORDS`.",
    ]
    heading = None
    for q in questions:
        if (q.lesson, q.section) != heading:  # lessons 04, 09, 10 all have a section "Interview questions"
            heading = q.lesson, q.section
            section = q.section
            title = section if q.lesson == LESSON else f"{section} (lesson {q.lesson.replace('_', ' ')})"
            lines += ["", f"## {title}", "", "| id | question | cell tag | |", "|---|---|---|---|"]
        lines.append(f"| `{q.id}` | {q.question.replace('|', '/')} | `{q.tag}` | {'▶' if q.cells else '*cited*'} |")
    return "\n".join(lines) + "\n"


def generated_files(repo: Path = REPO) -> dict[str, bytes]:
    """{INDEX: content} for `zero-lab build` (and `--check`), once lesson 08 exists."""
    source = repo / "solutions" / LESSON / f"{LESSON}.ipynb"
    if not source.is_file():
        return {}
    return {INDEX: index_markdown(read_bank(repo)).encode()}


WORD = re.compile(r"[\w.+-]+")
# Words that say nothing about a question's topic ("does offload slow down training": offload, slow).
STOP_WORDS = frozenset("""a an and are as at be by can do does for from how i in is it its of on or than that the
    this to vs what when where which who why will with without you your down up use using zero training train""".split())


def _stem(word: str) -> str:
    """A crude stem, so that offload ~ offloading, slow ~ slower, shard ~ sharded; names with a
    hyphen, a digit or a plus (zero-r, stage3-1.5x, zero++) stay whole."""
    if len(word) <= 4 or not word.isalpha():
        return word
    return word[:max(4, len(word) - 3)]


def rank(questions: list[Question], words: list[str]) -> list[Question]:
    """The questions that match `words`, best first. Each topic word (not a stop word) counts by
    how rare it is among the answers and by where it appears: the question's id and title (x3, x4
    when the word is there exactly as typed, as a name like zero++ is), its section's title (x4),
    its answer (x1). A word that names a section names the topic: that section's answers count
    double. An answer that matches more of the topic words comes first (score x matched words
    squared), and among equals the one whose title is most about them: the larger the share of
    the title's own words the query names, the better ("data parallelism" is "What is data
    parallelism?", not a longer title that also names them). Words match by their stem."""
    typed = [w for w in words if w not in STOP_WORDS] or list(words)
    topic = [_stem(w) for w in typed]
    as_typed = dict(zip(topic, typed))

    def tokens(text):  # words, and the parts of hyphenated ones (ZeRO-Offload: offload)
        found = WORD.findall(text.lower())
        return set(found) | {part for word in found for part in word.split("-")}

    def hits(stem, words):
        return any(word.startswith(stem) for word in words)

    fields = [[tokens(text) for text in (f"{q.id} {q.question}", re.sub(r"^\d+[a-z]?\.\s*", "", q.section), q.answer)]
              for q in questions]  # a section's title without its number
    weight = {stem: 1 + math.log((1 + len(questions)) / (1 + sum(any(hits(stem, f) for f in q) for q in fields)))
              for stem in topic}
    named_sections = {stem for stem in topic if any(hits(stem, section) for _, section, _ in fields)}
    scores = []
    for question, (title, section, body) in zip(questions, fields):
        own_words = {word for word in WORD.findall(question.question.lower()) if word not in STOP_WORDS}
        found = [stem for stem in topic if hits(stem, title) or hits(stem, section) or hits(stem, body)]
        score = sum(weight[stem] * (3 * hits(stem, title) + (as_typed[stem] in title) + 4 * hits(stem, section) + hits(stem, body))
                    for stem in found)
        focus = sum(any(word.startswith(stem) for stem in found) for word in own_words) / max(1, len(own_words))
        in_topic = any(hits(stem, section) for stem in named_sections)
        scores.append(score * len(found) ** 2 * (1 + focus) * (1 + in_topic / 2))
    ranked = sorted(range(len(questions)), key=lambda i: -scores[i])
    return [questions[i] for i in ranked if scores[i] > 0]


def ask(words: list[str], repo: Path = REPO, limit: int = 5) -> str:
    """The questions that best match `words`, each with its short answer and where its cells are."""
    words = WORD.findall(" ".join(words).lower())
    questions = read_bank(repo)
    ranked = rank(questions, words)[:limit]
    if not ranked:
        return f"No question matches {' '.join(words)!r}; the full list is {INDEX}."
    blocks = []
    for q in ranked:
        cells = f"{q.cells} runnable cell(s) tagged {q.tag}" if q.cells else f"tagged {q.tag}, cited: no cell"
        blocks.append(f"{q.id} · {q.question}\n"
                      + textwrap.fill(q.short_answer, 100, initial_indent="  ", subsequent_indent="  ")
                      + f"\n  → `zero-lab start {q.lesson[:2]}`, section “{q.section}”, heading “{q.id} ·”: {cells}")
    return "\n\n".join(blocks)
