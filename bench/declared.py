"""Declared experiments (issue 53): a bench runs arms only under a design committed to git
before its first arm, and reads its verdict from the endpoint and test declared there.

A declaration is ``bench/declared/<name>.json`` (tests/unit/test_declared.py): the design
(bench, run, arms, seeds, budget, ... exactly as the bench builds it), the primary endpoint
(a figure and an arms contrast, its test, its decision rule), secondary endpoints, and the
power assumptions (a per-seed sd with its source, the predicted effect). Before anything
runs the bench asks this module to refuse a declaration that git does not hold unchanged
at HEAD, that names arms the bench does not implement, whose design differs from the
bench's, or whose design cannot detect the predicted effect (the minimum detectable effect
printed first; ``--underpowered`` runs it anyway, said so in the RESULT line).

The test of a paired design over n seeds: the mean of the per-seed differences with its 95%
interval mean +- t(0.975, n-1) s.e., its two-sided t p-value (df n-1), and an exact
two-sided sign-flip permutation p-value (all 2^n sign patterns, n <= 16: no normality
assumed). Power: MDE = (t(0.975, n-1) + t(0.80, n-1)) sd / sqrt(n), the noncentral t of a
paired t-test at 80% power approximated by a shifted central t (t, not z, for the power
quantile too: with 10 seeds z would understate the MDE by 5%).

Results go under the run's OUT folder (``OUT/declared_result.json``, its path printed),
never beside the declaration: bench/declared/ is tracked by git, and generated files stay
out of git (STYLE.md 15). OUT/declared.json pins the declaration's git blob at the first
start, so a declaration edited and committed again after arms ran is refused on that OUT.

Pure apart from the git queries and those two files; no arpo_async import."""

from __future__ import annotations

import itertools
import json
import math
import operator
import subprocess
import time
from pathlib import Path

from verdict import mean_ci, t80, t975, t_two_sided_p

REQUIRED = ("name", "status", "design", "primary", "secondary", "power")
RULE_STATS = ("mean", "lo", "hi", "p_t", "p_perm")
RULE_OPS = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}
MAX_PERM_N = 16  # 2^16 sign patterns: enumerated in well under a second
PIN, RESULT = "declared.json", "declared_result.json"


def load(path: Path) -> dict:
    """A declaration, its required keys and its decision rule checked."""
    path = Path(path)
    if not path.is_file():
        raise SystemExit(f"--declared {path}: no such file; declare in bench/declared/")
    decl = json.loads(path.read_text())
    missing = [k for k in REQUIRED if k not in decl]
    rule = decl.get("primary", {}).get("decision", {})
    if missing:
        raise SystemExit(f"{path}: missing {', '.join(missing)}")
    if rule.get("stat") not in RULE_STATS or rule.get("op") not in RULE_OPS:
        raise SystemExit(f"{path}: primary.decision needs stat in {RULE_STATS} and op in "
                         f"{tuple(RULE_OPS)}, e.g. {{\"stat\": \"lo\", \"op\": \">\", "
                         "\"value\": 0}")
    if len(decl["design"].get("seeds", [])) > MAX_PERM_N:
        raise SystemExit(f"{path}: the exact sign-flip test enumerates 2^n patterns; at most "
                         f"{MAX_PERM_N} seeds")
    return decl


def _git(repo: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(repo), *argv], capture_output=True, text=True)


def check_committed(path: Path, repo: Path) -> dict:
    """Refuse a declaration git does not track or that differs from HEAD (staged or not);
    return its path in the repository, its blob and the commit that last touched it."""
    try:
        rel = Path(path).resolve().relative_to(Path(repo).resolve()).as_posix()
    except ValueError:
        raise SystemExit(f"{path}: a declaration lives in the repository ({repo}), under "
                         "bench/declared/") from None
    todo = f"commit {rel} before its first run"
    if _git(repo, "ls-files", "--error-unmatch", "--", rel).returncode:
        raise SystemExit(f"{rel}: not tracked by git; {todo}")
    if _git(repo, "diff", "--quiet", "HEAD", "--", rel).returncode:
        raise SystemExit(f"{rel}: differs from HEAD; {todo} (or restore it)")
    blob = _git(repo, "rev-parse", f"HEAD:{rel}").stdout.strip()
    commit = _git(repo, "log", "-1", "--format=%H", "--", rel).stdout.strip()
    return {"path": rel, "blob": blob, "commit": commit}


