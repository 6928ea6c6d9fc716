"""sglang_dflash.bench.stress against the fake server: aborts are counted, leaks and errors are caught."""

import json

import pytest

from test_benchmark import start_fake

from sglang_dflash.bench import stress
from sglang_dflash.bench.server import free_port


@pytest.fixture
def fake():
    started = []

    def start(*flags):
        port = free_port()
        started.append(start_fake(port, *flags))
        return f"http://127.0.0.1:{port}"

    yield start
    for proc in started:
        proc.kill()


def test_aborted_streams_leave_nothing_behind(fake, tmp_path):
    url = fake("--delay-ms", "5")
    out = tmp_path / "aborts.json"
    rc = stress.main(["--base-url", url, "--out", str(out), "--settle-seconds", "5", "aborts", "--requests", "200",
                      "--abort-fraction", "0.3", "--concurrency", "16", "--max-prompt-words", "80"])
    report = json.loads(out.read_text())
    assert rc == 0 and report["pass"]
    assert report["completed"] + report["aborted"] == 200 and report["error"] == 0
    assert 0 < report["aborted"] <= report["planned_aborts"]
    assert report["leak"] == {"num_used_tokens": 0, "num_running_reqs": 0}


def test_a_server_that_leaks_on_abort_fails_the_run(fake, tmp_path):
    url = fake("--delay-ms", "5", "--leak-on-abort")
    out = tmp_path / "aborts.json"
    rc = stress.main(["--base-url", url, "--out", str(out), "--settle-seconds", "1", "aborts", "--requests", "100",
                      "--abort-fraction", "0.5", "--concurrency", "8", "--max-prompt-words", "80"])
    report = json.loads(out.read_text())
    assert rc == 1 and not report["pass"]
    assert report["leak"]["num_used_tokens"] > 0 and report["leak"]["num_running_reqs"] == 0


def test_load_holds_concurrency_and_counts_errors(fake, tmp_path):
    out = tmp_path / "load.json"
    rc = stress.main(["--base-url", fake("--fail-every", "7"), "--out", str(out), "--settle-seconds", "1",
                      "load", "--concurrency", "8", "--seconds", "2"])
    report = json.loads(out.read_text())
    assert rc == 1 and report["requests"] > 8 and report["errors"] >= report["requests"] // 7 - 1 > 0
    assert report["output_tok_s"] > 0 and report["server_alive"]


def test_load_with_cancels_and_mixed_parameters_counts_cancels_apart_from_errors(fake, tmp_path):
    out = tmp_path / "load.json"
    rc = stress.main(["--base-url", fake("--delay-ms", "5"), "--out", str(out), "--settle-seconds", "5",
                      "load", "--concurrency", "8", "--seconds", "2", "--abort-fraction", "0.25", "--mixed-params"])
    report = json.loads(out.read_text())
    assert rc == 0 and report["pass"] and report["errors"] == 0
    assert 0 < report["aborted"] < report["requests"]
    assert report["leak"] == {"num_used_tokens": 0, "num_running_reqs": 0}


def test_no_server_is_a_clear_error(capsys):
    with pytest.raises(SystemExit):
        stress.main(["--base-url", f"http://127.0.0.1:{free_port()}", "load"])
    assert "no healthy server" in capsys.readouterr().err


def test_a_servers_memory_is_its_whole_process_trees_gpu_and_resident_memory(monkeypatch):
    """``Server.memory``: what a leak would grow, the server and every process under it."""
    import subprocess
    import sys
    import time

    import sglang_dflash.bench.server as server_mod

    child = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(64 << 20); time.sleep(30)"])
    try:
        server = server_mod.Server(server_mod.ServerSpec("ar", "m"), log_path="/dev/null")
        server.proc = child
        monkeypatch.setattr(server_mod, "gpu_processes", lambda: [(child.pid, 700), (child.pid + 10**6, 9)])
        for _ in range(100):  # until the child holds its 64 MiB
            got = server.memory()
            if got["host_rss_mb"] >= 64:
                break
            time.sleep(0.05)
        assert got["gpu_mb"] == 700 and 64 <= got["host_rss_mb"] < 1024, got
        assert sum(got["host_rss_mb_by_process"].values()) == got["host_rss_mb"]
        assert list(got["host_rss_mb_by_process"]) == ["server"]
    finally:
        child.kill()
        child.wait()


