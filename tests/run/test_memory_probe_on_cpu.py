"""The driver's memory probe names the allocation site that grows, and stays silent before its baseline."""

import json

from thundersync_verl.run.memory_probe import MemoryProbe

KEPT: list = []


def leak_a_little(n: int) -> None:
    KEPT.extend(bytearray(1000) for _ in range(n))  # the site the probe must name


def test_probe_names_the_growing_site(tmp_path):
    probe = MemoryProbe(tmp_path / "probe.jsonl", start_step=2, every=3)
    records = []
    try:
        for step in range(1, 9):
            leak_a_little(200)
            records.append(probe.on_step(step))
    finally:
        probe.close()
        KEPT.clear()
    written = [json.loads(x) for x in (tmp_path / "probe.jsonl").read_text().splitlines()]
    assert [r["step"] for r in written] == [2, 5, 8]  # the baseline at step 2, then every 3 steps
    assert records[0] is None and records[2:4] == [None, None] and records[1]["grown"] == []
    assert written[-1]["traced_mb"] > written[0]["traced_mb"]
    top = written[-1]["grown"][0]
    assert top["where"][0].endswith(f"test_memory_probe_on_cpu.py:{leak_a_little.__code__.co_firstlineno + 1}")
    assert top["blocks"] >= 6 * 200  # six steps of 200 kept objects since the baseline
    assert top["kb"] >= 6 * 200 * 1000 / 1024


def test_probe_from_env(monkeypatch, tmp_path):
    monkeypatch.delenv("THUNDERSYNC_MEMORY_PROBE", raising=False)
    assert MemoryProbe.from_env() is None
    monkeypatch.setenv("THUNDERSYNC_MEMORY_PROBE", str(tmp_path / "p.jsonl"))
    monkeypatch.setenv("THUNDERSYNC_MEMORY_PROBE_EVERY", "5")
    probe = MemoryProbe.from_env()
    assert probe.path == tmp_path / "p.jsonl" and probe.every == 5
