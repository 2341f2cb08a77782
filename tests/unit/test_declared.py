"""Declared experiments (bench/declared.py, issue 53): a declaration git does not hold
unchanged, a design that differs from it, arms the bench lacks and a design too small for
its predicted effect are refused before anything runs; the primary endpoint is read with
the declared test (paired t, exact sign-flip) and rule. Hand values throughout; the git
checks run in a repository made in tmp_path."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import REPO

EXAMPLE = REPO / "bench" / "declared" / "tree_credit_recover.json"


def _load(name: str):
    sys.path.insert(0, str(REPO / "bench"))
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def D():
    return _load("declared")


@pytest.fixture(scope="module")
def bench():
    return _load("arpo_vs_grpo")


DESIGN = {"bench": "arpo_vs_grpo", "run": "runs/recover", "arms": ["grpo", "arpo"],
          "seeds": [0, 1, 2, 3, 4], "budget": 2500, "curve_every": 0, "eval": [300, 4],
          "target_gain": 0.05, "overrides": []}


def _decl(**over) -> dict:
    decl = {"name": "t", "status": "declared, not run", "design": dict(DESIGN),
            "primary": {"name": "recovery", "figure": "recovery", "contrast": ["arpo", "grpo"],
                        "decision": {"stat": "lo", "op": ">", "value": 0}},
            "secondary": [{"name": "pass@1", "figure": "accuracy",
                           "contrast": ["arpo", "grpo"], "test": "paired_t"},
                          {"name": "bootstrap", "figure": "recovery",
                           "contrast": ["arpo", "grpo"], "test": "prompt_clustered_bootstrap"}],
            "power": {"sd": 0.02, "sd_source": "hand", "predicted_effect": 0.05,
                      "predicted_source": "assumed"}}
    decl.update(over)
    return decl


def _git(repo: Path, *argv: str) -> None:
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t",
                    "-c", "commit.gpgsign=false", *argv], check=True, capture_output=True)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    _git(tmp_path, "init", "-q")
    (tmp_path / "README").write_text("x\n")
    _git(tmp_path, "add", "README")
    _git(tmp_path, "commit", "-q", "-m", "first")
    (tmp_path / "bench" / "declared").mkdir(parents=True)
    return tmp_path


def test_an_untracked_staged_or_changed_declaration_is_refused(D, repo: Path):
    path = repo / "bench" / "declared" / "t.json"
    path.write_text(json.dumps(_decl()))
    with pytest.raises(SystemExit, match="bench/declared/t.json: not tracked by git; commit "
                                         "bench/declared/t.json before its first run"):
        D.check_committed(path, repo)
    _git(repo, "add", "bench/declared/t.json")  # staged is not committed
    with pytest.raises(SystemExit, match="differs from HEAD; commit"):
        D.check_committed(path, repo)
    _git(repo, "commit", "-q", "-m", "declare t")
    where = D.check_committed(path, repo)
    assert where["path"] == "bench/declared/t.json" and len(where["blob"]) == 40
    path.write_text(json.dumps(_decl(name="t2")))  # edited after the commit
    with pytest.raises(SystemExit, match="differs from HEAD"):
        D.check_committed(path, repo)
    with pytest.raises(SystemExit, match="lives in the repository"):
        D.check_committed(repo.parent / "elsewhere.json", repo)


def test_prepare_runs_every_check_and_pins_the_blob_to_out(D, repo: Path, tmp_path: Path):
    path = repo / "bench" / "declared" / "t.json"
    path.write_text(json.dumps(_decl()))
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "declare t")
    out = tmp_path / "out"
    spec = D.prepare(path, repo, ("grpo", "arpo"), dict(DESIGN), out, underpowered=False)
    assert spec["power"]["mde"] == pytest.approx((2.776 + 0.941) * 0.02 / math.sqrt(5))
    assert json.loads((out / D.PIN).read_text())["blob"] == spec["where"]["blob"]
    with pytest.raises(SystemExit, match=r"in budget, seeds \(budget: declared 2500, this run "
                                         r"2000; seeds"):
        D.prepare(path, repo, ("grpo", "arpo"), {**DESIGN, "budget": 2000, "seeds": [0]},
                  out, False)
    path.write_text(json.dumps(_decl(status="edited after results")))  # committed again
    _git(repo, "commit", "-q", "-am", "redeclare t")
    with pytest.raises(SystemExit, match="declare a new name and use another --out"):
        D.prepare(path, repo, ("grpo", "arpo"), dict(DESIGN), out, False)


def test_a_design_mismatch_names_its_keys(D):
    D.check_design(_decl(), dict(DESIGN))
    with pytest.raises(SystemExit, match="in arms, overrides, seeds "):
        D.check_design(_decl(), {**DESIGN, "arms": ["grpo"], "seeds": [0, 1],
                                 "overrides": ["run.x=1"]})
    with pytest.raises(SystemExit, match="in extra "):  # a key only one side has differs
        D.check_design(_decl(), {**DESIGN, "extra": 1})


def test_the_example_declares_arms_the_bench_lacks_and_is_refused_naming_them(D, bench):
    decl = D.load(EXAMPLE)
    assert decl["status"].startswith("declared, not run")
    assert decl["design"]["seeds"] == list(range(10)) and decl["design"]["budget"] == 2500
    assert decl["primary"]["contrast"] == ["tree_outcome_treeadv", "grpo"]
    with pytest.raises(SystemExit) as exc:
        D.check_arms(decl, bench.KNOWN_ARMS)
    msg = str(exc.value)
    assert "arms tree_random, tree_outcome, tree_outcome_treeadv, grpo_aepo_loss (" in msg
    D.check_arms(_decl(), bench.KNOWN_ARMS)


def test_the_bench_refuses_to_run_arms_undeclared(bench):
    args = SimpleNamespace(declared=None, report_only=False)
    with pytest.raises(SystemExit, match="--declared bench/declared/<name>.json"):
        bench.declare_run(args, Path("runs/recover"), [0], ["grpo"])
    assert bench.declare_run(SimpleNamespace(declared=None, report_only=True),
                             Path("runs/recover"), [0], ["grpo"]) is None


def test_load_refuses_a_declaration_without_its_parts(D, tmp_path: Path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"name": "x", "design": DESIGN}))
    with pytest.raises(SystemExit, match="missing status, primary, secondary, power"):
        D.load(path)
    bad = _decl()
    bad["primary"]["decision"] = {"stat": "lower", "op": ">", "value": 0}
    path.write_text(json.dumps(bad))
    with pytest.raises(SystemExit, match="primary.decision needs stat"):
        D.load(path)


def test_mde_by_hand(D):
    # n = 10: t(0.975, 9) = 2.262, t(0.80, 9) = 0.883
    assert D.mde(0.02, 10) == pytest.approx(3.145 * 0.02 / math.sqrt(10))
    assert D.mde(0.02, 10) == pytest.approx(0.019891, abs=1e-6)
    assert D.mde(0.02, 1) == math.inf


def test_an_underpowered_design_runs_only_when_asked(D):
    small = _decl(power={"sd": 0.02, "predicted_effect": 0.011})
    with pytest.raises(SystemExit, match="UNDERPOWERED; declare more seeds.*--underpowered"):
        D.check_power(small, underpowered=False)
    assert D.check_power(small, underpowered=True)["underpowered"] is True
    enough = D.check_power(_decl(power={"sd": 0.02, "predicted_effect": -0.05}), False)
    assert enough["underpowered"] is False and enough["predicted_effect"] == 0.05
    assert "minimum detectable effect 0.0332" in enough["line"]  # 3.717 * 0.02 / sqrt(5)


def test_the_sign_flip_p_value_by_hand(D):
    assert D.sign_flip_p([0.01, 0.02, 0.03, 0.04, 0.05]) == 2 / 32  # only + and - all
    assert D.sign_flip_p([1.0, 1.0, 1.0, 1.0]) == 2 / 16
    # |sum| >= 0.25 in (+++), (++-) 0.35, (--+) and (---): 4 of 8
    assert D.sign_flip_p([0.1, 0.2, -0.05]) == 0.5
    assert D.sign_flip_p([1.0, -1.0]) == 1.0 and D.sign_flip_p([0.0]) == 1.0
    assert math.isnan(D.sign_flip_p([]))
    with pytest.raises(ValueError, match="n <= 16"):
        D.sign_flip_p([1.0] * 17)


def _rows(diffs: dict[int, float]) -> list[dict]:
    rows = []
    for seed, d in diffs.items():
        rows += [{"arm": "grpo", "seed": seed, "recovery": 0.05, "accuracy": 0.5},
                 {"arm": "arpo", "seed": seed, "recovery": 0.05 + d, "accuracy": 0.5 + d}]
    return rows


def test_the_declared_rule_is_met_missed_or_incomplete(D):
    met = D.evaluate(_decl(), _rows(dict(enumerate([0.01, 0.02, 0.03, 0.04, 0.05]))))
    p = met["primary"]
    se = math.sqrt(0.00025 / 5)
    assert (p["n"], p["contrast"], p["verdict"], p["rule"]) == (5, "arpo-grpo", "met", "lo>0")
    assert p["mean"] == pytest.approx(0.03) and p["lo"] == pytest.approx(0.03 - 2.776 * se)
    # t = 0.03 / se = 4.243 on 4 df: 1 - sin(theta)(1 + cos^2(theta) / 2), cos^2 = 1 / 5.5
    assert p["p_t"] == pytest.approx(1 - math.sqrt(1 - 1 / 5.5) * (1 + 0.5 / 5.5))
    assert p["p_perm"] == 2 / 32
    assert met["secondary"][0]["computed"] and met["secondary"][0]["mean"] == pytest.approx(0.03)
    assert met["secondary"][1] == {"name": "bootstrap", "computed": False}
    missed = D.evaluate(_decl(), _rows(dict(enumerate([0.02, -0.03, 0.01, 0.0, 0.01]))))
    assert missed["primary"]["verdict"] == "missed"
    short = D.evaluate(_decl(), _rows(dict(enumerate([0.02, 0.03, 0.04]))))
    assert short["primary"]["verdict"] == "incomplete" and short["primary"]["seeds"] == [0, 1, 2]
    fields = D.result_fields(met, {"mde": 0.0332, "underpowered": False})
    assert fields.startswith("declared=t mde=0.0332 underpowered=false primary=+0.0300 lo=")
    assert fields.endswith(" p_perm=0.0625 n=5 rule=lo>0 met")


def test_the_result_line_keeps_its_fields_and_adds_the_declared_ones(D, bench):
    result = D.evaluate(_decl(), _rows(dict(enumerate([0.01, 0.02, 0.03, 0.04, 0.05]))))
    spec = {"power": {"mde": 0.0332, "underpowered": False}}
    line = bench.verdict_line({}, {"accuracy": {}, "recovery": {}},
                              SimpleNamespace(tool_calls=2500), spec, result)
    assert line.startswith("RESULT arpo_vs_grpo arpo_minus_random=")
    assert " budget=2500 target=arpo_minus_random>=2se missed declared=t " in line
    assert line.endswith("n=5 rule=lo>0 met")


def test_an_out_with_arms_from_before_the_declaration_is_refused(D, tmp_path: Path):
    where = {"path": "bench/declared/t.json", "blob": "a" * 40, "commit": "c" * 40}
    D.pin(tmp_path / "fresh", where, create=False)  # --report-only writes nothing
    assert not (tmp_path / "fresh").exists()
    (tmp_path / "old" / "grpo-seed0").mkdir(parents=True)
    with pytest.raises(SystemExit, match="holds arms run before this declaration"):
        D.pin(tmp_path / "old", where)
