"""The project's own training prompts for EAGLE draft-head self-distillation (data/train/).

`python scripts/make_train_prompts.py` (or `python -m rayspec.eagle.prompt_pools`) writes
    data/train/code_prompts.jsonl  -- programming prompts, mostly Python
    data/train/chat_prompts.jsonl  -- general assistant prompts
and with --extra the pools' prompts the quotas left out (`*_extra.jsonl`), in Spec-Bench format.

Everything is built combinatorially from the lists in rayspec/data/prompt_pools/ (code.json,
chat.json: topics, tasks, templates, quotas; function_specs.json: about 125 small Python functions
with one-line specs and example arguments as Python literals), with a fixed random seed, so the
files are reproducible byte for byte. Standard library only. Doctest outputs and the "expected /
got" lines of the fix-the-bug prompts come from running those functions and mutated copies.

None of the text is taken from the evaluation sets (HumanEval, MT-bench, GSM8K): no function name is
a HumanEval entry point (asserted), and the prompts are refused if one shares an 8-word sequence
with a bundled evaluation prompt (rayspec/data/prompts/, `check_against_eval`).
"""

from __future__ import annotations

import argparse
import ast
import copy
import inspect
import json
import random
import re
import signal
import textwrap
from pathlib import Path

from rayspec.bench.prompts import PROMPT_SETS_DIR

SEED = 20241122
POOLS_DIR = Path(__file__).resolve().parent.parent / "data" / "prompt_pools"
N_MATH_KINDS = 20
# Instruction wrappers shared on purpose with the evaluation prompts (format, not content).
BOILERPLATE = ["Complete the code I provided."]


def read_pools(pools_dir: Path = POOLS_DIR) -> tuple[dict, dict, list[dict]]:
    """(code.json, chat.json, function_specs.json)"""
    return tuple(json.loads((pools_dir / name).read_text())
                 for name in ("code.json", "chat.json", "function_specs.json"))


# ---- the function specs -------------------------------------------------------------------
class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def _run(fn, args, seconds=0.2):
    """Call fn(*args) with a time limit; returns ('ok', value) or ('err', exception name)."""
    signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return ("ok", repr(fn(*_copy(args))))
    except _Timeout:
        return ("err", "timeout")
    except Exception as exc:  # noqa: BLE001 - any error counts as a different behaviour
        return ("err", type(exc).__name__)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _copy(args):
    return copy.deepcopy(args)


def _load(source):
    namespace = {}
    exec(compile(source, "<spec>", "exec"), namespace)  # noqa: S102 - our own code
    return namespace


def third_person(doc):
    """'Return the x.' -> 'returns the x.'"""
    verb, rest = doc.split(" ", 1)
    v = verb.lower()
    if v.endswith("y") and v[-2] not in "aeiou":
        v = v[:-1] + "ies"
    elif v.endswith(("s", "sh", "ch", "x", "z")):
        v += "es"
    else:
        v += "s"
    return f"{v} {rest}"


def lower_first(doc):
    return doc[:1].lower() + doc[1:]