def check_arms(decl: dict, known) -> None:
    """Refuse a declaration that names arms the bench does not implement."""
    unknown = [a for a in decl["design"]["arms"] if a not in known]
    if unknown:
        raise SystemExit(f"{decl['name']}: the bench does not implement the declared arms "
                         f"{', '.join(unknown)} (it knows {', '.join(known)}); add them to "
                         "the bench before running this declaration")


def check_design(decl: dict, actual: dict) -> None:
    """Refuse a run whose design differs from the declared one, naming each key."""
    want = decl["design"]
    diff = sorted(k for k in {**want, **actual} if want.get(k) != actual.get(k))
    if diff:
        shown = "; ".join(f"{k}: declared {want.get(k)!r}, this run {actual.get(k)!r}"
                          for k in diff)
        raise SystemExit(f"{decl['name']}: this run's design differs from the declared one "
                         f"in {', '.join(diff)} ({shown}); run the declared design, or "
                         "declare a new one")


def mde(sd: float, n: int) -> float:
    """Minimum detectable effect of a paired design of n seeds at two-sided 5% and 80%
    power: (t(0.975, n-1) + t(0.80, n-1)) sd / sqrt(n)."""
    if n < 2:
        return math.inf
    return (t975(n - 1) + t80(n - 1)) * sd / math.sqrt(n)


def check_power(decl: dict, underpowered: bool) -> dict:
    """The design's MDE against the predicted effect; refuse when it cannot be detected
    unless ``underpowered``."""
    power, n = decl["power"], len(decl["design"]["seeds"])
    m, effect = mde(power["sd"], n), abs(power["predicted_effect"])
    out = {"mde": m, "sd": power["sd"], "predicted_effect": effect, "n": n,
           "underpowered": m > effect}
    out["line"] = (f"{decl['name']}: {n} seeds, sd {power['sd']:g} per seed -> minimum "
                   f"detectable effect {m:.4f} (95% two-sided, 80% power); predicted "
                   f"effect {effect:g}" + (": UNDERPOWERED" if m > effect else ""))
    if m > effect and not underpowered:
        raise SystemExit(out["line"] + "; declare more seeds or a larger predicted effect "
                         "with its source, or run with --underpowered")
    return out


def sign_flip_p(diffs: list[float]) -> float:
    """Exact two-sided sign-flip permutation p-value of the mean of paired differences:
    the share of all 2^n sign patterns whose |mean| is at least the observed one."""
    n = len(diffs)
    if not n:
        return math.nan
    if n > MAX_PERM_N:
        raise ValueError(f"exact sign-flip enumerates 2^n patterns; n <= {MAX_PERM_N}")
    observed = abs(sum(diffs)) - 1e-12 * max(1.0, sum(map(abs, diffs)))  # ties count
    hits = sum(abs(sum(s * d for s, d in zip(signs, diffs))) >= observed
               for signs in itertools.product((1, -1), repeat=n))
    return hits / 2 ** n


def paired_test(diffs: list[float]) -> dict:
    """Mean, 95% t interval, t p-value (df n-1) and sign-flip p of per-seed differences."""
    ci = mean_ci(diffs)
    t = ci["mean"] / ci["se"] if ci["se"] else (math.inf if ci["mean"] else math.nan)
    return {**ci, "p_t": t_two_sided_p(t, ci["n"] - 1), "p_perm": sign_flip_p(diffs)}


def contrast_diffs(rows: list[dict], figure: str, contrast: list[str],
                   seeds: list[int]) -> tuple[list[int], list[float]]:
    """(seeds, a - b) of ``figure`` over the declared seeds where both arms have it."""
    a, b = contrast
    val = {(r["arm"], r["seed"]): r.get(figure) for r in rows}
    present = {k for k, v in val.items() if v is not None and v == v}  # nan left out
    ok = [s for s in seeds if (a, s) in present and (b, s) in present]
    return ok, [val[(a, s)] - val[(b, s)] for s in ok]


def decide(stats: dict, rule: dict, n_declared: int) -> str:
    """met or missed by the declared rule; incomplete while seeds are missing."""
    if stats["n"] < n_declared:
        return "incomplete"
    return "met" if RULE_OPS[rule["op"]](stats[rule["stat"]], rule["value"]) else "missed"


