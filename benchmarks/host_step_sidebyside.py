"""benchmarks/host_step.py side by side across commits (issue #50's "one benchmark before and after"): each
side is a commit checked out in a git worktree of its own (or `.`, this checkout as it is) and runs its
own host_step.py in a process of its own, one torch thread; the sides take turns pass by pass, the order
reversed every other pass (ABC CBA ...), so that the VM's drift falls on all alike. Per side and cell:
the mean over the passes of host_step's median host ms per step, and its ratio to the first side's.

    python benchmarks/host_step_sidebyside.py --sides e93e92b,. \\
        --output-json benchmarks/results/host_step_sidebyside_<tag>.json
    python benchmarks/host_step_sidebyside.py --dry-run --sides HEAD,.   # host_step's tiny cells (the test)

Options after `--` go to every side's host_step.py (default: --rounds 2 --steps 15 --contexts 256);
--split-ops is passed to the sides whose script knows it (the vocabulary-wide ops' share, reported beside).
Worktrees are made under a temporary folder and removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from revisions import git, worktree  # noqa: E402

DEFAULT_ARGS = ["--rounds", "2", "--steps", "15", "--contexts", "256"]


def pass_orders(sides: list[str], passes: int) -> list[list[str]]:
    """Each pass's order: the sides as given, then reversed, alternately."""
    return [list(sides) if p % 2 == 0 else list(reversed(sides)) for p in range(passes)]


def summarize(sides: list[str], runs: list[dict]) -> dict:
    """runs: [{"side", "rows": host_step's rows}] -> per side, per cell "config b<batch> ctx<context>": the
    mean host ms (and tensor-op ms where measured) over its runs, and host ms as a ratio to sides[0]'s."""
    table: dict[str, dict[str, dict[str, list[float]]]] = {s: {} for s in sides}
    for run in runs:
        for row in run["rows"]:
            cell = f"{row['config']} b{row['batch']} ctx{row['context']}"
            entry = table[run["side"]].setdefault(cell, {"host_ms": [], "tensor_ops_ms": []})
            entry["host_ms"].append(row["host_ms"])
            if "tensor_ops_ms" in row:
                entry["tensor_ops_ms"].append(row["tensor_ops_ms"])
    out: dict[str, dict] = {}
    first = sides[0]
    for side in sides:
        out[side] = {}
        for cell, entry in table[side].items():
            host = sum(entry["host_ms"]) / len(entry["host_ms"])
            summary = {"host_ms": round(host, 3), "runs": len(entry["host_ms"])}
            if entry["tensor_ops_ms"]:
                summary["tensor_ops_ms"] = round(sum(entry["tensor_ops_ms"]) / len(entry["tensor_ops_ms"]), 3)
            base = table[first].get(cell)
            if base:
                summary["vs_first"] = round(host / (sum(base["host_ms"]) / len(base["host_ms"])), 3)
            out[side][cell] = summary
    return out


def main(argv: list[str] | None = None) -> dict:
    raw = list(sys.argv[1:] if argv is None else argv)
    argv, passthrough = raw, []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sides", default="e93e92b,.",
                        help="commas between: commits (any git revision) or `.` (this checkout as it is); the first "
                             "is the one the others are compared with")
    parser.add_argument("--passes", type=int, default=2, help="every side runs once per pass (order reversed each pass)")
    parser.add_argument("--split-ops", action="store_true", help="host_step.py --split-ops, on the sides that know it")
    parser.add_argument("--dry-run", action="store_true", help="host_step.py --dry-run on every side, one pass")
    parser.add_argument("--output-json")
    args = parser.parse_args(argv)
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if len(set(sides)) != len(sides) or not sides:
        parser.error("--sides: one or more distinct sides")
    side_args = ["--dry-run"] if args.dry_run else (passthrough or DEFAULT_ARGS)
    passes = 1 if args.dry_run else args.passes
    from rayspec.bench.environment import cpu_model

    started = time.time()
    runs: list[dict] = []
    commits: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="host-step-sides-") as tmp, contextlib.ExitStack() as stack:
        dirs: dict[str, Path] = {}
        for side in sides:
            if side == ".":
                dirs[side], commits[side] = ROOT, git("rev-parse", "HEAD") + (
                    " (+ uncommitted changes)" if git("status", "--porcelain", "--untracked-files=no") else "")
                continue
            commits[side] = git("rev-parse", "--verify", side + "^{commit}")
            dirs[side] = stack.enter_context(worktree(commits[side], Path(tmp)))
        for number, order in enumerate(pass_orders(sides, passes), 1):
            for side in order:
                script = dirs[side] / "benchmarks" / "host_step.py"
                extra = ["--split-ops"] if args.split_ops and "--split-ops" in script.read_text() else []
                out = Path(tmp) / f"{commits[side][:12]}_{number}.json"
                command = [sys.executable, str(script), *side_args, *extra, "--output-json", str(out)]
                env = {**os.environ, "OMP_NUM_THREADS": "1"}
                done = subprocess.run(command, cwd=dirs[side], env=env, capture_output=True, text=True)
                if done.returncode:
                    raise SystemExit(f"{side}: host_step.py failed ({done.returncode}):\n{done.stderr[-4000:]}")
                report = json.loads(out.read_text())
                runs.append({"side": side, "commit": commits[side], "pass": number,
                             "command": "python benchmarks/host_step.py " + " ".join(side_args + extra),
                             "rows": report["rows"]})
                print(f"pass {number} {side}: " + ", ".join(
                    f"{r['config']} b{r['batch']} ctx{r['context']} {r['host_ms']:.2f} ms" for r in report["rows"]),
                    flush=True)
    summary = summarize(sides, runs)
    report = {"what": "benchmarks/host_step.py side by side (each side its own commit's script, in its own worktree), "
                      "passes alternated ABC CBA; engine host time per decode step outside the forwards, ms",
              "command": "python benchmarks/host_step_sidebyside.py " + " ".join(raw),
              "side_args": side_args, "cpu_model": cpu_model()[0], "cpu_count": os.cpu_count(),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
              "seconds": round(time.time() - started, 1), "sides": commits, "mean_host_ms_by_side": summary,
              "runs": runs}
    cells = list(summary[sides[0]])
    print(f"\nhost ms per step (mean of {passes} pass(es); x = vs {sides[0]}), {report['cpu_model']}")
    for cell in cells:
        print(f"  {cell:28s} " + "  ".join(
            f"{side}: {summary[side][cell]['host_ms']:.2f}"
            + (f" ({summary[side][cell]['vs_first']:.2f}x)" if side != sides[0] and cell in summary[side] else "")
            for side in sides if cell in summary[side]))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
