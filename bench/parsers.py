"""Fuzz every tool-call parser (issue 32): hostile and malformed rounds per model family
through the syntax the rollout uses (``find_calls``), on the family's real tokenizer and
template.

Families: ``qwen3`` (Qwen3's hermes JSON calls, this project's parser), ``qwen3.5``
(XML calls, vLLM's ``qwen3_coder``), ``glm4.7`` (vLLM's ``glm47``), ``deepseek3.1``
(vLLM's ``deepseek_v31``). Rounds: toolenv/call_fuzz.py (truncated calls, nested markers,
unknown or hostile names, code as arguments, invalid JSON/XML, long values, control
tokens, random bytes, several calls). Counted: crashes (an exception out of
``find_calls``), code evaluated (``exec`` audit events), the calls refused with their
reasons, the well-formed calls left.

The instrument is calibrated first, on planted parsers whose answer is known: one that
evaluates every round (every round must count as an evaluation) and one that raises
(every round a crash); the bench stops if either is not seen.

    python bench/parsers.py [--rounds 100000] [--families qwen3,qwen3.5,glm4.7,deepseek3.1]

Each chunk of 10,000 rounds is saved as it ends (the results file with ``.partial.json``
in place of ``.json``); a rerun with the same settings takes those chunks as they are and
goes on from there (a GLM-4.7 run of 100,000 takes about an hour on one core).

Last line: ``RESULT parsers families=<n> fuzz_rounds=<m> crashes=<c> evals=<e>
target=families>=4 met|missed`` (met: at least four families, none crashed or evaluated).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, write_results  # noqa: E402

from arpo_async.core.files import atomic_write_json  # noqa: E402

COUNTS = ("rounds", "crashes", "evals", "valid_calls", "no_call", "invalid")

FAMILIES = ("qwen3", "qwen3.5", "glm4.7", "deepseek3.1")


class _Planted:
    """A syntax whose parser evaluates (``mode=eval``) or raises (``mode=raise``)."""

    specs, stop_strings, literals = {}, ["</tool_call>"], ()

    def __init__(self, mode: str):
        self.mode = mode

    def call_text(self, name: str, args: str) -> str:
        return f"<tool_call>{args}</tool_call>"

    def find_calls(self, text: str):
        if self.mode == "raise":
            raise ValueError("planted")
        eval(repr(text))  # noqa: S307 - the planted evaluation the counter must see
        return []


def calibrate(n: int = 200) -> dict:
    from toolenv.call_fuzz import fuzz

    seen = {"evals": fuzz(_Planted("eval"), n)["evals"],
            "crashes": fuzz(_Planted("raise"), n)["crashes"]}
    if seen != {"evals": n, "crashes": n}:
        raise SystemExit(f"calibration failed: planted {n} evaluations and {n} crashes, "
                         f"counted {seen}")
    return {"planted": n, **seen}


def family_syntax(name: str, scratch: Path):
    from transformers import AutoTokenizer

    from arpo_async.core.config import load_config
    from arpo_async.jobs.family_tokenizers import FAMILIES as KNOWN, export_family
    from arpo_async.jobs.qwen_tokenizer import export_qwen3_tokenizer
    from toolenv.syntax import build_syntax

    if name == "qwen3":
        tok = AutoTokenizer.from_pretrained(export_qwen3_tokenizer(scratch / name))
        syntax = "hermes"
    else:
        tok = AutoTokenizer.from_pretrained(export_family(name, scratch / name))
        syntax = KNOWN[name].parser
    cfg = load_config(None, [f"tools.syntax={syntax}", "tools.enabled=[python,search]"])
    return build_syntax(cfg.tools, tok, {"enable_thinking": False}), syntax


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=100_000, help="hostile rounds per family")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--results", default=str(RESULTS / "parsers.json"))
    args = ap.parse_args()
    from toolenv.call_fuzz import fuzz

    cal = calibrate()
    print(f"calibration: planted {cal['planted']} evaluations and crashes, counted "
          f"{cal['evals']} and {cal['crashes']}", flush=True)
    rows = {}
    progress = Path(args.results).with_suffix(".partial.json")  # resumes from it
    partial = json.loads(progress.read_text()) if progress.exists() else {}
    if partial:
        print(f"resuming from {progress}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in [f for f in args.families.split(",") if f]:
            syntax, parser = family_syntax(name, Path(tmp))
            t0, out = time.time(), {"rounds": 0, "crashes": 0, "evals": 0, "valid_calls": 0,
                                    "no_call": 0, "invalid": 0, "reasons": {}}
            chunk = 10_000
            # chunks done by an earlier run with these settings: taken as they are
            done = partial.setdefault(f"{name}:{args.seed}:{chunk}", {})
            for i, start in enumerate(range(0, args.rounds, chunk)):
                part = done.get(str(i))
                if part is None:
                    part = fuzz(syntax, min(chunk, args.rounds - start),
                                seed=args.seed * 1000 + i)
                    part = {k: part[k] for k in (*COUNTS, "reasons")} | {
                        "wall_s": round(time.time() - t0, 1)}
                    done[str(i)] = part
                    atomic_write_json(progress, partial)
                for key in COUNTS:
                    out[key] += part[key]
                for reason, c in part["reasons"].items():
                    out["reasons"][reason] = out["reasons"].get(reason, 0) + c
                print(f"  {name}: {out['rounds']}/{args.rounds} rounds, {out['crashes']} "
                      f"crashes, {out['evals']} evals, {time.time() - t0:.0f} s", flush=True)
            out.update(parser=parser, wall_s=round(time.time() - t0, 1))
            rows[name] = out
            top = sorted(out["reasons"].items(), key=lambda kv: -kv[1])[:4]
            print(f"{name} ({parser}): {out['rounds']} rounds, crashes {out['crashes']}, evals "
                  f"{out['evals']}, refused {out['invalid']}, no call {out['no_call']}, "
                  f"well-formed {out['valid_calls']}; top reasons {top}", flush=True)
    crashes = sum(r["crashes"] for r in rows.values())
    evals = sum(r["evals"] for r in rows.values())
    total = sum(r["rounds"] for r in rows.values())
    write_results("parsers", {"calibration": cal, "families": rows,
                              "args": vars(args)}, args.results)
    met = len(rows) >= 4 and crashes == 0 and evals == 0
    print(f"RESULT parsers families={len(rows)} fuzz_rounds={total} crashes={crashes} "
          f"evals={evals} target=families>=4 {'met' if met else 'missed'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