def test_every_planned_cancel_lands_mid_stream_even_on_requests_that_would_end_early(fake, tmp_path):
    """A quarter cancelled means a quarter: a third of the mix asks for one token, others stop early,
    so a cancel is sent at full length with nothing that ends it first."""
    out = tmp_path / "load.json"
    rc = stress.main(["--base-url", fake("--delay-ms", "2"), "--out", str(out), "--settle-seconds", "5",
                      "load", "--concurrency", "8", "--seconds", "2", "--abort-fraction", "1", "--mixed-params"])
    report = json.loads(out.read_text())
    assert rc == 0 and report["requests"] > 8 and report["aborted"] == report["requests"], report


def test_a_cancellable_request_keeps_its_parameters_but_nothing_that_ends_it_early():
    payload = {"text": "x", "return_logprob": True,
               "sampling_params": {"max_new_tokens": 1, "stop": ["the"], "regex": "[a-z]+", "min_new_tokens": 1,
                                   "ignore_eos": False, "temperature": 0.8}}
    got = stress.cancellable(payload, 256)
    assert got == {"text": "x", "return_logprob": True,
                   "sampling_params": {"max_new_tokens": 256, "ignore_eos": True, "temperature": 0.8}}
    assert payload["sampling_params"]["max_new_tokens"] == 1  # the plan's payloads are not changed


def test_the_load_reads_memory_as_it_goes_and_a_failed_reading_does_not_stop_it(fake, monkeypatch):
    readings = iter([{"gpu_mb": 1, "host_rss_mb": 10}, RuntimeError("nvidia-smi went away")])

    def probe():
        got = next(readings, {"gpu_mb": 1, "host_rss_mb": 11})
        if isinstance(got, Exception):
            raise got
        return got

    report = stress.run_load(fake("--delay-ms", "5"), concurrency=4, seconds=1.2, settle_s=1,
                             memory_probe=probe, memory_every_s=0.25)
    series = report["memory_series"]
    assert len(series) >= 4 and series[0] == {"t_s": 0.0, "gpu_mb": 1, "host_rss_mb": 10}
    assert series[1]["error"] == "RuntimeError: nvidia-smi went away" and series[-1]["host_rss_mb"] == 11
    assert [s["t_s"] for s in series] == sorted(s["t_s"] for s in series)


def test_server_processes_are_named_by_their_role():
    from sglang_dflash.bench.server import process_role

    assert process_role(["python", "-m", "sglang.launch_server"], "python", True) == "server"
    assert process_role(["sglang::scheduler_TP0"], "sglang::schedul", False) == "sglang::scheduler_TP0"
    assert process_role(["sglang::detokenizer   "], "sglang::detoken", False) == "sglang::detokenizer"
    assert process_role(["python", "-c", "x"], "python3", False) == "python3"
    assert process_role([], "zombie", False) == "zombie"


def test_late_growth_is_what_grew_after_the_middle_reading():
    series = [{"t_s": 0, "host_rss_mb": 100}, {"t_s": 30, "host_rss_mb": 900}, {"t_s": 60, "error": "x"},
              {"t_s": 90, "host_rss_mb": 1000}, {"t_s": 120, "host_rss_mb": 1010}]
    assert stress.late_growth(series, "host_rss_mb") == 10  # from the first reading at or past the middle (t=90)
    assert stress.late_growth(series[:2], "host_rss_mb") is None
    assert stress.late_growth(series, "gpu_mb") is None
