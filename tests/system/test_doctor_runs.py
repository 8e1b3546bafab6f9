"""ddp-amp doctor: real ranks measured on gloo. The judgement of the figures: tests/unit/test_doctor.py."""

import json

from helpers import assert_ok, run_cli


def test_doctor_measures_two_cpu_ranks(tmp_path):
    out = tmp_path / "doctor.json"
    result = run_cli("doctor", "-n", "2", "--device", "cpu", "--run-dir", str(tmp_path / "run"), "--json", str(out))
    assert_ok(result)
    report = json.loads(out.read_text())
    assert report["world_size"] == 2 and report["backend"] == "gloo" and report["precision"] == "fp32"
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    for figures in report["ranks"]:
        assert figures["matmul_gflops"] > 0 and figures["rendezvous_s"] > 0
        links = figures["all_reduce"]
        assert links["latency_us"] > 0 and [s["mib"] for s in links["sizes"]] == [1, 16, 256]
        assert all(s["bus_gb_per_s"] > 0 for s in links["sizes"])
    assert report["elapsed_s"] > 0
    assert report["judgement"]["verdict"] in " ".join(result.stdout.split())
