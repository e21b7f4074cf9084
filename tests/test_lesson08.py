"""Lesson 08, the interview question bank: every seed question answered, the index, `zero-lab ask`,
and the drills' tests catching typical wrong answers (run in-process: grading the whole notebook
is test_grading.py's job)."""

import os
import re
from fractions import Fraction

import nbformat
import pytest
import torch
import torch.distributed as dist

import zero_lab
from zero_lab.course_tools import build, cli, questions, where
from zero_lab.course_tools.implementation import REPO

NOTEBOOK = build.source_notebook(REPO, questions.LESSON)
SEED_QUESTIONS = REPO.parent / "shared" / "reference" / "seed-questions.md"


@pytest.fixture(scope="module")
def notebook():
    return nbformat.read(NOTEBOOK, as_version=4)


@pytest.fixture(scope="module")
def bank(notebook):
    return questions.collect(notebook)


@pytest.mark.skipif(not SEED_QUESTIONS.is_file(), reason="../shared/reference/seed-questions.md is not here")
def test_every_seed_question_has_a_tagged_answer(bank):
    seeds = questions.seed_ids(SEED_QUESTIONS)
    assert len(seeds) == 77
    answered = {q.id for q in bank if q.kind == "seed"}
    assert not set(seeds) - answered, f"unanswered: {sorted(set(seeds) - answered)}"
    assert not answered - set(seeds), f"not in seed-questions.md: {sorted(answered - set(seeds))}"


def test_answers_are_well_formed(bank):
    assert len([q for q in bank if q.kind == "q"]) >= 20, "at least 20 questions beyond the seeds"
    assert len({q.id for q in bank}) == len(bank)
    for q in bank:
        assert 80 <= len(q.short_answer) <= 1500, f"{q.id}: a short answer of a few sentences"
    measured = [q for q in bank if q.cells]
    assert len(measured) >= 0.7 * len(bank), "most answers are backed by a runnable cell"


def test_tags_must_follow_their_question():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1", metadata={"tags": ["seed:000-I1"]})])
    with pytest.raises(ValueError, match="before its question"):
        questions.collect(nb)
    nb.cells = [nbformat.v4.new_markdown_cell("### 000-I2 · Wrong id\n\nText.", metadata={"tags": ["seed:000-I1"]})]
    with pytest.raises(ValueError, match="000-I1"):
        questions.collect(nb)


def test_index_lists_every_question_and_is_generated(bank):
    index = (REPO / questions.INDEX).read_text()
    assert index == questions.index_markdown(questions.read_bank()), "run `zero-lab build`"
    for q in bank:
        assert f"| `{q.id}` |" in index
    assert questions.INDEX in questions.generated_files(REPO)


def test_index_heads_each_lessons_section():
    """Lessons whose sections share a title ("Interview questions") each get their own heading."""
    bank = [questions.Question(qid, "q", f"{qid}?", "A.", "Interview questions", 1, lesson)
            for qid, lesson in (("a", "04_zero2"), ("b", "09_zeropp"), ("c", "09_zeropp"), ("d", "10_infinity"))]
    index = questions.index_markdown(bank)
    for lesson in ("04 zero2", "09 zeropp", "10 infinity"):
        assert index.count(f"## Interview questions (lesson {lesson})") == 1, index
    assert index.index("| `c` |") < index.index("(lesson 10 infinity)") < index.index("| `d` |")


