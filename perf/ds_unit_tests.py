"""DeepSpeed's own unit tests, run on CPU against real DeepSpeed and against zpp.

Acceptance check: of the sampled DeepSpeed unit tests (tests/unit/..., public-API ones)
that real DeepSpeed passes on CPU, zpp must pass >= 80%.  The test sources are DeepSpeed's
code and are not in this repository: fetch them into a folder laid out like DeepSpeed's
repo (DIR/tests/conftest.py, DIR/tests/pytest.ini, DIR/tests/unit/...).

Rerun both sides (~25 min on 2 cores):
    python perf/ds_unit_tests.py --tests /work/dstests --deepspeed-python /work/dsenv/bin/python
Rerun only zpp, reusing the DeepSpeed outcomes of the last run:
    python perf/ds_unit_tests.py --tests /work/dstests --only zpp --reuse perf/results/ds_unit_tests.json

The zpp side runs `<this python> -m zpp run <this python> -m pytest ...` (i.e. `zpp run`); the
DeepSpeed side runs `--deepspeed-python -m pytest ...`.  Both get the same selection, the same
environment workarounds (DS_ACCELERATOR=cpu, LOCAL_SIZE=2 so DeepSpeed's CPU accelerator
reports 2 devices and 2-rank tests run) and a per-test timeout.  A hung test kills pytest
(pytest-timeout, thread method); the runner records it as "timeout" and resumes with the rest.
Per-test outcomes are recorded by this module acting as a pytest plugin (-p ds_unit_tests).
DeepSpeed's test files import hjson (a DeepSpeed dependency, not zpp's): `pip install hjson`
in the environment that runs the zpp side.
Full logs and tracebacks go to --workdir.  Skipped-by-DeepSpeed tests don't count.
"""
import argparse, datetime, json, os, platform, re, signal, socket, subprocess, sys, time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# The sample (paths relative to DIR/tests).  Slow or data-less parts are left out of the
# fetched files themselves (see the NOTE at the top of each file); DESELECT drops the rest.
SAMPLE = [
    "unit/runtime/zero/test_zero_config.py",
    "unit/runtime/test_ds_config_dict.py",
    "unit/comm/test_dist.py",
    "unit/runtime/test_ds_initialize.py",
    "unit/runtime/zero/test_zero_context.py",
    "unit/runtime/test_lr_schedulers.py",
    "unit/checkpoint/test_zero_optimizer.py",
]
DESELECT = [
    # needs tests/unit/model/BingBertSquad/*.json, not fetched
    "unit/runtime/test_ds_config_dict.py::test_quantized_eigenvalue_config_parses",
]
ENV = {"DS_ACCELERATOR": "cpu", "LOCAL_SIZE": "2", "DS_UNITTEST_TIMEOUT": "600",
       "TORCH_EXTENSIONS_DIR": "/work/ds_ext", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

# ---------------------------------------------------------------- pytest plugin side
_LOG = os.environ.get("DSU_JSONL")


def _emit(rec):
    if _LOG:
        with open(_LOG, "a") as f:
            f.write(json.dumps(rec) + "\n")


def _message(report):
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return crash.message
    if isinstance(report.longrepr, tuple):  # skip: (path, line, reason)
        return str(report.longrepr[2])
    return str(report.longrepr or "")


def pytest_collection_finish(session):
    _emit({"collected": [item.nodeid for item in session.items]})


def pytest_collectreport(report):
    if report.failed:
        errs = [l[1:].strip() for l in report.longreprtext.splitlines() if l.startswith("E ")]
        _emit({"collect_error": report.nodeid, "msg": errs[-1] if errs else _message(report),
               "text": report.longreprtext[-6000:]})


def pytest_runtest_logstart(nodeid, location):
    _emit({"start": nodeid})


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        _emit({"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
               "msg": _message(report) if report.outcome != "passed" else "",
               "text": report.longreprtext[-6000:] if report.failed else ""})

# ---------------------------------------------------------------- runner side


def run_side(side, args, python_cmd, env):
    """Runs the sample under one side, resuming after hangs; returns {nodeid: rec}."""
    jsonl = os.path.join(args.workdir, f"{side}.jsonl")
    open(jsonl, "w").close()
    env = dict(os.environ, **ENV, **env, DSU_JSONL=jsonl)
    env["PYTHONPATH"] = os.pathsep.join([HERE] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    base = ["-m", "pytest", "-p", "no:cacheprovider", "-p", "ds_unit_tests", "-q", "-rfE", "--continue-on-collection-errors",
            f"--timeout={args.timeout}", "--timeout-method=thread"]
    results, collected, hung, targets = {}, None, [], list(args.select or SAMPLE)
    deadline = time.time() + args.budget
    for attempt in range(50):
        cmd = python_cmd + base + targets + [f"--deselect={d}" for d in DESELECT + hung]
        with open(os.path.join(args.workdir, f"{side}.log"), "a") as log:
            log.write(f"\n### {' '.join(cmd)}\n")
            log.flush()
            p = subprocess.Popen(cmd, cwd=os.path.join(args.tests, "tests"), env=env, stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True)
            try:
                p.wait(timeout=max(60, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pass
            try:  # the session's leftovers: forkserver, pool workers of a hung test
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        started = None
        for line in open(jsonl):
            rec = json.loads(line)
            if "collected" in rec and collected is None:
                collected = rec["collected"]
            elif "collect_error" in rec:
                results.setdefault("collect:" + rec["collect_error"], {"outcome": "error", **rec})
            elif "start" in rec:
                started = rec["start"]
            elif "nodeid" in rec:
                started = None if started == rec["nodeid"] else started
                merge(results, rec)
        open(jsonl, "w").close()
        if started and started not in results:
            results[started] = {"outcome": "timeout", "msg": f"no result within {args.timeout}s (killed)"}
            hung.append(started)
        todo = [t for t in (collected or []) if t not in results and t not in DESELECT]
        if not todo or collected is None or time.time() > deadline:
            for t in todo:
                results[t] = {"outcome": "not run", "msg": "time budget spent or pytest died"}
            break
        targets = todo
    return results


def merge(results, rec):
    old = results.get(rec["nodeid"])
    out, when = rec["outcome"], rec["when"]
    outcome = {"passed": "passed", "skipped": "skipped"}.get(out, "failed" if when == "call" else "error")
    if old and old["outcome"] in ("failed", "error") and outcome == "passed":
        return
    if old and old["outcome"] in ("failed", "error", "skipped") and outcome == "error" and when == "teardown":
        return
    results[rec["nodeid"]] = {"outcome": outcome, "msg": first_line(rec["msg"]), "text": rec.get("text", "")}


def first_line(msg):
    lines = (msg or "").strip().splitlines()
    return lines[0][:300] if lines else ""


ZPP_FRAME = re.compile(r'(?:File "|^)(\S*?/zpp/[^"\s:]+\.py)"?(?:, line |:)(\d+)', re.M)


def zpp_where(text):
    hits = ZPP_FRAME.findall(text or "")
    return f"{os.path.relpath(hits[-1][0], ROOT) if hits[-1][0].startswith(ROOT) else hits[-1][0]}:{hits[-1][1]}" \
        if hits else ""


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tests", required=True, help="folder holding DeepSpeed's tests/ (conftest.py, unit/...)")
    ap.add_argument("--deepspeed-python", default="/work/dsenv/bin/python")
    ap.add_argument("--zpp-python", default=sys.executable)
    ap.add_argument("--only", choices=["zpp", "deepspeed"])
    ap.add_argument("--reuse", help="earlier JSON whose deepspeed outcomes to reuse")
    ap.add_argument("--select", nargs="*", help="override the sample (paths or node ids under tests/)")
    ap.add_argument("--timeout", type=int, default=120, help="per-test timeout, s")
    ap.add_argument("--budget", type=int, default=1500, help="wall budget per side, s")
    ap.add_argument("--workdir", default="/tmp/ds_unit_tests", help="logs and raw per-test records")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "ds_unit_tests.json"))
    args = ap.parse_args()
    args.tests = os.path.abspath(args.tests)
    os.makedirs(args.workdir, exist_ok=True)
    reuse = args.reuse or (args.out if args.only == "zpp" and os.path.exists(args.out) else None)
    old = json.load(open(reuse)) if reuse else {"tests": {}}
    ds_version = subprocess.run([args.deepspeed_python, "-c", "import deepspeed; print(deepspeed.__version__)"],
                                capture_output=True, text=True, env=dict(os.environ, **ENV)).stdout.strip()
    sides = {"deepspeed": ([args.deepspeed_python], {}),
             "zpp": ([args.zpp_python, "-m", "zpp", "run", args.zpp_python], {})}
    out = {}
    for side, (cmd, env) in sides.items():
        if args.only and side != args.only:
            out[side] = {k: {"outcome": v.get(side), "msg": v.get(side + "_msg", "")} for k, v in old["tests"].items()
                         if v.get(side)}
            continue
        t0 = time.time()
        out[side] = run_side(side, args, cmd, env)
        print(f"{side}: {len(out[side])} tests in {time.time() - t0:.0f}s", file=sys.stderr)
    tests, collect_errors = {}, {}
    for side in out:
        for k in [k for k in out[side] if k.startswith("collect:")]:
            collect_errors.setdefault(side, {})[k[8:]] = out[side].pop(k)
    chosen = lambda k: not args.select or any(k == s or k.startswith(s.rstrip("/") + ("::" if s.endswith(".py")
                                                                                      else "")) for s in args.select)
    for k in sorted(k for k in set(out["deepspeed"]) | set(out["zpp"]) if chosen(k)):
        d, z = out["deepspeed"].get(k, {}), out["zpp"].get(k, {})
        if not z and args.only != "deepspeed":  # module did not import under zpp
            z = collect_errors.get("zpp", {}).get(k.split("::")[0], {})
        rec = {"deepspeed": d.get("outcome"), "zpp": z.get("outcome")}
        if d.get("outcome") not in (None, "passed", "skipped"):
            rec["deepspeed_msg"] = first_line(d.get("msg"))
        if z.get("outcome") not in (None, "passed", "skipped"):
            rec["zpp_msg"] = first_line(z.get("msg"))
            where = zpp_where(z.get("text"))
            if where:
                rec["zpp_where"] = where
        tests[k] = rec
    if args.only != "deepspeed":
        with open(os.path.join(args.workdir, "zpp_failures.txt"), "w") as f:
            for k, z in out["zpp"].items():
                if z.get("outcome") not in ("passed", "skipped"):
                    f.write(f"\n===== {k} [{z.get('outcome')}]\n{z.get('text') or z.get('msg')}\n")
    ds_pass = [k for k, v in tests.items() if v["deepspeed"] == "passed"]
    both = [k for k in ds_pass if tests[k]["zpp"] == "passed"]
    git = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": f"{socket.gethostname()} ({platform.platform()}, {os.cpu_count()} cpus)",
        "command": " ".join([os.path.relpath(sys.argv[0], ROOT) if sys.argv[0].startswith(ROOT) else sys.argv[0]]
                            + sys.argv[1:]),
        "git_revision": git, "deepspeed_version": ds_version or old.get("deepspeed_version"),
        "deepspeed_outcomes_from": reuse if args.only == "zpp" else None,
        "sample": args.select or SAMPLE, "deselected": DESELECT, "per_test_timeout_s": args.timeout,
        "env": ENV,
        "summary": {"sampled": len(tests), "deepspeed_passed": len(ds_pass), "zpp_passed_of_those": len(both),
                    "ratio": round(len(both) / len(ds_pass), 4) if ds_pass else None, "target": 0.8,
                    "zpp_passed_total": sum(v["zpp"] == "passed" for v in tests.values())},
        "collect_errors": {s: {f: e["msg"] for f, e in c.items()} for s, c in collect_errors.items()},
        "tests": tests,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(json.dumps(result["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
