"""What the engine is given, checked before it runs: which Python the launchers use, configuration errors
under a plain torchrun, and training data whose token ids or splits cannot work."""
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import threading

import numpy as np
import pytest

from engine_utils import ROOT, free_port

VENV_PY = sys.executable  # the Python that has megatron_patch installed


def _executable(path, text: str) -> str:
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)
    return str(path)


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PY", "MEGATRON_PATCH_PY_CHECKED", "PYTHONUNBUFFERED")}
    env.update(PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", **extra)
    return env


# ---------------------------------------------------------------- which Python the launchers run


def test_python_resolution_order(tmp_path):
    """$PY if set, else <repo>/.venv, else python3 on PATH; and one sentence when it lacks megatron_patch."""
    root, bin_ = tmp_path / "repo", tmp_path / "bin"
    (root / ".venv" / "bin").mkdir(parents=True)
    bin_.mkdir()
    ok = "#!/bin/sh\nexit 0\n"  # answers the launchers' `import megatron_patch` probe with success
    venv = _executable(root / ".venv" / "bin" / "python", ok)
    python3 = _executable(bin_ / "python3", ok)
    mine = _executable(tmp_path / "my-python", ok)
    broken = _executable(tmp_path / "no-megatron-patch", "#!/bin/sh\nexit 1\n")
    script = os.path.join(ROOT, "pretrain_scripts", "resolve_python.sh")

    def resolve(**env):
        proc = subprocess.run(["bash", "-c", f'ROOT={root}; source {script}; echo "$PY $PYTHONUNBUFFERED"'],
                              capture_output=True, text=True, env=_clean_env(PATH=f"{bin_}:{os.environ['PATH']}", **env))
        return proc.returncode, proc.stdout.strip(), proc.stderr.strip()

    assert resolve(PY=mine) == (0, f"{mine} 1", "")
    assert resolve() == (0, f"{venv} 1", "")
    shutil.rmtree(root / ".venv")
    assert resolve() == (0, f"{python3} 1", "")
    rc, out, err = resolve(PY=broken)
    assert rc == 2 and out == "" and err.startswith(f"error: {broken} cannot import megatron_patch")
    rc, _, err = resolve(PY=str(tmp_path / "missing"))
    assert rc == 2 and "is not an executable Python" in err


def test_launchers_run_python3_when_there_is_no_venv(tmp_path):
    """A user who installed megatron_patch into their own environment (no .venv in the checkout): every
    step of the demo data and the launcher runs that environment's python3."""
    repo, bin_ = tmp_path / "repo", tmp_path / "bin"
    (repo / "pretrain_scripts").mkdir(parents=True)
    bin_.mkdir()
    for name in os.listdir(os.path.join(ROOT, "pretrain_scripts")):
        shutil.copy(os.path.join(ROOT, "pretrain_scripts", name), repo / "pretrain_scripts" / name)
    os.symlink(os.path.join(ROOT, "tools"), repo / "tools")
    os.symlink(os.path.join(ROOT, "pretrain_megatron_gpt.py"), repo / "pretrain_megatron_gpt.py")
    log = tmp_path / "python3.log"
    _executable(bin_ / "python3", f'#!/bin/sh\necho "$@" >> {log}\nexec {VENV_PY} "$@"\n')
    # A small corpus in place of the stdlib docstrings (step 1 runs "$PY" like steps 2 and 3, and takes seconds).
    (tmp_path / "demo").mkdir()
    with open(tmp_path / "demo" / "corpus.jsonl", "w") as f:
        for i in range(300):
            f.write(json.dumps({"text": f"Document {i} says that the launcher runs python {i % 7} times."}) + "\n")
    env = _clean_env(PATH=f"{bin_}:{os.environ['PATH']}", DEMO_DIR=str(tmp_path / "demo"), VOCAB_SIZE="400")

    proc = subprocess.run(["bash", str(repo / "pretrain_scripts" / "prepare_demo_data.sh")], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == str(tmp_path / "demo" / "demo_text_document")
    calls = log.read_text()
    for step in ("train_tokenizer.py", "preprocess_data.py"):
        assert step in calls, f"{step} did not run through python3:\n{calls}"

    proc = subprocess.run(["bash", str(repo / "pretrain_scripts" / "run_gpt.sh"), "--mock-data", "--validate-only"],
                          capture_output=True, text=True, env=dict(env, OUTPUT=str(tmp_path / "out")), timeout=300)
    assert proc.returncode == 0 and "configuration ok for 1 process(es)" in proc.stderr, proc.stderr[-3000:]
    assert "pretrain_megatron_gpt.py" in log.read_text()


def test_launchers_refuse_a_python_without_megatron_patch(tmp_path):
    # -I -S: neither PYTHONPATH nor site-packages, where megatron_patch is installed
    bare = _executable(tmp_path / "bare-python", f"#!/bin/sh\nexec {VENV_PY} -I -S \"$@\"\n")
    env = _clean_env(PY=bare, DEMO_DIR=str(tmp_path / "demo"), OUTPUT=str(tmp_path / "out"))
    for script in ("prepare_demo_data.sh", "run_gpt.sh"):
        proc = subprocess.run(["bash", os.path.join(ROOT, "pretrain_scripts", script)], capture_output=True,
                              text=True, env=env, timeout=120)
        assert proc.returncode == 2, (script, proc.stderr)
        assert proc.stderr.strip() == (f"error: {bare} cannot import megatron_patch; install it into that Python "
                                       f"(pip install -e {ROOT}), run 'make venv', or set PY=/path/to/python that has it")
    assert not (tmp_path / "demo").exists()


# ---------------------------------------------------------------- configuration errors under torchrun


def test_plain_torchrun_reports_a_configuration_error_once(tmp_path):
    """No launcher: every worker refuses the configuration before any process group starts, the message
    is printed once (local rank 0), and every rank exits with 2."""
    cmd = [VENV_PY, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           os.path.join(ROOT, "pretrain_megatron_gpt.py"), "--mock-data", "--tensor-model-parallel-size", "3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=_clean_env(), timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert out.count("configuration error:") == 1, out
    assert "configuration error: --num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3" in out
    assert re.search(r"rank\s*: 0 \(local_rank: 0\)\s+exitcode\s*: 2", out), out
    # torchrun stops the other workers once one has failed, so see each rank's own status directly.
    for rank in (0, 1):
        env = _clean_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
        one = subprocess.run([VENV_PY, *cmd[7:]], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
        assert one.returncode == 2, one.stderr
        assert one.stderr.count("configuration error:") == (rank == 0), one.stderr
        assert "Traceback" not in one.stderr


def test_plain_entry_point_streams_its_log(tmp_path):
    """`python pretrain_megatron_gpt.py ... > log` (no torchrun, whose workers run `python -u`): each line
    must reach the pipe when it is printed, not when 8 KB have gathered or the process exits."""
    metrics = tmp_path / "metrics.jsonl"
    cmd = [VENV_PY, os.path.join(ROOT, "pretrain_megatron_gpt.py"), "--mock-data", "--vocab-size", "128",
           "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
           "--micro-batch-size", "1", "--train-iters", "100000", "--log-interval", "1", "--eval-iters", "0",
           "--metrics-file", str(metrics)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=tmp_path,
                            env=_clean_env(), start_new_session=True)
    watchdog = threading.Timer(300, lambda: os.killpg(proc.pid, signal.SIGKILL))
    watchdog.start()
    try:
        first = next((line for line in iter(proc.stdout.readline, "") if line.startswith("iteration")), None)
        done = len(metrics.read_text().splitlines()) if metrics.exists() else 0
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert first is not None and first.startswith("iteration      1/100000"), first
    # Block-buffered, the first line would come only once about 45 lines (8 KB) had been printed.
    assert done < 20, f"the line of iteration 1 arrived after {done} iterations: stdout is buffered"


# ---------------------------------------------------------------- training data


def _write(prefix, docs, dtype=np.uint16) -> str:
    from megatron_patch.data.indexed_dataset import IndexedDatasetWriter

    w = IndexedDatasetWriter(str(prefix), dtype)
    for d in docs:
        w.add_document([d])
    w.finalize()
    return str(prefix)


@pytest.fixture(scope="module")
def foreign_data(tmp_path_factory):
    """Token ids below 9000, as another tokenizer would write them; document 3 holds the largest."""
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 500, 64) for _ in range(400)]
    docs[3][5] = 8999
    return _write(tmp_path_factory.mktemp("foreign") / "foreign_text_document", docs)


def test_token_ids_outside_the_vocabulary_are_refused_when_the_data_is_opened(foreign_data, tmp_path):
    from megatron_patch.data.datasets import DataError, build_gpt_datasets
    from megatron_patch.data.tokenizers import build_tokenizer

    small = build_tokenizer("NullTokenizer", vocab_size=999)  # ids 0..999
    expected = (f"{foreign_data}.bin: largest token id 8999 is outside the tokenizer's vocabulary of 1000 "
                f"(ids 0..999), first at token {3 * 64 + 5} (id 8999, document 3); the data was probably made "
                f"with another tokenizer")
    with pytest.raises(DataError, match=re.escape(expected)):
        build_gpt_datasets([foreign_data], small, 32, (8, 2, 2), split="90,5,5", cache_dir=str(tmp_path))
    large = build_tokenizer("NullTokenizer", vocab_size=8999)  # ids 0..8999: every id fits
    train, _, _ = build_gpt_datasets([foreign_data], large, 32, (8, 2, 2), split="90,5,5", cache_dir=str(tmp_path))
    assert int(max(train[i]["tokens"].max() for i in range(len(train)))) < 9000


def test_token_range_is_cached_by_size_and_mtime(foreign_data, tmp_path):
    from megatron_patch.data import checks

    cache = str(tmp_path / "cache")
    assert checks.token_range(foreign_data, cache) == (0, 8999)
    scans = []
    real = checks._token_range
    checks._token_range = lambda *a: scans.append(a) or real(*a)
    try:
        assert checks.check_token_ids([foreign_data], 9000, cache) == 8999 and scans == []  # from the cache
        prefix = _write(tmp_path / "copy", [np.array([1, 2, 70])])
        assert checks.token_range(prefix, cache) == (1, 70) and len(scans) == 1
        _write(tmp_path / "copy", [np.array([1, 2, 7000])])  # rewritten: size and mtime change
        assert checks.token_range(prefix, cache) == (1, 7000) and len(scans) == 2
        # uint16 data with a vocabulary above 65535 cannot hold a foreign id: nothing to scan
        assert checks.check_token_ids([prefix], 70000, None) == -1 and len(scans) == 2
    finally:
        checks._token_range = real


def test_a_split_without_tokens_is_refused_instead_of_hanging(tmp_path):
    """megatron-core counts epochs forever over an empty split: 200 documents give --split 969,30,1 an empty
    test split (round(0.999 x 200) = 200)."""
    from megatron_patch.data.datasets import DataError, build_gpt_datasets
    from megatron_patch.data.tokenizers import build_tokenizer

    prefix = _write(tmp_path / "small_text_document", [np.arange(1, 60) for _ in range(200)])
    tok = build_tokenizer("NullTokenizer", vocab_size=100)

    def hung(*_):
        raise TimeoutError("build_gpt_datasets hangs on an empty split")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    try:
        with pytest.raises(DataError, match=re.escape(f"{prefix}.bin: --split 969,30,1 leaves the test split of its "
                                                      f"200 sequences (0 of them, sequences 200..200) without tokens")):
            build_gpt_datasets([prefix], tok, 16, (8, 2, 2), split="969,30,1", cache_dir=str(tmp_path / "c"))
        train, valid, test = build_gpt_datasets([prefix], tok, 16, (8, 2, 0), split="98,2,0",
                                                cache_dir=str(tmp_path / "c"))
        assert len(train) >= 8 and test is None
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
