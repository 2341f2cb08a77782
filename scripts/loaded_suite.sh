#!/usr/bin/env bash
# Run the tests on a busy machine on purpose: one CPU-bound process per core (nproc) for as
# long as pytest runs, as on a shared CI host, and a log of the processes the run leaves
# behind (zombies or alive). Issue 37: a suite that passed on a quiet machine failed there.
#
#   scripts/loaded_suite.sh [--clone] [pytest args...]     (default: the whole suite)
#
# --clone   run in a fresh clone of this checkout's HEAD (commits only) under
#           ${LOADED_SUITE_CLONE_PARENT:-/tmp}, with this checkout's .venv.
# Env: LOAD_PROCS (busy processes, default nproc), LOADED_SUITE_LOG (the log's path).
#
# The log holds `ps` before the run, zombies seen in pytest's process tree while it runs
# (sampled every 5 s), and after it the processes the run left: pytest runs under a
# child-subreaper, so its orphans and their zombies are adopted and listed, then killed.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY="$REPO/.venv/bin/python"
LOG=${LOADED_SUITE_LOG:-/tmp/loaded_suite-$(date +%Y%m%d-%H%M%S)-$$.log}
[ -x "$PY" ] || { echo "no $PY: run scripts/setup.sh first" >&2; exit 2; }

WORK=$REPO
if [ "${1:-}" = "--clone" ]; then
  shift
  parent=$(mktemp -d "${LOADED_SUITE_CLONE_PARENT:-/tmp}/arpo_suite.XXXXXX")
  git clone --quiet "$REPO" "$parent/repo"
  # tests/conftest.py looks for the real data beside the repository
  [ -d "$REPO/../shared" ] && ln -s "$(cd "$REPO/../shared" && pwd)" "$parent/shared"
  WORK=$parent/repo
  # the venv's editable install points at this checkout: children that start elsewhere
  # than the clone must still import the clone's code
  export PYTHONPATH="$WORK${PYTHONPATH:+:$PYTHONPATH}"
fi

# The machine's zombies and Python-side processes (long command lines cut to 200 columns).
snapshot() {
  ps -eo pid,ppid,stat,etime,args | awk 'NR == 1 || $3 ~ /Z/ || /python|pytest|VLLM|bwrap/' \
    | grep -v ' awk ' | cut -c1-200
}

load=()
stop_load() {
  [ ${#load[@]} -eq 0 ] || kill "${load[@]}" 2>/dev/null || true
  [ ${#load[@]} -eq 0 ] || wait "${load[@]}" 2>/dev/null || true
  load=()
}
trap stop_load EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

{
  echo "# loaded suite $(date -Is): $WORK, pytest $*"
  echo "# the project imports from $(cd "$WORK" && "$PY" -c 'import actors; print(actors.__file__)')"
  echo "# ps before the run: zombies and Python processes"
  snapshot
} > "$LOG"
echo "loaded_suite: log $LOG" >&2

for _ in $(seq "${LOAD_PROCS:-$(nproc)}"); do  # niceness 0: the tests' own priority
  nice -n 0 "$PY" -c 'while True: pass' &
  load+=("$!")
done
echo "# load: ${#load[@]} busy processes, pids ${load[*]}" >> "$LOG"

# Runs pytest as its child and, being a subreaper, adopts what pytest's processes leave.
read -r -d '' RUNNER <<'EOF' || true
import ctypes, os, signal, subprocess, sys, time
import psutil

log_path, cmd = sys.argv[1], sys.argv[2:]
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def ps(pids):
    if not pids:
        return "(none)\n"
    args = ["ps", "-o", "pid,ppid,stat,etime,args", "-p", ",".join(map(str, pids))]
    out = subprocess.run(args, capture_output=True, text=True).stdout
    return "".join(line[:200] + "\n" for line in out.splitlines())


with open(log_path, "a") as log:
    t0 = time.monotonic()
    pytest = subprocess.Popen(cmd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops pytest; we still report
    seen = set()
    while True:
        try:
            rc = pytest.wait(timeout=5)
            break
        except subprocess.TimeoutExpired:
            pass
        try:
            tree = psutil.Process(pytest.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            continue
        zombies = []
        for p in tree:
            try:
                if p.status() == psutil.STATUS_ZOMBIE and p.pid not in seen:
                    zombies.append(p.pid)
            except psutil.NoSuchProcess:
                pass
        if zombies:
            seen.update(zombies)
            log.write(f"# {time.monotonic() - t0:.0f} s: zombies in pytest's tree\n{ps(zombies)}")
            log.flush()
    left = [p.pid for p in psutil.Process().children()]
    log.write(f"# pytest exited {rc} after {time.monotonic() - t0:.0f} s; processes it left "
              f"(adopted here; now killed)\n{ps(left)}")
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
    print(f"loaded_suite: pytest exited {rc}; {len(seen)} zombies seen during the run, "
          f"{len(left)} processes left after it (see {log_path})", file=sys.stderr)
    sys.exit(rc)
EOF

rc=0
(cd "$WORK" && "$PY" -c "$RUNNER" "$LOG" "$PY" -m pytest -q -p no:cacheprovider "$@") || rc=$?
stop_load
{ echo "# ps after the run: zombies and Python processes"; snapshot; } >> "$LOG"
exit "$rc"