class Spec:
    """One function of function_specs.json: its doctest outputs are computed by running it, its
    bug is the first of `mutations` that changes an example's result."""

    def __init__(self, source, doc, examples, mutations):
        self.source = source.strip("\n") + "\n"
        self.doc = doc
        lines = self.source.splitlines()
        def_idx = next(i for i, line in enumerate(lines) if line.startswith("def "))
        self.header = "\n".join(lines[:def_idx]).strip()  # imports, may be ''
        self.def_line = lines[def_idx]
        self.body = "\n".join(lines[def_idx + 1:]) + "\n"
        self.name = re.match(r"def (\w+)\(", self.def_line).group(1)
        self.signature = self.def_line[4:].rstrip(":")
        fn = _load(self.source)[self.name]
        self.params = list(inspect.signature(fn).parameters.values())
        self.calls = []  # (call text, repr(result))
        for args in examples:
            status, value = _run(fn, args)
            if status != "ok":
                raise RuntimeError(f"{self.name}{args!r} failed: {value}")
            call = f"{self.name}({', '.join(repr(a) for a in args)})"
            self.calls.append((call, value, args))
        self.bug = self._make_bug(fn, mutations)

    def _make_bug(self, fn, mutations):
        """First mutation of the body that changes the result of some example."""
        for old, new in mutations:
            if old not in self.body:
                continue
            body = self.body.replace(old, new, 1)
            mutated = (self.header + "\n\n" if self.header else "") + self.def_line + "\n" + body
            try:
                bad = _load(mutated)[self.name]
            except Exception:  # noqa: BLE001
                continue
            for call, expected, args in self.calls:
                got = _run(bad, args)
                if got != ("ok", expected):
                    return mutated, call, expected, got
        return None

    def completion_code(self, with_examples):
        doc_lines = textwrap.wrap(self.doc, width=76)
        parts = [self.header + "\n\n" if self.header else "", self.def_line, '\n    """']
        parts.append(doc_lines[0])
        for line in doc_lines[1:]:
            parts.append("\n    " + line)
        if with_examples:
            parts.append("\n")
            for call, value, _ in self.calls:
                if value == "None":  # doctest prints nothing for None
                    call, value = f"{call} is None", "True"
                parts.append(f"\n    >>> {call}\n    {value}")
            parts.append('\n    """\n')
        else:
            parts.append('\n    """\n' if len(doc_lines) > 1 else '"""\n')
        return "".join(parts)


def camel(name):
    first, *rest = name.split("_")
    return first + "".join(p.capitalize() for p in rest)


def js_params(spec):
    out = []
    for p in spec.params:
        if p.default is inspect.Parameter.empty:
            out.append(camel(p.name))
        else:
            d = p.default
            lit = "null" if d is None else json.dumps(d)
            if isinstance(d, float) and d == int(d):
                lit = str(int(d))
            out.append(f"{camel(p.name)} = {lit}")
    return ", ".join(out)


# ---- word problems ------------------------------------------------------------------------
def money(x):
    return f"${x:.2f}" if x != int(x) else f"${int(x)}"