def test_ask_prints_the_best_matches(capsys):
    assert cli.main(["ask", "stage", "3", "communication", "1.5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("stage3-1.5x · Why does stage 3 cost 1.5×")
    assert "zero-lab start 08" in out and "heading “stage3-1.5x ·”" in out and "q:stage3-1.5x" in out
    assert "course/" not in out, "point to the learner's copy (`zero-lab start 08`), not the release"
    assert "No question matches" in questions.ask(["xyzzy"])


TOP_ANSWERS = {  # a learner's question -> the answer `zero-lab ask` must put first
    "does offload slow down training": "003-S2",
    "stage 3 communication 1.5": "stage3-1.5x",
    "what is fsdp": "fsdp",
    "delayed parameter update": "dpu",
    "tied weights": "tied",
    "gradient accumulation": "accumulation",
    "clip gradients": "clipping",
    "node failure": "001-13",
    "who proposed zero": "myth-google",
    "16 bytes per parameter": "16psi",
    "prefetch": "reshard-prefetch",
    "ZeRO-R residual memory": "zero-r",
    "mixed precision memory": "001-23",
    "data parallelism": "001-1",
    "zero++ quantized": "zeropp",
}


def test_ask_ranks_by_the_questions_topic_words(bank):
    for query, expected in TOP_ANSWERS.items():
        ranked = [q.id for q in questions.rank(bank, questions.WORD.findall(query.lower()))]
        assert ranked and ranked[0] == expected, f"{query!r}: {ranked[:5]}"
    offload = [q.id for q in questions.rank(bank, ["does", "offload", "slow", "down", "training"])[:5]]
    assert sum(q.startswith("003-") for q in offload) >= 3, offload


def test_index_points_to_the_learners_copy_and_the_cell(bank):
    index = questions.index_markdown(bank)
    assert "zero-lab start 08" in index and "../course/" not in index
    for q in bank:
        assert f"`{q.tag}`" in index
    cited = [q for q in bank if not q.cells]
    assert cited and all("answer:cited" in tags for tags in _tags_of(cited)), "a prose-only answer is tagged answer:cited"


def _tags_of(qs):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    return [next(c.metadata.get("tags", []) for c in nb.cells if c.cell_type == "markdown"
                 and c.source.startswith(f"### {q.id} ·")) for q in qs]


# Drills: typical wrong answers fail the tests, hidden ones included (the reference's full marks are
# checked by test_grading.py).

def _cells(nb, pattern):
    return {m[1]: c.source for c in nb.cells if c.cell_type == "code" and (m := re.match(pattern, c.source))}


def _run_drill(nb, test_id, replacement=None, seeds=None):
    """Exec the lesson's set-up cell and the drills' reference solutions (one replaced by
    `replacement`), then test `test_id`, hidden tests included; `seeds` replaces their fixed seeds."""
    namespace = {}
    exec(next(c.source for c in nb.cells if c.cell_type == "code" and not where.is_where_cell(c)),
         namespace)  # CONFIG, BATCHES, prepare, ledgers
    for source in _cells(nb, r"#\| solution (drill-\S+)").values():
        exec(source, namespace)
    if replacement:
        exec(replacement, namespace)
    test = _cells(nb, r"#\| test (test_\S+)")[test_id]
    if seeds is not None:
        test, replaced = re.subn(r"^_SEEDS = \(.*$", f"_SEEDS = {tuple(seeds)!r}", test, flags=re.M)
        assert replaced == 1, f"{test_id}: no `_SEEDS = (...)` line"
    exec(test, namespace)


MUTANTS = {
    "test_bytes_per_device": [
        # stage 2 also shards the parameters
        "def bytes_per_device(psi, stage, nd, mixed=True):\n"
        "    return Fraction(psi) * (16 if stage == 0 else (4 + Fraction(12, nd) if stage == 1 else Fraction(16, nd)))",
        # fp32 counted with a separate master copy (K = 12)
        "def bytes_per_device(psi, stage, nd, mixed=True):\n"
        "    w = 2 if mixed else 4\n"
        "    return Fraction(psi) * (Fraction(w, nd if stage == 3 else 1) + Fraction(w, nd if stage >= 2 else 1)\n"
        "                            + Fraction(12, nd if stage >= 1 else 1))",
    ],
    "test_bytes_sent_per_step": [
        # ZeRO-3 "costs the same as DDP"
        "def bytes_sent_per_step(psi, stage, nd, element_bytes, micro_steps=1):\n"
        "    return Fraction(2 * (nd - 1) * psi * element_bytes, nd)",
        # stage 2 accumulates locally like stage 1
        "def bytes_sent_per_step(psi, stage, nd, element_bytes, micro_steps=1):\n"
        "    return Fraction((3 * micro_steps if stage == 3 else 2) * (nd - 1) * psi * element_bytes, nd)",
    ],
    "test_largest_model": [
        "def largest_model(device_bytes, stage, nd):\n    return int(device_bytes // 16)",
        # one parameter too many: rounds the quotient instead of flooring it
        "def largest_model(device_bytes, stage, nd):\n"
        "    per = {0: 16, 1: 4 + Fraction(12, nd), 2: 2 + Fraction(14, nd), 3: Fraction(16, nd)}[stage]\n"
        "    return round(Fraction(device_bytes) / per)",
    ],
    "test_shard_range": [
        # the snippet's bug: the last numel % world_size elements belong to nobody
        "def shard_range(numel, rank, world_size):\n"
        "    size = numel // world_size\n"
        "    return rank * size, (rank + 1) * size",
        # ceiling sizes without clamping: the last ranks run past the end
        "def shard_range(numel, rank, world_size):\n"
        "    size = -(-numel // world_size)\n"
        "    return rank * size, (rank + 1) * size",
    ],
    "test_sharded_sgd_step": [
        # sum instead of mean
        "def sharded_sgd_step(flat_params, flat_grads, lr):\n"
        "    rank, n = dist.get_rank(), dist.get_world_size()\n"
        "    shard = torch.empty(flat_grads.numel() // n)\n"
        "    dist.reduce_scatter_single(shard, flat_grads)\n"
        "    dist.all_gather_single(flat_params, flat_params.chunk(n)[rank] - lr * shard)",
        # all-reduce, then every rank updates everything: right numbers, DDP's collectives
        "def sharded_sgd_step(flat_params, flat_grads, lr):\n"
        "    dist.all_reduce(flat_grads)\n"
        "    flat_params -= lr * flat_grads / dist.get_world_size()",
    ],
    "test_plan": [
        # the fewest devices at any stage (stage 3 wins almost always), not the lowest stage that fits
        "def plan(psi, device_bytes, max_nd):\n"
        "    return next(((s, n) for n in range(1, max_nd + 1) for s in range(4)\n"
        "                 if bytes_per_device(psi, s, n) <= device_bytes), None)",
        # strictly below the budget
        "def plan(psi, device_bytes, max_nd):\n"
        "    return next(((s, n) for s in range(4) for n in range(1, max_nd + 1)\n"
        "                 if bytes_per_device(psi, s, n) < device_bytes), None)",
    ],
    "test_step_bytes": [
        # the ledger around the last micro-step and the optimizer step only
        "def step_bytes(stage, micro_steps):\n"
        "    rank, nd = dist.get_rank(), dist.get_world_size()\n"
        "    model, optimizer = prepare(GPT(CONFIG, seed=0), torch.optim.AdamW, stage=stage, lr=LR, param_dtype=torch.bfloat16)\n"
        "    tokens, targets = shard_batch(BATCHES[0], rank, nd)\n"
        "    for t, y in list(zip(tokens.chunk(micro_steps), targets.chunk(micro_steps)))[:-1]:\n"
        "        (model(t, y)[1] / micro_steps).backward()\n"
        "    with zero_lab.CommLedger() as ledger:\n"
        "        (model(tokens.chunk(micro_steps)[-1], targets.chunk(micro_steps)[-1])[1] / micro_steps).backward()\n"
        "        optimizer.step()\n"
        "    return {k: r['sent_bytes'] for k, r in ledger.summary().items()}",
    ],
    "test_offload": [
        # the paper's fp16 gradient shard on the host: 14 psi / nd, not what this implementation keeps
        "def offload_prediction(psi, nd):\n"
        "    return {'device': 2 * psi, 'host': Fraction(14 * psi, nd), 'to_host': Fraction(2 * psi, nd),\n"
        "            'to_device': Fraction(2 * psi, nd)}",
        # the whole model crosses PCIe, not the rank's shard
        "def offload_prediction(psi, nd):\n"
        "    return {'device': 2 * psi, 'host': Fraction(16 * psi, nd), 'to_host': 2 * psi, 'to_device': 2 * psi}",
    ],
    "test_prefetch": [
        # depth units instead of depth + 1: forgets the unit that is computing
        "def gathered_peak(numels, depth, element_bytes=2):\n"
        "    return element_bytes * max(sum(numels[i:i + max(depth, 1)]) for i in range(len(numels)))",
        # measured in the first step, before the order is recorded: nothing is prefetched yet
        "def measure_gathered_peak(depth):\n"
        "    rank, nd = dist.get_rank(), dist.get_world_size()\n"
        "    model, optimizer = prepare(GPT(CONFIG, seed=0), torch.optim.AdamW, stage=3, prefetch=depth, lr=LR,\n"
        "                               param_dtype=torch.bfloat16)\n"
        "    start, readings = model_state_bytes(model, optimizer).bytes['parameters'], []\n"
        "    for m in model.modules():\n"
        "        m.register_forward_pre_hook(lambda *_: readings.append(model_state_bytes(model, optimizer).bytes['parameters'] - start))\n"
        "    model(*shard_batch(BATCHES[0], rank, nd))[1].backward()\n"
        "    return max(readings)",
    ],
}

PURE_DRILLS = ("test_bytes_per_device", "test_bytes_sent_per_step", "test_largest_model", "test_shard_range", "test_plan")


@pytest.mark.parametrize("test_id, mutant", [(t, m) for t, ms in MUTANTS.items() for m in ms],
                         ids=[f"{t}-{i}" for t, ms in MUTANTS.items() for i in range(len(ms))])
def test_typical_wrong_answers_fail(notebook, test_id, mutant):
    with pytest.raises((AssertionError, zero_lab.RankFailed)):
        _run_drill(notebook, test_id, mutant)


@pytest.mark.parametrize("test_id", PURE_DRILLS)
def test_hidden_tests_pass_the_reference_on_other_seeds(notebook, test_id):
    """The graded notebook fixes its seeds (a grading can be reproduced); here they vary per run."""
    seeds = [int.from_bytes(os.urandom(4), "little") for _ in range(3)]
    _run_drill(notebook, test_id, seeds=seeds)