def evaluate(decl: dict, rows: list[dict]) -> dict:
    """The declared primary endpoint with its test and rule, and each secondary endpoint
    that is a paired figure the rows carry (others are listed, not computed here)."""
    seeds, prim = decl["design"]["seeds"], decl["primary"]
    used, diffs = contrast_diffs(rows, prim["figure"], prim["contrast"], seeds)
    stats = paired_test(diffs)
    rule = prim["decision"]
    primary = {"name": prim["name"], "figure": prim["figure"],
               "contrast": "-".join(prim["contrast"]), "seeds": used, "diffs": diffs,
               **stats, "rule": f"{rule['stat']}{rule['op']}{rule['value']:g}",
               "verdict": decide(stats, rule, len(seeds))}
    secondary = []
    for sec in decl["secondary"]:
        if sec.get("test", "paired_t") != "paired_t" or "figure" not in sec:
            secondary.append({"name": sec["name"], "computed": False})
            continue
        used, diffs = contrast_diffs(rows, sec["figure"], sec["contrast"], seeds)
        secondary.append({"name": sec["name"], "contrast": "-".join(sec["contrast"]),
                          "computed": bool(diffs), "seeds": used, "diffs": diffs,
                          **(paired_test(diffs) if diffs else {})})
    return {"name": decl["name"], "primary": primary, "secondary": secondary}


def result_fields(result: dict, power: dict) -> str:
    """The RESULT line's declared fields; the last token is the primary verdict."""
    p = result["primary"]
    return (f"declared={result['name']} mde={power['mde']:.4f} "
            f"underpowered={str(power['underpowered']).lower()} primary={p['mean']:+.4f} "
            f"lo={p['lo']:+.4f} hi={p['hi']:+.4f} p_t={p['p_t']:.4f} p_perm={p['p_perm']:.4f} "
            f"n={p['n']} rule={p['rule']} {p['verdict']}")


def report_lines(result: dict) -> list[str]:
    """The declared endpoints as the report prints them, primary first."""
    lines = []
    for tag, e in [("primary", result["primary"]),
                   *(("secondary", e) for e in result["secondary"])]:
        if tag == "secondary" and not e["computed"]:
            lines.append(f"declared secondary {e['name']}: not computed by this bench")
            continue
        per_seed = ", ".join(f"{d:+.3f}" for d in e["diffs"])
        lines.append(f"declared {tag} {e['name']} {e['contrast']}: {e['mean']:+.4f} (95% t "
                     f"{e['lo']:+.4f} to {e['hi']:+.4f}; p_t {e['p_t']:.4f}, p_perm "
                     f"{e['p_perm']:.4f}; n {e['n']}; per seed: {per_seed})"
                     + (f" {e['rule']} {e['verdict']}" if tag == "primary" else ""))
    return lines


def pin(out: Path, where: dict, create: bool = True) -> dict:
    """Hold OUT to the declaration's blob at its first start (OUT/declared.json): refuse a
    declaration changed since, and an OUT holding arms run before any declaration."""
    path = Path(out) / PIN
    if path.is_file():
        had = json.loads(path.read_text())
        if (had["path"], had["blob"]) != (where["path"], where["blob"]):
            raise SystemExit(f"{path}: this --out was started under {had['path']} at blob "
                             f"{had['blob'][:12]}; {where['path']} is now blob "
                             f"{where['blob'][:12]}: declare a new name and use another --out")
        return had
    if any(Path(out).glob("*-seed*")):
        raise SystemExit(f"{out}: holds arms run before this declaration; use a fresh --out")
    pinned = {**where, "first_start": time.strftime("%Y-%m-%d %H:%M:%S")}
    if create:
        Path(out).mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(pinned, indent=1) + "\n")
    return pinned


def prepare(path: Path, repo: Path, known, design: dict, out: Path,
            underpowered: bool, report_only: bool = False) -> dict:
    """Every check before a run, in order: committed, arms known, design equal, power,
    pinned to OUT; returns the declaration with ``where`` and ``power`` added."""
    decl = load(path)
    where = check_committed(path, repo)
    check_arms(decl, known)
    check_design(decl, design)
    power = check_power(decl, underpowered or report_only)  # report-only runs nothing
    return {**decl, "where": pin(out, where, create=not report_only), "power": power}


def write_result(out: Path, decl: dict, result: dict) -> Path:
    """OUT/declared_result.json: the declaration's git blob, its power and its result."""
    path = Path(out) / RESULT
    path.write_text(json.dumps({"declared": decl["where"], "power": decl["power"],
                                **result}, indent=1, default=str) + "\n")
    return path