def math_problem(kind, rng, names, items):
    """A GSM8K-like word problem of one of N_MATH_KINDS kinds, numbers drawn from rng."""
    name = rng.choice(names)
    if kind == 0:
        a = rng.choice([2, 2.5, 3, 3.5, 4, 4.5, 5]); b = rng.choice([0.75, 1, 1.25, 1.5, 2])
        x = rng.randint(2, 6); y = rng.randint(2, 5)
        cost = a * x + b * y
        bill = 20 if cost < 20 else 50
        return f"{name} buys {x} notebooks at {money(a)} each and {y} pens at {money(b)} each, paying with a {money(bill)} bill. How much change does {name} get back?"
    if kind == 1:
        v = rng.randint(12, 25); t = rng.randint(2, 4); k = rng.randint(5, 9)
        return f"A cyclist rides {v * t} km in {t} hours at a constant speed. How long will it take the cyclist to ride {v * k} km at the same speed?"
    if kind == 2:
        p = rng.choice([40, 60, 80, 120, 150, 200]); pct = rng.choice([10, 15, 20, 25, 30]); c = rng.choice([5, 10, 15])
        item = rng.choice(items)
        return f"A {item} costs {money(p)}. The store takes {pct}% off, and then {name} uses a {money(c)} coupon on the discounted price. What is the final price?"
    if kind == 3:
        a, b = rng.choice([(3, 6), (4, 12), (6, 12), (10, 15), (2, 3), (5, 20), (4, 6), (12, 24)])
        return f"One hose can fill a pool in {a} hours and a second hose can fill it in {b} hours. How long will it take to fill the pool if both hoses run together?"
    if kind == 4:
        b = rng.randint(3, 12); k = rng.randint(2, 4); y = rng.randint(2, 10)
        s = k * b + b + 2 * y
        return f"{name} is {k} times as old as a younger cousin. In {y} years, the sum of their two ages will be {s}. How old is {name} now?"
    if kind == 5:
        scores = [rng.randint(60, 95) for _ in range(4)]
        for avg in range(90, 60, -1):
            need = 5 * avg - sum(scores)
            if 60 <= need <= 100:
                break
        return f"{name} scored {scores[0]}, {scores[1]}, {scores[2]} and {scores[3]} on four quizzes. What score does {name} need on the fifth quiz to have an average of exactly {avg}?"
    if kind == 6:
        n = rng.choice([12, 18, 24, 30]); f = rng.choice([1.5, 2, 2.5, 3])
        m = rng.choice([n // 2 * 3, n * 2, n // 3 * 4])
        return f"A recipe for {n} muffins uses {f} cups of flour. How many cups of flour are needed to make {m} muffins?"
    if kind == 7:
        l = rng.randint(8, 30); w = rng.randint(5, 20); c = rng.choice([4, 6, 7.5, 9, 12]); g = rng.choice([1, 2, 3])
        return f"A rectangular garden measures {l} m by {w} m. Fencing costs {money(c)} per meter. How much will it cost to fence the whole garden if a {g} m gap is left for a gate?"
    if kind == 8:
        r = rng.randint(3, 8); b = rng.randint(2, 7); g = rng.randint(1, 5)
        return f"A jar holds {r} red, {b} blue and {g} green marbles. Two marbles are drawn without putting the first one back. What is the probability that both are red?"
    if kind == 9:
        h = rng.randint(1, 9); m = rng.choice([0, 10, 15, 20, 30, 40, 45, 50]); d = rng.randint(85, 175)
        return f"A film starts at {h}:{m:02d} pm and runs for {d} minutes. At what time does it end?"
    if kind == 10:
        a = rng.randint(2, 9); x = rng.randint(-10, 15); b = rng.randint(-20, 20) or 7
        c = a * x + b
        op = f"+ {b}" if b > 0 else f"- {-b}"
        return f"Solve for x: {a}x {op} = {c}."
    if kind == 11:
        x = rng.randint(3, 40); y = rng.randint(1, x - 1)
        return f"Find two numbers whose sum is {x + y} and whose difference is {x - y}."
    if kind == 12:
        a = rng.choice([15, 20, 25, 30, 40]); s = rng.choice([0, 35, 60, 85, 120]); p = rng.choice([249, 320, 450, 599, 700])
        item = rng.choice(items)
        return f"{name} saves {money(a)} every week and already has {money(s)}. How many weeks will it take until {name} can afford a {item} that costs {money(p)}?"
    if kind == 13:
        w = rng.choice([3, 4, 5, 6]); h = rng.choice([2, 3, 4]); d = rng.choice([6, 8, 10, 12]); w2 = w * rng.choice([2, 3]); h2 = h * rng.choice([2, 3, 4])
        return f"If {w} workers can paint {h} houses in {d} days, how many days would {w2} workers need to paint {h2} houses, assuming everyone works at the same rate?"
    if kind == 14:
        n = rng.choice([20, 24, 30, 40, 50]); p = rng.choice([10, 20, 30, 40, 50, 60])
        return f"In a class of {n} students, {p}% walk to school, and half of the remaining students take the bus. How many students take the bus?"
    if kind == 15:
        l = rng.choice([5.5, 6, 6.5, 7, 8]); d = rng.choice([240, 320, 450, 600, 780]); c = rng.choice([1.6, 1.75, 1.8, 1.9])
        return f"A car uses {l} liters of fuel per 100 km. How much fuel does it need for a {d} km trip, and how much will that fuel cost at {money(c)} per liter?"
    if kind == 16:
        p = rng.choice([500, 1200, 2500, 4000, 8000]); y = rng.randint(2, 6); r = rng.choice([2, 3, 3.5, 4, 5])
        return f"How much interest does {money(p)} earn in {y} years at a simple annual interest rate of {r}%? What is the total amount at the end?"
    if kind == 17:
        l = rng.choice([3, 3.5, 4, 4.5, 5, 6]); w = rng.choice([2.5, 3, 3.5, 4])
        return f"A room is {l} m long and {w} m wide. How many square tiles measuring 50 cm by 50 cm are needed to cover the floor?"
    if kind == 18:
        adult = rng.choice([8, 10, 12, 15]); student = rng.choice([4, 5, 6]); na = rng.randint(40, 120); ns = rng.randint(30, 150)
        return f"A school sold {na + ns} tickets to a play. Adult tickets cost {money(adult)} and student tickets cost {money(student)}. If ticket sales brought in {money(adult * na + student * ns)}, how many adult tickets were sold?"
    if kind == 19:
        n = rng.choice([120, 240, 360, 480]); a = rng.choice([2, 3, 4]); b = rng.choice([3, 4, 5, 6])
        return f"A bakery made {n} cookies. It sold 1/{a} of them in the morning and 1/{b} of the remaining cookies in the afternoon. How many cookies are left?"
    raise ValueError(kind)


# ---- building -----------------------------------------------------------------------------
def weighted_choice(rng, weighted):
    total = sum(w for w, _ in weighted)
    r = rng.uniform(0, total)
    for w, item in weighted:
        r -= w
        if r <= 0:
            return item
    return weighted[-1][1]


def build_code(rng, pool: dict, function_specs: list[dict]):
    """-> (chosen, leftover) (category, prompt) pairs from code.json and function_specs.json."""
    specs = [Spec(f["source"], f["doc"], [ast.literal_eval(e) for e in f["examples"]],
                  pool["mutations"]) for f in function_specs]
    names = [s.name for s in specs]
    assert names == [f["name"] for f in function_specs], "a spec's name is not its function's"
    assert len(set(names)) == len(names), "duplicate spec name"
    clash = sorted(set(names) & set(pool["humaneval_names"]))
    assert not clash, f"spec names collide with HumanEval entry points: {clash}"

    pools = {k: [] for k in pool["quotas"]}
    for s in specs:
        for with_examples in (True, False):
            tpl = weighted_choice(rng, pool["complete_templates"])
            pools["code-complete"].append(tpl.format(code=s.completion_code(with_examples)))
        d3, base = third_person(s.doc), lower_first(s.doc)
        for tpl in rng.sample(pool["write_templates"], 2):
            pools["code-write"].append(tpl.format(sig=s.signature, name=s.name, d3=d3, base=base))
        pools["code-explain"].append(rng.choice(pool["explain_templates"]).format(src=s.source))
        if s.bug:
            bug, call, expected, got = s.bug
            got_text = f"it returns `{got[1]}`" if got[0] == "ok" else (
                "it never finishes" if got[1] == "timeout" else f"it raises {got[1]}")
            pools["code-fix"].append(rng.choice(pool["fix_templates"]).format(
                bug=bug, call=call, expected=expected, got_text=got_text, name=s.name,
                base=base, base_np=base.rstrip(".")))
        pools["code-test"].append(rng.choice(pool["test_templates"]).format(src=s.source))
        pools["code-refactor"].append(rng.choice(pool["refactor_templates"]).format(src=s.source))
        pools["code-translate"].append(rng.choice(pool["translate_templates"]).format(src=s.source))
        if not re.search(r"\b(dicts?|None|ValueError|tuples?|Python)\b", s.doc):
            d3js = re.sub(r"\blist\b", "array", re.sub(r"\blists\b", "arrays", re.sub(r"\ba list\b", "an array", d3)))
            pools["javascript"].append(rng.choice(pool["js_write_templates"]).format(
                jsname=camel(s.name), jsparams=js_params(s), d3=d3js))
    pools["javascript"] += pool["js_prompts"]  # hand-written ones are added in full below
    for name, desc in pool["classes"]:
        for tpl in rng.sample(pool["class_templates"], 2):
            pools["code-class"].append(tpl.format(name=name, desc=desc))
    for algo in pool["algorithms"]:
        for tpl in rng.sample(pool["algorithm_templates"], 2):
            pools["code-algorithm"].append(tpl.format(algo=algo))
    for a, b in pool["concept_pairs"]:
        pools["code-concept"].append(rng.choice(pool["concept_pair_templates"]).format(a=a, b=b))
    for c in pool["concepts"]:
        pools["code-concept"].append(rng.choice(pool["concept_templates"]).format(c=c))
    for c in pool["cs_concepts"]:
        pools["code-concept"].append(rng.choice(pool["cs_templates"]).format(c=c))
    pools["code-task"] += pool["python_tasks"]
    for e in pool["errors"]:
        pools["code-error"].append(rng.choice(pool["error_templates"]).format(e=e))
    for schema, q in pool["sql_queries"]:
        pools["sql"].append(rng.choice(pool["sql_templates"]).format(schema=pool["sql_schemas"][schema], q=q))
    pools["sql"] += pool["sql_prompts"]
    pools["shell"] += pool["shell_prompts"]

    must_keep = {"javascript": pool["js_prompts"]}
    return select(pools, pool["quotas"], rng, must_keep)


def build_chat(rng, pool: dict):
    """-> (chosen, leftover) (category, prompt) pairs from chat.json."""
    pools = {k: [] for k in pool["quotas"]}
    for t in pool["explain_topics"]:
        for tpl in rng.sample(pool["explain_templates"], 2):
            pools["explain"].append(tpl.format(t=t))
    for t in pool["howto_tasks"]:
        for tpl in rng.sample(pool["howto_templates"], 2):
            pools["howto"].append(tpl.format(t=t))
    for p in pool["email_purposes"]:
        for tpl in rng.sample(pool["email_templates"], 2):
            pools["writing-email"].append(tpl.format(p=p))
    for _ in range(120):
        pools["writing-story"].append(rng.choice(pool["story_templates"]).format(
            genre=rng.choice(pool["story_genres"]), char=rng.choice(pool["story_characters"]), sit=rng.choice(pool["story_situations"])))
    for form in pool["poem_forms"]:
        for subject in rng.sample(pool["poem_subjects"], 5):
            pools["writing-poem"].append(f"Write {form} about {subject}.")
    for word in pool["acrostic_words"]:
        pools["writing-poem"].append(f"Write an acrostic poem using the word {word}.")
    pools["writing"] += pool["writing_prompts"]
    for p in pool["passages"]:
        for tpl in rng.sample(pool["summary_templates"], 3):
            pools["summarize"].append(tpl.format(p=p))
    for s in pool["rewrite_sentences"]:
        for ins in rng.sample(pool["rewrite_instructions"], 3):
            pools["rewrite"].append(f"{ins}\n\n\"{s}\"")
    for s in pool["advice_situations"]:
        for tpl in rng.sample(pool["advice_templates"], 2):
            pools["advice"].append(tpl.format(s=s))
    for a, b, ctx in pool["comparisons"]:
        for tpl in rng.sample(pool["compare_templates"], 2):
            pools["compare"].append(tpl.format(a=a, b=b, ctx=ctx))
    for role, reqs in pool["roles"]:
        for req in reqs:
            pools["roleplay"].append(rng.choice(pool["role_templates"]).format(role=role, req=req))
    for t in pool["brainstorm_topics"]:
        for tpl in rng.sample(pool["brainstorm_templates"], 2):
            pools["brainstorm"].append(tpl.format(n=rng.choice([5, 7, 8, 10, 12]), t=t))
    for kind in range(N_MATH_KINDS):
        for _ in range(8):
            pools["math"].append(math_problem(kind, rng, pool["math_names"], pool["math_items"])
                                 + rng.choice(pool["math_suffixes"]))
    pools["reasoning"] += pool["logic_puzzles"]
    pools["knowledge"] += pool["knowledge"]
    for city in pool["cities"]:
        for interest in rng.sample(pool["interests"], 2):
            days = rng.choice([2, 3, 4, 5])
            pools["planning"].append(f"Plan a {days}-day itinerary in {city} for someone interested in {interest}.")
    pools["planning"] += pool["planning_other"]

    return select(pools, pool["quotas"], rng, {"planning": pool["planning_other"]})


def select(pools, quotas, rng, must_keep):
    """Dedupe each pool, keep the must-keep prompts, fill up to the quota at random.

    -> (chosen, leftover): the leftover prompts feed the `--extra` files."""
    out, leftover = [], []
    seen = set()
    for cat, pool in pools.items():
        uniq = list(dict.fromkeys(pool))
        keep = [p for p in uniq if p in set(must_keep.get(cat, []))]
        rest = [p for p in uniq if p not in set(keep)]
        n = max(0, min(len(rest), quotas[cat] - len(keep)))
        chosen = keep + rng.sample(rest, n)
        leftover += [(cat, p) for p in rest if p not in set(chosen)]
        for p in chosen:
            key = " ".join(p.lower().split())
            if key not in seen:
                seen.add(key)
                out.append((cat, p))
    rng.shuffle(out)
    picked = {" ".join(p.lower().split()) for _, p in out}
    leftover = [(c, p) for c, p in dict.fromkeys(leftover) if " ".join(p.lower().split()) not in picked]
    random.Random(len(leftover)).shuffle(leftover)
    return out, leftover


def shingles(text, n=8):
    for phrase in BOILERPLATE:
        text = text.replace(phrase, " ")
    words = re.findall(r"[a-z0-9]+", text.lower())
    grams = (words[i:i + n] for i in range(len(words) - n + 1))
    return {" ".join(g) for g in grams if not all(w.isdigit() for w in g)}  # skip pure number runs


# prompt sets written from the GSM8K *train* split (scripts/make_long_document_prompts.py): stress
# traffic for benchmarks, not evaluation prompts; sharing text with training prompts is by design
TRAIN_DERIVED_SETS = frozenset({"long_documents"})


def eval_shingles(eval_dir: Path = PROMPT_SETS_DIR) -> dict[str, str]:
    """8-word sequence -> the evaluation file holding it, over every turn of every evaluation prompt."""
    found: dict[str, str] = {}
    for f in sorted(eval_dir.glob("*.jsonl")):
        if f.stem in TRAIN_DERIVED_SETS:
            continue
        for line in f.read_text().splitlines():
            for turn in json.loads(line)["turns"]:
                for sh in shingles(turn):
                    found.setdefault(sh, f.name)
    return found


def check_against_eval(rows, eval_dir: Path = PROMPT_SETS_DIR) -> None:
    """ValueError if any prompt shares an 8-word sequence with an evaluation prompt."""
    known = eval_shingles(eval_dir)
    if not known:
        raise ValueError(f"no evaluation prompts in {eval_dir} to check against")
    bad = []
    for cat, p in rows:
        hit = next((sh for sh in shingles(p) if sh in known), None)
        if hit:
            bad.append(f"[{cat}] '{hit}' ({known[hit]}): {p[:120]!r}")
    if bad:
        raise ValueError(f"{len(bad)} prompts overlap the evaluation sets; edit the pools:\n" + "\n".join(bad))


def write(rows, prefix, path: Path) -> str:
    """Writes the rows as Spec-Bench JSONL; -> a line saying how many of each category."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        for i, (cat, p) in enumerate(rows):
            fh.write(json.dumps({"question_id": f"{prefix}-{i}", "category": cat, "turns": [p]},
                                ensure_ascii=False) + "\n")
    counts = {}
    for cat, _ in rows:
        counts[cat] = counts.get(cat, 0) + 1
    return f"{path}: {len(rows)} prompts  " + ", ".join(f"{k}={v}" for k, v in sorted(counts.items()))


def build(pools_dir: Path = POOLS_DIR) -> dict[str, tuple[list, list]]:
    """{"code": (chosen, leftover), "chat": (chosen, leftover)}, (category, prompt) pairs."""
    code_pool, chat_pool, function_specs = read_pools(pools_dir)
    return {"code": build_code(random.Random(SEED), code_pool, function_specs),
            "chat": build_chat(random.Random(SEED + 1), chat_pool)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="write the EAGLE training prompts (data/train/*_prompts.jsonl)")
    ap.add_argument("--out-dir", default="data/train")
    ap.add_argument("--extra", action="store_true", help="write the prompts the quotas left out instead")
    args = ap.parse_args(argv)
    built = build()
    out = Path(args.out_dir)
    which = 1 if args.extra else 0  # the pools' leftovers: more training data of the same kinds
    rows = {kind: pair[which] for kind, pair in built.items()}
    check_against_eval(rows["code"] + rows["chat"])
    print(f"overlap check against {', '.join(sorted(p.name for p in PROMPT_SETS_DIR.glob('*.jsonl')))}: none")
    suffix = "_extra" if args.extra else ""
    for kind in ("code", "chat"):
        print(write(rows[kind], f"{kind}-extra" if args.extra else kind, out / f"{kind}_prompts{suffix}.jsonl"))


if __name__ == "__main__":
    main()
